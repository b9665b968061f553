"""The base of sparsifiers whose payload is kept values and their int32 indices."""

import math
from abc import abstractmethod

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload, sparse_k
from lightning_gravac.compressors.select import at_least, exact_topk, fill_to_k, sample, seeded_generator


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

    Subclasses implement :meth:`threshold`, usually from a sample of the magnitudes (:meth:`sample`). Entries at or
    above it are candidates, and :func:`fill_to_k` turns them into exactly ``k`` indices, so the payload has the
    fixed size ``sparse_k(numel, cf)`` like Top-K's whatever the estimate's error: when fewer than ``k`` pass, the
    threshold is lowered (up to :attr:`retries` times) before padding; when more than ``4k`` pass, the exact Top-K is
    taken instead. Probes at other factors are approximate (a threshold estimated per
    factor).
    """

    nesting = "approximate"
    #: Times the threshold is lowered (x0.7) when fewer than ``k`` entries pass, before the payload is padded.
    retries = 3

    def __init__(self, seed: int = 0, sample_ratio: float = 0.01, min_samples: int = 1024) -> None:
        if not 0 < sample_ratio <= 1:
            raise ValueError(f"`sample_ratio` must be in (0, 1], got {sample_ratio!r}.")
        self.seed, self.sample_ratio, self.min_samples = seed, sample_ratio, min_samples

    def sample(self, magnitude: Tensor, *, key: str, step: int) -> Tensor:
        """A uniform sample of ``sample_ratio`` of the magnitudes (at least ``min_samples``, at most all), float32."""
        n = magnitude.numel()
        count = min(n, max(self.min_samples, math.ceil(self.sample_ratio * n)))
        if count == n:
            return magnitude.float()
        return sample(magnitude, count, seeded_generator(self.seed, step, key)).float()

    @abstractmethod
    def threshold(self, magnitude: Tensor, k: int, *, key: str, step: int) -> Tensor:
        """A 0-d tensor: the magnitude at or above which about ``k`` entries of the flat ``magnitude`` lie."""

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        flat = tensor.reshape(-1)
        k = sparse_k(flat.numel(), cf, flat.dtype)
        magnitude = self.scratch.magnitude(flat)
        if k * 4 >= flat.numel():  # a quarter or more: the exact top-k is as cheap as an estimate
            indices = torch.topk(magnitude, k, sorted=False).indices
        else:
            mask = self.scratch.mask(flat)
            threshold = self.threshold(magnitude, k, key=key, step=step)
            candidates = at_least(magnitude, threshold, mask)
            for _ in range(self.retries):  # too few passed: lower the bar, as DGC does, before padding
                if candidates.numel() >= k:
                    break
                threshold = threshold * 0.7
                candidates = at_least(magnitude, threshold, mask)
            if candidates.numel() > 4 * k:  # an estimate far too low (RedSync's search on heavy tails): exact instead
                indices = exact_topk(magnitude, k, mask, seeded_generator(self.seed, step, key))
            else:
                indices = fill_to_k(magnitude, candidates, k, mask)
        return Payload((flat.index_select(0, indices), indices.to(torch.int32)), tensor.shape, tensor.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed})"
