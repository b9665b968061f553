"""The divergence guard: a compressed step whose gradient norm explodes, or a training loss that climbs while
compressing, makes the controller send dense a while."""

from types import SimpleNamespace

import pytest
import torch

from lightning_gravac import DivergenceGuard, Static, StepStats, get_compressor
from lightning_gravac.adaptations import MomentumCorrection
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
    with pytest.raises(ValueError, match=r"`loss_ratio` must be > 1 or None"):
        DivergenceGuard(loss_ratio=ratio)


def test_a_loss_climbing_past_4x_its_lowest_median_triggers_a_slow_blow_up_that_the_norm_misses():
    guard = DivergenceGuard(min_history=4, cooldown=5)
    losses = [1.0, 0.8, 0.6, 0.5, 0.5, 0.5, 0.8, 1.2, 1.6, 1.9, 2.0, 2.1, 2.2]  # lowest median 0.5
    # The norm grows 5% a step: never 10x its recent median.
    fired = [guard.check(_stats(1.05**i), loss) for i, loss in enumerate(losses)]
    assert fired == [False] * 12 + [True], fired  # median of (1.9, 2.0, 2.1, 2.2) = 2.05 > 4 x 0.5
    assert guard.holding == 5 and guard.lowest is None and not guard.losses  # the hold starts the history afresh
    saved = guard.state_dict()
    restored = DivergenceGuard(min_history=4, cooldown=5)
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved


def test_a_loss_that_stays_up_after_a_hold_is_judged_against_its_new_lowest_not_held_dense_for_good():
    guard = DivergenceGuard(min_history=4, cooldown=3)
    assert [guard.check(_stats(1.0), loss) for loss in [0.5] * 4 + [2.5] * 3] == [False] * 6 + [True]
    assert not any(guard.check(_stats(1.0), 2.5) for _ in range(3))  # the hold
    # Released with the loss still 5x the old lowest (it rose for a reason: a schedule restart, a new data phase):
    # the new lowest is 2.5, and the guard fires again only if the loss climbs 4x from there.
    assert not any(guard.check(_stats(1.0), loss) for loss in [2.5] * 8 + [4.0, 6.0])
    assert guard.lowest == 2.5 and guard.triggers == 1
    assert [guard.check(_stats(1.0), 11.0) for _ in range(3)] == [False, False, True]  # median 11 > 4 x 2.5


@pytest.mark.parametrize(
    ("loss_ratio", "compressed", "losses"),
    [
        pytest.param(None, True, [0.5] * 4 + [5.0] * 4, id="not-watched"),
        pytest.param(4.0, False, [0.5] * 4 + [5.0] * 4, id="dense-steps"),
        pytest.param(4.0, True, [0.5] * 4 + [5.0, float("nan"), -1.0, None], id="one-climb-then-nan-negative-none"),
        pytest.param(4.0, True, [0.5] * 4 + [1.2, 0.3, 1.9, 1.4], id="hard-batches-under-4x"),
    ],
)
def test_the_loss_test_skips_what_it_cannot_judge(loss_ratio, compressed, losses):
    guard = DivergenceGuard(min_history=4, loss_ratio=loss_ratio)
    assert not any(guard.check(_stats(1.0, compressed), loss) for loss in losses)


def _guarded_static(compressor: str, cooldown: int):
    """A ``Static(cf=10)`` with a quick guard on a state of its own, and ``step(norm)``: one compressed step whose
    summed gradient norm is ``norm``, through the controller's end-of-batch hook; returns the next factor."""
    state = CompressionState(get_compressor(compressor), error_feedback=compressor != "dgc")
    controller = Static(cf=10)
    controller.guard = DivergenceGuard(ratio=10, min_history=3, cooldown=cooldown)
    controller.compression_state = state
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
    state.carry.residuals.set("w", torch.ones(3))
    assert step(40.0) == 1.0  # exploded: dense, and the residual that exploded is dropped
    assert len(state.carry.residuals) == 0 and controller.last_metrics["gravac/guarded"] == 1.0
    saved = controller.state_dict()
    assert [step(1.0), step(1.0)] == [1.0, 10]  # the cooldown, then the controller's own factor again
    assert controller.last_metrics["gravac/guarded"] == 0.0
    resumed = Static(cf=10)
    resumed.load_state_dict(saved)
    assert resumed.guard.state_dict() == saved["guard"]


