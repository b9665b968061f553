"""What the default controller weighs, scripted: an unbiased code's variance against the batches' noise, the momentum
masking drops, epsilon as a floor, smoothed gains, the budget and the ladder, the paper one argument away."""

from types import SimpleNamespace

import pytest
import torch
from scripted import Scripted, default_on_a_link
from torch import nn

from lightning_gravac import GraVAC, GraVACStrategy, get_compressor
from lightning_gravac.adaptations import MomentumCorrection
from lightning_gravac.callbacks.gravac.ladder import ladder_factors
from lightning_gravac.callbacks.gravac.prediction import best_predicted
from lightning_gravac.zoo import TeacherRegression


def test_default_weighs_an_unbiased_code_variance_against_the_batches_noise():
    from lightning_gravac.callbacks.gravac.prediction import kept

    assert kept(3.0, biased=False) == pytest.approx(1 / 3) and kept(3.0, biased=False, variance_weight=0.5) == 0.5
    assert kept(0.4, biased=True, variance_weight=0.5) == 0.4  # error feedback's kept energy: nothing to weigh
    gain = {10: 1.2, 20: 2.0, 40: 3.6, 160: 40.0, 1000: 400.0}  # an unbiased code's: 1 + the variance it adds
    # 1 us a byte: seconds 0.2, 0.15, 0.125, 0.10625, 0.101. kept^(1/3) / seconds, the variance in full: cf 10 4.71,
    # 20 5.29, 40 5.21, 160 2.75: cf 20. At half weight (gradients that agree across the 2 ranks): 4.84, 5.83, 6.06,
    # 3.44: cf 40.
    full = default_on_a_link(1e-6, gain, _with_moved_momentum("qsgd", 0.0))
    assert full.kept(40) == pytest.approx(1 / 3.6) and full.sent[-1] == 20
    halved = default_on_a_link(1e-6, gain, _with_moved_momentum("qsgd", 0.0), variance_weight=(0.5, 1.0))
    assert halved.kept(40) == pytest.approx(1 / 2.3) and halved.sent[-1] == 40
    off = default_on_a_link(1e-6, gain, _with_moved_momentum("qsgd", 0.0), variance_weight=(0.5, 1.0),
                             weigh_noise=False)  # fmt: skip
    assert off.kept(40) == pytest.approx(1 / 3.6) and off.sent[-1] == 20


def _with_moved_momentum(method, momentum: float, masking: bool = True, nesterov: bool = False):
    """A compression state for ``method`` (a name or a compressor) whose hook holds SGD's momentum ``momentum`` (as
    momentum correction moves it), masked or not."""
    from lightning_gravac import CompressionState

    state = CompressionState(get_compressor(method) if isinstance(method, str) else method, error_feedback=True)
    state.carry.get(MomentumCorrection).masking = masking
    w = nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([w], lr=0.1, momentum=momentum, nesterov=nesterov)
    state.carry.get(MomentumCorrection).take_from_optimizer(optimizer, {id(w): "w"})
    return state


def test_default_weighs_the_momentum_that_masking_drops_at_each_factor():
    gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.025}
    # 200 ns a byte: dense 1 / 0.3 = 3.33; gain^(1/3) / seconds: cf 10 0.794 / 0.12 = 6.61, 20 0.705 / 0.11 = 6.41,
    # 40 0.630 / 0.105 = 6.00, 160 0.464 / 0.10125 = 4.58, 1000 0.292 / 0.1002 = 2.92: cf 10 without momentum.
    assert default_on_a_link(2e-7, gain).sent[-1] == 10
    # Top-K with fp32 values and int32 indices keeps numel / (2 cf) entries: an entry waits 2 cf steps. Momentum 0.9
    # masked keeps r(20), r(40), r(80), r(320), r(2000) = 0.605, 0.778, 0.888, 0.972, 0.996: 4.00, 4.99, 5.33, 4.46,
    # 2.91: cf 40.
    masked = default_on_a_link(2e-7, gain, _with_moved_momentum("topk", 0.9))
    assert masked.masking_weight(10) == pytest.approx(0.604709, abs=1e-6) and masked.sent[-1] == 40
    # At 50 ns a byte cf 10 beats dense unweighed (7.56 against 6.67), but weighed every factor loses to dense (cf 40:
    # 6.22 x 0.888 = 5.52): masking would cost momentum more than the bytes save.
    assert default_on_a_link(5e-8, gain).sent[-1] == 10
    assert default_on_a_link(5e-8, gain, _with_moved_momentum("topk", 0.9)).sent[-1] == 1.0
    # Nothing to weigh: masking off, no momentum moved, a method that sends no entry exactly, or the weight off.
    for state, kwargs in [
        (_with_moved_momentum("topk", 0.9, masking=False), {}),
        (_with_moved_momentum("topk", 0.0), {}),
        (_with_moved_momentum("qsgd", 0.9), {}),
        (_with_moved_momentum(get_compressor("randomk", unbiased=True), 0.9), {}),
        (_with_moved_momentum("topk", 0.9), {"weigh_masking": False}),
    ]:
        c = default_on_a_link(2e-7, gain, state, **kwargs)
        assert c.masking_weight(10) == 1.0 and c.sent[-1] == 10, (
            state.compressor,
            state.carry.get(MomentumCorrection).masking,
            kwargs,
        )


