"""CodedAllGather: parameters gathered in block codes, against gloo's exact all-gather and in an FSDP2 forward."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_gravac.compressors import get_compressor
from lightning_gravac.launch import run_distributed
from lightning_gravac.sharded.all_gather import CodedAllGather

SHARD = 1000
BLOCK = 128


def _shards(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHARD, generator=g) * 10.0 ** torch.randint(-3, 1, (SHARD,), generator=g) for _ in range(world)]


def _gather(rank: int, world: int, method: str) -> dict:
    dist.init_process_group("gloo")
    comm = CodedAllGather(get_compressor(method, block_size=BLOCK))
    out = comm.allocate((world * SHARD,), dtype=torch.float32, device=torch.device("cpu"))
    out.view(world, SHARD)[rank].copy_(_shards(world)[rank])  # FSDP's input is a view into its output
    comm(out, out.view(world, SHARD)[rank], dist.group.WORLD)
    return {"gathered": out, "sent": comm.bytes_sent}


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_every_rank_gathers_the_same_parameters_within_half_a_level_of_each_block_peak(method):
    ranks = run_distributed(_gather, 2, timeout=120, method=method)
    assert torch.equal(ranks[0]["gathered"], ranks[1]["gathered"])
    exact = torch.cat(_shards(2))
    peaks = torch.nn.functional.pad(exact.view(2, SHARD).abs(), (0, -SHARD % BLOCK)).view(2, -1, BLOCK).amax(2)
    bound = peaks.repeat_interleave(BLOCK, dim=1)[:, :SHARD].reshape(-1) / (2 * get_compressor(method).levels)
    error = (ranks[0]["gathered"] - exact).abs()
    assert (error <= bound * (1 + 1e-6)).all() and error.max() > 0
    bits = 8 if method == "int8" else 4
    assert ranks[0]["sent"] == SHARD * bits // 8 + 8 * 4


def _forward(rank: int, world: int, method: str | None) -> torch.Tensor:
    """A sharded transformer layer's output on one batch, its parameters gathered exact or in ``method``."""
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    if method is not None:
        model.set_custom_all_gather(CodedAllGather(get_compressor(method)))
    with torch.no_grad():
        return model(torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(1)))


@pytest.mark.distributed
def test_the_forward_with_int8_parameters_is_within_a_percent_of_the_exact_one():
    exact = run_distributed(_forward, 2, timeout=120, method=None)[0]
    errors = {}
    for method in ("int8", "int4"):
        coded = run_distributed(_forward, 2, timeout=120, method=method)
        assert torch.equal(coded[0], coded[1])
        errors[method] = float((coded[0] - exact).norm() / exact.norm())
    # Measured: int8 0.27%, int4 4.4% of the output's norm (this layer, this batch).
    assert 0 < errors["int8"] < 0.01
    assert errors["int8"] < errors["int4"] < 0.1
