"""The GraVAC controller: scripted decisions, multi-level Top-K, and real 2-rank training."""

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_gravac import GraVAC, GraVACStrategy, RunSummary, Static, StepStats, get_compressor
from lightning_gravac.adaptations import MomentumCorrection
from lightning_gravac.callbacks.gravac.ladder import ladder_factors
from lightning_gravac.callbacks.gravac.prediction import best_predicted
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo import TeacherRegression, teacher_dataset

from models import SimulatedLink, Snapshot, loader, trainer_kwargs, weights


class Scripted(GraVAC):
    """GraVAC driven by hand: gains and step times are functions of the factor.

    By default a step takes 1 s of compute plus 1 s of dense communication divided by the factor.
    """

    def __init__(
        self,
        gain_at,
        seconds_of=lambda cf: 1.0 + 1.0 / cf,
        comm_of=lambda cf: 0.0,
        compress_of=lambda cf: 0.0,
        **kwargs,
    ):
        kwargs.setdefault("search", "sequential")  # the paper's search, unless a test asks for the model search
        super().__init__(**kwargs)
        self.gain_at, self.seconds_of, self.comm_of, self.compress_of = gain_at, seconds_of, comm_of, compress_of
        self.sent: list[float] = []

    def step_seconds(self, stats: StepStats) -> float:
        return self.seconds_of(self.cf)

    def run(self, steps: int, state=None) -> "Scripted":
        """``steps`` steps; with a ``CompressionState``, probing only where :meth:`apply` asks for probes."""
        for _ in range(steps):
            self.sent.append(self.cf)
            if state is not None:
                self.apply(state)
            probes = self.probe_cfs if state is None else tuple(state.probe_cfs)
            gain = 1.0 if self.cf == 1 else self.gain_at(self.cf)
            dense = 1_000_000
            stats = StepStats(
                bytes_sent=dense if self.cf == 1 else int(dense / self.cf), bytes_dense=dense, sq_norm=1.0,
                sq_norm_sent=gain, buckets=1, probe_cfs=probes, probe_sq=[self.gain_at(c) for c in probes],
                probe_basis=1.0, comm_s=self.comm_of(self.cf), compress_s=self.compress_of(self.cf),
            )  # fmt: skip
            self.observe(stats, None)
        return self


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


GRAVAC = {"cf_min": 10, "cf_max": 1000, "epsilon": 0.15, "omega": 0.5, "window": 20}


def _uneven_batches(rank, batches=64):
    """This rank's own batches, of a size other ranks do not share (32 on rank 0, 24 on rank 1), as a user batching by
    tokens or streaming an iterable data set has: a value the decisions must not depend on."""
    x, y = teacher_dataset().tensors
    size = 32 if rank == 0 else 24
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(rank))
    assert batches * size <= len(x)
    chunks = [order[i * size : (i + 1) * size] for i in range(batches)]
    return DataLoader([(x[c], y[c]) for c in chunks], batch_size=None)


