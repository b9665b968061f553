"""Adaptive quantization (Dryden et al., MLHPC 2016)."""

import math

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import INDEX_BYTES, Compressor, Payload, register_compressor
from lightning_gravac.compressors.select import exact_lowest, exact_topk, seeded_generator, signed_extremes


@register_compressor
class AdaQ(Compressor):
    """Keep the largest positive and the most negative entries, each group sent as positions and one mean.

    Of the ``k`` positions a factor affords (int32 each, no values), half go to the largest entries and half to the
    smallest (most negative) ones; decoding sets the first group to its mean and the second to its mean, two floats
    in all. So ``cf=100`` from fp32 keeps ``numel/100`` entries, twice Top-K's. Biased: error feedback is on by
    default. When a tensor has fewer positives than its share, the group takes the largest entries whatever their
    sign, and its mean says so.
    """

    name = "adaq"

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        value_bytes = flat.element_size()
        k = max(1, min(n, math.ceil(n * value_bytes / (cf * INDEX_BYTES))))
        low = min(k // 2, n // 2)
        high = min(k - low, n - low)
        out = self.scratch.like(flat)
        highest, lowest = signed_extremes(flat, high)  # both groups' block peaks from one read
        top = exact_topk(flat, high, out, seeded_generator(0, step, key), signed=True, peak=highest)
        if low:
            # The top group's positions out of the bottom's reach: on ties (an all-zero tensor) the groups could
            # otherwise share a position, which decoding would write once and summing ranks add twice.
            bottom = exact_lowest(flat, low, out, seeded_generator(1, step, key), exclude=top, peak=lowest)
            if bottom is None:  # the selection from a negated copy, whose top positions are -inf
                negated = torch.neg(flat, out=self.scratch.like(flat, slot=1))
                negated.index_fill_(0, top, -math.inf)
                bottom = exact_topk(negated, low, out, seeded_generator(1, step, key), signed=True)
        else:
            bottom = top.new_zeros(0)
        means = torch.stack([_mean(flat.index_select(0, top)), _mean(flat.index_select(0, bottom))]).to(tensor.dtype)
        wire = (means, top.to(torch.int32), bottom.to(torch.int32))
        return Payload(wire, tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        means, top, bottom = payload.wire
        out = torch.zeros(payload.shape.numel(), dtype=payload.dtype, device=means.device)
        out.index_fill_(0, bottom.long(), means[1])
        out.index_fill_(0, top.long(), means[0])
        return out.view(payload.shape)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        # Each group's positions at its mean (the groups never share a position).
        means, top, bottom = payload.wire
        counts = torch.tensor([top.numel(), bottom.numel()], dtype=torch.float64, device=means.device)
        return (counts * means.to(payload.dtype).double().square()).sum()

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        means, top, bottom = stacked.wire  # [ranks, 2], [ranks, high], [ranks, low]
        for rank in range(means.shape[0]):  # rank order, as the decoded sum would run
            scaled = (means[rank] * scale).to(out.dtype)
            for group, value in ((bottom[rank], scaled[1]), (top[rank], scaled[0])):
                _add_at(out, group, value)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        # Only the sent positions change; the top group is written last, as decoding writes it.
        means, top, bottom = payload.wire
        flat = tensor.view(-1)
        _add_at(flat, bottom, -means[1].to(flat.dtype))  # x + (-m) is x - m, bit for bit
        _add_at(flat, top, -means[0].to(flat.dtype))


def _mean(values: Tensor) -> Tensor:
    return values.float().mean() if values.numel() else values.new_zeros((), dtype=torch.float32)


def _add_at(out: Tensor, positions: Tensor, value: Tensor) -> None:
    """``out[positions] += value`` for one rank's distinct positions (int32) of the flat ``out``: the compiled
    kernel where it can (index_add_'s bits, prefetching the positions' lines), else a gather, an add and a scatter
    (a third of index_add_'s time on a CPU, the same sums)."""
    if kernels.usable(out) and positions.dtype == torch.int32 and positions.is_contiguous():
        kernels.scatter_add_(out, positions, None, constant=float(value))
    else:
        wide = positions.long()
        out.index_copy_(0, wide, out.index_select(0, wide).add_(value))