def test_the_masking_weight_follows_each_method_wait_and_the_momentum_it_restarts():
    def on_link(state, **kwargs):
        return default_on_a_link(2e-7, {cf: 0.5 for cf in (10, 20, 40, 160, 1000)}, state, **kwargs)

    topk = on_link(_with_moved_momentum("topk", 0.9))
    assert topk.masking_weight(1.0) == 1.0  # dense never masks
    # Nesterov sends g + m u: 1 - m (1 - r(20)) = 0.644.
    nesterov = on_link(_with_moved_momentum("topk", 0.9, nesterov=True))
    assert nesterov.masking_weight(10) == pytest.approx(0.644239, abs=1e-6)
    # Random-K sends no index (an entry waits cf steps) and picks at random (geometric waits): 0.1 / (0.1 + 0.09).
    assert on_link(_with_moved_momentum("randomk", 0.9)).masking_weight(10) == pytest.approx(0.526316, abs=1e-6)
    # bf16 gradients: a 2-byte value and a 4-byte index, an entry waits 3 cf steps: r(30) = 0.7127.
    topk.grad_dtype = torch.bfloat16
    assert topk.masking_weight(10) == pytest.approx(0.712717, abs=1e-6)
    # DGC keeps its own momentum (the optimizer's stays at 0): its masking weighs the same way, unless it is off.
    from lightning_gravac.compressors import DGC

    for masking, expected in [(True, 0.604709), (False, 1.0)]:
        dgc = _with_moved_momentum(DGC(momentum=0.9, momentum_masking=masking), 0.0)
        assert on_link(dgc).masking_weight(10) == pytest.approx(expected, abs=1e-6)
    # The fp16 rung sends every entry rounded, never exactly: not weighed.
    rung = on_link(_with_moved_momentum("topk", 0.9), fp16_rung=True)
    assert rung.rungs and rung.masking_weight(rung.rungs[0]) == 1.0


def test_default_keeps_epsilon_as_a_floor_and_the_paper_weighs_progress_by_the_gain():
    gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.01}  # cf 1000 keeps less than the 0.02 floor
    c = default_on_a_link(1e-4, gain)  # so slow that the most aggressive factor would win on time alone
    assert c.sent[-1] == 160
    assert c.sent[:3] == [10, 10, 10]  # the first window: the mildest factor
    # 160 below the floor too: the next most aggressive, 40 (gain^(1/3) / seconds: 0.63 / 2.6 beats 20's 0.70 / 5.1).
    gain[160] = 0.01
    assert default_on_a_link(1e-4, gain).sent[-1] == 40


def test_the_papers_weighing_of_progress_by_the_gain_itself_is_one_argument_away():
    gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.05}
    # 1 us a byte: dense 1 / 1.1 = 0.91. gain^(1/3) / seconds: cf 10 0.79 / 0.2 = 4.0, 20 0.70 / 0.15 = 4.7,
    # 40 0.63 / 0.125 = 5.0, 160 0.46 / 0.106 = 4.4, 1000 0.37 / 0.101 = 3.6: cf 40. Weighed by the gain itself
    # (gain_power=1): 10 2.5, 20 2.3, 40 2.0, 160 0.94, 1000 0.50: cf 10.
    assert default_on_a_link(1e-6, gain).sent[-1] == 40
    paper_weighing = default_on_a_link(1e-6, gain, gain_power=1.0)
    assert paper_weighing.gain_power == 1.0 and paper_weighing.sent[-1] == 10


