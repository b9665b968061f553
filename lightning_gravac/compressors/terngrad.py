"""TernGrad: stochastic ternary gradients (Wen et al., NeurIPS 2017)."""

import math

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Compressor, Payload, note_clamped, register_compressor
from lightning_gravac.compressors.packing import pack_bits, unpack_bits
from lightning_gravac.compressors.select import stream_key
from lightning_gravac.compressors.uniform import uniforms


@register_compressor
class TernGrad(Compressor):
    """Send ``s sign(g_i) b_i`` with ``s = max|g|`` and ``b_i ~ Bernoulli(|g_i| / s)``: unbiased, 2 bits an entry.

    Entries are first clipped to ``clip_std`` standard deviations (the paper's gradient clipping, which shrinks
    ``s`` and so the variance; unbiased for the clipped gradient). Each entry travels as the code ``sign b + 1`` in
    2 bits, 4 a byte, with one fp32 scale a tensor. The factor is fixed (about 16 from fp32); a requested ``cf`` is
    clamped to it. Unbiased, so error feedback is off by default. Draws come from a counter-based generator whose
    stream is ``(seed, step, tensor, rank)``. With the compiled kernels the gradient is read twice: once for the
    standard deviation and the peak (the deviation in float64, by blocks: on a tensor whose mean is far above its
    spread it is accurate where ``torch.std`` in fp32 is not, so the two paths can clip differently there), once to
    clip, draw, round and pack.

    Args:
        clip_std: clipping bound in standard deviations of the tensor; ``None`` turns clipping off.
    """

    fixed_cf = 16.0
    name = "terngrad"
    biased = False

    def __init__(self, clip_std: float | None = 2.5, seed: int = 0) -> None:
        if clip_std is not None and not clip_std > 0:
            raise ValueError(f"`clip_std` must be positive or None, got {clip_std!r}.")
        self.clip_std, self.seed = clip_std, seed
        self.rank = 0

    def setup(self, world_size: int, rank: int = 0) -> None:
        self.rank = rank

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        flat = tensor.reshape(-1).float()
        # max |clip(x)| = min(max |x|, bound): the extremes, no clipped copy (nor the copy `abs` would make).
        std: Tensor | None = None  # (none for a single entry)
        if kernels.usable(flat) and flat.numel() > 1:  # the deviation and the extremes in one read
            deviation, *extremes = kernels.moments(flat)
            std = torch.tensor(deviation, dtype=torch.float32)
            low, high = torch.tensor(extremes, dtype=torch.float32)
        else:
            std = flat.std() if self.clip_std is not None and flat.numel() > 1 else None
            low, high = flat.aminmax()
        bound = None if self.clip_std is None or std is None else (self.clip_std * std).float()
        peak = torch.maximum(-low, high).abs()  # abs: +0.0 for an all-zero tensor, as max |x| gives
        scale = peak if bound is None else torch.minimum(peak, bound)
        stream = stream_key(self.seed, step, key, self.rank)
        if kernels.usable(flat):  # clip, draw, round and pack in one pass
            limit = math.inf if bound is None else float(bound)
            packed = kernels.terngrad_encode(flat, limit, float(scale), stream)
        else:
            clipped = flat if bound is None else flat.clamp(-bound, bound)
            keep = uniforms(stream, flat.numel(), flat.device).mul_(scale) < clipped.abs()
            packed = pack_bits(torch.where(keep, clipped.sign(), 0).add_(1), 2)
        payload = Payload((packed, scale.view(1)), tensor.shape, tensor.dtype)
        note_clamped(self, cf, self.achieved_cf(payload))
        return payload

    def decompress(self, payload: Payload) -> Tensor:
        packed, scale = payload.wire
        numel = payload.shape.numel()
        out = torch.zeros(numel, dtype=torch.float32, device=packed.device)
        if kernels.usable(out) and packed.is_contiguous():  # (code - 1) * scale, as below, in one pass
            kernels.codes_add_(out, packed, 2, 1, scale.float().contiguous(), numel, 1.0)
            return out.to(payload.dtype).view(payload.shape)
        ternary = unpack_bits(packed, 2, payload.shape.numel()).float().sub_(1)
        return ternary.mul_(scale).to(payload.dtype).view(payload.shape)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        # The non-zero codes, each decoded to +-scale (in the payload's dtype): counted from the packed codes alone.
        packed, scale = payload.wire
        numel = payload.shape.numel()
        if numel == 0 or not (kernels.usable(scale) and packed.is_contiguous()):
            return super().sent_sq_norm(payload)
        count = kernels.codes_sq(packed, numel, 2, 1, numel)
        step = scale.float().to(payload.dtype).double()
        return (count.double() * step.square()).reshape(())

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        # Each rank's decoded values times `scale` (rounded), added in rank order; one pass a rank with the kernel.
        for packed, own in zip(*stacked.wire, strict=True):
            if kernels.usable(out) and packed.is_contiguous():
                kernels.codes_add_(out, packed, 2, 1, own.float().contiguous(), out.numel(), scale)
            else:
                out.add_(self.decompress(Payload((packed, own), stacked.shape, stacked.dtype)).view(-1).mul_(scale))

    def __repr__(self) -> str:
        return f"TernGrad(clip_std={self.clip_std}, seed={self.seed})"
