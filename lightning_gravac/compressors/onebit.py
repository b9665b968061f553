"""1-bit SGD (Seide et al., Interspeech 2014)."""

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Compressor, Payload, note_clamped, register_compressor
from lightning_gravac.compressors.packing import pack_bits, unpack_bits


def _columns(tensor: Tensor) -> Tensor:
    """The 2-D view ``[rows, columns]``: the first dimension down, the rest across; 1-D tensors are one column."""
    return tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(-1, 1)


def _view(tensor: Tensor, shape: torch.Size) -> Tensor | None:
    """The ``[rows, columns]`` view of ``tensor`` (a flat bucket slice, or the gradient) for a payload of ``shape``,
    sharing its memory, so that writing it writes ``tensor``; ``None`` where only a copy could have that shape."""
    if not tensor.is_contiguous() or tensor.numel() != shape.numel():
        return None
    return _columns(tensor.view(shape))


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
        rows = matrix.shape[0]
        if kernels.usable(matrix):  # the column sums in one read (float64), the signs in another
            count, above, total = kernels.onebit_sums(matrix)
            bits = kernels.pack_signs(matrix.view(-1))
        else:
            positive = matrix >= 0
            count, total = positive.sum(0), matrix.sum(0)
            above = torch.where(positive, matrix, 0).sum(0)
            bits = pack_bits(positive.view(-1), 1)
        means = torch.stack([above / count.clamp(min=1), (total - above) / (rows - count).clamp(min=1)])
        means = means.to(tensor.dtype)
        # The decoded energy from the counts: each column's set entries at its first mean, the others at its second.
        counts = torch.stack([count, rows - count]).double()
        sent = (counts * means.double().square()).sum()
        payload = Payload((bits, means), tensor.shape, tensor.dtype, sent=sent)
        note_clamped(self, cf, self.achieved_cf(payload))
        return payload

    def decompress(self, payload: Payload) -> Tensor:
        bits, means = payload.wire
        rows = payload.shape[0] if len(payload.shape) > 1 else payload.shape.numel()
        out = torch.zeros(rows, payload.shape.numel() // max(rows, 1), dtype=torch.float32, device=bits.device)
        if kernels.usable(out) and bits.is_contiguous():  # the means written by the bits in one pass
            kernels.onebit_add_(out, bits, means, 1.0)
            return out.to(payload.dtype).view(payload.shape)
        positive = unpack_bits(bits, 1, payload.shape.numel()).view(rows, -1).bool()
        return torch.where(positive, means[0], means[1]).view(payload.shape)

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        # Each rank's decoded values times `scale` (rounded), added in rank order; one pass a rank with the kernel.
        matrix = _view(out, stacked.shape)
        for bits, means in zip(*stacked.wire, strict=True):
            if matrix is not None and kernels.usable(matrix) and bits.is_contiguous():
                kernels.onebit_add_(matrix, bits, means, scale)
            else:
                row = Payload((bits, means), stacked.shape, stacked.dtype)
                out.add_(self.decompress(row).view(-1).mul_(scale))

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        matrix = _view(tensor, payload.shape)
        bits, means = payload.wire
        if matrix is not None and kernels.usable(matrix) and bits.is_contiguous():  # x - decoded, in place: exact
            kernels.onebit_add_(matrix, bits, means, -1.0)
        else:
            super().residual_(tensor, payload)
