"""Error-feedback signSGD (Karimireddy et al., ICML 2019)."""

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload, note_clamped, register_compressor
from lightning_gravac.compressors.signsgd import add_signs_, signs, unsigned


@register_compressor
class EFSignSGD(Compressor):
    """Send ``(||p||_1 / n) sign(p)`` of the error-fed gradient ``p``: one bit an entry and one scale a tensor.

    The scale makes the compressed gradient's magnitude match the gradient's, so the learning rate of dense
    training applies; error feedback (on by default) carries what the sign dropped. The factor is fixed (about 32
    from fp32); a requested ``cf`` is clamped to it.
    """

    fixed_cf = 32.0
    name = "efsignsgd"

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        scale = torch.linalg.vector_norm(tensor.reshape(-1), 1, dtype=torch.float32) / tensor.numel()
        payload = Payload((signs(tensor), scale.view(1)), tensor.shape, tensor.dtype)
        note_clamped(self, cf, self.achieved_cf(payload))
        return payload

    def decompress(self, payload: Payload) -> Tensor:
        bits, scale = payload.wire
        return unsigned(bits, payload.shape.numel(), torch.float32).mul_(scale).to(payload.dtype).view(payload.shape)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        # Every decoded entry is +-scale, rounded to the payload's dtype as decoding does.
        step = payload.wire[1].float().to(payload.dtype).double()
        return (step.square() * payload.shape.numel()).reshape(())

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        # Each rank's +-(its scale x `scale`), that product rounded to float32 once, added in rank order.
        for bits, own in zip(*stacked.wire, strict=True):
            add_signs_(out, bits, float((own.float() * scale).to(out.dtype)))

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        bits, scale = payload.wire
        if tensor.dtype == torch.float32 and tensor.is_contiguous():
            add_signs_(tensor.view(-1), bits, -float(scale))  # g - (+-s): the bits of subtracting the decoded payload
        else:
            super().residual_(tensor, payload)
