"""Sampled-quantile thresholding (Aji & Heafield, EMNLP 2017)."""

import torch
from torch import Tensor

from lightning_gravac.compressors.base import register_compressor
from lightning_gravac.compressors.select import margin_rank
from lightning_gravac.compressors.sparse import ThresholdSparsifier


@register_compressor
class Threshold(ThresholdSparsifier):
    """Drop the smallest magnitudes by a quantile estimated on a random sample of each tensor.

    The share dropped follows ``cf`` (``1 - k / numel`` with ``k = sparse_k(numel, cf)``: ``cf=50`` drops Aji and
    Heafield's 99% with fp32 values and int32 indices). The threshold is the quantile of a ``sample_ratio`` sample (at
    least ``min_samples`` entries) that a little over ``k`` entries pass; the exact top ``k`` among those (or, when
    fewer pass, all of them filled to ``k``) is sent (:func:`fill_to_k`).

    Args:
        sample_ratio: share of the entries sampled.
        min_samples: fewest entries sampled.
        seed: seed of the sampling (ranks need not agree: payload sizes are fixed by ``k``).
    """

    name = "threshold"

    def threshold(self, flat: Tensor, k: int, *, key: str, step: int) -> float:
        drawn = self.sample(flat, key=key, step=step)
        # A quantile of the sample (topk is cheaper than a sort) a little over k candidates: falling short of k
        # (another look at the blocks) is rare, and few enough blocks hold a candidate to copy only those.
        kept = min(drawn.numel(), max(2, margin_rank(drawn.numel(), k, flat.numel())))
        return float(torch.topk(drawn, kept, sorted=False).values.min())
