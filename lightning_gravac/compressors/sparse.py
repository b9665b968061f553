"""The base of sparsifiers whose payload is kept values and their int32 indices."""

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload


class Sparsifier(Compressor):
    """A compressor whose payload is ``(values, int32 indices)`` into the flat tensor: decoding, aggregation and
    residuals are shared by every such method (Top-K, DGC and the threshold methods)."""

    def decompress(self, payload: Payload) -> Tensor:
        values, indices = payload.wire
        out = torch.zeros(payload.shape.numel(), dtype=payload.dtype, device=values.device)
        out.index_put_((indices.long(),), values)
        return out.view(payload.shape)

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        # One index_add_ over every rank's entries; duplicates add up, in rank order on CPU.
        values, indices = stacked.wire
        out.index_add_(0, indices.reshape(-1), values.reshape(-1), alpha=scale)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        # g - decoded is g with the sent entries zeroed: exact, and no dense temporary.
        tensor.view(-1).index_fill_(0, payload.wire[1].long(), 0)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        return payload.wire[0].double().square().sum()
