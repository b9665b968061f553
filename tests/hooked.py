"""The DDP set-up of the comm hook's tests on gloo ranks, and the reference they check it against: every rank's
plain gradients, compressed with their residuals and averaged."""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gravac.state import CompressionState
from lightning_gravac.strategies.hook import gravac_hook


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


def _backward_both(ddp, reference, step, rank):
    """One backward pass of the DDP model (through the hook) and of its plain copy on this rank's batch of ``step``;
    the copy's parameter names and gradients."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    for m in (ddp, reference):
        m.zero_grad()
        m(x).square().mean().backward()
    return [n for n, _ in reference.named_parameters()], [p.grad for _, p in reference.named_parameters()]
