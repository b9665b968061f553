"""What local steps leave behind them: checkpoints whose every value is finite, also after the guard undid a round
(through Lightning's Trainer on two gloo ranks), checkpoints that saved no lowest round as NaN still loading, a
fit-start line that says what the rounds send and logged factors that say it too."""

import csv
import glob
import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from lightning_gravac import Accordion, GraVACStrategy, LocalSteps, RunSummary, Static
from lightning_gravac.adaptations.round_guard import RoundGuard
from lightning_gravac.launch import run_distributed

from models import loader, trainer_kwargs


def _non_finite(value: Any, path: str = "") -> list[str]:
    """The paths of every non-finite number in ``value`` (a checkpoint or a part of one)."""
    if isinstance(value, torch.Tensor):
        return [path] if value.is_floating_point() and not bool(torch.isfinite(value).all()) else []
    if isinstance(value, float):
        return [] if math.isfinite(value) else [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _non_finite(v, f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _non_finite(v, f"{path}/{i}")]
    return []


def _undone_and_saved(rank: int, world_size: int, ckpt_dir: str) -> dict[str, int]:
    from local_steps_runs import StepData

    pl.seed_everything(0)
    strategy = GraVACStrategy(local_steps=LocalSteps(every=4, cooldown=3))
    every_step = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)
    kwargs = trainer_kwargs(2, enable_checkpointing=True)
    trainer = pl.Trainer(strategy=strategy, callbacks=[every_step], max_steps=14, **kwargs)
    trainer.fit(StepData(blow_at=5), loader(n=32768))
    return {"triggers": strategy.outer.guard.triggers, "step": strategy.compression_state.step}


@pytest.mark.distributed
def test_no_checkpoint_holds_a_non_finite_value_also_after_a_round_undone(tmp_path):
    # Rank 1 is thrown off at step 6: the round of steps 5-8 is undone, and the guard's lowest round starts afresh.
    # Each step of the hold after it ends a round of its own: the step count still advances once a step.
    ranks = run_distributed(_undone_and_saved, timeout=300, ckpt_dir=str(tmp_path))
    assert ranks == [{"triggers": 1, "step": 14}] * 2
    paths = sorted(glob.glob(f"{tmp_path}/*.ckpt"))
    assert len(paths) == 14
    undone = 0
    for path in paths:
        checkpoint = torch.load(path, weights_only=False)
        # Lightning's own ModelCheckpoint keeps an infinite k-th best score until it has k: stock DDP's too.
        ours = {k: v for k, v in checkpoint["callbacks"].items() if not k.startswith("ModelCheckpoint")}
        assert _non_finite({**checkpoint, "callbacks": ours}) == [], path
        undone += bool(checkpoint["gravac"]["outer"]["triggers"].eq(1).all())
        assert checkpoint["gravac"]["step"] == checkpoint["global_step"], path  # what a resumed run counts from
    assert undone >= 6, "checkpoints after the undo were scanned"


def test_a_checkpoint_that_saved_no_lowest_round_as_nan_loads():
    guard = RoundGuard()
    guard.lowest = 0.5
    saved = guard.state_dict()
    assert float(saved["lowest"]) == 0.5
    guard.lowest = None
    assert "lowest" not in guard.state_dict()
    guard.load_state_dict({**saved, "lowest": torch.tensor(math.nan, dtype=torch.float64)})
    assert guard.lowest is None
    guard.load_state_dict(saved)
    assert guard.lowest == 0.5


@pytest.mark.parametrize(
    ("rounds", "said"),
    [
        (8, "local steps in rounds of 8, each round's change averaged in 'qsgd' codes at cf 8"),
        (LocalSteps(every=4, cf=1, overlap=True), "local steps in rounds of 4, each round's change averaged whole"),
    ],
    ids=["4-bit", "whole-overlap"],
)
def test_the_fit_start_line_says_what_local_steps_send(caplog, rounds, said):
    trainer = SimpleNamespace(callbacks=[])
    with caplog.at_level(logging.INFO):
        GraVACStrategy(local_steps=rounds)._attach_controller(trainer)
    (controller,) = trainer.callbacks
    assert isinstance(controller, Static) and controller.cf == 1  # it reports; the rounds' code is LocalSteps'
    (line,) = [r.getMessage() for r in caplog.records if "GraVACStrategy" in r.getMessage()]
    assert said in line and "Static" not in line


def _logged(rank: int, world_size: int, rounds: LocalSteps, log_dir: str, accordion: bool) -> dict[str, Any]:
    from local_steps_runs import StepData

    pl.seed_everything(0)
    strategy, summary = GraVACStrategy(local_steps=rounds), RunSummary(plot=False)
    logger = CSVLogger(log_dir, name="m", version=0)
    callbacks = [summary, *([Accordion()] if accordion else [])]  # one that logs its own factor every step otherwise
    trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, max_steps=10, **trainer_kwargs(2, logger=logger))
    trainer.fit(StepData(), loader(n=4096))
    return {
        "rows": summary.history, "outer bytes": strategy.outer.bytes_sent, "table": summary.table(0.0),
        "steps": (strategy.compression_state.step, trainer.global_step),
    }  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("cf", "logged", "accordion"),
    [(8, 8.0, False), (1, 1.0, False), (8, 8.0, True)],
    ids=["4-bit", "whole", "accordion"],
)
def test_the_logged_factors_say_what_the_rounds_send(tmp_path, cf, logged, accordion):
    rounds = LocalSteps(every=4, cf=cf)
    ranks = run_distributed(_logged, timeout=300, rounds=rounds, log_dir=str(tmp_path), accordion=accordion)
    for result in ranks:
        rows = result["rows"]
        assert len(rows) == 10 and all(r["gravac/cf"] == logged for r in rows)
        # A step a row, at Lightning's global step: a round's end is one optimizer step, however much it sends.
        assert [r["step"] for r in rows] == list(range(1, 11)) and result["steps"] == (10, 10)
        # Rounds end at steps 4 and 8 and at the budget (10): only their last steps send, and all the bytes counted.
        sent = [r["gravac/bytes_sent"] for r in rows]
        assert [i + 1 for i, b in enumerate(sent) if b] == [4, 8, 10]
        assert sum(sent) == result["outer bytes"]
        assert all("gravac/achieved_cf" not in r for r in rows[:3])  # nothing sent yet: no factor achieved
        for last, steps in ((3, 4), (7, 4), (9, 2)):
            row = rows[last]
            assert row["gravac/achieved_cf"] == steps * row["gravac/bytes_dense"] / row["gravac/bytes_sent"]
        assert [r["gravac/achieved_cf"] for r in rows[4:7]] == [rows[3]["gravac/achieved_cf"]] * 3  # the last round's
        if cf == 1:  # sent whole: a round's change is one step's dense bytes
            assert rows[3]["gravac/achieved_cf"] == 4.0
        else:
            assert 4 * 7 < rows[3]["gravac/achieved_cf"] < 4 * 8  # four steps, each a code of about 8x
    assert "Local steps: 7 of the 10 steps sent nothing" in ranks[0]["table"]
    (metrics_csv,) = tmp_path.rglob("metrics.csv")
    written = [float(row["gravac/cf"]) for row in csv.DictReader(metrics_csv.open()) if row.get("gravac/cf")]
    assert written == [logged] * 10  # what W&B or any logger gets
