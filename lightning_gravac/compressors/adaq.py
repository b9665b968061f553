"""Adaptive quantization (Dryden et al., MLHPC 2016)."""

import math

import torch
from torch import Tensor

from lightning_gravac.compressors.base import INDEX_BYTES, Compressor, Payload, register_compressor


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
        top = torch.topk(flat, high, sorted=False).indices
        bottom = torch.topk(flat, low, largest=False, sorted=False).indices
        means = torch.stack([_mean(flat[top]), _mean(flat[bottom])]).to(tensor.dtype)
        wire = (means, top.to(torch.int32), bottom.to(torch.int32))
        return Payload(wire, tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        means, top, bottom = payload.wire
        out = torch.zeros(payload.shape.numel(), dtype=payload.dtype, device=means.device)
        out[bottom.long()] = means[1]
        out[top.long()] = means[0]
        return out.view(payload.shape)


def _mean(values: Tensor) -> Tensor:
    return values.float().mean() if values.numel() else values.new_zeros((), dtype=torch.float32)
