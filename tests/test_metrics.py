"""The metrics contract: every step's gravac/* values in trainer.callback_metrics, loggers at their cadence."""

import csv
from pathlib import Path

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger

from lightning_gravac import GraVACStrategy
from lightning_gravac.launch import run_distributed

from models import MLP, Cycling, loader, trainer_kwargs


class Seen(pl.Callback):
    """What a user's callback reads from ``trainer.callback_metrics`` after every step."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gravac/")})


def _run(rank, world_size, log_dir):
    pl.seed_everything(0)
    seen = Seen()
    trainer = pl.Trainer(
        strategy=GraVACStrategy("topk"),
        callbacks=[Cycling(factors=(4, 1, 16, 8), every=1), seen],
        max_steps=9,
        **trainer_kwargs(world_size, logger=CSVLogger(log_dir, name="m", version=0), log_every_n_steps=3),
    )
    trainer.fit(MLP(), loader())
    return seen.rows


@pytest.mark.distributed
def test_every_step_reaches_callback_metrics_and_the_logger_gets_its_cadence(tmp_path):
    ranks = run_distributed(_run, log_dir=str(tmp_path))
    for rows in ranks:
        assert len(rows) == 9
        # The factor of each step, fresh at every step (log_every_n_steps=3 would have left it stale before).
        assert [r["gravac/cf"] for r in rows] == [4, 1, 16, 8, 4, 1, 16, 8, 4]
        assert all(r["gravac/bytes_sent"] > 0 and "gravac/guarded" in r for r in rows)
        assert [r["gravac/bytes_sent"] < r["gravac/bytes_dense"] for r in rows] == [
            cf > 1 for cf in (4, 1, 16, 8) * 2 + (4,)
        ]
    for mine, theirs in zip(*ranks, strict=True):  # every rank the same values, but for its own timings
        timings = ("gravac/compress_ms", "gravac/comm_ms")
        assert {k: v for k, v in mine.items() if k not in timings} == {
            k: v for k, v in theirs.items() if k not in timings
        }
    (metrics_csv,) = Path(tmp_path).rglob("metrics.csv")
    logged = [row for row in csv.DictReader(metrics_csv.open()) if row.get("gravac/cf")]
    # Written on the steps Lightning writes to its loggers: every third.
    assert [float(row["gravac/cf"]) for row in logged] == [16, 1, 4]
