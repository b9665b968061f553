"""Casting to a 16-bit float before the all-reduce: fp16 and bf16."""

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload, note_clamped, register_compressor, sq_norm


class _Cast(Compressor):
    """Send the gradient in a 16-bit float type, summed by an all-reduce in that type (after division by N, so an
    fp16 sum does not overflow).

    The factor is fixed by the types, not by ``cf``: 2 from fp32, 1 from a 16-bit bucket. A requested ``cf`` is
    clamped to it (warned once; ``gravac/achieved_cf`` logs what was achieved). Unbiased up to rounding, so
    error feedback is off by default.
    """

    near_lossless = True
    fixed_cf = 2.0
    wire_dtype: torch.dtype
    biased = False
    summable = True

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        # A copy even when the dtypes agree: with error feedback the input becomes the residual in place.
        payload = Payload((tensor.reshape(-1).to(self.wire_dtype, copy=True),), tensor.shape, tensor.dtype)
        note_clamped(self.name, cf, self.achieved_cf(payload))
        return payload

    def decompress(self, payload: Payload) -> Tensor:
        return payload.wire[0].to(payload.dtype).view(payload.shape)

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        out.add_(stacked.wire[0].to(out.dtype).sum(0), alpha=scale)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        return sq_norm(payload.wire[0])


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