def test_default_smooths_gains_with_bias_correction_and_leaves_the_warm_up_step_untimed():
    level = {"gain": 0.8}
    c = Scripted(lambda cf: level["gain"], search="model", alpha=0.1)
    c.clock.warm_up = True  # as at fit start
    c.run(1)
    assert c.window.tally == {} and c.window.progress == 1, "the first step's time was tallied"
    assert c.probes.gains[10] == pytest.approx(0.8)
    level["gain"] = 0.4
    c.run(1)
    # Weights 0.9 x 0.1 and 0.1, normalised: the first probe weighs about what the second does, not 0.9 of the mean.
    assert c.probes.gains[10] == pytest.approx((0.09 * 0.8 + 0.1 * 0.4) / 0.19)
    paper = Scripted(lambda cf: level["gain"], alpha=0.1)
    level["gain"] = 0.8
    paper.run(1)
    level["gain"] = 0.4
    paper.run(1)
    assert paper.probes.gains[10] == pytest.approx(0.9 * 0.8 + 0.1 * 0.4)  # the paper's EWMA starts at the first value


def test_the_paper_is_one_argument_away_and_dgc_keeps_the_error_fed_gain_by_default():
    paper, default = GraVAC(search="sequential"), GraVAC()
    assert (
        paper.epsilon,
        paper.window.length,
        paper.probes.probe_every,
        paper.probes.gain_of,
        paper.gain_power,
        paper.time_link,
    ) == (
        0.7,
        500,
        1,
        "error_fed",
        1.0,
        False,
    )
    assert (
        default.search,
        default.epsilon,
        default.window.length,
        default.probes.probe_every,
        default.window.first,
    ) == (
        "model",
        0.02,
        50,
        25,
        3,
    )
    assert (default.probes.gain_of, default.gain_power, default.time_link) == ("gradient", pytest.approx(1 / 3), True)
    trainer = SimpleNamespace(strategy=GraVACStrategy("dgc"), world_size=1)
    default.setup(trainer, TeacherRegression(width=256), "fit")  # no error: DGC has no gain of the gradient alone
    assert default.probes.gain_of == "error_fed"


def test_the_default_says_what_it_sends_and_why_at_each_change_of_regime(caplog):
    gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.025}
    with caplog.at_level("INFO"):
        fast = default_on_a_link(1e-9, gain)  # cf 10 for the first step, then dense: one change of regime
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GraVAC: after step")]
    assert fast.sent[-1] == 1.0 and len(said) == 1, said
    assert "sending dense (cf 1): the link measured 8000 Mbit/s, so a dense step is predicted at" in said[0]
    caplog.clear()
    with caplog.at_level("INFO"):
        slow = default_on_a_link(1e-5, gain)  # compressed throughout: cf 10, then cf 160, the same regime
    assert slow.sent[-1] == 160 and not [r for r in caplog.records if "after step" in r.getMessage()]


def test_the_budget_leaves_out_factors_whose_entries_would_wait_past_the_run():
    gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.025}
    sent = {}
    for budget in (100, 100_000):
        # Top-K's entry waits 2 cf steps: a 100-step run admits cf 10, 20 and 40; a long one every factor.
        c = default_on_a_link(1e-5, gain, _with_moved_momentum("topk", 0.0), budget_steps=budget)
        assert [cf for cf in c.ladder.factors if c.within_budget(cf)] == (
            [10, 20, 40] if budget == 100 else list(c.ladder.factors)
        )
        sent[budget] = c.sent
    # The first window sends the mildest admitted factor, then the best predicted among the admitted ones.
    assert sent[100][:3] == [10, 10, 10] and sent[100][-1] == 40
    assert sent[100_000][:3] == [10, 10, 10] and sent[100_000][-1] == 160
    # Off (asked, and always for the paper's search): every factor.
    c = default_on_a_link(1e-5, gain, _with_moved_momentum("topk", 0.0), budget_steps=100, budget=False)
    assert c.sent[-1] == 160 and GraVAC(search="sequential", budget=True).budget.on is False


