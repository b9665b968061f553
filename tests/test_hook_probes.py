"""What the comm hook measures for the controller (2 gloo ranks, no Lightning): the probes' gains, of the error-fed
gradient or of the step's own, against every rank's plain gradients, and how much the code's variance counts."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from hooked import _backward_both, _hooked, _reference_step

from lightning_gravac.compressors import get_compressor
from lightning_gravac.launch import run_distributed
from lightning_gravac.state import CompressionState

pytestmark = pytest.mark.distributed


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
