"""Natural compression: each entry stochastically rounded to a neighbouring power of two, 8 bits on the wire
(Horváth et al., "Natural Compression for Distributed Deep Learning", 2019).

Added through the path ``docs/design.md`` describes for a new method: this module, one line in
``compressors/__init__.py``, and its tests; the hook, the communicators and the controllers are untouched (its
payloads are gathered like every packed payload).
"""

import math

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload, note_clamped, register_compressor
from lightning_gravac.compressors.select import stream_key
from lightning_gravac.compressors.uniform import uniforms

#: Exponent codes 1..127 (0 is zero): values more than 2^-126 below the tensor's largest are sent as 0.
_CODES = 127
_SIGN = 128
#: The byte of a NaN or Inf entry (the sign bit with code 0, which no finite entry uses: a zero is sent as 0).
_NOT_FINITE = _SIGN


@register_compressor
class Natural(Compressor):
    """``C(t) = sign(t) 2^e`` with ``2^e`` the power of two just below ``|t|`` or just above, chosen with the
    probabilities that make it unbiased: with ``a = 2^floor(log2 |t|)``, ``2a`` with probability ``|t|/a - 1``, else
    ``a``. The variance is at most ``|t|^2 / 8``.

    On the wire each entry is one byte, a sign bit and a 7-bit exponent relative to the tensor's largest (one int32
    beside it): a factor of 4 from fp32 (2 from 16-bit) whatever ``cf`` asks. Entries below ``2^-126`` times the
    largest are sent as 0 (the paper's method keeps every fp32 exponent; the 8-bit code is this project's choice, and
    the bias it leaves is below fp32's own rounding of any sum with the largest entry), and entries that would round up
    past the largest power of two their dtype holds round down. A NaN or Inf entry is sent as such (it decodes as
    NaN). Unbiased, so error feedback is off by default. The draws are counter-based, streamed by ``(seed, step,
    tensor, rank)`` as QSGD's. No compiled kernel yet: about 0.03 GB/s on a CPU, a proof of the new-method path more
    than a fast method.

    Args:
        seed: seed of the rounding draws.
    """

    name = "natural"
    biased = False
    fixed_cf = 4.0

    def __init__(self, seed: int = 0) -> None:
        self.seed, self.rank = seed, 0

    def setup(self, world_size: int, rank: int = 0) -> None:
        self.rank = rank

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        flat = tensor.reshape(-1).float()
        mantissa, exponent = torch.frexp(flat)  # |t| = |m| 2^e with |m| in [0.5, 1): a = 2^(e - 1)
        draws = uniforms(stream_key(self.seed, step, key, self.rank), flat.numel(), flat.device)
        up = draws < mantissa.abs().mul_(2).sub_(1)  # P(up) = |t| / a - 1
        # The exponent of the power of two sent; never above the largest power the input's dtype holds (rounding up
        # from beyond it would overflow: those few entries round down instead).
        rounded = exponent.sub_(1).add_(up).clamp_(max=math.floor(math.log2(torch.finfo(tensor.dtype).max)))
        finite = torch.isfinite(flat)
        nonzero = (flat != 0) & finite
        top = rounded[nonzero].max() if bool(nonzero.any()) else rounded.new_zeros(())
        code = top.sub(rounded).add_(1)  # 1 for the largest power sent
        code.masked_fill_(~nonzero | (code > _CODES), 0)
        byte = code.to(torch.uint8).bitwise_or_((flat.signbit() & nonzero).to(torch.uint8) * _SIGN)  # -0 as 0
        byte.masked_fill_(~finite, _NOT_FINITE)  # NaN and Inf decode as NaN: never as a finite power of two
        payload = Payload((byte, top.to(torch.int32).view(1)), tensor.shape, tensor.dtype)
        note_clamped(self.name, cf, self.achieved_cf(payload))
        return payload

    def decompress(self, payload: Payload) -> Tensor:
        byte, top = payload.wire
        code = byte.bitwise_and(_CODES).to(torch.int32)
        magnitude = torch.ldexp(torch.ones_like(code, dtype=torch.float32), top.to(torch.int32) - code + 1)
        value = magnitude.masked_fill_(code == 0, 0.0)
        value = torch.where(byte >= _SIGN, -value, value).masked_fill_(byte == _NOT_FINITE, math.nan)
        return value.to(payload.dtype).view(payload.shape)

    def __repr__(self) -> str:
        return f"Natural(seed={self.seed})"
