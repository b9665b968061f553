"""The communicators on their own, the header's round trip, and `encode` (error feedback -> compress -> residual).

The hook's tests (``test_hook.py``) run every method through DDP; here each communicator gets a bucket built by hand on
2 gloo ranks, and its result, pending residuals, header sums and record are checked against every rank's inputs.
"""

import math

import pytest
import torch
import torch.distributed as dist

from lightning_gravac.adaptations import ErrorFeedback
from lightning_gravac.adaptations.residuals import encode
from lightning_gravac.compressors import get_compressor
from lightning_gravac.compressors.powersgd import PowerSGD
from lightning_gravac.launch import run_distributed
from lightning_gravac.state import GATHER, REDUCE, CompressionState, Factors
from lightning_gravac.strategies.communicators import (
    DenseProbed,
    Gathered,
    Header,
    InRounds,
    Segment,
    Summed,
    Work,
    communicator_for,
)

SHAPES = {"w": (24, 16), "b": (24,)}


def _bucket(rank: int, step: int) -> tuple[torch.Tensor, list[str], list[torch.Tensor]]:
    """A bucket buffer with each parameter's gradient a view into it, different on each rank."""
    numel = sum(math.prod(s) for s in SHAPES.values())
    buffer = torch.randn(numel, generator=torch.Generator().manual_seed(10 * rank + step))
    grads, offset = [], 0
    for shape in SHAPES.values():
        n = math.prod(shape)
        grads.append(buffer[offset : offset + n].view(shape))
        offset += n
    return buffer, list(SHAPES), grads


def _one(rank: int, world: int, name: str, cf: float, dense: tuple[bool, bool] = (False, False)) -> list[dict]:
    """Two steps of one method on a hand-made bucket (``dense[step]``: that step every factor is 1, probed)."""
    state = CompressionState(get_compressor(name), error_feedback=True)
    state.binding.world_size = world
    state.decide(Factors(probe_cfs=(10.0,)))
    state.compressor.setup(world, rank)
    out = []
    for step, dense_now in enumerate(dense):  # the second step error-feeds the first one's residuals
        buffer, names, grads = _bucket(rank, step)
        inputs = {n: g.clone() for n, g in zip(names, grads, strict=True)}
        memory = state.carry.residuals
        fed = {n: inputs[n] + memory.get(n) if n in memory else inputs[n].clone() for n in names}
        method = state.identity if dense_now else state.compressor
        segments = [Segment(n, g, 1.0 if dense_now else cf, method, g) for n, g in zip(names, grads, strict=True)]
        if dense_now:  # as the hook does: the residuals added in place, sent in full
            for n, g in zip(names, grads, strict=True):
                state.carry.residuals.compensate_(n, g)
        work = Work(state, buffer, segments, names, grads, "copy" if dense_now else "recycle", dense_now)
        communicator = communicator_for(work)
        result = communicator.send(work).wait()
        state.carried.step += 1
        out.append({
            "communicator": type(communicator).__name__, "result": result.clone(), "fed": fed,
            "residuals": {n: state.carry.residuals.get(n).clone() for n in names if n in state.carry.residuals},
            "records": list(state.scratch.records),
        })  # fmt: skip
        state.scratch.records.clear()
    return out


