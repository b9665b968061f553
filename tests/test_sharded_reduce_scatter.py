"""CodedReduceScatter against gloo's exact reduce-scatter, on 2 ranks without Lightning."""

import pytest
import torch
import torch.distributed as dist

from lightning_gravac.compressors import get_compressor
from lightning_gravac.launch import run_distributed
from lightning_gravac.sharded import CodedReduceScatter
from lightning_gravac.sharded.control import ShardedCompressionState
from lightning_gravac.state import Factors

#: Entries in each rank's chunk: not a whole number of blocks, so the last block is short.
CHUNK = 1000
BLOCK = 128


def _inputs(world: int, step: int) -> list[torch.Tensor]:
    """Every rank's flat gradient buffer at ``step`` (``world`` chunks), entries across four orders of magnitude."""
    g = torch.Generator().manual_seed(step)
    return [torch.randn(world * CHUNK, generator=g) * 10.0 ** torch.randint(-3, 1, (world * CHUNK,), generator=g)
            for _ in range(world)]  # fmt: skip


def _reduce(rank: int, world: int, method: str, steps: int, error_feedback: bool, op: str, vary: bool = True) -> dict:
    dist.init_process_group("gloo")
    reduce_op = getattr(dist.ReduceOp, op)
    code = get_compressor(method, block_size=BLOCK)
    comm = CodedReduceScatter(code, error_feedback, [("flat", world * CHUNK, CHUNK)])
    coded, exact, owed = [], [], []
    for step in range(steps):
        mine = _inputs(world, step if vary else 0)[rank]
        out, reference = comm.allocate((CHUNK,), dtype=torch.float32, device=torch.device("cpu")), torch.empty(CHUNK)
        comm(out, mine.clone(), dist.group.WORLD, reduce_op)
        dist.reduce_scatter_single(reference, mine.clone(), op=reduce_op)
        coded.append(out)
        exact.append(reference)
        if error_feedback:
            # What every rank still owes this one: the rows of every rank's residual destined here.
            assert comm.residual is not None
            residuals = [torch.empty(world, CHUNK) for _ in range(world)]
            dist.all_gather(residuals, comm.residual)
            owed.append(sum(residual[rank] for residual in residuals))
    return {"coded": coded, "exact": exact, "owed": owed, "sent": comm.bytes_sent, "state": comm.state_dict()}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("method", "op", "world"),
    [("int8", "SUM", 2), ("int8", "AVG", 2), ("int4", "SUM", 2), ("int4", "AVG", 2), ("int8", "AVG", 4)],
)
def test_each_entry_within_half_a_level_of_each_senders_block_peak(method, op, world):
    ranks = run_distributed(_reduce, world, timeout=120, method=method, steps=1, error_feedback=False, op=op)
    levels = get_compressor(method).levels
    scale = 1.0 / world if op == "AVG" else 1.0
    inputs = _inputs(world, 0)
    for rank, result in enumerate(ranks):
        coded, exact = result["coded"][0], result["exact"][0]
        # Half a level of each other sender's block peak; this rank's own chunk is added exact.
        bound = torch.zeros(CHUNK)
        for source in range(world):
            if source != rank:
                chunk = inputs[source].view(world, CHUNK)[rank]
                peaks = torch.nn.functional.pad(chunk.abs(), (0, -CHUNK % BLOCK)).view(-1, BLOCK).amax(1)
                bound += peaks.repeat_interleave(BLOCK)[:CHUNK] / (2 * levels)
        error = (coded - exact).abs()
        assert (error <= scale * bound * (1 + 1e-5) + 1e-6).all()
        assert error.max() > 0, "nothing was coded"
        assert error.max() <= world * scale * bound.max()
    # To each peer, a chunk of codes and the scales of its ceil(1000 / 128) = 8 blocks.
    bits = 8 if method == "int8" else 4
    assert ranks[0]["sent"] == (world - 1) * (CHUNK * bits // 8 + 8 * 4)


@pytest.mark.distributed
def test_the_residual_holds_what_coding_dropped_and_error_feedback_brings_two_steps_closer():
    world = 2
    # One gradient twice: without error feedback its rounding error is made twice over.
    kwargs = dict(timeout=120, method="int4", steps=2, op="SUM", vary=False)
    fed = run_distributed(_reduce, world, error_feedback=True, **kwargs)
    plain = run_distributed(_reduce, world, error_feedback=False, **kwargs)
    for rank in range(world):
        f, p = fed[rank], plain[rank]
        # After each step, what was received plus what the senders still owe is the exact sum.
        total_exact = torch.zeros(CHUNK)
        total_coded = torch.zeros(CHUNK)
        for step in range(2):
            total_exact += f["exact"][step]
            total_coded += f["coded"][step]
            torch.testing.assert_close(total_coded + f["owed"][step], total_exact, rtol=1e-5, atol=1e-5)
        # Over two steps the error-fed sum misses by one step's rounding; without, by both steps'.
        fed_miss = (total_coded - total_exact).norm()
        plain_miss = (p["coded"][0] + p["coded"][1] - total_exact).norm()
        assert fed_miss < 0.7 * plain_miss
    # Named by parameter, the padding dropped: the residual of everything this rank sent.
    assert fed[0]["state"].keys() == {"flat"} and fed[0]["state"]["flat"].shape == (world * CHUNK,)


def _dense(rank: int, world: int) -> bool:
    dist.init_process_group("gloo")
    comm = CodedReduceScatter(None)
    mine = _inputs(world, 0)[rank]
    out, reference = torch.empty(CHUNK), torch.empty(CHUNK)
    comm(out, mine.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    dist.reduce_scatter_single(reference, mine.clone(), op=dist.ReduceOp.AVG)
    return torch.equal(out, reference)


@pytest.mark.distributed
def test_without_a_code_it_is_the_exact_reduce_scatter():
    assert run_distributed(_dense, 2, timeout=120) == [True, True]


def _split(rank: int, world: int) -> dict:
    """One error-fed int8 step with the parameter "b" (the last 400 entries of each chunk) at factor 1, then one step
    with every parameter at factor 1."""
    dist.init_process_group("gloo")
    state = ShardedCompressionState(get_compressor("int8", block_size=BLOCK), True, lambda: None)
    state.measures = True
    state.decide(Factors(cf=4.0, param_cf={"b": 1.0}))
    comm = CodedReduceScatter(state.compressor, True, [("w", world * 600, 600), ("b", world * 400, 400)], state)
    out, reference = torch.empty(CHUNK), torch.empty(CHUNK)
    mine = _inputs(world, 0)[rank]
    comm(out, mine.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
    dist.reduce_scatter_single(reference, mine.clone(), op=dist.ReduceOp.SUM)
    assert comm.residual is not None
    residual = comm.residual.clone()
    state.decide(Factors(cf=1.0))
    flushed, second = torch.empty(CHUNK), _inputs(world, 1)[rank]
    comm(flushed, second.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
    owed_total = torch.empty(CHUNK)
    dist.reduce_scatter_single(owed_total, (second + residual.view(-1)).clone(), op=dist.ReduceOp.SUM)
    return {"out": out, "reference": reference, "residual": residual, "flushed": flushed, "owed": owed_total,
            "after": comm.residual, "stats": state.pop_stats()}  # fmt: skip


@pytest.mark.distributed
def test_a_parameter_at_factor_1_goes_exact_beside_the_codes_and_a_step_all_at_1_pays_what_was_owed():
    for rank, result in enumerate(run_distributed(_split, 2, timeout=120)):
        out, reference = result["out"], result["reference"]
        assert torch.equal(out[600:], reference[600:])  # "b": exact, the sum of two fp32s in either order
        error = (out[:600] - reference[:600]).abs()
        assert 0 < error.max() < 1e-2 * reference[:600].abs().max()
        residual = result["residual"]
        assert residual[:, 600:].abs().max() == 0 and residual[rank].abs().max() == 0
        assert residual[1 - rank, :600].abs().max() > 0
        # A step at factor 1 sends its gradient and what coding still owed, exact: FSDP's own collective.
        assert torch.equal(result["flushed"], result["owed"])
        assert result["after"] is None
        stats = result["stats"]
        assert stats.bytes_dense == 2 * CHUNK * 4 and 0 < stats.bytes_sent - CHUNK * 4 < CHUNK * 4
        assert 0.99 < stats.gain < 1.01


def _owed_on_resume(rank: int, world: int) -> list[torch.Tensor]:
    """One coded step after restoring a residual whose every row is owed, this rank's own included: what a resume on
    another world size lays out. Returns what arrived, what the ranks still owe here, and the exact sum."""
    dist.init_process_group("gloo")
    comm = CodedReduceScatter(get_compressor("int4", block_size=BLOCK), True, [("flat", world * CHUNK, CHUNK)])
    g = torch.Generator().manual_seed(100 + rank)
    restored = torch.randn(world * CHUNK, generator=g) * 0.1
    comm.load_state_dict({"flat": restored}, world, torch.device("cpu"))
    mine = _inputs(world, 0)[rank]
    out, reference = torch.empty(CHUNK), torch.empty(CHUNK)
    comm(out, mine.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
    dist.reduce_scatter_single(reference, mine + restored, op=dist.ReduceOp.SUM)
    assert comm.residual is not None
    residuals = [torch.empty(world, CHUNK) for _ in range(world)]
    dist.all_gather(residuals, comm.residual)
    return [out, sum(residual[rank] for residual in residuals), reference]


@pytest.mark.distributed
def test_a_restored_residual_owed_to_this_ranks_own_chunk_is_paid_not_dropped():
    for out, owed, exact in run_distributed(_owed_on_resume, 2, timeout=120):
        torch.testing.assert_close(out + owed, exact, rtol=1e-5, atol=1e-5)
