"""Adaptive quantization (Dryden et al., MLHPC 2016)."""

import math

import torch
from torch import Tensor

from lightning_gravac.compressors.base import INDEX_BYTES, Compressor, Payload, register_compressor
from lightning_gravac.compressors.select import exact_lowest, exact_topk, seeded_generator


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
        top = exact_topk(flat, high, out, seeded_generator(0, step, key), signed=True)
        if low:
            # The top group's positions out of the bottom's reach: on ties (an all-zero tensor) the groups could
            # otherwise share a position, which decoding would write once and summing ranks add twice.
            bottom = exact_lowest(flat, low, out, seeded_generator(1, step, key), exclude=top)
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
            out.index_add_(0, bottom[rank].long(), scaled[1].expand(bottom.shape[1]))
            out.index_add_(0, top[rank].long(), scaled[0].expand(top.shape[1]))

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        # Only the sent positions change; the top group is written last, as decoding writes it.
        means, top, bottom = payload.wire
        flat = tensor.view(-1)
        top, bottom = top.long(), bottom.long()
        below = flat.index_select(0, bottom).sub_(means[1])
        above = flat.index_select(0, top).sub_(means[0])
        flat.index_copy_(0, bottom, below)
        flat.index_copy_(0, top, above)


def _mean(values: Tensor) -> Tensor:
    return values.float().mean() if values.numel() else values.new_zeros((), dtype=torch.float32)
