"""signSGD with majority vote (Bernstein et al., ICML 2018)."""

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Compressor, Payload, note_clamped, register_compressor
from lightning_gravac.compressors.packing import pack_bits, unpack_bits


def signs(tensor: Tensor) -> Tensor:
    """The sign bits of the flat ``tensor``, 8 a byte: set for ``>= 0`` (one read with the compiled kernel)."""
    flat = tensor.reshape(-1)
    return kernels.pack_signs(flat) if kernels.usable(flat) else pack_bits(flat >= 0, 1)


def unsigned(bits: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """``+1`` where a bit is set, ``-1`` elsewhere, as a flat tensor of ``dtype``."""
    out = torch.zeros(numel, dtype=dtype, device=bits.device)
    if kernels.usable(out) and bits.is_contiguous():
        kernels.add_signs_(out, bits, 1.0, -1.0)
        return out
    return unpack_bits(bits, 1, numel).to(dtype).mul_(2).sub_(1)


def add_signs_(out: Tensor, bits: Tensor, step: float) -> None:
    """``out += step`` where a bit is set and ``out -= step`` elsewhere (``step`` a float32 value): in one pass with
    the compiled kernel, else as ``out + unsigned(bits) * step`` (the same bits: the product is exact)."""
    if kernels.usable(out) and bits.is_contiguous():
        kernels.add_signs_(out, bits, step, -step)
    else:
        out.add_(unsigned(bits, out.numel(), out.dtype).mul_(step))


@register_compressor
class SignSGD(Compressor):
    """Send the sign of every entry, one bit each; the ranks' signs are combined by majority vote.

    Args:
        scaled: multiply the vote by the ranks' mean of ``||g||_2 / sqrt(n)``, each rank's root-mean-square gradient
            entry (one float a tensor beside its bits), so that a rank's signs are as long as its gradient and the
            learning rate of the SGD it replaces applies: a step's second-order term is SGD's (the same stability),
            its first-order progress ``||g||_1 / (sqrt(n) ||g||_2)`` of SGD's (the mean magnitude ``||g||_1 / n``
            would shorten both by that ratio again). ``False`` is the published method: the decoded gradient is
            ``sign(sum of the ranks' signs)``, entries of magnitude 1 (0 on a tie), so the learning rate alone sets
            the step size, and it needs one suited to signSGD (about ``1e-4`` for SGD on typical nets; an SGD rate
            such as 0.05 diverges).

    The vote needs every rank's bits, which the hook gathers whenever sparse gathering pays (below 64 ranks for fp32);
    above that it all-reduces each rank's decoded signs, which averages them instead. The factor is fixed (32 from
    fp32); a requested ``cf`` is clamped to it. Defined without error feedback, so it is off unless asked for;
    ``efsignsgd`` is the variant with it.
    """

    fixed_cf = 32.0
    name = "signsgd"

    def __init__(self, scaled: bool = True) -> None:
        self.scaled = scaled

    @property
    def error_feedback_default(self) -> bool:
        return False

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        wire: tuple[Tensor, ...] = (signs(tensor),)
        if self.scaled:
            rms = torch.linalg.vector_norm(tensor.reshape(-1), 2, dtype=torch.float32).div(tensor.numel() ** 0.5)
            wire += (rms.view(1),)
        payload = Payload(wire, tensor.shape, tensor.dtype)
        note_clamped(self, cf, self.achieved_cf(payload))
        return payload

    def _magnitude(self, payload: Payload) -> float:
        """The step of one decoded entry: this rank's root-mean-square entry when scaled, else 1."""
        return float(payload.wire[1]) if self.scaled else 1.0

    def decompress(self, payload: Payload) -> Tensor:
        signed = unsigned(payload.wire[0], payload.shape.numel(), torch.float32)
        return signed.mul_(self._magnitude(payload)).to(payload.dtype).view(payload.shape)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        # Every decoded entry is +-1, or +- the rank's root-mean-square entry when scaled.
        step = torch.tensor(self._magnitude(payload), dtype=torch.float32).to(payload.dtype).double()
        return (step.square() * payload.shape.numel()).to(payload.wire[0].device)

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        # Majority vote: the sign of the summed signs, weighted so that the hook's 1/N averaging leaves it at +-1, or,
        # scaled, at +- the ranks' mean RMS entry (their values summed in rank order, times the hook's 1/N).
        rows = stacked.wire[0]
        ranks, numel = rows.shape[0], stacked.shape.numel()
        step = scale * ranks
        if self.scaled:
            step = scale * float(stacked.wire[1].reshape(-1).double().sum())
        if kernels.usable(out) and rows.stride(1) == 1:  # one pass: count, vote, add
            kernels.vote_(out, rows, step)
            return
        votes = torch.stack([unsigned(bits, numel, torch.float32) for bits in rows]).sum(0)
        out.add_(votes.sign_().to(out.dtype), alpha=step)

    def __repr__(self) -> str:
        return "SignSGD()" if self.scaled else "SignSGD(scaled=False)"
