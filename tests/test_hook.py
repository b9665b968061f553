"""The comm hook against a reference computed from every rank's plain gradients (2 gloo ranks, no Lightning).

Each rank trains on different data, so a hook that communicated nothing, or averaged the wrong thing, fails.
"""

import copy
from dataclasses import replace
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gravac.compressors import DGC, get_compressor, sparse_k
from lightning_gravac.launch import run_distributed
from lightning_gravac.state import GATHER, REDUCE, Collective, CompressionState
from lightning_gravac.strategies.hook import gravac_hook

pytestmark = pytest.mark.distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 8))


def _hooked(state: CompressionState, bucket_cap_mb: float = 25) -> tuple[nn.Module, nn.Module, DistributedDataParallel]:
    """The one DDP set-up of these tests: the process group (once a rank), the test model, an untouched copy of it
    for the reference, and DDP over the model with the hook registered on ``state``."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = _model()
    reference = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    state.bind(model)
    ddp.register_comm_hook(state, gravac_hook)
    return model, reference, ddp


def _all_ranks(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _reference_step(compressor, names, grads, residuals, cf, granularity, step, param_cf):
    """Mean over ranks of decode(compress(grad + residual)); updates ``residuals``; returns (expected, norms)."""
    world = dist.get_world_size()
    fed = {n: g + residuals.get(n, torch.zeros_like(g)) for n, g in zip(names, grads, strict=True)}
    decoded = {}
    if granularity == "bucket":
        # One bucket, laid out as DDP lays it: parameters in order at first, then, once DDP has rebuilt its buckets
        # after the first step, in the order their gradients got ready (reverse). Thresholds and sums see the order.
        order = names if step == 0 else names[::-1]
        flat = torch.cat([fed[n].reshape(-1) for n in order])
        dec = compressor.decompress(compressor.compress(flat, cf, key=f"bucket:{order[0]}", step=step))
        offset = 0
        for n in order:
            decoded[n] = dec[offset : offset + fed[n].numel()].view_as(fed[n])
            offset += fed[n].numel()
    else:
        for n in names:
            layer_cf = param_cf.get(n, cf)
            decoded[n] = (
                fed[n]
                if layer_cf == 1
                else compressor.decompress(compressor.compress(fed[n], layer_cf, key=n, step=step))
            )
    expected = {}
    for n in names:
        residuals[n] = fed[n] - decoded[n]
        expected[n] = sum(d * (1.0 / world) for d in _all_ranks(decoded[n]))
    sq = torch.tensor(
        [sum(fed[n].double().square().sum() for n in names), sum(decoded[n].double().square().sum() for n in names)],
        dtype=torch.float64,
    )
    dist.all_reduce(sq)
    return expected, sq


def _compare(rank, world, compressor, cf, granularity, bucket_cap_mb, param_cf=None):
    state = CompressionState(get_compressor(compressor), error_feedback=True, granularity=granularity, cf=cf)
    state.decide(replace(state.factors, param_cf=param_cf or {}))
    model, reference, ddp = _hooked(state, bucket_cap_mb)
    memory = state.carry.residuals
    residuals: dict[str, torch.Tensor] = {}
    results = []
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        reference.zero_grad()
        reference(x).square().mean().backward()
        names = [n for n, _ in reference.named_parameters()]
        grads = [p.grad for _, p in reference.named_parameters()]
        expected, sq = _reference_step(state.compressor, names, grads, residuals, cf, granularity, step, state.param_cf)
        stats = state.pop_stats()
        got = dict(model.named_parameters())
        results.append(
            {
                "max_err": max((got[n].grad - expected[n]).abs().max().item() for n in names),
                "equal": all(torch.equal(got[n].grad, expected[n]) for n in names),
                "gain": stats.gain,
                "expected_gain": (sq[1] / sq[0]).item(),
                "gathered": stats.gathered,
                "buckets": stats.buckets,
                "bytes_sent": stats.bytes_sent,
                "bytes_dense": stats.bytes_dense,
                "residual_err": max((memory.get(n) - residuals[n]).abs().max().item() for n in names if n in memory)
                if granularity == "layer"
                else 0.0,
                "grads": {n: got[n].grad.clone() for n in names},
            }
        )
    return results


class Case(NamedTuple):
    compressor: str
    cf: float
    granularity: str
    cap: float  # DDP's bucket_cap_mb
    collective: Collective
    param_cf: dict[str, float] | None = None  # per-layer factors (Accordion's), None: the global one


# cf 1.0001 with one bucket makes the packed payload (values + indices + header) larger than the dense bucket, so
# the hook must take its third path: decode locally and all-reduce densely.
CASES = {
    "topk-layer-gather": Case("topk", 50, "layer", 0.005, GATHER),
    "topk-bucket-gather": Case("topk", 50, "bucket", 25, GATHER),
    # Per-layer factors: one layer dense, one at 5x, the rest at the global factor, in one bucket.
    "topk-layer-mixed-factors": Case("topk", 50, "layer", 25, GATHER, {"0.weight": 1.0, "2.weight": 5.0}),
    "topk-bucket-dense": Case("topk", 1.0001, "bucket", 25, REDUCE),
    "randomk-layer-summed": Case("randomk", 20, "layer", 0.005, REDUCE),
    "redsync-layer-gather": Case("redsync", 50, "layer", 0.005, GATHER),
    "sidco-bucket-gather": Case("sidco", 50, "bucket", 25, GATHER),
    "threshold-layer-gather": Case("threshold", 50, "layer", 25, GATHER),
    "adaq-layer-gather": Case("adaq", 20, "layer", 25, GATHER),
    "onebit-layer-gather": Case("onebit", 32, "layer", 25, GATHER),
    "efsignsgd-bucket-gather": Case("efsignsgd", 32, "bucket", 25, GATHER),
    "qsgd-layer-gather": Case("qsgd", 10, "layer", 25, GATHER),
    "terngrad-layer-gather": Case("terngrad", 16, "layer", 25, GATHER),
    "int8-layer-gather": Case("int8", 4, "layer", 0.005, GATHER),
    "int4-bucket-gather": Case("int4", 8, "bucket", 25, GATHER),
    # The method added through docs/design.md's path: no change to the hook or the communicators.
    "natural-layer-gather": Case("natural", 4, "layer", 25, GATHER),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_hook_averages_the_compressed_error_fed_gradients(case):
    ranks = run_distributed(
        _compare, compressor=case.compressor, cf=case.cf, granularity=case.granularity, bucket_cap_mb=case.cap,
        param_cf=case.param_cf,
    )  # fmt: skip
    for steps in ranks:
        for s in steps:
            assert s["equal"], f"max abs error {s['max_err']}"
            assert s["residual_err"] == 0.0
            assert s["gain"] == pytest.approx(s["expected_gain"], rel=1e-6)  # norms: fp32 chunks summed in fp64
            assert s["gathered"] == (s["buckets"] if case.collective == GATHER else 0)
    # Both ranks hold the same averaged gradient, bit for bit.
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])
    if case.cap < 1:
        # DDP starts with one bucket and rebuilds smaller ones after the first iteration: residuals, keyed by
        # parameter, must survive that.
        assert ranks[0][0]["buckets"] == 1 and ranks[0][-1]["buckets"] > 1


def test_bucket_bytes_follow_the_stated_accounting():
    steps = run_distributed(_compare, compressor="topk", cf=50, granularity="bucket", bucket_cap_mb=25)[0]
    numel = sum(p.numel() for p in _model().parameters())
    k = sparse_k(numel, 50, torch.float32)
    header = 16
    payload = header + 8 * k
    assert steps[-1]["bytes_dense"] == 4 * numel
    assert steps[-1]["bytes_sent"] == -(-payload // 8) * 8


def _backward_both(ddp, reference, step, rank):
    """One backward pass of the DDP model (through the hook) and of its plain copy on this rank's batch of ``step``;
    the copy's parameter names and gradients."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    for m in (ddp, reference):
        m.zero_grad()
        m(x).square().mean().backward()
    return [n for n, _ in reference.named_parameters()], [p.grad for _, p in reference.named_parameters()]