def _gravac_vs_dense(rank, world_size, search):
    data = teacher_dataset()
    out = {}
    # "default": no controller, so the strategy installs the zero-argument GraVAC() (the model search, link timed,
    # steps timed: its choices follow the machine's speed). "model": the model search on a modelled link and clock.
    gravac: list[pl.Callback] = []
    if search == "model":
        gravac = [SimulatedLink(**GRAVAC, search="model")]
    elif search == "sequential":
        gravac = [GraVAC(**GRAVAC, search=search)]
    for name, callbacks in [("dense", [Static(cf=1)]), ("gravac", gravac)]:
        summary = RunSummary()
        pl.seed_everything(0)
        model = TeacherRegression(width=256, lr=0.1)
        with torch.no_grad():
            out["untrained"] = nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]).item()
        trainer = pl.Trainer(strategy=GraVACStrategy("topk"), callbacks=[*callbacks, summary], max_steps=200,
                             **trainer_kwargs(world_size, use_distributed_sampler=False))  # fmt: skip
        trainer.fit(model, _uneven_batches(rank))
        with torch.no_grad():
            loss = nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]).item()
        controller = next(c for c in trainer.callbacks if isinstance(c, (GraVAC, Static)))
        gravac = controller if isinstance(controller, GraVAC) else None
        out[name] = {"loss": loss, "cf": [r["gravac/cf"] for r in summary.history],
                     "probed": gravac.cost.timed if gravac else None, "gains": gravac.probes.gains if gravac else None,
                     "link": repr(gravac.cost.link if gravac else None),
                     "throughput": gravac.window.throughput if gravac else None}  # fmt: skip
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("search", ["sequential", "model", "default"])
def test_ranks_on_different_data_decide_alike_and_gravac_learns_like_dense(search):
    # Each rank its own data, in batches of its own size (32 and 24).
    ranks = run_distributed(_gravac_vs_dense, search=search)
    mine, theirs = ranks[0]["gravac"], ranks[1]["gravac"]
    assert mine["cf"] == theirs["cf"], "ranks took different decisions"
    # Every input of a decision is the same on every rank: the link timer's costs, the gains, the fitted step model,
    # and the throughputs the sequential search settles on (samples summed over ranks, not N x this rank's batch).
    assert (mine["probed"], mine["gains"], mine["link"]) == (theirs["probed"], theirs["gains"], theirs["link"])
    assert mine["throughput"] and mine["throughput"] == theirs["throughput"]
    if search == "sequential":
        assert mine["probed"] is None  # the paper's search does not probe the link
    elif search == "default":
        latency, per_byte = mine["probed"]
        assert latency >= 0 and per_byte > 0, "the setup probe did not measure the link"
    cfs = mine["cf"]
    # The paper starts at cf_min; on a probed link the model search's first step sends dense or the mildest factor.
    assert len(cfs) == 200 and cfs[0] in ((GRAVAC["cf_min"],) if search == "sequential" else (1.0, GRAVAC["cf_min"]))
    if search == "sequential":
        assert max(cfs) > GRAVAC["cf_min"], "the search never moved to a higher factor"
    if search == "default":  # factors chosen from timed steps: how far it compresses follows the machine's load
        assert ranks[0]["gravac"]["loss"] < 0.2 * ranks[0]["untrained"]
    else:  # scripted decisions: same steps, loss within 30% of dense training (error-fed Top-K at 10x to 40x)
        assert ranks[0]["gravac"]["loss"] < 1.3 * ranks[0]["dense"]["loss"]


def _interrupted_vs_uninterrupted(rank, world_size, ckpt_dir, compressor, search):
    def fit(callbacks, ckpt_path=None):
        summary = RunSummary()
        pl.seed_everything(0)
        model = TeacherRegression(width=256, lr=0.05, momentum=0.0 if compressor == "dgc" else 0.9)
        kwargs = trainer_kwargs(world_size, enable_checkpointing=True)
        strategy = GraVACStrategy(compressor)
        trainer = pl.Trainer(strategy=strategy, callbacks=[SimulatedLink(**GRAVAC, search=search), summary, *callbacks],
                             max_steps=80, **kwargs)  # fmt: skip
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
        return [r["gravac/cf"] for r in summary.history], weights(model)

    # 32 steps an epoch: the checkpoint after step 32 falls mid-window (window 20) and mid-search. It is written
    # after the step (`every_n_train_steps`): Lightning 2.6 resumes a checkpoint written in `on_train_epoch_end` one
    # epoch ahead in its sampler's order, which no plugin state can make up for.
    saved = Snapshot(at_epoch=0)
    every_32 = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=32, save_top_k=-1)
    whole, whole_weights = fit([saved, every_32])
    restored = Snapshot()
    resumed, resumed_weights = fit([restored], ckpt_path=f"{ckpt_dir}/epoch=0-step=32.ckpt")
    return {
        "whole": whole, "resumed": resumed, "saved": saved.taken, "restored": restored.taken,
        "weights_equal": [torch.equal(whole_weights[k], resumed_weights[k]) for k in whole_weights],
    }  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("compressor", "search"), [("topk", "sequential"), ("dgc", "sequential"), ("topk", "model")])
