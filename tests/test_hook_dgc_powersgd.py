"""The comm hook with the methods that keep state of their own (2 gloo ranks, no Lightning): DGC's momentum and
accumulation on every path a factor of 1 takes, and PowerSGD's two reductions and local projection error."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from hooked import _all_ranks, _backward_both, _hooked

from lightning_gravac.compressors import DGC, get_compressor
from lightning_gravac.launch import run_distributed
from lightning_gravac.state import CompressionState

pytestmark = pytest.mark.distributed


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