def test_a_trigger_drops_a_method_own_accumulation_and_the_hold_survives_a_resume():
    controller, state, step = _guarded_static("dgc", cooldown=4)
    for norm in (1.0, 1.0, 1.0, 50.0):
        state.compressor.load_state_dict({"v/w": torch.ones(3)})  # DGC's accumulation, outside the residuals
        step(norm)
    assert state.compressor.state_dict() == {} and state.cf == 1.0
    # Resumed mid-hold: the restored controller hands over factor 1, not its own 10.
    resumed = Static(cf=10)
    resumed.compression_state = CompressionState(get_compressor("topk"), error_feedback=True)
    resumed.load_state_dict(controller.state_dict())
    assert resumed.state.cf == 1.0


def test_the_loss_is_taken_on_compressed_steps_only_not_on_dense_steps_that_carry_probes():
    controller, state, _ = _guarded_static("topk", cooldown=2)
    connector = SimpleNamespace(should_update_logs=False)
    trainer = SimpleNamespace(global_step=0, current_epoch=0, callback_metrics={}, _logger_connector=connector)
    # Compressed, dense with a probe header (more than dense), compressed, dense, a local SGD step (nothing sent).
    for sent in (100, 1100, 100, 1000, 0):
        state.record(BucketRecord(bytes_sent=sent, bytes_dense=1000, collective=GATHER, sq_norm=1.0))
        state.end_step()
        controller.on_train_batch_end(trainer, None, {"loss": torch.tensor(0.5)}, None, 0)
    assert list(controller.guard.losses) == [0.5, 0.5]


def test_a_backward_pass_outside_the_strategy_is_ended_by_the_controller():
    # Manual optimization with a plain `loss.backward()` never reaches the strategy's post_backward: the controller
    # ends the step itself, so the statistics are read and the step count (which seeds the draws) still advances.
    state = CompressionState(get_compressor("randomk"), error_feedback=True)
    controller = Static(cf=10)
    controller.compression_state = state
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
    moved = state.carry.get(MomentumCorrection)
    moved.load_state_dict({"u/w": torch.full((3,), 1e6), "local/w": torch.tensor(True)})
    assert not moved.in_sync(["w"])
    step(50.0)
    assert state.cf == 1.0 and moved.state_dict() == {} and moved.in_sync(["w"])


def _blow_up(rank, world_size):
    """Top-K cf 1000 with SGD lr 0.5 and momentum 0.9 (corrected in the hook) on the test regression: a slow blow-up
    (dense trains at this rate). With the guard's norm test alone and with the default guard (the loss watched)."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from lightning_gravac import GraVACStrategy

    from models import Regression, regression_data, trainer_kwargs

    test = regression_data(2048, seed=1)
    out = {}
    for name, loss_ratio in (("norm-only", None), ("default", DivergenceGuard().loss_ratio)):
        pl.seed_everything(0)
        model = Regression(lr=0.5, momentum=0.9)
        controller = Static(cf=1000)
        controller.guard = DivergenceGuard(loss_ratio=loss_ratio)
        trainer = pl.Trainer(strategy=GraVACStrategy("topk"), callbacks=[controller], max_steps=200,
                             **trainer_kwargs(world_size))  # fmt: skip
        trainer.fit(model, DataLoader(regression_data(4096, seed=0), batch_size=32, shuffle=True))
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(model(test.tensors[0]), test.tensors[1]).item()
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[name] = {"loss": loss, "triggers": controller.guard.triggers, "weights": weights}
    return out


@pytest.mark.distributed
def test_the_loss_test_rescues_a_slow_blow_up_the_norm_test_misses():
    from lightning_gravac.launch import run_distributed

    ranks = run_distributed(_blow_up, timeout=300)
    norm_only, default = ranks[0]["norm-only"], ranks[0]["default"]
    assert not norm_only["loss"] < 1.0, norm_only  # diverged (NaN, or far off), the norm test too late if at all
    assert default["triggers"] >= 1 and default["loss"] < 0.2, default  # held dense in time, trained on
    assert torch.equal(default["weights"], ranks[1]["default"]["weights"])  # every rank decided alike
