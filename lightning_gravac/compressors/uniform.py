"""Uniform draws from a counter-based generator: draw ``i`` of a stream is a hash of ``(stream, i)``.

QSGD and TernGrad round stochastically, one uniform draw an entry. Drawing them with ``torch.rand`` fills a tensor
the size of the gradient (a write and a read of 100 MB for 25M entries) in the order a generator produces them. Here
draw ``i`` is the top 24 bits of SplitMix64's output function (Steele, Lea & Flood, OOPSLA 2014) applied to
``stream + (i + 1) * 0x9E3779B97F4A7C15``, over ``2^24``: any entry's draw is computed where it is used, by any
thread, so the compiled kernels quantize in one pass; this module computes the same bits with int64 tensors (the
eager path, and the reference the kernels are tested against). The stream is a 63-bit hash of ``(seed, step, key,
rank)``, as the methods' generators were seeded.
"""

import torch
from torch import Tensor

_GOLDEN = 0x9E3779B97F4A7C15
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _signed(value: int) -> int:
    """The int64 that has ``value``'s 64 bits (torch's integers are signed; their products wrap)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic: mask the sign's copies)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(stream: int, numel: int, device: torch.device | str = "cpu") -> Tensor:
    """Draws ``0 .. numel - 1`` of ``stream``, fp32 in ``[0, 1)`` (multiples of ``2^-24``)."""
    z = torch.arange(1, numel + 1, dtype=torch.int64, device=device).mul_(_signed(_GOLDEN)).add_(_signed(stream))
    for bits, factor in zip((30, 27), _MIX, strict=True):
        z = (z ^ _shift_right(z, bits)).mul_(_signed(factor))
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 40).to(torch.float32).mul_(2.0**-24)
