"""Natural compression: each entry stochastically rounded to a neighbouring power of two, 8 bits on the wire
(Horváth et al., "Natural Compression for Distributed Deep Learning", 2019).

Added through the path ``docs/design.md`` describes for a new method: this module, one line in
``compressors/__init__.py``, and its tests; the hook, the communicators and the controllers are untouched (its
payloads are gathered like every packed payload).
"""

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload, register_compressor
from lightning_gravac.compressors.select import stream_key
from lightning_gravac.compressors.uniform import uniforms

#: Exponent codes 1..127 (0 is zero): values more than 2^-126 below the tensor's largest are sent as 0.
_CODES = 127
_SIGN = 128


@register_compressor
class Natural(Compressor):
    """``C(t) = sign(t) 2^e`` with ``2^e`` the power of two just below ``|t|`` or just above, chosen with the
    probabilities that make it unbiased: with ``a = 2^floor(log2 |t|)``, ``2a`` with probability ``|t|/a - 1``, else
    ``a``. The variance is at most ``|t|^2 / 8``.

    On the wire each entry is one byte, a sign bit and a 7-bit exponent relative to the tensor's largest (one int32
    beside it): a factor of 4 from fp32 (2 from 16-bit) whatever ``cf`` asks. Entries below ``2^-126`` times the
    largest are sent as 0 (the paper's method keeps every fp32 exponent; the 8-bit code is this project's choice, and
    the bias it leaves is below fp32's own rounding of any sum with the largest entry). Unbiased, so error feedback
    is off by default. The draws are counter-based, streamed by ``(seed, step, tensor, rank)`` as QSGD's.

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
        rounded = exponent.sub_(1).add_(up)  # the exponent of the power of two sent
        nonzero = flat != 0
        top = rounded[nonzero].max() if bool(nonzero.any()) else torch.zeros((), dtype=rounded.dtype)
        code = top.sub(rounded).add_(1)  # 1 for the largest power sent
        code.masked_fill_(~nonzero | (code > _CODES), 0)
        byte = code.to(torch.uint8).bitwise_or_(flat.signbit().to(torch.uint8) * _SIGN)
        return Payload((byte, top.to(torch.int32).view(1)), tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        byte, top = payload.wire
        code = byte.bitwise_and(_CODES).to(torch.int32)
        magnitude = torch.ldexp(torch.ones_like(code, dtype=torch.float32), top.to(torch.int32) - code + 1)
        value = magnitude.masked_fill_(code == 0, 0.0)
        value = torch.where(byte >= _SIGN, -value, value)
        return value.to(payload.dtype).view(payload.shape)

    def __repr__(self) -> str:
        return f"Natural(seed={self.seed})"
