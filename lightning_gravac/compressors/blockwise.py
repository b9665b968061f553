"""Block-wise quantization to 8, 4 or 2 bits: one scale a block, every entry rounded to its nearest level.

Each block of ``block_size`` entries is sent as its largest magnitude ``m`` (fp32) and, for every entry ``x``, the
nearest of the ``2s + 1`` levels ``k m / s`` (``k`` in ``[-s, s]``; a tie rounds away from zero): ``s = 127`` in 8 bits
(``int8``), ``s = 7`` in 4 bits (``int4``), ``s = 1`` in 2 bits (``int2``: ``-m``, 0 or ``m``). An entry is off by at
most half a level, ``m / (2s)``: deterministic, biased by that rounding, so error feedback is on by default and carries
the whole rounding error into the next step. Every rank's payload is decoded to fp32 before any sum (codes are never
summed). The largest systems send gradients this way (ZeRO++'s 4-bit reduce-scatter; 8-bit blocks of Adam's states in
bitsandbytes).

Why the largest magnitude and not a norm (QSGD's): with a norm, an entry's level is a fraction of a bucket's whole
length and most round to zero; against the largest entry, the levels span the block's own range.
"""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Payload, note_clamped, register_compressor
from lightning_gravac.compressors.levels import LevelCodes, code_bits
from lightning_gravac.compressors.packing import pack_bits


class BlockCode(LevelCodes):
    """The nearest of ``2s + 1`` levels of each block's largest magnitude (see the module's docstring); the factor is
    fixed by the code's width (``cf`` asks for nothing else).

    Args:
        block_size: entries sharing one scale (an fp32 on the wire: ``32 / block_size`` bits an entry more). Smaller
            blocks follow the gradient's local range more closely and cost more.
    """

    #: Bits of a code; the levels are ``2 ** (bits - 1) - 1`` each side of zero.
    bits: ClassVar[int]
    biased = True
    near_exact = True

    def __init__(self, block_size: int = 128) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"`block_size` must be a whole number >= 1, got {block_size!r}.")
        self.block_size = block_size
        self.group = block_size

    @property
    def levels(self) -> int:
        """``s``: the non-zero levels each side of zero."""
        return 2 ** (self.bits - 1) - 1

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        return self._coded(tensor.reshape(-1).float(), tensor, cf, residual=False)

    def compress_residual_(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload | None:
        # The compiled encode writes the residual as it codes each entry: one pass fewer than decoding and subtracting.
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor
        if not (kernels.usable(flat) and self.block_size % 8 == 0):
            return None
        return self._coded(flat, tensor, cf, residual=True)

    def _coded(self, flat: Tensor, tensor: Tensor, cf: float, residual: bool) -> Payload:
        """The payload of ``flat`` (``tensor`` flat, in fp32); with ``residual`` (compiled kernel), ``flat`` becomes
        ``flat - decoded`` in place."""
        s, bits = self.levels, code_bits(self.levels)
        peaks = _block_peaks(flat, self.block_size)
        # `s / m` per block; 0 for a block of zeros (its codes all the zero level, its step 0: decoded exactly 0). A
        # non-finite peak stays on the wire, so the decoded block is non-finite and the step is skipped everywhere.
        scales = torch.where(peaks > 0, s / peaks, 0.0).contiguous()
        if kernels.usable(flat):
            steps = (peaks / s).float().contiguous() if residual else None  # decoding's steps
            packed = kernels.block_encode(flat, scales, self.block_size, s, bits, steps)
        else:
            blocks = F.pad(flat, (0, -flat.numel() % self.block_size)).view(-1, self.block_size)
            level = blocks.abs().mul_(scales.unsqueeze(1)).add_(0.5).floor_().clamp_(max=s)
            level.nan_to_num_(nan=0.0)  # an infinite entry times a zero scale
            packed = pack_bits(level.copysign_(blocks).add_(s).view(-1)[: flat.numel()], bits)
        payload = Payload((packed, peaks), tensor.shape, tensor.dtype, derived=(torch.tensor(s),))
        if flat.numel() >= self.block_size:  # a smaller tensor pays a whole block's scale: its size sets its factor
            note_clamped(self, cf, self.achieved_cf(payload))
        return payload

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


@register_compressor
class Int8(BlockCode):
    """8-bit block codes (255 levels): about 3.9x fewer bytes than fp32 at 128-entry blocks, an entry within
    ``1/254`` of its block's largest magnitude."""

    name = "int8"
    bits = 8
    fixed_cf = 4.0


@register_compressor
class Int4(BlockCode):
    """4-bit block codes (15 levels): about 7.5x fewer bytes than fp32 at 128-entry blocks, an entry within ``1/14``
    of its block's largest magnitude."""

    name = "int4"
    bits = 4
    fixed_cf = 8.0


@register_compressor
class Int2(BlockCode):
    """2-bit block codes (3 levels: ``-m``, 0, ``m``): about 14x fewer bytes than fp32 at 128-entry blocks, an entry
    within half its block's largest magnitude. Coarse for a gradient every step; as local steps' outer code with error
    feedback, what a round rounds away goes into the next round and the fit's last round is sent in ``int8``."""

    name = "int2"
    bits = 2
    fixed_cf = 16.0


def _block_peaks(flat: Tensor, size: int) -> Tensor:
    """The largest magnitude of each ``size``-entry block of ``flat`` (NaN where a block has one), the last one short:
    the compiled kernel's one read, else the larger of each block's largest entry and its negated least (two plain
    reductions of a strided view, no copy; ``abs_`` makes a block of zeros' ``-0.0`` a ``0.0``, whose step then decodes
    to positive zeros)."""
    if kernels.usable(flat):
        return kernels.block_absmax(flat, size)
    whole = flat.numel() - flat.numel() % size
    blocks = flat[:whole].view(-1, size)
    peaks = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).abs_()
    if whole == flat.numel():
        return peaks
    rest = flat[whole:]
    return torch.cat([peaks, torch.maximum(rest.amax(), rest.amin().neg()).abs_().view(1)])
