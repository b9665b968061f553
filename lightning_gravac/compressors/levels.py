"""Codes of signed levels with one scale a group of entries: the wire format QSGD and the block codes share.

An entry travels as ``level + s`` in ``b = ceil(log2(2s + 1))`` bits, packed, ``level`` in ``[-s, s]``; its group of
``group`` entries sends one fp32 scale, from which every rank derives the group's step (``scale / s``). Decoding is
``level * step``, rounded to fp32 and summed rank by rank in rank order, so every rank computes the same bits. How a
level is chosen (stochastic rounding against a norm, the nearest level against the largest magnitude) is the
method's; decoding, the payloads' sum and the decoded energy are this class's.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Compressor, Payload
from lightning_gravac.compressors.packing import unpack_bits


class LevelCodes(Compressor):
    """A method whose payload is ``(packed codes, scales)`` with ``s`` in ``payload.derived[0]`` and a group of
    :attr:`group` entries a scale."""

    group: int

    def decompress(self, payload: Payload) -> Tensor:
        packed, scales = payload.wire
        numel = payload.shape.numel()
        s = int(payload.derived[0])
        out = torch.zeros(numel, dtype=torch.float32, device=packed.device)
        if kernels.usable(out) and packed.is_contiguous():  # (code - s) * step, as below, in one pass
            kernels.codes_add_(out, packed, code_bits(s), s, (scales / s).float().contiguous(), self.group, 1.0)
            return out.to(payload.dtype).view(payload.shape)
        codes = unpack_bits(packed, code_bits(s), numel).float().sub_(s)
        values = F.pad(codes, (0, -numel % self.group)).view(-1, self.group)
        values.mul_((scales / s).unsqueeze(1))
        return values.view(-1)[:numel].to(payload.dtype).view(payload.shape)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        # `tensor - decoded` in one pass, without the decoded tensor: minus each decoded value, rounded as `decompress`
        # rounds it, added in place (fp32 payloads; a 16-bit one decodes with one more rounding).
        packed, scales = payload.wire
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor
        if payload.dtype == torch.float32 and kernels.usable(flat) and packed.is_contiguous():
            s = int(payload.derived[0])
            kernels.codes_add_(flat, packed, code_bits(s), s, (scales / s).float().contiguous(), self.group, -1.0)
            return
        super().residual_(tensor, payload)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        # Per group, the integer sum of the squared levels times step^2: from the packed codes alone.
        packed, scales = payload.wire
        # fp32 payloads only: a 16-bit one decodes with one more rounding, which the closed form does not see.
        if not (payload.dtype == torch.float32 and kernels.usable(scales) and packed.is_contiguous()):
            return super().sent_sq_norm(payload)
        s = int(payload.derived[0])
        levels = kernels.codes_sq(packed, payload.shape.numel(), code_bits(s), s, self.group)
        steps = (scales / s).float().double()  # decoding's fp32 step
        return (levels.double() * steps.square()).sum()

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        # Each rank's decoded values times `scale` (rounded), added in rank order; one pass a rank with the kernel.
        s = int(stacked.derived[0])
        for packed, scales in zip(*stacked.wire, strict=True):
            steps = (scales / s).float().contiguous()
            if kernels.usable(out) and packed.is_contiguous():
                kernels.codes_add_(out, packed, code_bits(s), s, steps, self.group, scale)
            else:
                row = Payload((packed, scales), stacked.shape, stacked.dtype, derived=stacked.derived)
                out.add_(self.decompress(row).view(-1).mul_(scale))


def code_bits(levels: int) -> int:
    """Bits of a code in ``[0, 2 levels]``."""
    return math.ceil(math.log2(2 * levels + 1))
