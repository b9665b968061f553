"""The base of sparsifiers whose payload is kept values and their int32 indices."""

import math
from abc import abstractmethod

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload, sparse_k, sq_norm
from lightning_gravac.compressors.select import above, exact_topk, fill_to_k, sample, seeded_generator


class Sparsifier(Compressor):
    """A compressor whose payload is ``(values, int32 indices)`` into the flat tensor: decoding, aggregation and
    residuals are shared by every such method (Top-K, DGC and the threshold methods)."""

    @staticmethod
    def kept(tensor: Tensor, indices: Tensor) -> Payload:
        """The payload that keeps the entries of the flat ``tensor`` at ``indices``."""
        values = tensor.reshape(-1).index_select(0, indices)
        return Payload((values, indices.to(torch.int32)), tensor.shape, tensor.dtype)

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
        return sq_norm(payload.wire[0])


class ThresholdSparsifier(Sparsifier):
    """A sparsifier that estimates a magnitude threshold instead of running a top-k over the whole tensor.

    Subclasses implement :meth:`threshold`, usually from a sample of the magnitudes (:meth:`sample`). Entries above
    it are candidates, and :func:`fill_to_k` turns them into exactly ``k`` indices, so the payload has the fixed size
    ``sparse_k(numel, cf)`` like Top-K's whatever the estimate's error. A threshold is checked on every 101st entry
    before the full pass: one admitting too few is lowered (x0.7, up to :attr:`retries` times, then again on the full
    pass, and at last to 0: every non-zero), one admitting more than ``8k`` gives way to the exact Top-K. Probes at
    other factors are approximate (a threshold estimated per factor).
    """

    nesting = "approximate"
    #: Times the threshold is lowered (x0.7) when fewer than ``k`` entries pass, before the payload is padded.
    retries = 3
    #: Stride of the quick check of a threshold.
    _STRIDE = 101

    def __init__(self, seed: int = 0, sample_ratio: float = 0.01, min_samples: int = 1024) -> None:
        if not 0 < sample_ratio <= 1:
            raise ValueError(f"`sample_ratio` must be in (0, 1], got {sample_ratio!r}.")
        self.seed, self.sample_ratio, self.min_samples = seed, sample_ratio, min_samples

    def sample(self, flat: Tensor, *, key: str, step: int) -> Tensor:
        """The magnitudes of a uniform sample of ``sample_ratio`` of ``flat`` (at least ``min_samples``), float32."""
        n = flat.numel()
        count = min(n, max(self.min_samples, math.ceil(self.sample_ratio * n)))
        drawn = flat if count == n else sample(flat, count, seeded_generator(self.seed, step, key))
        return drawn.abs().float()

    @abstractmethod
    def threshold(self, flat: Tensor, k: int, *, key: str, step: int) -> float:
        """The magnitude above which about ``k`` entries of ``flat`` lie."""

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = sparse_k(n, cf, flat.dtype)
        if k * 4 >= n:  # a quarter or more: the exact top-k is as cheap as an estimate
            return self.kept(tensor, torch.topk(flat.abs(), k, sorted=False).indices)
        out = self.scratch.like(flat)
        threshold = max(0.0, self.threshold(flat, k, key=key, step=step))
        strided = flat[:: self._STRIDE].abs()

        def estimate(thr: float) -> int:
            return int(torch.count_nonzero(strided > thr)) * self._STRIDE

        for _ in range(self.retries):
            if estimate(threshold) >= k or threshold <= 0:
                break
            threshold *= 0.7
        if estimate(threshold) > 8 * k:  # far too low (RedSync's linear search on heavy tails ends at the mean)
            return self.kept(tensor, exact_topk(flat, k, out, seeded_generator(self.seed, step, key)))
        candidates = above(flat, threshold, out)
        for _ in range(self.retries):
            if candidates.numel() >= k or threshold <= 0:  # enough, or a sparse gradient: every non-zero passed
                break
            threshold *= 0.7
            candidates = above(flat, threshold, out)
        if candidates.numel() < k and threshold > 0:  # still short: every non-zero, then the padding
            candidates = above(flat, 0.0, out)
        return self.kept(tensor, fill_to_k(flat, candidates, k, out))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed})"
