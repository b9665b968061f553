"""SIDCo's statistical threshold (Abdelmoniem et al., MLSys 2021)."""

import math

from torch import Tensor

from lightning_gravac.compressors.base import register_compressor
from lightning_gravac.compressors.sparse import ThresholdSparsifier


@register_compressor
class SIDCo(ThresholdSparsifier):
    """A threshold from an exponential fit of the magnitudes, refined in stages on the tail.

    An exponential with mean ``mu`` leaves a share ``d`` above ``mu ln(1/d)``. The first stage fits every ``|g|``
    and keeps ``first_keep`` of it; each later stage fits the exceedances over the previous threshold (peaks over
    threshold) and keeps an equal share ``(d / first_keep) ** (1 / (stages - 1))`` of them, so the shares multiply
    to the target density ``d = k / numel``. Gradients are heavier-tailed than Gaussian far out, which the later
    stages capture. The fits use a ``sample_ratio`` sample of the magnitudes; the payload is then filled to exactly
    ``k`` (:func:`fill_to_k`).

    Args:
        stages: number of fits (at least 2).
        first_keep: share the first stage keeps.
    """

    name = "sidco"

    def __init__(self, stages: int = 3, first_keep: float = 0.75, seed: int = 0, sample_ratio: float = 0.01) -> None:
        if stages < 2:
            raise ValueError(f"`stages` must be >= 2, got {stages!r}.")
        if not 0 < first_keep < 1:
            raise ValueError(f"`first_keep` must be in (0, 1), got {first_keep!r}.")
        super().__init__(seed, sample_ratio)
        self.stages, self.first_keep = stages, first_keep

    def threshold(self, flat: Tensor, k: int, *, key: str, step: int) -> float:
        density = k / flat.numel()
        drawn = self.sample(flat, key=key, step=step)
        if density >= self.first_keep:
            return float(drawn.mean()) * math.log(1 / density)
        later = (density / self.first_keep) ** (1 / (self.stages - 1))
        thr = float(drawn.mean()) * math.log(1 / self.first_keep)
        for _ in range(self.stages - 1):
            tail = drawn[drawn >= thr]
            if tail.numel() == 0:
                break
            thr += float(tail.mean() - thr) * math.log(1 / later)
        return thr