def _probed(rank, world, granularity, cf):
    """GraVAC's probe gains from the hook, both ways, against norms of every rank's plain gradients."""
    cfs = (20.0, 80.0)
    out = {}
    for gain_of in ("error_fed", "gradient"):
        topk = get_compressor("topk")
        state = CompressionState(topk, error_feedback=True, granularity=granularity, cf=cf)
        state.decide(replace(state.factors, probe_cfs=cfs, gain_of=gain_of))
        _, reference, ddp = _hooked(state)
        residuals: dict[str, torch.Tensor] = {}
        got, expected = [], []
        for step in range(3):
            names, grads = _backward_both(ddp, reference, step, rank)
            probed = (
                grads if gain_of == "gradient" else [g + residuals.get(n, 0) for n, g in zip(names, grads, strict=True)]
            )
            # Top-K's kept norm does not depend on the order of a bucket's layers: their concatenation will do.
            units = [torch.cat([g.reshape(-1) for g in probed])] if granularity == "bucket" else probed
            sums = torch.tensor(
                [sum(float(u.double().square().sum()) for u in units)]
                + [sum(float(topk.sent_sq_norm(topk.compress(u, c))) for u in units) for c in cfs],
                dtype=torch.float64,
            )
            dist.all_reduce(sums)
            expected.append([(sums[i + 1] / sums[0]).item() for i in range(len(cfs))])
            _reference_step(topk, names, grads, residuals, cf, granularity, step, {})
            got.append(list(state.pop_stats().probe_gains().values()))
        out[gain_of] = {"got": got, "expected": expected}
    return out


