"""Local steps that go wrong, through Lightning's Trainer on two gloo ranks: a non-finite inner step skipped on its
rank, a round that diverges undone and followed by synchronous steps, and runs resumed around the undoing."""

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from local_steps_runs import StepData, Trace, _fit
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.precision import Precision

from lightning_gravac import GraVACStrategy, LocalSteps, Static
from lightning_gravac.launch import run_distributed

from models import loader, trainer_kwargs


def _non_finite(rank: int, world_size: int) -> dict[str, Any]:
    trace = _fit(GraVACStrategy(local_steps=4), 8, model=StepData(nan_at=2))
    return {"after": trace.after}


@pytest.mark.distributed
def test_a_non_finite_inner_step_is_skipped_on_its_rank_and_nothing_is_lost():
    r0, r1 = run_distributed(_non_finite, timeout=300)
    # Rank 1's step 3 (global step 2) had a NaN loss: it kept its parameters; rank 0 stepped.
    assert torch.equal(r1["after"][2], r1["after"][1])
    assert not torch.equal(r0["after"][2], r0["after"][1])
    for rank in (r0, r1):
        assert all(bool(torch.isfinite(p).all()) for p in rank["after"])
    assert torch.equal(r0["after"][3], r1["after"][3]) and torch.equal(r0["after"][7], r1["after"][7])


class Momenta(pl.Callback):
    """This rank's SGD momentum buffers after every optimizer step."""

    def __init__(self) -> None:
        self.after: list[torch.Tensor | None] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        state = trainer.optimizers[0].state
        buffers = [state[p].get("momentum_buffer") for p in pl_module.parameters() if p in state]
        self.after.append(torch.cat([b.reshape(-1).clone() for b in buffers]) if buffers else None)


class ClosureFirst(Precision):
    """Runs the step's closure itself, then the optimizer's step without one: as fp16's gradient scaler does."""

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure()
        return optimizer.step(**kwargs)


def _blown(rank: int, world_size: int, guard: float | None, closure_first: bool = False) -> dict[str, Any]:
    momenta = Momenta()
    strategy = GraVACStrategy(local_steps=LocalSteps(every=4, guard=guard, cooldown=3))
    plugins = [ClosureFirst()] if closure_first else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = _fit(strategy, 14, model=StepData(blow_at=5), callbacks=[momenta], plugins=plugins)
    said = [str(w.message) for w in caught if "Local steps diverged" in str(w.message)]
    return {"after": trace.after, "momenta": momenta.after, "triggers": strategy.outer.guard.triggers, "said": said}


@pytest.mark.distributed
@pytest.mark.parametrize("closure_first", [False, True], ids=["optimizer-runs-closure", "precision-runs-closure"])
def test_a_round_that_diverges_is_undone_and_the_next_steps_are_synchronous(closure_first):
    r0, r1 = run_distributed(_blown, timeout=300, guard=4.0, closure_first=closure_first)
    # Told by the ranks' mean training loss, whoever runs the step's closure (under fp16's scaler, the precision
    # plugin does, before the optimizer's step).
    assert len(r0["said"]) == 1 and "mean training loss" in r0["said"][0]
    # Rank 1 is thrown off at step 6 (global step 5), in the second round (steps 5-8): the round's mean loss is far
    # above the first round's, so the round is undone. Every rank is back where the round began (the parameters after
    # step 4) with its own momentum as it was then, as though steps 5-8 had not been taken.
    assert r0["triggers"] == r1["triggers"] == 1
    for rank in (r0, r1):
        assert torch.equal(rank["after"][7], rank["after"][3])
        assert torch.equal(rank["momenta"][7], rank["momenta"][3])
        assert all(bool(torch.isfinite(p).all()) for p in rank["after"])
    assert not torch.equal(r0["momenta"][3], r1["momenta"][3]), "each rank's momentum is its own"
    # Steps 9-11 are synchronous: the ranks are one model after each; the rounds go on from step 12 (12-14 the last).
    same = [torch.equal(a, b) for a, b in zip(r0["after"], r1["after"], strict=True)]
    assert same == [step in (4, 8, 9, 10, 11, 14) for step in range(1, 15)]
    if closure_first:
        return
    # Without the guard the blown-up round is averaged in: the ranks' model lands far off, where no round moves it any
    # more, and the run stops there on both ranks (where it ended its fit with those weights frozen).
    with pytest.raises(RuntimeError, match=r"(?s)rank 0.*LocalStepsDiverged: .*rank 1.*LocalStepsDiverged: "):
        run_distributed(_blown, timeout=300, guard=None)


def _blown_and_resumed(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    def fit(callbacks: list[pl.Callback], ckpt_path: str | None = None) -> list[torch.Tensor]:
        trace = Trace()
        pl.seed_everything(0)
        strategy = GraVACStrategy("topk", local_steps=LocalSteps(every=4, cf=10, momentum=0.5, cooldown=5))
        kwargs = trainer_kwargs(2, enable_checkpointing=True)
        trainer = pl.Trainer(strategy=strategy, callbacks=[Static(cf=1), trace, *callbacks], max_steps=16, **kwargs)
        trainer.fit(StepData(blow_at=6), loader(n=4096), ckpt_path=ckpt_path)
        return trace.after

    every_6 = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=6, save_top_k=-1)
    whole = fit([every_6])
    return {
        "whole": whole,
        "at_6": fit([], ckpt_path=f"{ckpt_dir}/epoch=0-step=6.ckpt"),
        "at_12": fit([], ckpt_path=f"{ckpt_dir}/epoch=0-step=12.ckpt"),
    }


@pytest.mark.distributed
def test_a_run_resumed_before_a_round_is_undone_or_within_the_hold_after_it_is_bit_for_bit(tmp_path):
    ranks = run_distributed(_blown_and_resumed, timeout=300, ckpt_dir=str(tmp_path))
    # Resumed after step 6, two steps into the round that rank 1 throws off at step 7: the round is undone to each
    # rank's momentum as the round began, restored from the checkpoint. Resumed after step 12: within the synchronous
    # steps that follow (9-13), with the outer momentum and Top-K's residual dropped.
    r0, r1 = ranks
    assert torch.equal(r0["whole"][7], r0["whole"][3]), "the round was undone"
    assert torch.equal(r0["whole"][11], r1["whole"][11]) and not torch.equal(r0["whole"][14], r1["whole"][14])
    for rank in ranks:
        for at in (6, 12):
            resumed = rank[f"at_{at}"]
            assert len(resumed) == 16 - at
            for step, (a, b) in enumerate(zip(rank["whole"][at:], resumed, strict=True), start=at + 1):
                assert torch.equal(a, b), f"resumed after step {at}: step {step} differs from the uninterrupted run"