def test_resume_mid_search_continues_bit_for_bit(tmp_path, compressor, search):
    ranks = run_distributed(_interrupted_vs_uninterrupted, ckpt_dir=str(tmp_path), compressor=compressor, search=search)
    first = GRAVAC["window"] if search == "sequential" else 3  # the first window's length
    for r, rank in enumerate(ranks):
        saved, restored = rank["saved"], rank["restored"]
        assert saved["controller"]["progress"] == (32 - first) % GRAVAC["window"] and saved["controller"]["tally"]
        if r > 0:
            # Lightning writes rank 0's callback state: other ranks resume with rank 0's partial-window times, the
            # only rank-local values here (they feed the window's MAX; the sample counts, summed, are equal with
            # these even batches). Everything else is the same on every rank.
            for tally in (*saved["controller"]["tally"].values(), *restored["controller"]["tally"].values()):
                for rank_local in ("comm_seconds", "compress_seconds", "plain_compress_seconds"):
                    tally.pop(rank_local)
        assert restored["controller"] == saved["controller"]
        assert restored["step"] == saved["step"] == 32
        assert saved["residuals"].keys() == restored["residuals"].keys()
        assert bool(saved["residuals"]) == (compressor != "dgc"), "DGC keeps its own residual"
        for name, residual in saved["residuals"].items():
            assert torch.equal(restored["residuals"][name], residual), name
        # DGC's momentum and velocity, every rank's own (they differ across ranks).
        assert saved["compressor"].keys() == restored["compressor"].keys()
        assert bool(saved["compressor"]) == (compressor == "dgc")
        for name, tensor in saved["compressor"].items():
            assert torch.equal(restored["compressor"][name], tensor), name
        # Momentum correction's buffers (Top-K with SGD momentum 0.9), every rank's own once a step was compressed.
        assert bool(saved["momentum"]) == (compressor != "dgc")
        assert saved["momentum"].keys() == restored["momentum"].keys()
        for name, tensor in saved["momentum"].items():
            assert torch.equal(restored["momentum"][name], tensor), name
        # The resumed run decides as the uninterrupted one did, step for step, and ends with the same weights.
        assert rank["resumed"] == rank["whole"][32:]
        assert len(set(rank["whole"])) > 1, "the search should have moved"
        assert all(rank["weights_equal"]), "resumed weights differ from the uninterrupted run's, bit for bit"


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


def _default_on_a_link(per_byte: float, gain: dict[float, float], state=None, **kwargs) -> Scripted:
    """The default rule on a scripted link: 0.1 s of compute, 1 MB dense, ``per_byte`` s a moved byte (2 ranks);
    with ``state``, attached to that compression state (its method and the momentum moved into its hook)."""

    def seconds(cf: float) -> float:
        return 0.1 + 1_000_000 / cf * per_byte  # two ranks: a rank moves the payload, or the dense buffer once

    budget_steps = kwargs.pop("budget_steps", math.inf)
    variance_weight = kwargs.pop("variance_weight", None)
    c = Scripted(lambda cf: gain[cf], seconds, search="model", **kwargs)
    c.probes.variance_weight = variance_weight  # as the probe steps would have measured it
    c.cost.world_size = 2
    c.compression_state = state
    c.budget.steps = budget_steps  # what fit start reads from the trainer
    c.cost.timed = (0.0, per_byte)  # what the fit-start timing would have measured
    c.cost.cast_cost, c.cost.half_per_byte = 0.01, per_byte  # the fp16 rung: casts 10 ms a step, bytes as fp32's
    return c.run(4)  # the first window (3 steps), then one step at the factor it chose


def test_default_sends_the_factor_of_highest_predicted_throughput_on_each_link():
    gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.025}
    # Predicted gain^(1/3) / step seconds (dense: gain 1, 1 MB), the highest wins:
    # - 1 ns a byte: dense 1/0.101 = 9.9 beats cf 10's 0.794/0.1001 = 7.9 (compressing gains no time, costs progress)
    #   and fp16's 1/0.1105 = 9.0 (its casts cost more than the bytes they save);
    # - 100 ns a byte: dense 1/0.2 = 5.0, cf 10 0.794/0.11 = 7.2, cf 20 0.705/0.105 = 6.7, cf 160 0.464/0.1006 = 4.6;
    # - 10 us a byte: dense 0.099, cf 40 0.63/0.35 = 1.8, cf 160 0.464/0.1625 = 2.86, cf 1000 0.292/0.11 = 2.66.
    for per_byte, expected in [(1e-9, 1.0), (1e-7, 10.0), (1e-5, 160.0)]:
        c = _default_on_a_link(per_byte, gain)
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


