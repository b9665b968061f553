"""QSGD: stochastic quantization to a few levels per bucket (Alistarh et al., NeurIPS 2017)."""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Payload, note_clamped, register_compressor
from lightning_gravac.compressors.levels import LevelCodes, code_bits
from lightning_gravac.compressors.packing import pack_bits
from lightning_gravac.compressors.select import stream_key
from lightning_gravac.compressors.uniform import uniforms

#: Bits of a bucket's norm on the wire (fp32).
_NORM_BITS = 32


@register_compressor
class QSGD(LevelCodes):
    """Per bucket ``v`` of ``bucket_size`` entries: ``||v|| sign(v_i) l_i / s``, with the level ``l_i`` in ``0..s``
    drawn by stochastic rounding of ``s |v_i| / ||v||`` to a neighbouring integer, so that the expectation is ``v_i``.

    Sign and level travel as one code ``sign(v_i) l_i + s`` in ``b = ceil(log2(2s + 1))`` bits, packed, with one
    fp32 norm per bucket. ``levels`` fixes ``s``; by default it follows ``cf``: the code width ``b`` (2 to 8) whose
    cost, ``b + 32 / bucket_size`` bits an entry, gives the factor nearest ``cf``, with ``s = 2**(b-1) - 1``
    (``cf=10`` from fp32: 3 bits, ``s=3``). Outside 3.97x to 15.5x from fp32 a requested ``cf`` is clamped.
    Unbiased, so error feedback is off by default. The draws come from a counter-based generator whose stream is
    ``(seed, step, tensor, rank)``: reproducible, independent across ranks, and computed where they are used (with the
    compiled kernel, norms aside, the gradient is read once and the packed codes written once).

    Args:
        levels: ``s``, the number of non-zero levels (1 to 127); ``None`` derives it from ``cf``.
        bucket_size: entries sharing one norm.
    """

    name = "qsgd"
    biased = False

    def __init__(self, levels: int | None = None, bucket_size: int = 512, seed: int = 0) -> None:
        if levels is not None and not 1 <= levels <= 127:
            raise ValueError(f"`levels` must be in [1, 127] (8-bit codes), got {levels!r}.")
        if bucket_size < 1:
            raise ValueError(f"`bucket_size` must be >= 1, got {bucket_size!r}.")
        self.levels, self.bucket_size, self.seed = levels, bucket_size, seed
        self.group = bucket_size
        self.rank = 0

    def setup(self, world_size: int, rank: int = 0) -> None:
        self.rank = rank

    def levels_for(self, cf: float, dtype: torch.dtype) -> int:
        """``s`` for a requested factor on ``dtype`` values (or the fixed ``levels``)."""
        if self.levels is not None:
            return self.levels
        value_bits = 8 * torch.empty((), dtype=dtype).element_size()
        overhead = _NORM_BITS / self.bucket_size
        exact = value_bits / cf  # bits an entry the factor affords, norms included
        # The code width whose factor is nearest cf by ratio, within 2..8 bits.
        bits = min(range(2, 9), key=lambda b: abs(math.log((b + overhead) / exact)))
        return 2 ** (bits - 1) - 1

    def factor_range(self, dtype: torch.dtype) -> tuple[float, float] | None:
        if self.levels is not None:  # one code width whatever the factor
            return None
        value_bits = 8 * torch.empty((), dtype=dtype).element_size()
        overhead = _NORM_BITS / self.bucket_size
        return value_bits / (8 + overhead), value_bits / (2 + overhead)

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        s = self.levels_for(cf, tensor.dtype)
        flat = tensor.reshape(-1).float()
        norms = _bucket_norms(flat, self.bucket_size)
        scales = s / norms.clamp(min=torch.finfo(torch.float32).tiny)
        stream = stream_key(self.seed, step, key, self.rank)
        if kernels.usable(flat):  # draws, levels and bits in one pass
            packed = kernels.qsgd_encode(flat, scales, self.bucket_size, s, code_bits(s), stream)
        else:
            buckets = F.pad(flat, (0, -flat.numel() % self.bucket_size)).view(-1, self.bucket_size)
            noise = uniforms(stream, buckets.numel(), flat.device).view_as(buckets)
            level = buckets.abs().mul_(scales.unsqueeze(1)).add_(noise).floor_().clamp_(max=s)
            level.nan_to_num_(nan=0.0)  # 0 times a zero bucket's infinite scale (s / tiny overflows for s >= 4)
            packed = pack_bits(level.copysign_(buckets).add_(s).view(-1)[: flat.numel()], code_bits(s))
        # `s` is derived from `cf` identically on every rank: it decodes locally and never crosses the network.
        levels = torch.tensor(s)
        payload = Payload((packed, norms), tensor.shape, tensor.dtype, derived=(levels,))
        if flat.numel() >= self.bucket_size:  # a smaller tensor pays a whole bucket's norm: its size sets its factor
            note_clamped(self, cf, self.achieved_cf(payload))
        return payload

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, bucket_size={self.bucket_size}, seed={self.seed})"


def _bucket_norms(flat: Tensor, size: int) -> Tensor:
    """The L2 norm of each ``size``-entry bucket of ``flat``, the last one short: whole buckets as one strided view, the
    rest on its own (padding the tensor to whole buckets would copy it)."""
    whole = flat.numel() - flat.numel() % size
    norms = torch.linalg.vector_norm(flat[:whole].view(-1, size), dim=1)
    if whole == flat.numel():
        return norms
    return torch.cat([norms, torch.linalg.vector_norm(flat[whole:]).view(1)])
