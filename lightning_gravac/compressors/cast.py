"""Casting to a 16-bit float before the all-reduce: fp16 and bf16."""

from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import (
    Compressor,
    Pattern,
    Payload,
    note_clamped,
    register_compressor,
    sq_norm,
)


class _Cast(Compressor):
    """Send the gradient in a 16-bit float type, summed by an all-reduce in that type (after division by N, so an
    fp16 sum does not overflow).

    The factor is fixed by the types, not by ``cf``: 2 from fp32, 1 from a 16-bit bucket. A requested ``cf`` is
    clamped to it (warned once; ``gravac/achieved_cf`` logs what was achieved). Unbiased up to rounding, so
    error feedback is off by default.
    """

    near_lossless = True
    fixed_cf = 2.0
    wire_dtype: ClassVar[torch.dtype]
    biased = False
    communication = Pattern.SUM

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        out = torch.empty(tensor.numel(), dtype=self.wire_dtype, device=tensor.device)
        return self.compress_into(tensor, cf, out, key=key, step=step)

    def compress_into(self, tensor: Tensor, cf: float, out: Tensor, *, key: str = "", step: int = 0) -> Payload:
        # A copy even when the dtypes agree: with error feedback the input becomes the residual in place. `copy_`
        # rounds as `to` does (to nearest, ties to even).
        flat = tensor.reshape(-1)
        if kernels.usable(flat) and kernels.usable(out, kernels.HALVES):
            # Cast and the header's two norms (of the input and of what is sent) in one pass over the gradient.
            basis, sent = kernels.cast_half(flat, out)
            payload = Payload((out,), tensor.shape, tensor.dtype, basis=basis, sent=sent)
        else:
            payload = Payload((out.copy_(flat),), tensor.shape, tensor.dtype)
        note_clamped(self, cf, self.achieved_cf(payload))
        return payload

    def decompress(self, payload: Payload) -> Tensor:
        return payload.wire[0].to(payload.dtype).view(payload.shape)

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        rows = stacked.wire[0]
        for part, chunk in _chunks(out.view(-1), rows.shape[1]):
            # The rows' sum in ``out``'s type, then scaled: one chunk's temporaries at a time (stays in cache).
            part.add_(rows[:, chunk].to(out.dtype).sum(0), alpha=scale)

    def decode_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        rows = stacked.wire[0]
        if rows.shape[0] != 1:
            super().decode_(out, stacked, scale)
            return
        flat = out.view(-1)
        flat.copy_(rows[0])  # the cast back, in the copy's one pass: what ``0 + row x scale`` gives, bit for bit
        if scale != 1.0:
            flat.mul_(scale)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        wire = payload.wire[0]
        for part, chunk in _chunks(tensor.view(-1), wire.numel()):
            part.sub_(wire[chunk].to(tensor.dtype))  # the rounding the cast left

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        if payload.sent is not None:  # found by the cast itself
            return payload.sent
        # A norm read straight from 16-bit values runs several times slower on a CPU than the widening kernel.
        wire = payload.wire[0]
        return kernels.half_sq(wire) if kernels.usable(wire, kernels.HALVES) else sq_norm(wire)


#: Entries a chunk: 1 MB of fp32. On CPU torch converts an operand of another type into a temporary of the whole
#: operand's size (an allocation and a pass through memory); a chunk's temporary stays in cache.
_CHUNK = 1 << 18


def _chunks(flat: Tensor, numel: int) -> Iterator[tuple[Tensor, slice]]:
    """``(flat[chunk], chunk)`` for consecutive chunks of ``numel`` entries."""
    for start in range(0, numel, _CHUNK):
        chunk = slice(start, min(start + _CHUNK, numel))
        yield flat[chunk], chunk


@register_compressor
class FP16(_Cast):
    """IEEE half precision on the wire: 10 mantissa bits, range to 65504."""

    name = "fp16"
    wire_dtype = torch.float16


@register_compressor
class BF16(_Cast):
    """bfloat16 on the wire: fp32's range, 7 mantissa bits."""

    name = "bf16"
    wire_dtype = torch.bfloat16
