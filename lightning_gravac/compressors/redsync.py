"""RedSync's trimmed threshold search (Fang et al., JPDC 2019)."""

import torch
from torch import Tensor

from lightning_gravac.compressors.base import register_compressor
from lightning_gravac.compressors.sparse import ThresholdSparsifier


@register_compressor
class RedSync(ThresholdSparsifier):
    """Binary search for a threshold between the mean and the maximum magnitude.

    ``thr(r) = mean|g| + r (max|g| - mean|g|)`` with ``r`` searched in ``[0, 1]`` by bisection until more than ``k``
    and fewer than ``2k`` entries pass, or the interval is narrower than ``min_width``. The highest threshold found to
    pass at least ``k`` entries is used, so the exact top ``k`` of its candidates is usually the exact Top-K; when
    even ``r = 0`` passes fewer, the payload is filled to ``k`` (:func:`fill_to_k`). The max is over every entry; the
    mean and the counts are estimated on a ``sample_ratio`` sample (on a GPU the paper counts every entry; on a CPU
    each full count is a pass over the gradient).

    Args:
        min_width: the interval width at which the search stops (the paper's 0.2).
    """

    name = "redsync"

    def __init__(self, min_width: float = 0.2, seed: int = 0, sample_ratio: float = 0.01) -> None:
        if not 0 < min_width < 1:
            raise ValueError(f"`min_width` must be in (0, 1), got {min_width!r}.")
        super().__init__(seed, sample_ratio)
        self.min_width = min_width

    def threshold(self, flat: Tensor, k: int, *, key: str, step: int) -> float:
        # The max over every entry (what a sample misses; one aminmax pass, no |g| materialized); the mean of the
        # magnitudes and the bisection's counts from a sample.
        n = flat.numel()
        low_end, high_end = torch.aminmax(flat)
        top = max(-float(low_end), float(high_end))
        drawn = self.sample(flat, key=key, step=step)
        mean = float(drawn.mean())
        target = k * drawn.numel() / n
        low, high = 0.0, 1.0
        best = mean  # r = 0
        while high - low >= self.min_width:
            r = (low + high) / 2
            thr = mean + r * (top - mean)
            count = int(torch.count_nonzero(drawn >= thr))
            if count < target:
                high = r
            else:
                low, best = r, thr
                if count < 2 * target:
                    break
        return best
