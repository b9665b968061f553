"""What local steps leave behind them: checkpoints whose every value is finite, also after the guard undid a round
(through Lightning's Trainer on two gloo ranks), checkpoints that saved no lowest round as NaN still loading, and a
fit-start line that says what the rounds send."""

import glob
import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_gravac import GraVACStrategy, LocalSteps, Static
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


def _undone_and_saved(rank: int, world_size: int, ckpt_dir: str) -> int:
    from test_local_steps import StepData

    pl.seed_everything(0)
    strategy = GraVACStrategy(local_steps=LocalSteps(every=4, cooldown=3))
    every_step = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)
    kwargs = trainer_kwargs(2, enable_checkpointing=True)
    trainer = pl.Trainer(strategy=strategy, callbacks=[every_step], max_steps=14, **kwargs)
    trainer.fit(StepData(blow_at=5), loader(n=32768))
    return strategy.outer.guard.triggers


@pytest.mark.distributed
def test_no_checkpoint_holds_a_non_finite_value_also_after_a_round_undone(tmp_path):
    # Rank 1 is thrown off at step 6: the round of steps 5-8 is undone, and the guard's lowest round starts afresh.
    assert run_distributed(_undone_and_saved, timeout=300, ckpt_dir=str(tmp_path)) == [1, 1]
    paths = sorted(glob.glob(f"{tmp_path}/*.ckpt"))
    assert len(paths) == 14
    undone = 0
    for path in paths:
        checkpoint = torch.load(path, weights_only=False)
        # Lightning's own ModelCheckpoint keeps an infinite k-th best score until it has k: stock DDP's too.
        ours = {k: v for k, v in checkpoint["callbacks"].items() if not k.startswith("ModelCheckpoint")}
        assert _non_finite({**checkpoint, "callbacks": ours}) == [], path
        undone += bool(checkpoint["gravac"]["outer"]["triggers"].eq(1).all())
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