def test_default_weighs_an_unbiased_code_variance_against_the_batches_noise():
    from lightning_gravac.callbacks.gravac.prediction import kept

    assert kept(3.0, biased=False) == pytest.approx(1 / 3) and kept(3.0, biased=False, variance_weight=0.5) == 0.5
    assert kept(0.4, biased=True, variance_weight=0.5) == 0.4  # error feedback's kept energy: nothing to weigh
    gain = {10: 1.2, 20: 2.0, 40: 3.6, 160: 40.0, 1000: 400.0}  # an unbiased code's: 1 + the variance it adds
    # 1 us a byte: seconds 0.2, 0.15, 0.125, 0.10625, 0.101. kept^(1/3) / seconds, the variance in full: cf 10 4.71,
    # 20 5.29, 40 5.21, 160 2.75: cf 20. At half weight (gradients that agree across the 2 ranks): 4.84, 5.83, 6.06,
    # 3.44: cf 40.
    full = _default_on_a_link(1e-6, gain, _with_moved_momentum("qsgd", 0.0))
    assert full.kept(40) == pytest.approx(1 / 3.6) and full.sent[-1] == 20
    halved = _default_on_a_link(1e-6, gain, _with_moved_momentum("qsgd", 0.0), variance_weight=(0.5, 1.0))
    assert halved.kept(40) == pytest.approx(1 / 2.3) and halved.sent[-1] == 40
    off = _default_on_a_link(1e-6, gain, _with_moved_momentum("qsgd", 0.0), variance_weight=(0.5, 1.0),
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
    assert _default_on_a_link(2e-7, gain).sent[-1] == 10
    # Top-K with fp32 values and int32 indices keeps numel / (2 cf) entries: an entry waits 2 cf steps. Momentum 0.9
    # masked keeps r(20), r(40), r(80), r(320), r(2000) = 0.605, 0.778, 0.888, 0.972, 0.996: 4.00, 4.99, 5.33, 4.46,
    # 2.91: cf 40.
    masked = _default_on_a_link(2e-7, gain, _with_moved_momentum("topk", 0.9))
    assert masked.masking_weight(10) == pytest.approx(0.604709, abs=1e-6) and masked.sent[-1] == 40
    # At 50 ns a byte cf 10 beats dense unweighed (7.56 against 6.67), but weighed every factor loses to dense (cf 40:
    # 6.22 x 0.888 = 5.52): masking would cost momentum more than the bytes save.
    assert _default_on_a_link(5e-8, gain).sent[-1] == 10
    assert _default_on_a_link(5e-8, gain, _with_moved_momentum("topk", 0.9)).sent[-1] == 1.0
    # Nothing to weigh: masking off, no momentum moved, a method that sends no entry exactly, or the weight off.
    for state, kwargs in [
        (_with_moved_momentum("topk", 0.9, masking=False), {}),
        (_with_moved_momentum("topk", 0.0), {}),
        (_with_moved_momentum("qsgd", 0.9), {}),
        (_with_moved_momentum(get_compressor("randomk", unbiased=True), 0.9), {}),
        (_with_moved_momentum("topk", 0.9), {"weigh_masking": False}),
    ]:
        c = _default_on_a_link(2e-7, gain, state, **kwargs)
        assert c.masking_weight(10) == 1.0 and c.sent[-1] == 10, (
            state.compressor,
            state.carry.get(MomentumCorrection).masking,
            kwargs,
        )


def test_the_masking_weight_follows_each_method_wait_and_the_momentum_it_restarts():
    def on_link(state, **kwargs):
        return _default_on_a_link(2e-7, {cf: 0.5 for cf in (10, 20, 40, 160, 1000)}, state, **kwargs)

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
    c = _default_on_a_link(1e-4, gain)  # so slow that the most aggressive factor would win on time alone
    assert c.sent[-1] == 160
    assert c.sent[:3] == [10, 10, 10]  # the first window: the mildest factor
    # 160 below the floor too: the next most aggressive, 40 (gain^(1/3) / seconds: 0.63 / 2.6 beats 20's 0.70 / 5.1).
    gain[160] = 0.01
    assert _default_on_a_link(1e-4, gain).sent[-1] == 40


def test_the_papers_weighing_of_progress_by_the_gain_itself_is_one_argument_away():
    gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.05}
    # 1 us a byte: dense 1 / 1.1 = 0.91. gain^(1/3) / seconds: cf 10 0.79 / 0.2 = 4.0, 20 0.70 / 0.15 = 4.7,
    # 40 0.63 / 0.125 = 5.0, 160 0.46 / 0.106 = 4.4, 1000 0.37 / 0.101 = 3.6: cf 40. Weighed by the gain itself
    # (gain_power=1): 10 2.5, 20 2.3, 40 2.0, 160 0.94, 1000 0.50: cf 10.
    assert _default_on_a_link(1e-6, gain).sent[-1] == 40
    paper_weighing = _default_on_a_link(1e-6, gain, gain_power=1.0)
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


