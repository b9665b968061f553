"""The default controller's model search, scripted: its probes, the cost model of a link and what compressing
costs."""

import math
from types import SimpleNamespace

import pytest
import torch
from scripted import Scripted, default_on_a_link
from torch import nn

from lightning_gravac import GraVAC, get_compressor


def test_after_the_first_window_probes_run_one_step_in_probe_every():
    from lightning_gravac import CompressionState

    c = Scripted(lambda cf: 0.9, cf_min=10, cf_max=1000, window=4, epsilon=0.5, probe_every=3)
    state = CompressionState(get_compressor("topk"), error_feedback=True)
    probed = []
    for _ in range(13):
        c.apply(state)
        probed.append(bool(state.probe_cfs))
        c.run(1)
    # Steps 1-4 (the first window): every one. Then steps 5-13: those after a multiple of 3 steps (7, 10, 13).
    assert probed == [True] * 4 + [False, False, True, False, False, True, False, False, True]
    assert GraVAC(probe_every=1).probes.probe_every == 1
    with pytest.raises(ValueError, match=r"`probe_every` must be a whole number >= 1, got 0"):
        GraVAC(probe_every=0)


def _model_search(gain, compress_s=0.0, **kwargs):
    """A model search on a link where bytes dominate (1 s of compute, 1 MB dense at 100 kB/s), compressing at
    ``compress_s`` seconds a step."""

    def comm(cf: float) -> float:
        return 1_000_000 / cf / 100_000

    c = Scripted(lambda cf: gain[cf], lambda cf: 1.0 + comm(cf) + (compress_s if cf != 1 else 0.0), comm,
                 cf_min=10, cf_max=1000, search="model", **kwargs)  # fmt: skip
    c.cost.world_size = 2
    c.compress_seconds = lambda stats: compress_s if c.cf != 1 else 0.0
    return c


def _probed_steps(c, steps, state):
    """The steps (counted from the run's first, 1-based) on which ``c`` asks the hook for probes."""
    probed = []
    for _ in range(steps):
        c.apply(state)
        if state.probe_cfs:
            probed.append(c.window.steps + 1)
        c.run(1, state)
    return probed


def test_probes_back_off_while_they_change_nothing_and_come_back_when_the_choice_moves():
    from lightning_gravac import CompressionState

    gain = {10: 0.95, 20: 0.9, 40: 0.85, 160: 0.8, 1000: 0.5}
    c = _model_search(gain, window=1000, first_window=2, probe_every=2, probe_backoff=4, alpha=1.0)
    state = CompressionState(get_compressor("topk"), error_feedback=True)
    # The first window (steps 1-2), then a probe after 2 steps done (step 3): the choice stays, the spacing doubles
    # to 4 (step 5), then to 8, its cap (steps 9, 17, 25).
    assert _probed_steps(c, 26, state) == [1, 2, 3, 5, 9, 17, 25]
    chosen = c.cf
    gain[chosen] = 0.03  # the chosen factor now keeps almost nothing: the next probe moves the choice
    probed = _probed_steps(c, 12, state)
    assert probed[0] == 33 and c.cf != chosen
    assert probed[1:] == [35, 37], "a change of choice brings the spacing back to probe_every"
    assert GraVAC(search="sequential").probes.probe_backoff == 1 and GraVAC().probes.probe_backoff == 8
    with pytest.raises(ValueError, match=r"`probe_backoff` must be a whole number >= 1, got 0"):
        GraVAC(probe_backoff=0)


