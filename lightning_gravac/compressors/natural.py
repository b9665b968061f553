"""Natural compression: each entry stochastically rounded to a neighbouring power of two, 8 bits on the wire
(Horváth et al., "Natural Compression for Distributed Deep Learning", 2019).

Added through the path ``docs/design.md`` describes for a new method: this module, one line in
``compressors/__init__.py``, and its tests; the hook, the communicators and the controllers are untouched (its
payloads are gathered like every packed payload).
"""

import math

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
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
    tensor, rank)`` as QSGD's. With the compiled kernel an fp32 gradient is read twice (the largest rounded exponent,
    then the bytes, the same draws both times) and decoded by a 256-entry table; the header's ``||C(g)||^2`` is the
    sum of the squares of the powers sent (by the kernel from a table of the 256 bytes' squares, by the eager path from
    the count of each byte).

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
        stream = stream_key(self.seed, step, key, self.rank)
        # The exponent of the power of two sent is never above the largest power the input's dtype holds (rounding up
        # from beyond it would overflow: those few entries round down instead).
        info = torch.finfo(tensor.dtype)
        maxexp = math.floor(math.log2(info.max))
        smallest = round(math.log2(info.smallest_normal * info.eps))  # the subnormal: -149 fp32, -24 fp16, -133 bf16
        if kernels.usable(flat):  # draw, round and code in two passes over the gradient, nothing gradient-sized else
            byte, peak, sent = kernels.natural_encode(flat, maxexp, smallest, stream)
            top = torch.tensor([peak], dtype=torch.int32)
        else:
            byte, top = _encode(flat, maxexp, stream)
            sent = _energy(torch.bincount(byte, minlength=256), top, smallest)
        payload = Payload((byte, top), tensor.shape, tensor.dtype, sent=sent)
        note_clamped(self, cf, self.achieved_cf(payload))
        return payload

    def decompress(self, payload: Payload) -> Tensor:
        byte, top = payload.wire
        if payload.dtype == torch.float32 and kernels.usable(byte, (torch.uint8,)):
            out = torch.zeros(byte.numel(), dtype=torch.float32)
            kernels.natural_add_(out, byte, _decode(_BYTES, top))
            return out.view(payload.shape)
        return _decode(byte, top).to(payload.dtype).view(payload.shape)

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        # Each rank's decoded values times `scale` (the product rounded to fp32, then added), in rank order: with the
        # kernel, a byte's product is looked up in a table of the 256 (each rank's `top` gives its own).
        fast = stacked.dtype == torch.float32 and kernels.usable(out)
        for byte, top in zip(*stacked.wire, strict=True):
            if fast:
                kernels.natural_add_(out, byte.contiguous(), _decode(_BYTES, top).mul_(scale))
            else:
                out.add_(self.decompress(Payload((byte, top), stacked.shape, stacked.dtype)).view(-1).mul_(scale))

    def __repr__(self) -> str:
        return f"Natural(seed={self.seed})"


#: Every byte, in order: decoded through the eager definition, the table the kernel looks values up in.
_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def _encode(flat: Tensor, maxexp: int, stream: int) -> tuple[Tensor, Tensor]:
    """The bytes of the fp32 ``flat`` and the largest rounded exponent (int32, ``[1]``): the eager definition."""
    mantissa, exponent = torch.frexp(flat)  # |t| = |m| 2^e with |m| in [0.5, 1): a = 2^(e - 1)
    draws = uniforms(stream, flat.numel(), flat.device)
    up = draws < mantissa.abs().mul_(2).sub_(1)  # P(up) = |t| / a - 1
    rounded = exponent.sub_(1).add_(up).clamp_(max=maxexp)
    finite = torch.isfinite(flat)
    nonzero = (flat != 0) & finite
    top = rounded[nonzero].max() if bool(nonzero.any()) else rounded.new_zeros(())
    code = top.sub(rounded).add_(1)  # 1 for the largest power sent
    code.masked_fill_(~nonzero | (code > _CODES), 0)
    # Signed only where a power is sent (-0, and an entry too small for a code, are 0: the sign with code 0 is NaN's).
    byte = code.to(torch.uint8).bitwise_or_((flat.signbit() & (code != 0)).to(torch.uint8) * _SIGN)
    byte.masked_fill_(~finite, _NOT_FINITE)  # NaN and Inf decode as NaN: never as a finite power of two
    return byte, top.to(torch.int32).view(1)


def _decode(byte: Tensor, top: Tensor) -> Tensor:
    """The fp32 values of ``byte`` for the largest exponent ``top``."""
    code = byte.bitwise_and(_CODES).to(torch.int32)
    magnitude = torch.ldexp(torch.ones_like(code, dtype=torch.float32), top.to(byte.device, torch.int32) - code + 1)
    value = magnitude.masked_fill_(code == 0, 0.0)
    return torch.where(byte >= _SIGN, -value, value).masked_fill_(byte == _NOT_FINITE, math.nan)


def _energy(counts: Tensor, top: Tensor, smallest: int) -> Tensor:
    """``||decompress(payload)||^2`` (float64) from how many entries got each byte: code ``c`` of either sign decodes
    to ``2^(top - c + 1)``, 0 below ``2^smallest`` (the payload dtype's smallest subnormal); NaN if any entry is not
    finite."""
    counts = counts.to(torch.float64)
    per_code = counts[1:_SIGN] + counts[_SIGN + 1 :]
    exponent = top.to(counts.device, torch.int64) - torch.arange(1, _SIGN, device=counts.device) + 1
    squares = torch.ldexp(torch.ones_like(per_code), 2 * exponent).masked_fill_(exponent < smallest, 0.0)
    energy = per_code.mul_(squares).sum()
    return torch.where(counts[_NOT_FINITE] > 0, math.nan, energy)