class StepStarts(pl.Callback):
    """When GraVAC's timing of the step under way began, as each micro-batch ends."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.starts.append(next(c for c in trainer.callbacks if isinstance(c, GraVAC)).clock.start)


def _accumulating(rank: int, world_size: int) -> list[float]:
    starts = StepStarts()
    trainer = pl.Trainer(strategy=GraVACStrategy("qsgd"), callbacks=[SimulatedLink(search="model"), starts],
                         max_steps=5, accumulate_grad_batches=4, **trainer_kwargs(world_size))  # fmt: skip
    trainer.fit(TeacherRegression(), loader())
    return starts.starts


@pytest.mark.distributed
def test_under_gradient_accumulation_a_step_is_timed_from_its_first_micro_batch():
    for starts in run_distributed(_accumulating):
        assert len(starts) == 20
        for step in range(5):  # four micro-batches a step, one start
            group = starts[4 * step : 4 * step + 4]
            assert len(set(group)) == 1, f"step {step} was timed from a later micro-batch"
        assert len(set(starts)) == 5


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
        fast = _default_on_a_link(1e-9, gain)  # cf 10 for the first step, then dense: one change of regime
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GraVAC: after step")]
    assert fast.sent[-1] == 1.0 and len(said) == 1, said
    assert "sending dense (cf 1): the link measured 8000 Mbit/s, so a dense step is predicted at" in said[0]
    caplog.clear()
    with caplog.at_level("INFO"):
        slow = _default_on_a_link(1e-5, gain)  # compressed throughout: cf 10, then cf 160, the same regime
    assert slow.sent[-1] == 160 and not [r for r in caplog.records if "after step" in r.getMessage()]


def test_the_budget_leaves_out_factors_whose_entries_would_wait_past_the_run():
    gain = {10: 0.5, 20: 0.35, 40: 0.25, 160: 0.1, 1000: 0.025}
    sent = {}
    for budget in (100, 100_000):
        # Top-K's entry waits 2 cf steps: a 100-step run admits cf 10, 20 and 40; a long one every factor.
        c = _default_on_a_link(1e-5, gain, _with_moved_momentum("topk", 0.0), budget_steps=budget)
        assert [cf for cf in c.ladder.factors if c.within_budget(cf)] == (
            [10, 20, 40] if budget == 100 else list(c.ladder.factors)
        )
        sent[budget] = c.sent
    # The first window sends the mildest admitted factor, then the best predicted among the admitted ones.
    assert sent[100][:3] == [10, 10, 10] and sent[100][-1] == 40
    assert sent[100_000][:3] == [10, 10, 10] and sent[100_000][-1] == 160
    # Off (asked, and always for the paper's search): every factor.
    c = _default_on_a_link(1e-5, gain, _with_moved_momentum("topk", 0.0), budget_steps=100, budget=False)
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
