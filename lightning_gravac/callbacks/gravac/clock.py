"""GraVAC's clock of this rank's steps: when the step under way began, its samples, and the fit's first step apart."""

import time
from dataclasses import dataclass
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn
from pytorch_lightning.utilities.data import extract_batch_size
from pytorch_lightning.utilities.exceptions import MisconfigurationException


@dataclass(kw_only=True)
class StepClock:
    """What a fit measures of this rank's steps, not checkpointed (the decisions take every rank's, reduced).

    Attributes:
        start: when the step under way began: at its first micro-batch (under gradient accumulation).
        step: which step that was; -1 before a fit's first batch.
        samples: the step's samples, over its micro-batches (1 a batch where no batch size is found).
        first_seconds: this rank's seconds of a fit's first step (the cost model's ``first_step`` is the slowest
            rank's).
        warm_up: the next observed step is a fit's first, whose time is not tallied (it allocates, builds DDP's
            buckets, warms caches).
    """

    start: float = 0.0
    step: int = -1
    samples: int = 1
    first_seconds: float = 0.0
    warm_up: bool = False

    def begin_batch(self, step: int, batch: Any, warn: bool) -> None:
        """A micro-batch of step ``step`` begins: the step's first starts the clock, each adds its samples. ``warn``:
        say it when no batch size is found, whatever was found before."""
        first = step != self.step
        if first:
            self.step, self.start = step, time.perf_counter()
        try:
            size = extract_batch_size(batch)
        except (MisconfigurationException, RecursionError):
            # No tensor to count: the batch counts as one sample (throughputs per batch; the searches compare alike).
            if self.samples != 1 or warn:
                rank_zero_warn("GraVAC: no batch size found in the batch; throughputs are reported per batch.")
            size = 1
        self.samples = size if first else self.samples + size

    def seconds(self) -> float:
        """The seconds since the step under way began."""
        return time.perf_counter() - self.start

    def tallied(self) -> bool:
        """Whether the step just observed is tallied: not a fit's first, which ends the warm-up."""
        warm_up, self.warm_up = self.warm_up, False
        return not warm_up