def test_the_budget_edge_becomes_a_rung_of_the_ladder():
    c = GraVAC()
    c.compression_state = _with_moved_momentum("topk", 0.0)
    c.budget.steps = 200.0  # Top-K's wait is 2 cf: cf 100 is the most aggressive factor a 200-step run admits
    c.budget.fit(c.ladder, c.compression_state.compressor, c.grad_dtype, c.rungs)
    assert c.ladder.factors == (10, 20, 40, 100)
    c.budget.steps = 120.0
    c.ladder.factors = ladder_factors(c.ladder.cf_min, c.ladder.cf_max, c.ladder.policy)
    c.budget.fit(c.ladder, c.compression_state.compressor, c.grad_dtype, c.rungs)
    assert c.ladder.factors == (10, 20, 40, 60)
    # Too short for any factor: dense alone.
    c.budget.steps, c.ladder.factors = 15.0, ladder_factors(c.ladder.cf_min, c.ladder.cf_max, c.ladder.policy)
    c.budget.fit(c.ladder, c.compression_state.compressor, c.grad_dtype, c.rungs)
    assert c.ladder.factors == () and best_predicted(c.decision()) == 1.0
    # A long run: the ladder as it was.
    c.budget.steps, c.ladder.factors = 1e6, ladder_factors(c.ladder.cf_min, c.ladder.cf_max, c.ladder.policy)
    c.budget.fit(c.ladder, c.compression_state.compressor, c.grad_dtype, c.rungs)
    assert c.ladder.factors == (10, 20, 40, 160, 1000)


def test_an_unbiased_method_keeps_one_over_its_gain_and_its_factors_follow_its_reach():
    """QSGD's gain is ``1 + w`` (its variance ``w`` added to the gradient's energy): a step keeps ``1 / (1 + w)``
    of a dense one, so its most aggressive codes are not mistaken for the best; a biased method keeps its gain. The
    default bounds follow QSGD's 2- to 8-bit codes, capped by the model's largest gradient."""
    c = GraVAC()
    c.compression_state = _with_moved_momentum("qsgd", 0.0)
    c.probes.gains = {4.0: 1.01, 8.0: 2.5, 15.5: 16.0}
    assert c.kept(4.0) == pytest.approx(1 / 1.01) and c.kept(8.0) == pytest.approx(0.4) and c.kept(15.5) == 1 / 16
    c.fit_to_model(10_000)
    lo, hi = 32 / (8 + 1 / 16), 32 / (2 + 1 / 16)
    assert c.ladder.factors == pytest.approx((lo, 2 * lo, hi)) and (c.ladder.cf_min, c.ladder.cf_max) == (lo, hi)
    c.fit_to_model(10)  # a model whose largest gradient has 10 entries
    assert c.ladder.factors == pytest.approx((lo, 2 * lo, 10.0))
    topk = GraVAC()
    topk.compression_state = _with_moved_momentum("topk", 0.0)
    topk.probes.gains = {10.0: 0.4, 20.0: 1.2}  # a biased method's gain above 1 is rounding: it keeps everything
    assert topk.kept(10.0) == 0.4 and topk.kept(20.0) == 1.0
    topk.fit_to_model(10_000)
    assert topk.ladder.factors == (10, 20, 40, 160, 1000)
    explicit = GraVAC(cf_min=5, cf_max=12)
    explicit.compression_state = _with_moved_momentum("qsgd", 0.0)
    explicit.fit_to_model(10_000)
    assert explicit.ladder.factors == (5, 10, 12)  # what the user passed stays
    # A resumed run's dense factor (restored before fit start fits the bounds to the method) stays dense.
    resumed = GraVAC()
    resumed.fit_to_model(64)  # at setup, before the strategy's method is known
    resumed.load_state_dict({**resumed.state_dict(), "cf": 1.0})
    resumed.compression_state = _with_moved_momentum("qsgd", 0.0)
    resumed.fit_to_model(64)
    assert resumed.cf == 1.0 and resumed.ladder.cf_min == pytest.approx(lo)


#: A checkpoint of the first format, for each search (``RESUMED_RUNS``): its ``state_dict`` mid-window (tallies, gains,
#: the fitted link), and what that controller did next, uninterrupted, once its link and gains changed (``next``: the
#: factors sent; ``after``: its ``state_dict`` then). Written by that version: ``_resumable(search)``, ``run`` the first
#: steps, ``state_dict()``, change the link and gains, ``run`` the next steps.