# At cf 1 the bucket is sent dense while the probes still measure: no residual is kept, so both gains agree.
@pytest.mark.parametrize(("granularity", "cf"), [("layer", 50), ("bucket", 50), ("layer", 1)])
def test_probe_gains_are_of_the_error_fed_or_of_the_step_own_gradient(granularity, cf):
    ranks = run_distributed(_probed, granularity=granularity, cf=cf)
    for gains in ranks:
        for gain_of in ("error_fed", "gradient"):
            for got, expected in zip(gains[gain_of]["got"], gains[gain_of]["expected"], strict=True):
                assert got == pytest.approx(expected, rel=1e-6)
        # From the second step on a compressed step's residual is part of the error-fed gradient: the gains differ.
        for fed, own in zip(gains["error_fed"]["got"][1:], gains["gradient"]["got"][1:], strict=True):
            assert all((abs(a - b) > 1e-3) == (cf > 1) for a, b in zip(fed, own, strict=True))
    assert ranks[0] == ranks[1], "gains are sums over ranks: every rank must see the same"


def _variance_weights(rank, world, cf):
    """The weight of the code's variance the hook's statistics give on probe steps: ranks on one batch, then on their
    own batches; and what the plain gradients give: ``sum_i ||g_i||^2 / ||sum_i g_i||^2``."""
    state = CompressionState(get_compressor("qsgd"), error_feedback=False, cf=cf)
    state.decide(replace(state.factors, probe_cfs=(8.0,), gain_of="gradient"))
    _, reference, ddp = _hooked(state)
    out = []
    for same in (True, False):
        _, grads = _backward_both(ddp, reference, 0, 0 if same else rank)
        flat = torch.cat([g.reshape(-1) for g in grads]).double()
        own, summed = flat.square().sum(), flat.clone()
        dist.all_reduce(own)
        dist.all_reduce(summed)
        out.append((state.pop_stats().variance_weight(world), float(own / summed.square().sum())))
    return out


def test_hook_measures_how_much_the_code_variance_counts_against_the_batches_noise():
    dense, coded = run_distributed(_variance_weights, cf=1.0), run_distributed(_variance_weights, cf=8.0)
    for ranks in dense, coded:
        assert ranks[0] == ranks[1], "the statistics are sums over ranks: every rank must see the same"
    (same, one), (own, expected) = dense[0]
    # Sent dense, the average's norm is exact. One batch on both ranks: nothing of the gradient differs between them,
    # the weight is 1/N; each rank's own batch: the plain gradients' ratio, above 1/N.
    assert one == 0.5 and same == pytest.approx(0.5, rel=1e-9)
    assert 0.5 < expected < 1.0 and own == pytest.approx(expected, rel=1e-6)
    # In 4-bit codes the average's norm is corrected by what the codes' variance added (one step's sample of it).
    for got, truth in coded[0]:
        assert got == pytest.approx(truth, abs=0.03)


