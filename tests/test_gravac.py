"""The GraVAC controller's search, scripted: the paper's sequential search, its bounds and errors, multi-level
Top-K, and resuming a search from a checkpoint (also of the first format)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from scripted import Scripted

from lightning_gravac import GraVAC, GraVACStrategy, get_compressor
from lightning_gravac.zoo import TeacherRegression


def test_candidate_advances_each_window_exponentially_and_never_past_cf_max():
    # Gains fall fast with the factor: no promotion, the candidate alone moves, s = 2, 4, 16, 256, ...
    c = Scripted(lambda cf: 0.9 / cf**0.5, cf_min=10, cf_max=1000, window=5, epsilon=0.1)
    candidates = []
    for _ in range(6):
        candidates.append(c.ladder.candidate)
        c.run(5)
    assert candidates == [20, 40, 160, 1000, 1000, 1000]
    assert c.ladder.cf_min == 10 and max(c.sent) <= 1000


def test_geometric_policy_doubles_the_scale():
    c = Scripted(lambda cf: 0.9 / cf**0.5, cf_min=10, cf_max=1000, window=5, epsilon=0.1, policy="geometric")
    candidates = []
    for _ in range(5):
        candidates.append(c.ladder.candidate)
        c.run(5)
    assert candidates == [20, 40, 80, 160, 320]


def test_promotion_when_the_candidate_keeps_as_much():
    # Gain flat up to 100x: the candidate keeps what cf_min keeps, so it becomes cf_min.
    c = Scripted(lambda cf: 0.9 if cf <= 100 else 0.3, cf_min=10, cf_max=1000, window=5, epsilon=0.7)
    c.run(5)
    assert c.ladder.cf_min == 20 and c.ladder.candidate == 80  # promoted to 20, then s = 4
    c.run(5)
    assert c.ladder.cf_min == 80 and c.ladder.candidate == min(80 * 16, 1000)
    c.run(5)
    assert c.ladder.cf_min == 80  # 1000x keeps too little to be promoted
    assert c.sent[-1] == 80  # and too little to be sent (0.3 < epsilon)


def test_dense_fallback_below_epsilon_and_back():
    gains = {"level": 0.5}
    c = Scripted(lambda cf: gains["level"], cf_min=10, window=1000, epsilon=0.7, alpha=1.0)
    c.run(3)
    assert c.sent == [10, 1.0, 1.0]  # the first step is sent at cf_min, then nothing keeps 0.7
    gains["level"] = 0.8
    c.run(2)
    assert c.sent[-1] == 20  # the candidate keeps enough again


def test_plateau_settles_on_the_less_aggressive_of_the_two_best_and_can_move_again():
    # Same step time at every factor: Tc is proportional to the gain. 10x and 20x keep 0.8 and 0.7999: their
    # throughputs (both measured in the first window, which starts at cf_min) are within omega.
    gain = {10: 0.8, 20: 0.7999}
    c = Scripted(lambda cf: gain.get(cf, 0.1), lambda cf: 1.0, cf_min=10, window=4, epsilon=0.5, omega=0.01, alpha=1.0)
    c.run(4)
    assert set(c.window.throughput) == {10, 20}
    assert c.window.settled == 10, "settles on the less aggressive of the two"
    c.run(4)
    assert c.sent[-4:] == [10, 10, 10, 10]
    gain[10] = 0.6  # 10x now keeps much less than 20x did: no plateau any more, the search resumes
    c.run(4)
    assert c.window.settled is None
    c.run(1)
    assert c.sent[-1] != 10


def test_model_search_picks_the_best_predicted_factor_after_one_window():
    # A link where bytes dominate: 1 s of compute plus 1 MB at 0.1 MB/s dense. Gains: 100x keeps 0.75, more keeps less.
    gain = {10: 0.95, 20: 0.9, 40: 0.85, 160: 0.8, 1000: 0.5}

    def comm(cf: float) -> float:
        return 1_000_000 / cf / 100_000  # the bytes a step moves at 100 kB/s

    c = Scripted(lambda cf: gain[cf], lambda cf: 1.0 + comm(cf), comm, cf_min=10, window=3, epsilon=0.7, search="model")
    c.cost.world_size = 2
    c.run(3)
    assert c.cost.link is not None and c.cost.link.seconds_per_byte == pytest.approx(1e-5)
    c.run(1)
    # Predicted Tc: gain / (1 + bytes/1e5): 160x -> 0.8/1.0625 beats 40x -> 0.85/1.25 and 1000x (0.5 < epsilon).
    assert c.sent[-1] == 160
    assert c.probe_cfs == (10, 20, 40, 160, 1000)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cf_min": 100, "cf_max": 10}, r"`cf_min` \(100\) must not exceed `cf_max` \(10\)"),
        ({"cf_min": 0.5}, r"`cf_min` must be a finite number >= 1"),
        ({"epsilon": 0.0}, r"`epsilon` must be in \(0, 1\], got 0.0"),
        ({"omega": 1.5}, r"`omega` must be in \(0, 1\], got 1.5"),
        ({"alpha": -1}, r"`alpha` must be in \(0, 1\], got -1"),
        ({"window": 0}, r"`window` must be a whole number >= 1, got 0"),
        ({"policy": "linear"}, r"`policy` must be one of \('exponential', 'geometric'\), got 'linear'"),
        ({"search": "grid"}, r"`search` must be one of \('sequential', 'model'\), got 'grid'"),
        ({"gain_of": "fresh"}, r"`gain_of` must be one of \('error_fed', 'gradient'\), got 'fresh'"),
        ({"gain_power": -1}, r"`gain_power` must be a finite number >= 0, got -1"),
    ],
)
def test_bad_options_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GraVAC(**kwargs)


def test_gain_of_the_gradient_refuses_a_method_with_its_own_accumulation():
    trainer = SimpleNamespace(strategy=GraVACStrategy("dgc"), world_size=1)
    with pytest.raises(ValueError, match=r"`gain_of='gradient'`.*'dgc' selects from an accumulation of its own"):
        GraVAC(gain_of="gradient").setup(trainer, TeacherRegression(width=256), "fit")
    GraVAC(gain_of="gradient").setup(SimpleNamespace(strategy=GraVACStrategy("topk"), world_size=1),
                                     TeacherRegression(width=256), "fit")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_multilevel_topk_equals_direct_topk_at_each_factor(dtype):
    topk = get_compressor("topk")
    g = (torch.randn(50_000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 2, 50_000)).to(dtype)
    payload, probes = topk.compress_and_probe(g, 10, [20, 40, 160])
    direct = topk.compress(g, 10)
    assert set(payload.wire[1].tolist()) == set(direct.wire[1].tolist())
    for cf, probed in zip([20, 40, 160], probes, strict=True):
        at_cf = topk.compress(g, cf)
        # Norms are fp32 chunks summed in float64 (sq_norm): equal to 1e-6, whatever the order of the values.
        assert probed.item() == pytest.approx(at_cf.wire[0].double().square().sum().item(), rel=1e-6)
    assert topk.probe(g, [40]).item() == pytest.approx(probes[1].item(), rel=1e-6)


def test_a_window_tallied_before_samples_were_counted_is_dropped_on_resume_and_one_with_them_kept():
    c = Scripted(lambda cf: 0.9, window=20).run(25)  # mid-window: a partial tally to save
    saved = c.state_dict()
    assert saved["tally"] and all(t["samples"] == t["steps"] for t in saved["tally"].values())
    resumed = Scripted(lambda cf: 0.9, window=20)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved
    old = {**saved, "tally": {f: {k: v for k, v in t.items() if k != "samples"} for f, t in saved["tally"].items()}}
    resumed.load_state_dict(old)  # a checkpoint of a version that did not count samples
    assert resumed.state_dict()["tally"] == {} and resumed.state_dict()["progress"] == saved["progress"]


CHECKPOINT_V1 = Path(__file__).parent / "data" / "gravac_state_v1.pt"

#: Each search's settings, its steps before the checkpoint and after it, its link's seconds a byte and its gains by
#: factor before and after.
RESUMED_RUNS = {
    "model": {
        "kwargs": {"search": "model", "window": 8, "probe_every": 2, "probe_backoff": 4, "fp16_rung": True},
        "steps": (8, 30),
        "per_byte": (1e-5, 1e-5),
        "gain": ({10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.025}.get, {10: 0.6, 20: 0.5, 40: 0.4, 160: 0.01}.get),
    },
    "sequential": {
        "kwargs": {"cf_min": 10, "cf_max": 1000, "window": 5, "epsilon": 0.7, "omega": 0.05, "alpha": 0.5},
        "steps": (12, 15),
        "per_byte": (1e-6, 1e-6),
        "gain": (lambda cf: 0.9 if cf <= 100 else 0.3, lambda cf: 0.95 if cf <= 20 else 0.6),
    },
}


def _resumable(search: str) -> tuple[Scripted, dict]:
    """A controller of ``RESUMED_RUNS[search]`` on its first link and gains (the returned dict: set to change them)."""
    run = RESUMED_RUNS[search]
    link = {"per_byte": run["per_byte"][0], "gain": run["gain"][0]}
    c = Scripted(lambda cf: link["gain"](cf) or 0.0, lambda cf: 0.1 + 1_000_000 / cf * link["per_byte"],
                 **run["kwargs"])  # fmt: skip
    c.cost.world_size = 2
    if search == "model":
        c.cost.timed, c.cost.half_per_byte = (0.0, link["per_byte"]), link["per_byte"]
    return c, link


@pytest.mark.parametrize("search", ["model", "sequential"])
def test_a_checkpoint_of_the_first_format_resumes_as_the_run_went_on(search):
    saved = torch.load(CHECKPOINT_V1, weights_only=True)[search]
    run = RESUMED_RUNS[search]
    resumed, link = _resumable(search)
    resumed.load_state_dict(saved["state_dict"])
    assert resumed.state_dict() == saved["state_dict"] and list(resumed.state_dict()) == list(saved["state_dict"])
    link.update(per_byte=run["per_byte"][1], gain=run["gain"][1])
    assert resumed.run(run["steps"][1]).sent == saved["next"]
    assert resumed.state_dict() == saved["after"]