def test_no_probes_while_no_factor_could_beat_dense_whatever_it_kept():
    from lightning_gravac import CompressionState

    gain = {10: 0.95, 20: 0.9, 40: 0.85, 160: 0.8, 1000: 0.5}
    # Compressing takes 20 s a step; a dense step's bytes take 10 s: no factor pays, even keeping everything.
    c = _model_search(gain, compress_s=20.0, window=1000, first_window=2, probe_every=2, fp16_rung=False)
    state = CompressionState(get_compressor("topk"), error_feedback=True)
    assert _probed_steps(c, 20, state) == [1, 2]
    assert c.cf == 1 and not c.gains_can_matter()
    # At 5 s a step, the factors that save more than 5 s of bytes could pay: the gains are measured again.
    cheap = _model_search(
        gain, compress_s=5.0, window=1000, first_window=2, probe_every=2, probe_backoff=1, fp16_rung=False
    )
    assert _probed_steps(cheap, 8, state) == [1, 2, 3, 5, 7] and cheap.gains_can_matter()
    assert GraVAC(search="sequential").gains_can_matter()


def test_the_model_search_sends_fp16_where_no_factor_keeps_enough_and_bytes_cost():
    from lightning_gravac import CompressionState

    state = CompressionState(get_compressor("topk"), error_feedback=True)
    # Every factor keeps 0.1% of the gradient (below the 0.02 floor): dense, or the whole gradient in fp16.
    poor = _model_search({**dict.fromkeys((10, 20, 40, 160, 1000), 0.001), 2.0: 1.0}, window=3, fp16_rung=True)
    poor.cost.cast_cost, poor.cost.half_per_byte = 0.5, 1e-5  # as the fit-start timing would have measured them
    poor.run(6, state)
    # Dense: 1 s + 10 s of bytes. fp16: 1 s + 5 s + 0.5 s of casts.
    assert poor.cf == 2.0 and state.half and state.cf == 2.0
    poor.run(3, state)  # a window at fp16, whose steps take 1 s + 5 s (the casts' time as measured: none)
    assert poor.cost.seconds(poor.cost.link, 2.0, 1_000_000, poor.rungs) == pytest.approx(6.0, rel=1e-6)
    # Casting dearer than the bytes it saves: dense.
    poor.cost.cast_cost = 6.0
    poor.run(1, state)
    poor.apply(state)
    assert poor.cf == 1.0 and not state.half
    # Factors that keep enough beat both: the rung is one choice among the others.
    rich = _model_search({10: 0.95, 20: 0.9, 40: 0.85, 160: 0.8, 1000: 0.5}, window=3, fp16_rung=True)
    rich.cost.half_per_byte = 1e-5
    rich.run(6, state)
    rich.apply(state)
    assert rich.cf > 2 and not state.half
    assert not GraVAC(search="sequential").fp16_rung and not GraVAC().fp16_rung, "off by default"
    assert GraVAC(fp16_rung=True).fp16_rung
    with pytest.raises(ValueError, match="`fp16_rung=True` needs `search='model'`"):
        GraVAC(search="sequential", fp16_rung=True)


def test_spaced_probes_weigh_as_the_steps_they_stand_for():
    from lightning_gravac import CompressionState

    level = {"gain": 0.8}
    # 20x keeps half what 10x keeps: no promotion, so cf_min stays 10 and is probed each time.
    c = Scripted(
        lambda cf: level["gain"] / (1 if cf == 10 else 2),
        cf_min=10, window=1000, first_window=2, epsilon=0.3, alpha=0.5, probe_every=4,
    )  # fmt: skip
    state = CompressionState(get_compressor("topk"), error_feedback=True)
    c.run(3, state)  # the first window (steps 1-2) probes every step; then step 3 probes nothing
    assert c.probes.gains[10] == pytest.approx(0.8)
    level["gain"] = 0.4
    c.run(2, state)  # steps 4-5: step 5 (4 steps done) probes, 3 steps after step 2: weight 1 - 0.5^3
    assert c.probes.gains[10] == pytest.approx(0.8 * 0.5**3 + 0.4 * (1 - 0.5**3))
    before = c.probes.gains[10]
    c.run(4, state)  # steps 6-9: step 9 probes, 4 steps after step 5
    assert c.probes.gains[10] == pytest.approx(before * 0.5**4 + 0.4 * (1 - 0.5**4))