def _all(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    return {
        "gathered": _one(rank, world, "topk", 4.0),
        "reduced-decoded": _one(rank, world, "topk", 1.0),  # half the entries plus indices: the gather moves more
        "summed": _one(rank, world, "randomk", 4.0),
        "low-rank": _one(rank, world, "powersgd", 4.0),
        # A compressed step, then a dense one that carries its residuals in full and drops them.
        "dense-probed": _one(rank, world, "topk", 4.0, dense=(False, True)),
    }


@pytest.mark.distributed
def test_each_communicator_averages_its_bucket_and_keeps_what_it_did_not_send():
    ranks = run_distributed(_all)
    expected = {  # (communicator, collective) of each step
        "gathered": [(Gathered, GATHER)] * 2, "reduced-decoded": [(Gathered, REDUCE)] * 2,
        "summed": [(Summed, REDUCE)] * 2, "low-rank": [(InRounds, REDUCE)] * 2,
        "dense-probed": [(Gathered, GATHER), (DenseProbed, REDUCE)],
    }  # fmt: skip
    for case, steps in expected.items():
        for step, (cls, collective) in enumerate(steps):
            per_rank = [r[case][step] for r in ranks]
            assert all(s["communicator"] == cls.__name__ for s in per_rank), case
            # Both ranks end with the same averaged bucket, bit for bit.
            assert torch.equal(per_rank[0]["result"], per_rank[1]["result"]), case
            names = list(SHAPES)
            fed = [torch.cat([s["fed"][n].reshape(-1) for n in names]) for s in per_rank]
            if cls is DenseProbed:  # the error-fed gradients, averaged; every residual sent and dropped
                assert torch.allclose(per_rank[0]["result"], (fed[0] + fed[1]) / 2, atol=1e-6)
                assert all(not s["residuals"] for s in per_rank)
            else:
                # What each rank kept plus what everyone received is what the ranks had: residual_0 + residual_1 +
                # 2 x average == fed_0 + fed_1 (each rank's decoded part is its fed gradient minus its residual; for
                # PowerSGD, P Q_rank^T with the shared P, whose average is what was received).
                # (PowerSGD sends the 1-D bias dense: it keeps no residual.)
                assert all(set(s["residuals"]) == ({"w"} if case == "low-rank" else set(names)) for s in per_rank)
                zero = {n: torch.zeros(SHAPES[n]) for n in names}
                kept = [torch.cat([s["residuals"].get(n, zero[n]).reshape(-1) for n in names]) for s in per_rank]
                total = kept[0] + kept[1] + 2 * per_rank[0]["result"]
                assert torch.allclose(total, fed[0] + fed[1], atol=1e-5), case
            (record,) = per_rank[0]["records"]
            assert record.collective == collective, case
            fed_sq = sum(float(f.double().square().sum()) for f in fed)
            assert record.sq_norm == pytest.approx(fed_sq, rel=1e-6), case  # summed over ranks
            assert len(record.probe_sq) == 1 and 0 < record.probe_sq[0] <= record.sq_norm * (1 + 1e-9), case
            assert record.bytes_sent < record.bytes_dense or case == "reduced-decoded" or cls is DenseProbed, case


def test_header_round_trip_names_every_field():
    basis, sent = torch.tensor(4.0, dtype=torch.float64), [torch.tensor(1.0, dtype=torch.float64)] * 2
    probes = [torch.tensor([0.5, 0.25], dtype=torch.float64), torch.tensor([0.5, 0.25], dtype=torch.float64)]
    packed = Header.pack(basis, sent, probes, None)
    assert packed.numel() == Header.numel(2, fresh=False)
    assert Header.unpack(packed, fresh=False) == Header(4.0, 2.0, (1.0, 0.5))
    fresh = (torch.tensor([0.75, 0.5], dtype=torch.float64), torch.tensor(3.0, dtype=torch.float64))
    packed = Header.pack(basis, sent, probes, fresh)
    header = Header.unpack(packed, fresh=True)
    assert packed.numel() == Header.numel(2, fresh=True)
    assert header == Header(4.0, 2.0, (0.75, 0.5), 3.0) and header.probe_basis == 3.0
    assert Header(4.0, 2.0, ()).probe_basis == 4.0


@pytest.mark.parametrize("name", ["topk", "qsgd", "dgc", "fp16", "none"])
def test_encode_error_feeds_compresses_and_leaves_the_residual_the_same_way_in_every_mode(name):
    grad = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    old = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    outcomes = {}
    for residual_mode in ("recycle", "copy", "off"):
        compressor = get_compressor(name, warmup_epochs=0) if name == "dgc" else get_compressor(name)
        memory = ErrorFeedback()
        memory.set("w", old.clone())
        tensor = grad.clone() if residual_mode == "recycle" else grad + old if residual_mode == "copy" else grad.clone()
        given = tensor.clone()
        encoded = encode(
            compressor, tensor, 8.0, key="w", step=3, residual_mode=residual_mode, memory=memory, probe_cfs=(4.0,)
        )
        assert torch.equal(tensor, given), "the tensor given is left as it is"
        outcomes[residual_mode] = encoded
    recycle, copy, off = outcomes["recycle"], outcomes["copy"], outcomes["off"]
    assert all(torch.equal(a, b) for a, b in zip(recycle.payload.wire, copy.payload.wire, strict=True))
    assert torch.equal(recycle.basis, copy.basis) and torch.equal(recycle.probes, copy.probes)
    assert off.residual is None
    if get_compressor(name).passthrough:
        assert recycle.residual is None and copy.residual is None
        return
    assert torch.equal(recycle.residual, copy.residual)
    if name != "dgc":  # DGC selects from its own accumulation: its residual is that, not the input's
        decoded = get_compressor(name).decompress(copy.payload)
        assert torch.equal(copy.residual, (grad + old) - decoded)
        assert copy.basis == pytest.approx(float((grad + old).double().square().sum()), rel=1e-6)
    else:
        assert copy.basis == copy.payload.basis


def test_in_rounds_is_the_communicator_of_powersgd_only():
    state = CompressionState(PowerSGD(), error_feedback=True)
    g = torch.zeros(4, 4)
    work = Work(state, g.view(-1), [Segment("w", g, 4.0, state.compressor, g)], ["w"], [g])
    assert isinstance(communicator_for(work), InRounds)
    state.decide(Factors(half=True))
    half = Work(state, g.view(-1), [Segment("w", g, 2.0, state.cast, g)], ["w"], [g])
    assert isinstance(communicator_for(half), Summed)  # a half step is a cast, whatever the method


def test_the_wire_buffers_are_recycled_and_a_step_drops_those_it_did_not_write():
    import pickle

    state = CompressionState(get_compressor("fp16"), error_feedback=False)
    first = state.wire_buffer("a", 100, torch.float16, torch.device("cpu"))
    state.wire_buffer("b", 50, torch.float16, torch.device("cpu"))
    state.end_step()
    assert state.wire_buffer("a", 100, torch.float16, torch.device("cpu")) is first  # recycled
    state.end_step()  # a step that wrote only "a" (DDP rebuilt its buckets): "b" goes
    assert set(state.scratch.wires) == {"a"}
    state.end_step()  # a step that wrote none (a sparsifier's step) drops nothing
    assert set(state.scratch.wires) == {"a"}
    assert state.wire_buffer("a", 100, torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16  # re-made
    assert pickle.loads(pickle.dumps(state)).scratch.wires == {}  # scratch, not state
