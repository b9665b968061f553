"""The base of sparsifiers whose payload is kept values and their int32 indices."""

import math
from abc import abstractmethod

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import INDEX_BYTES, Compressor, Payload, sparse_k, sq_norm
from lightning_gravac.compressors.select import Blocks, fill_to_k, sample, seeded_generator


class Sparsifier(Compressor):
    """A compressor whose payload is ``(values, int32 indices)`` into the flat tensor: decoding, aggregation and
    residuals are shared by every such method (Top-K, DGC and the threshold methods)."""

    def masked_wait(self, cf: float, dtype: torch.dtype) -> float | None:
        # ``sparse_k``: an entry costs its value and an index, so ``numel / k`` is cf x (value + index) / value.
        value_bytes = torch.empty((), dtype=dtype).element_size()
        return cf * (value_bytes + INDEX_BYTES) / value_bytes

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
        # One index_add_ over every rank's entries; duplicates add up, in rank order on CPU. The kernel adds as
        # index_add_ does, with the next positions' lines prefetched (a fifth of its time).
        values, indices = stacked.wire
        flat_values, flat_indices = values.reshape(-1), indices.reshape(-1)
        if kernels.usable(out) and kernels.usable(flat_values) and flat_indices.dtype == torch.int32:
            kernels.scatter_add_(out, flat_indices.contiguous(), flat_values, scale=scale)
        else:
            out.index_add_(0, flat_indices, flat_values, alpha=scale)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        # g - decoded is g with the sent entries zeroed: exact, and no dense temporary.
        tensor.view(-1).index_fill_(0, payload.wire[1].long(), 0)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        return sq_norm(payload.wire[0])


class ThresholdSparsifier(Sparsifier):
    """A sparsifier that estimates a magnitude threshold instead of running a top-k over the whole tensor.

    Subclasses implement :meth:`threshold`, usually from a sample of the magnitudes (:meth:`sample`). Entries above
    it are candidates, and :func:`fill_to_k` turns them into exactly ``k`` indices, so the payload has the fixed size
    ``sparse_k(numel, cf)`` like Top-K's whatever the estimate's error. A threshold is first checked against the
    block peaks (:class:`~lightning_gravac.compressors.select.Blocks`): one that more than ``8k`` blocks (or a
    quarter of them) pass gives way to the exact Top-K, the same entries found faster. One admitting fewer than
    ``k`` candidates is lowered to just below the ``k``-th largest block peak (:meth:`Blocks.lowered`; x0.7 when
    there are fewer than ``k`` blocks), up to three times (:meth:`Blocks.above_lowering`), then to 0 (every
    non-zero); each try looks at
    the peaks and the blocks that pass, not at the whole tensor. Probes at other factors are approximate (a
    threshold estimated per factor).
    """

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
        blocks = Blocks(flat, signed=False)
        # Far too low (RedSync's linear search on heavy tails ends at the mean): with that many candidates the top k
        # among them, which is what is sent, is the exact top k, and that is cheaper to find directly.
        if blocks.count(threshold) > min(8 * k, blocks.peak.numel() // 4):
            return self.kept(tensor, blocks.topk(k, out, seeded_generator(self.seed, step, key)))
        candidates, threshold = blocks.above_lowering(threshold, k, out)
        if candidates.numel() < k and threshold > 0:  # still short: every non-zero, then the padding
            candidates = blocks.above(0.0, out)
        return self.kept(tensor, fill_to_k(flat, candidates, k))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed})"