#: DGC's steps through every path a factor of 1 takes: (global factor, per-layer factors, probe factors).
DGC_STEPS = [
    (50.0, {}, ()),  # compressed
    (1.0, {}, ()),  # the plain all-reduce: the accumulation and the momentum delivered
    (50.0, {"0.weight": 1.0, "2.bias": 1.0}, (20.0,)),  # two layers sent dense inside a compressed bucket, probed
    (1.0, {}, (20.0,)),  # dense while the controller probes
    (1.0, {}, ()),  # plain again: heavy-ball momentum
    (50.0, {}, (20.0,)),  # compressed, probed
]


def _dgc_units(names, grads, step, granularity, cf, param_cf):
    """What DGC compresses, as the hook cuts it: (key, parameters, tensor, factor) of each layer, or of the whole bucket
    (in DDP's order: the parameters' at first, reversed once DDP has rebuilt its buckets; dense where every factor
    is 1)."""
    if granularity == "layer":
        return [(n, [n], g.clone(), param_cf.get(n, cf)) for n, g in zip(names, grads, strict=True)]
    order = names if step == 0 else names[::-1]
    by_name = dict(zip(names, grads, strict=True))
    dense = all(param_cf.get(n, cf) == 1.0 for n in names)
    flat = torch.cat([by_name[n].reshape(-1) for n in order])
    return [(f"bucket:{order[0]}", order, flat, 1.0 if dense else cf)]


def _dgc_steps(rank, world, granularity):
    """DGC through the hook against this rank's own DGC: a rank sends the top-k of its ``v`` where compressed and
    ``v + u`` where sent dense; the average, the header's norms and the state kept must agree."""
    options = dict(momentum=0.9, clip_norm=1.0, warmup_epochs=0)
    state = CompressionState(DGC(**options), error_feedback=False, granularity=granularity)
    own = DGC(**options)
    own.setup(world, rank)
    _, reference, ddp = _hooked(state)
    out = []
    for step, (cf, param_cf, probe_cfs) in enumerate(DGC_STEPS):
        state.decide(replace(state.factors, cf=cf, param_cf=param_cf, probe_cfs=probe_cfs))
        names, grads = _backward_both(ddp, reference, step, rank)
        shapes = {n: g.shape for n, g in zip(names, grads, strict=True)}
        sent, sums = {}, torch.zeros(1 + len(probe_cfs), dtype=torch.float64)  # ||g||^2 and the probes' norms
        units = _dgc_units(names, grads, step, granularity, cf, param_cf)
        for key, params, tensor, unit_cf in units:
            if unit_cf == 1.0:
                if probe_cfs:  # a probe is pure: of the accumulation this step makes, before it is delivered
                    sums[1:] += own.probe(tensor, probe_cfs, key=key, step=step)
                own.deliver_([(key, tensor)], step=step)
                sums[0] += tensor.double().square().sum()
                decoded = tensor
            else:
                payload, probes = own.compress_and_probe(tensor, unit_cf, probe_cfs, key=key, step=step)
                sums += torch.cat([payload.basis.view(1), probes])
                decoded = own.decompress(payload)
            parts = decoded.reshape(-1).split([shapes[n].numel() for n in params])
            sent.update({n: part.view(shapes[n]) for n, part in zip(params, parts, strict=True)})
        own.commit([key for key, _, _, _ in units])
        dist.all_reduce(sums)
        stats = state.pop_stats()
        got = dict(ddp.module.named_parameters())
        expected = {n: sum(d * (1.0 / world) for d in _all_ranks(sent[n])) for n in names}
        out.append({
            "err": max((got[n].grad - expected[n]).abs().max().item() for n in names),
            "gains": list(stats.probe_gains().values()),
            "expected_gains": (sums[1:] / sums[0]).tolist(),
            "sq_norm": (stats.sq_norm, sums[0].item()),
        })  # fmt: skip
    theirs, ours = state.compressor.state_dict(), own.state_dict()
    equal = theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    return out, sorted(ours), equal