def test_model_search_decides_after_a_short_first_window():
    assert GraVAC(search="model", window=500).window.first == 3
    assert GraVAC(search="sequential", window=500).window.first == 500
    assert GraVAC(search="model", window=2).window.first == 2
    with pytest.raises(ValueError, match=r"`first_window` must be a whole number >= 1, got 0"):
        GraVAC(first_window=0)
    gain = {10: 0.95, 20: 0.9, 40: 0.85, 160: 0.8, 1000: 0.5}

    def comm(cf: float) -> float:
        return 0.05 + 1_000_000 / cf / 100_000  # 50 ms a step, then the bytes at 100 kB/s

    c = Scripted(
        lambda cf: gain[cf], lambda cf: 1.0 + comm(cf), comm, cf_min=10, window=100, first_window=10, search="model"
    )
    c.cost.world_size = 2
    c.run(10)
    # Steps at 10x and 20x moved different byte counts: the fit separates the per-step cost from the per-byte one.
    assert c.window.windows == 1 and c.cost.link is not None
    assert c.cost.link.seconds_per_byte == pytest.approx(1e-5) and c.cost.link.per_step == pytest.approx(0.05)
    assert c.cost.link.other_seconds == pytest.approx(1.0)
    c.run(1)
    assert c.sent[:2] == [10, 20] and c.sent[-1] == 160


def test_link_fit_is_proportional_with_one_payload_size_and_none_without_bytes():
    from lightning_gravac.callbacks.gravac import fit_link

    link = fit_link({100.0: (4, 4.4, 0.4, 4000.0)})
    assert link is not None and link.per_step == 0 and link.seconds_per_byte == pytest.approx(1e-4)
    assert link.other_seconds == pytest.approx(1.0)
    assert fit_link({1.0: (3, 3.0, 0.0, 0.0)}) is None


def test_default_sends_the_factor_of_highest_predicted_throughput_on_each_link():
    gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.025}
    # Predicted gain^(1/3) / step seconds (dense: gain 1, 1 MB), the highest wins:
    # - 1 ns a byte: dense 1/0.101 = 9.9 beats cf 10's 0.794/0.1001 = 7.9 (compressing gains no time, costs progress)
    #   and fp16's 1/0.1105 = 9.0 (its casts cost more than the bytes they save);
    # - 100 ns a byte: dense 1/0.2 = 5.0, cf 10 0.794/0.11 = 7.2, cf 20 0.705/0.105 = 6.7, cf 160 0.464/0.1006 = 4.6;
    # - 10 us a byte: dense 0.099, cf 40 0.63/0.35 = 1.8, cf 160 0.464/0.1625 = 2.86, cf 1000 0.292/0.11 = 2.66.
    for per_byte, expected in [(1e-9, 1.0), (1e-7, 10.0), (1e-5, 160.0)]:
        c = default_on_a_link(per_byte, gain)
        assert c.cost.link is not None and c.cost.link.other_seconds == pytest.approx(0.1)
        scores = {cf: c.predicted_throughput(cf, 1_000_000) for cf in (1.0, *c.ladder.factors)}
        assert max(scores, key=scores.__getitem__) == expected
        assert c.sent[-1] == expected, (per_byte, c.sent)
        # The first window: the mildest factor until the first step has measured the computation, then that factor
        # where it saves a tenth of a step (cf 10: 0.11 s against dense's 0.2 s at 100 ns a byte), else dense (1 ns a
        # byte: 0.1001 s against 0.101 s).
        assert c.sent[:3] == ([10, 1.0, 1.0] if per_byte == 1e-9 else [10, 10, 10])


