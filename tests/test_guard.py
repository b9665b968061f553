"""The divergence guard: a compressed step whose gradient norm explodes makes the controller send dense a while."""

from types import SimpleNamespace

import pytest
import torch

from lightning_gravac import DivergenceGuard, Static, StepStats, get_compressor
from lightning_gravac.state import GATHER, BucketRecord, CompressionState


def _stats(norm: float, compressed: bool = True) -> StepStats:
    return StepStats(bytes_sent=100 if compressed else 1000, bytes_dense=1000, sq_norm=norm**2, buckets=1)


def test_an_explosion_against_the_recent_median_triggers_and_each_trigger_doubles_the_cooldown():
    guard = DivergenceGuard(ratio=10, history=20, min_history=5, cooldown=3)
    assert not any(guard.check(_stats(n)) for n in (1.0, 1.2, 0.9, 1.1))  # too little history yet
    assert not guard.check(_stats(50.0, compressed=False))  # a dense step is never an explosion of compression
    assert not guard.check(_stats(1.0))
    assert not guard.check(_stats(9.0))  # under 10x the median
    assert guard.check(_stats(15.0))
    assert guard.holding == 3 and guard.triggers == 1
    assert not any(guard.check(_stats(100.0)) for _ in range(3))  # holding: counted down, not judged
    assert guard.holding == 0
    assert guard.check(_stats(100.0))
    assert guard.holding == 6  # doubled
    assert not guard.check(_stats(0.0))


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_a_ratio_of_one_or_less_is_refused(ratio):
    with pytest.raises(ValueError, match=r"`ratio` must be > 1"):
        DivergenceGuard(ratio=ratio)


def _guarded_static(compressor: str, cooldown: int):
    """A ``Static(cf=10)`` with a quick guard on a state of its own, and ``step(norm)``: one compressed step whose
    summed gradient norm is ``norm``, through the controller's end-of-batch hook; returns the next factor."""
    state = CompressionState(get_compressor(compressor), error_feedback=compressor != "dgc")
    controller = Static(cf=10)
    controller.guard = DivergenceGuard(ratio=10, min_history=3, cooldown=cooldown)
    controller._state = state
    controller.apply(state)
    connector = SimpleNamespace(should_update_logs=False)
    trainer = SimpleNamespace(global_step=0, current_epoch=0, callback_metrics={}, _logger_connector=connector)

    def step(norm: float) -> float:
        state.record(BucketRecord(bytes_sent=100, bytes_dense=1000, collective=GATHER, sq_norm=norm**2))
        state.end_step()  # what the strategy does after backward
        controller.on_train_batch_end(trainer, None, None, None, 0)
        return state.cf

    return controller, state, step


def test_the_controller_sends_dense_while_the_guard_holds_then_decides_again_and_resumes_exactly():
    controller, state, step = _guarded_static("topk", cooldown=2)

    assert [step(1.0) for _ in range(4)] == [10, 10, 10, 10]
    state.memory.set("w", torch.ones(3))
    assert step(40.0) == 1.0  # exploded: dense, and the residual that exploded is dropped
    assert len(state.memory) == 0 and controller.last_metrics["gravac/guarded"] == 1.0
    saved = controller.state_dict()
    assert [step(1.0), step(1.0)] == [1.0, 10]  # the cooldown, then the controller's own factor again
    assert controller.last_metrics["gravac/guarded"] == 0.0
    resumed = Static(cf=10)
    resumed.load_state_dict(saved)
    assert resumed.guard.state_dict() == saved["guard"]


def test_a_trigger_drops_a_method_own_accumulation_and_the_hold_survives_a_resume():
    controller, state, step = _guarded_static("dgc", cooldown=4)
    for norm in (1.0, 1.0, 1.0, 50.0):
        state.compressor._v["w"] = torch.ones(3)  # DGC's accumulation, outside the residual memory
        step(norm)
    assert state.compressor.state_dict() == {} and state.cf == 1.0
    # Resumed mid-hold: the restored controller hands over factor 1, not its own 10.
    resumed = Static(cf=10)
    resumed._state = CompressionState(get_compressor("topk"), error_feedback=True)
    resumed.load_state_dict(controller.state_dict())
    assert resumed.state.cf == 1.0


def test_a_backward_pass_outside_the_strategy_is_ended_by_the_controller():
    # Manual optimization with a plain `loss.backward()` never reaches the strategy's post_backward: the controller
    # ends the step itself, so the statistics are read and the step count (which seeds the draws) still advances.
    state = CompressionState(get_compressor("randomk"), error_feedback=True)
    controller = Static(cf=10)
    controller._state = state
    connector = SimpleNamespace(should_update_logs=False)
    trainer = SimpleNamespace(global_step=0, current_epoch=0, callback_metrics={}, _logger_connector=connector)
    for step in (1, 2):
        state.record(BucketRecord(bytes_sent=100 * step, bytes_dense=1000, collective=GATHER, sq_norm=1.0))
        controller.on_train_batch_end(trainer, None, None, None, 0)
        assert state.step == step and controller.last_metrics["gravac/bytes_sent"] == 100 * step
        assert controller.metrics_step == step


def test_a_trigger_drops_the_momentum_moved_into_the_hook_and_the_buffers_are_in_sync_again():
    # With SGD momentum moved into the hook, the buffers accumulated the explosion as the residuals did.
    _, state, step = _guarded_static("topk", cooldown=2)
    for norm in (1.0, 1.0, 1.0):
        step(norm)
    state.momentum._buffers["w"] = torch.full((3,), 1e6)
    state.momentum._local.add("w")
    assert not state.momentum.in_sync(["w"])
    step(50.0)
    assert state.cf == 1.0 and state.momentum.state_dict() == {} and state.momentum.in_sync(["w"])