@pytest.mark.parametrize("granularity", ["layer", "bucket"])
def test_dgc_delivers_its_momentum_and_accumulation_on_every_path_a_factor_of_1_takes(granularity):
    for steps, kept, equal in run_distributed(_dgc_steps, granularity=granularity):
        for step, ((cf, _, probe_cfs), s) in enumerate(zip(DGC_STEPS, steps, strict=True)):
            assert s["err"] < 1e-6, step
            assert s["gains"] == pytest.approx(s["expected_gains"], rel=1e-6), step
            if probe_cfs or cf > 1:  # a header's norms (the plain all-reduce has none)
                assert s["sq_norm"][0] == pytest.approx(s["sq_norm"][1], rel=1e-6), step
        # The last step was compressed: v is kept again beside u, the same as the reference's.
        assert equal and any(k.startswith("v/") for k in kept) and any(k.startswith("u/") for k in kept)


def _low_rank_steps(rank, world, cf):
    state = CompressionState(get_compressor("powersgd"), error_feedback=True, cf=cf)
    model, reference, ddp = _hooked(state)
    memory = state.carry.residuals
    method = get_compressor("powersgd")  # the reference's own warm starts
    residuals: dict[str, torch.Tensor] = {}
    results = []
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        for m in (ddp, reference):
            m.zero_grad()
            m(x).square().mean().backward()
        expected, sent = {}, 0
        for name, p in reference.named_parameters():
            fed = p.grad + residuals.get(name, torch.zeros_like(p.grad))
            if fed.dim() < 2:
                expected[name] = sum(_all_ranks(fed / world))
                sent += fed.numel() * 4
                continue
            matrix = fed.reshape(fed.shape[0], -1)
            p_sum = method.project(matrix, method.rank_for(fed.shape, cf), name)
            dist.all_reduce(p_sum)
            method.orthonormalize_(p_sum)
            q = matrix.T @ p_sum
            residuals[name] = matrix - p_sum @ q.T
            q_sum = q.clone()
            dist.all_reduce(q_sum)
            method.keep(name, q_sum)
            method.commit([name])
            expected[name] = (p_sum @ q_sum.T).div_(world).view_as(fed)
            sent += (p_sum.numel() + q.numel()) * 4
        stats = state.pop_stats()
        got = dict(model.named_parameters())
        results.append(
            {
                "max_err": max((got[n].grad - expected[n]).abs().max().item() for n in expected),
                "residual_err": max(
                    (memory.get(n) - r.view_as(got[n])).abs().max().item() for n, r in residuals.items()
                ),
                "bytes": (stats.bytes_sent, sent + 16, stats.bytes_dense),
                "grads": {n: got[n].grad.clone() for n in expected},
            }
        )
    return results


@pytest.mark.parametrize("cf", [4, 16])
def test_powersgd_hook_reduces_p_then_q_and_keeps_the_local_projection_error(cf):
    ranks = run_distributed(_low_rank_steps, cf=cf)
    for steps in ranks:
        for s in steps:
            assert s["max_err"] < 1e-6 and s["residual_err"] < 1e-6
            sent, expected_sent, dense = s["bytes"]
            assert sent == expected_sent and sent < dense
    for a, b in zip(ranks[0], ranks[1], strict=True):
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"])


def _vote(rank, world):
    state = CompressionState(get_compressor("signsgd", scaled=False), error_feedback=False, cf=32)
    model, _, ddp = _hooked(state)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().mean().backward()
    reference = _model()
    reference(x).square().mean().backward()
    signs = {n: torch.where(p.grad >= 0, 1.0, -1.0) for n, p in reference.named_parameters()}
    expected = {n: sum(_all_ranks(s)).sign() for n, s in signs.items()}  # 2 ranks: 0 where they disagree
    return all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters())


def _low_rank_probed(rank, world, gain_of):
    state = CompressionState(get_compressor("powersgd"), error_feedback=True, cf=8)
    state.decide(replace(state.factors, probe_cfs=(16.0, 32.0), gain_of=gain_of))
    model, _, ddp = _hooked(state)
    steps = []
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        stats = state.pop_stats()
        steps.append({"gains": list(stats.probe_gains().values()), "gain": stats.gain, "bytes": stats.bytes_sent})
    return {"steps": steps, "grads": [p.grad.clone() for p in model.parameters()]}