def test_default_counts_what_compressing_costs_before_it_sends_compressed():
    # A fast link (30 ns a byte: 30 ms a dense step's 1 MB) where compressing costs 50 ms a step, more than the bytes
    # it saves: cf 10's step takes 0.1 + 0.003 + 0.05 s against dense's 0.13 s.
    def seconds(cf: float) -> float:
        return 0.1 + 1_000_000 / cf * 3e-8 + (0.0 if cf == 1 else 0.05)

    def default(timed_compression: float) -> Scripted:
        gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.025}
        c = Scripted(lambda cf: gain[cf], seconds, compress_of=lambda cf: 0.0 if cf == 1 else 0.05, search="model")
        c.cost.world_size, c.budget.steps = 2, math.inf
        c.cost.timed, c.cost.model_bytes = (0.0, 3e-8), 1_000_000
        c.cost.take_compression(timed_compression, fresh=True)
        c.cf = c.choose()  # as at fit start, once the link is timed
        return c.run(5)

    # Timed at fit start, compressing is counted from the first decision on: dense throughout.
    assert default(0.05).sent == [1.0] * 5
    # Untimed, the model predicts cf 10 at 0.103 s and sends it for the first window (3 steps), until the window's
    # steps measure what compressing costs.
    assert default(0.0).sent == [10, 10, 10, 1.0, 1.0]


def test_compression_timing_leaves_the_method_state_and_a_resumed_run_keeps_what_it_measured(monkeypatch):
    from lightning_gravac.callbacks.gravac.cost import CostModel
    from lightning_gravac.callbacks.gravac.link_timer import LinkTimer
    from lightning_gravac.compressors.topk import TopK

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=2, lightning_module=model
    )
    timer = LinkTimer(trainer, None, lambda values: values)  # type: ignore[arg-type]
    for name in ("powersgd", "dgc", "qsgd", "topk"):
        method = get_compressor(name)
        method.setup(2)
        seconds = timer.compression(method, 10.0, residual=True)
        # What the timing compressed was discarded: committing its keys keeps nothing of it.
        method.commit([f"timed/{n}" for n, _ in model.named_parameters()])
        assert seconds > 0 and "timed/" not in repr(method.state_dict()), name
    # A model larger than the timing's cap is timed on its first parameters, the last one's leading rows.
    shapes = []

    class Spy(TopK):
        def compress(self, tensor, cf, *, key="", step=0):
            shapes.append(tuple(tensor.shape))
            return super().compress(tensor, cf, key=key, step=step)

    monkeypatch.setattr("lightning_gravac.callbacks.gravac.link_timer.TIMED_ENTRIES", 100)
    assert timer.compression(Spy(), 10.0, residual=False) > 0
    assert shapes[:2] == [(12, 8), (4,)] and len(shapes) == 6  # 96 + 4 entries, three times
    cost = CostModel(compress_cost=0.03)
    cost.take_compression(0.01, fresh=False)
    assert cost.compress_cost == 0.03  # measured on the steps a resumed run sent compressed
    cost.take_compression(0.01, fresh=True)
    assert cost.compress_cost == 0.01


def test_round_timing_compresses_the_whole_model_flat_and_leaves_the_method_state(monkeypatch):
    from lightning_gravac.callbacks.gravac.link_timer import LinkTimer
    from lightning_gravac.compressors.qsgd import QSGD

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))  # 144 + 68 = 212 entries
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=2, lightning_module=model
    )
    timer = LinkTimer(trainer, None, lambda values: values)  # type: ignore[arg-type]
    calls = []

    class Spy(QSGD):
        def compress(self, tensor, cf, *, key="", step=0):
            calls.append((tuple(tensor.shape), cf, key))
            return super().compress(tensor, cf, key=key, step=step)

        def decode_(self, out, stacked, scale):
            calls.append(("decoded", stacked.wire[0].shape[0], scale))
            return super().decode_(out, stacked, scale)

    method = Spy()
    method.setup(2)
    assert timer.round(method, 8.0) > 0
    # Three timings of one flat change of the model's size, each rank's payload decoded into the mean.
    assert calls == [((212,), 8.0, "timed/round"), ("decoded", 2, 0.5)] * 3
    topk = get_compressor("topk")
    topk.setup(2)
    assert timer.round(topk, 8.0) > 0
    topk.commit(["timed/round"])
    assert "timed/" not in repr(topk.state_dict())
    calls.clear()
    monkeypatch.setattr("lightning_gravac.callbacks.gravac.link_timer.TIMED_ENTRIES", 100)
    timer.round(method, 8.0)
    assert calls[0][0] == (100,)  # capped, and scaled to the model
