"""Two small 2-rank fits whose mid-run checkpoints are kept in ``tests/data/``: the format a release saved, which
every later version must load and resume to the uninterrupted run's weights (``tests/test_saved_checkpoints.py``).

Top-level, so that spawned ranks can import it. ``python tests/saved_runs.py`` (from the repository root) runs each
fit whole, keeps its checkpoint at :data:`SAVED_AT` steps with the whole run's final weights beside it, and writes
``tests/data/<case>.ckpt``.
"""

import sys
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_gravac import GraVACStrategy, Static
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo import TeacherRegression

from models import loader, trainer_kwargs, weights

DATA = Path(__file__).parent / "data"
#: Steps a whole run takes, and the step its kept checkpoint was saved at (the end of an epoch: 4 steps an epoch).
STEPS, SAVED_AT = 16, 8
#: Where the script puts the whole run's final weights in the kept checkpoint (Lightning leaves unknown keys alone).
EXPECTED_KEY = "uninterrupted_final_weights"


class _AdamW(TeacherRegression):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def _case(case: str) -> tuple[pl.LightningModule, pl.Callback]:
    """The model and the controller of ``case``.

    ``sgd_momentum``: Top-K at factor 20 under SGD with momentum 0.9: residuals, and the momentum moved into the hook.
    ``adam_moments``: Top-K at factor 10 under AdamW: Adam's first moment moves into the hook after a warm-up of 2
    steps, its second frozen; residuals.
    """
    if case == "sgd_momentum":
        return TeacherRegression(width=16, momentum=0.9), Static(cf=20)
    if case == "adam_moments":
        return _AdamW(width=16), Static(cf=10)
    raise ValueError(f"unknown case {case!r}")


def fit(rank: int, world_size: int, case: str, ckpt_dir: str | None = None, ckpt_path: str | None = None) -> Any:
    """One fit of ``case`` on 2 gloo ranks, to :data:`STEPS`: saving a checkpoint every :data:`SAVED_AT` steps into
    ``ckpt_dir``, or resumed from ``ckpt_path``. Returns the final weights and the compression state's summary."""
    pl.seed_everything(0)
    model, controller = _case(case)
    callbacks: list[pl.Callback] = [controller]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVED_AT, save_top_k=-1))
    trainer = pl.Trainer(
        strategy=GraVACStrategy("topk"),
        callbacks=callbacks,
        max_steps=STEPS,
        **trainer_kwargs(world_size, enable_checkpointing=ckpt_dir is not None),
    )
    trainer.fit(model, loader(n=256, batch_size=32), ckpt_path=ckpt_path)
    return weights(model)


def main() -> None:
    for case in ("sgd_momentum", "adam_moments"):
        with tempfile.TemporaryDirectory() as scratch:
            final = run_distributed(fit, case=case, ckpt_dir=scratch, timeout=300)[0]
            checkpoint = torch.load(f"{scratch}/epoch=1-step={SAVED_AT}.ckpt", weights_only=False)
        checkpoint[EXPECTED_KEY] = final
        torch.save(checkpoint, DATA / f"{case}.ckpt")


if __name__ == "__main__":
    sys.exit(main())