def test_powersgd_probes_of_the_step_own_gradient_leave_what_is_sent_alone():
    fed, own = (run_distributed(_low_rank_probed, gain_of=g) for g in ("error_fed", "gradient"))
    for a, b in zip(fed, own, strict=True):
        # Probing warm-starts from the same Q but must not advance it: the same factors, the same averaged gradient.
        assert [s["gain"] for s in a["steps"]] == [s["gain"] for s in b["steps"]]
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"], strict=True))
        assert [s["bytes"] + 8 for s in a["steps"]] == [s["bytes"] for s in b["steps"]]  # ||grad||^2 in the header
        # No residual before the first step: both gains agree there, and differ after.
        assert a["steps"][0]["gains"] == pytest.approx(b["steps"][0]["gains"], rel=1e-6)
        assert all(abs(x - y) > 1e-3 for x, y in zip(a["steps"][2]["gains"], b["steps"][2]["gains"], strict=True))
    assert own[0]["steps"] == own[1]["steps"], "gains are sums over ranks: every rank must see the same"


def test_signsgd_through_the_hook_is_the_majority_vote():
    assert run_distributed(_vote) == [True, True]


def _half_steps(rank, world, granularity):
    """Top-K at cf 50, then a half step (the whole gradient in fp16), then Top-K again, against every rank's plain
    gradients: a half step sends the error-fed gradient cast to fp16, averaged in fp16, and keeps the rounding."""
    state = CompressionState(get_compressor("topk"), error_feedback=True, granularity=granularity, cf=50)
    model, reference, ddp = _hooked(state)
    residuals: dict[str, torch.Tensor] = {}
    out = []
    for step, half in enumerate((False, True, False, True)):
        state.decide(replace(state.factors, half=half))
        names, grads = _backward_both(ddp, reference, step, rank)
        if half:
            expected = {}
            for n, g in zip(names, grads, strict=True):
                fed = g + residuals.get(n, torch.zeros_like(g))
                wire = fed.to(torch.float16)
                residuals[n] = fed - wire.float()
                summed = sum(_all_ranks(wire.div(world))[1:], _all_ranks(wire.div(world))[0])
                expected[n] = summed.float()
        else:
            expected, _ = _reference_step(state.compressor, names, grads, residuals, 50, granularity, step, {})
        stats = state.pop_stats()
        got = dict(model.named_parameters())
        out.append({
            "equal": all(torch.equal(got[n].grad, expected[n]) for n in names),
            "residuals": all(torch.equal(state.carry.residuals.get(n), residuals[n]) for n in names),
            "achieved_cf": stats.achieved_cf,
            "wires": {key: wire.data_ptr() for key, wire in state.scratch.wires.items()},
        })  # fmt: skip
    return out


def _residual_bytes(rank, world, method):
    """Compressed steps at cf 20, then a half step and compressed again: the bytes the error feedback holds after
    each step, and the gradients' bytes."""
    state = CompressionState(get_compressor(method), error_feedback=True, granularity="layer", cf=20)
    model, reference, ddp = _hooked(state)
    held = []
    for step, half in enumerate((False, False, False, True, False, False)):
        state.decide(replace(state.factors, half=half))
        _backward_both(ddp, reference, step, rank)
        held.append(state.carry.residuals.nbytes())
    return held, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("method", ["topk", "randomk", "qsgd"])
def test_error_feedback_keeps_one_residual_buffer_a_parameter(method):
    """The residual is written over the one it replaces once the step is known finite: no second buffer a
    parameter, on compressed steps and after a half step (which writes its own before the collective)."""
    for held, gradient_bytes in run_distributed(_residual_bytes, method=method):
        assert held[0] == held[1] == held[2] == gradient_bytes, held
        assert held[-1] == gradient_bytes, held


@pytest.mark.parametrize("granularity", ["layer", "bucket"])
def test_a_half_step_sends_the_error_fed_gradient_in_fp16_and_keeps_the_rounding(granularity):
    for steps in run_distributed(_half_steps, granularity=granularity):
        assert all(s["equal"] and s["residuals"] for s in steps), steps
        assert 1.9 < steps[1]["achieved_cf"] <= 2.0 and steps[0]["achieved_cf"] > 10
        # The fp16 payloads were written into one buffer a bucket, the same one at the next half step.
        assert steps[1]["wires"] and steps[3]["wires"] == steps[1]["wires"]
