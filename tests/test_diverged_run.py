"""A run of local steps that cannot go on stops on every rank with one message, never ends ``rc=0`` with frozen,
non-finite weights: through Lightning's Trainer on two gloo ranks (a regression under OneCycleLR that local steps throw
off where stock DDP survives), and the guard's two reasons to stop on their own."""

import math
from typing import Any

import pytest
import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy

from lightning_gravac import GraVACStrategy, LocalSteps, LocalStepsDiverged
from lightning_gravac.adaptations.round_guard import MOST_UNDOS, RoundGuard
from lightning_gravac.launch import run_distributed

from models import OneCycleRegression, one_cycle_loader, trainer_kwargs

STEPS = 40


def _one_cycle(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, make in [
        ("stock", DDPStrategy),
        ("rounds", lambda: GraVACStrategy(local_steps=8)),
        ("rounds-no-guard", lambda: GraVACStrategy(local_steps=LocalSteps(every=8, guard=None))),
    ]:
        pl.seed_everything(0)
        model = OneCycleRegression(steps=STEPS)
        trainer = pl.Trainer(strategy=make(), max_steps=STEPS, **trainer_kwargs(world_size))
        try:
            trainer.fit(model, one_cycle_loader())
            error = None
        except LocalStepsDiverged as stopped:
            error = str(stopped)
        out[name] = {"losses": model.losses, "error": error, "step": trainer.global_step}
    return out


@pytest.mark.distributed
def test_a_run_that_local_steps_throw_off_stops_on_every_rank_with_what_to_try():
    r0, r1 = run_distributed(_one_cycle, timeout=300)
    # Stock DDP survives this run (its loss spikes to 573 and ends at 36).
    assert r0["stock"]["error"] is None and all(math.isfinite(loss) for loss in r0["stock"]["losses"])
    # Rounds of 8 in 4-bit codes: the guard undoes the third round, and the synchronous steps after it diverge from
    # its start until no rank's gradient is finite. The run stops there, at the same step on both ranks, saying so.
    for name in ("rounds", "rounds-no-guard"):
        error = r0[name]["error"]
        assert error is not None and error == r1[name]["error"], name
        assert r0[name]["step"] == r1[name]["step"] < STEPS, name
        assert "Local steps cannot go on: its last two rounds moved nothing" in error
        assert "smaller learning rate" in error and "local_steps=4" in error and "local_steps=None" in error
    assert "after the guard undid a round" in r0["rounds"]["error"]
    assert "after the guard" not in r0["rounds-no-guard"]["error"]


def _ended(guard: RoundGuard, steps: int, stepped: bool = False, lost: bool = False) -> None:
    if stepped:
        guard.stepped(None)  # a step under manual optimization: it counts, though it has no loss
    assert guard.close(steps, synchronous=False) is None
    if lost:
        with pytest.warns(UserWarning, match="the averaged change was not finite"):
            guard.lost()
    guard.ended()


def test_two_round_ends_in_a_row_that_moved_nothing_stop_the_run():
    guard = RoundGuard()
    guard.configure(None, cooldown=2)
    _ended(guard, 8, stepped=True)
    assert guard.stalled == 0
    _ended(guard, 8)
    assert guard.stalled == 1, "a round with no step anywhere"
    _ended(guard, 0)
    assert guard.stalled == 1, "a round of no steps (the fit's end) says nothing"
    _ended(guard, 1, stepped=True)
    assert guard.stalled == 0, "a step taken starts the count again"
    _ended(guard, 8, stepped=True, lost=True)
    assert guard.stalled == 1, "a round whose averaged change was not finite"
    with pytest.raises(LocalStepsDiverged, match="its last two rounds moved nothing"):
        _ended(guard, 1)


def test_the_guard_undoes_a_few_rounds_and_stops_the_run_at_the_next_divergence():
    guard = RoundGuard()
    guard.configure(4.0, cooldown=2)
    for undone in range(MOST_UNDOS):
        with pytest.warns(UserWarning, match="Local steps diverged"):
            guard.undo(50.0, step=8 * (undone + 1))
        assert guard.holding == 2 * 2**undone
        while guard.hold():
            pass
    with pytest.raises(LocalStepsDiverged, match=rf"after the guard had undone {MOST_UNDOS} rounds.*local_steps=None"):
        guard.undo(None, step=100)
