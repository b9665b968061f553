"""The identity: plain DDP all-reduce, no compression."""

from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Pattern, Payload, register_compressor, sq_norm


@register_compressor
class NoCompression(Compressor):
    """Send the gradient as it is. Under ``GraVACStrategy`` every bucket takes the plain all-reduce path.

    Also the method the hook uses for layers whose factor is 1 inside an otherwise compressed bucket.
    """

    near_lossless = True
    name = "none"
    biased = False
    communication = Pattern.SUM
    passthrough = True

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        return Payload((tensor.reshape(-1).clone(),), tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        return payload.wire[0].view(payload.shape).clone()

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        out.add_(stacked.wire[0].sum(0), alpha=scale)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        tensor.zero_()

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        return sq_norm(payload.wire[0])
