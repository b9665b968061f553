"""GraVAC's steps and windows (:class:`Window`): what each step cost and kept, tallied by the factor sent, and at a
window's end each factor's throughput, from the slowest rank's times and every rank's samples."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_gravac.callbacks.gravac.checkpoint import Checkpointed, checkpointed
from lightning_gravac.callbacks.gravac.cost import Measured, Tally

#: ``values`` reduced over the compression's ranks by an operation (MAX, SUM), the same on every rank.
Reduce = Callable[[torch.Tensor, dist.ReduceOp.RedOpType], torch.Tensor]
Interval = Literal["step", "epoch"]


def _tallies(saved: dict[float, dict[str, Any]]) -> dict[float, Tally]:
    # A window's tallies from a checkpoint before samples were counted are dropped: half a window without them would
    # weigh that factor's throughput low. The window goes on; it measures from here.
    return {cf: Tally(**t) for cf, t in saved.items() if "samples" in t}


@dataclass
class Closed:
    """A window's end: its steps by factor (``measured``) and, for each factor sent, ``(cf, steps, steps without
    probes, seconds compressing, those steps' seconds compressing)``, the slowest rank's (``compression``)."""

    measured: Measured
    compression: list[tuple[float, int, int, float, float]]

    @property
    def compress_seconds(self) -> float:
        """The window's seconds compressing, the slowest rank's."""
        return sum(row[3] for row in self.compression)


@dataclass(kw_only=True)
class Window(Checkpointed):
    """GraVAC's steps and windows: the steps of a window are tallied by the factor sent; its end gives each factor's
    throughput, and the search decides. Every rank holds the same values but for the current window's times and
    samples (``tally``), which the window's end reduces over ranks.

    Attributes:
        settled: the factor the sequential search settled on (two throughputs within ``omega``), else ``None``.
        throughput: the last window's compression throughput of each factor sent.
        windows: the windows ended so far.
        progress: the steps (or epochs) of the current window so far.
        steps: the steps observed so far.
        tally: what each factor sent during the current window cost and kept.
        length: steps (or epochs) between search decisions; ``first``: the first window's.
        interval: the unit of ``length``, ``"step"`` or ``"epoch"``.
    """

    settled: float | None = field(default=None, metadata=checkpointed())
    throughput: dict[float, float] = field(default_factory=dict, metadata=checkpointed(restore=dict))
    windows: int = field(default=0, metadata=checkpointed())
    progress: int = field(default=0, metadata=checkpointed())
    steps: int = field(default=0, metadata=checkpointed(added=True))
    tally: dict[float, Tally] = field(default_factory=dict, metadata=checkpointed(restore=_tallies))
    length: int
    first: int
    interval: Interval = field(default="step")

    @property
    def current_length(self) -> int:
        """Steps (or epochs) of the current window: ``first`` for the first, ``length`` after."""
        return self.first if self.windows == 0 else self.length

    def advance(self) -> bool:
        """Count a step (or an epoch) of the window; whether that fills it."""
        self.progress += 1
        return self.progress >= self.current_length

    def close(self, reduce: Reduce | None, world_size: int) -> Closed | None:
        """End the window: each factor's throughput ``samples / seconds x mean gain``, from the slowest rank's times
        and every rank's samples (``reduce`` over the ranks; ``None``: one process, whose samples stand for each of the
        ``world_size`` ranks'); clear the tallies and count the window. ``None`` for a window without tallied steps."""
        self.progress = 0
        if not self.tally:
            return None
        factors, local, samples = self._totals()
        # Step times are this rank's own: the slowest rank sets the pace, and every rank must see the same value. So
        # must the samples: a rank's batches may differ from another's (batching by tokens, an uneven last batch of an
        # iterable data set), and the sequential search settles on these throughputs.
        if reduce is not None:
            local, samples = reduce(local, dist.ReduceOp.MAX), reduce(samples, dist.ReduceOp.SUM)
        else:
            samples = samples * world_size
        closed = Closed({}, [])
        for f, (seconds, comm_seconds, compress_s, plain_s), total in zip(
            factors, local.tolist(), samples.tolist(), strict=True
        ):
            tally = self.tally[f]
            self.throughput[f] = total / seconds * (tally.gain / tally.steps)
            closed.measured[f] = (tally.steps, seconds, comm_seconds, tally.moved_bytes)
            closed.compression.append((f, tally.steps, tally.plain_steps, compress_s, plain_s))
        self.tally.clear()
        self.windows += 1
        return closed

    def settle(self, omega: float) -> None:
        """Settle on the less aggressive of the two best factors when their throughputs agree within ``omega``."""
        ranked = sorted(self.throughput.items(), key=lambda item: item[1], reverse=True)
        if len(ranked) >= 2 and ranked[0][1] > 0 and (ranked[0][1] - ranked[1][1]) / ranked[0][1] <= omega:
            self.settled = min(ranked[0][0], ranked[1][0])
        else:
            self.settled = None

    def _totals(self) -> tuple[list[float], torch.Tensor, torch.Tensor]:
        """The factors sent in the window, sorted; this rank's times of each (seconds, communication, compression, and
        compression on the steps without probes) and its samples, as float64 tensors to reduce over ranks."""
        factors = sorted(self.tally)
        times = torch.tensor(
            [[t.seconds, t.comm_seconds, t.compress_seconds, t.plain_compress_seconds]
             for t in (self.tally[f] for f in factors)],
            dtype=torch.float64,
        )  # fmt: skip
        samples = torch.tensor([float(self.tally[f].samples) for f in factors], dtype=torch.float64)
        return factors, times, samples
