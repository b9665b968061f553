"""The base of sparsifiers whose payload is kept values and their int32 indices."""

from abc import abstractmethod

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload, sparse_k
from lightning_gravac.compressors.select import fill_to_k


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


class ThresholdSparsifier(Sparsifier):
    """A sparsifier that estimates a magnitude threshold instead of running a top-k over the whole tensor.

    Subclasses implement :meth:`threshold`. Entries at or above it are candidates, and :func:`fill_to_k` turns them
    into exactly ``k`` indices, so the payload has the fixed size ``sparse_k(numel, cf)`` like Top-K's whatever the
    estimate's error. Probes at other factors are approximate (a threshold estimated per factor).
    """

    nesting = "approximate"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    @abstractmethod
    def threshold(self, magnitude: Tensor, k: int, *, key: str, step: int) -> Tensor:
        """A 0-d tensor: the magnitude at or above which about ``k`` entries of the flat ``magnitude`` lie."""

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        flat = tensor.reshape(-1)
        k = sparse_k(flat.numel(), cf, flat.dtype)
        magnitude = flat.abs()
        if k * 4 >= flat.numel():  # a quarter or more: the exact top-k is as cheap as an estimate
            indices = torch.topk(magnitude, k, sorted=False).indices
        else:
            indices = fill_to_k(magnitude, magnitude >= self.threshold(magnitude, k, key=key, step=step), k)
        return Payload((flat[indices], indices.to(torch.int32)), tensor.shape, tensor.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed})"
