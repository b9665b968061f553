"""1-bit SGD (Seide et al., Interspeech 2014)."""

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload, note_clamped, register_compressor
from lightning_gravac.compressors.packing import pack_bits, unpack_bits


def _columns(tensor: Tensor) -> Tensor:
    """The 2-D view ``[rows, columns]``: the first dimension down, the rest across; 1-D tensors are one column."""
    return tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(-1, 1)


@register_compressor
class OneBit(Compressor):
    """One bit an entry, its sign, and per column the means of the column's non-negative and negative entries.

    Decoding puts the non-negative mean where the bit is set and the negative mean elsewhere, so every column keeps
    its sum exactly. The bits are packed 8 a byte, the two means a column travel in the gradient's dtype. The
    factor is fixed by the shape (about 32 for an fp32 matrix with many rows); a requested ``cf`` is clamped to it
    (warned once, logged as ``gravac/achieved_cf``). Only defined with error feedback, which cannot be turned off.
    """

    fixed_cf = 32.0
    name = "onebit"
    requires_feedback = True

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        matrix = _columns(tensor).float()
        positive = matrix >= 0
        count = positive.sum(0)
        total = matrix.sum(0)
        above = torch.where(positive, matrix, 0).sum(0)
        means = torch.stack([above / count.clamp(min=1), (total - above) / (matrix.shape[0] - count).clamp(min=1)])
        means = means.to(tensor.dtype)
        # The decoded energy from the counts: each column's set entries at its first mean, the others at its second.
        counts = torch.stack([count, matrix.shape[0] - count]).double()
        sent = (counts * means.double().square()).sum()
        payload = Payload((pack_bits(positive.view(-1), 1), means), tensor.shape, tensor.dtype, sent=sent)
        note_clamped(self.name, cf, self.achieved_cf(payload))
        return payload

    def decompress(self, payload: Payload) -> Tensor:
        bits, means = payload.wire
        rows = payload.shape[0] if len(payload.shape) > 1 else payload.shape.numel()
        positive = unpack_bits(bits, 1, payload.shape.numel()).view(rows, -1).bool()
        return torch.where(positive, means[0], means[1]).view(payload.shape)
