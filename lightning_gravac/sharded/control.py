"""What the compression controllers read and decide under fully sharded training.

The controllers of the DDP strategy (``Static``, ``Accordion``, the divergence guard every controller carries) read a
:class:`~lightning_gravac.CompressionState`: each step's bytes and norms, and they hand it the factor of the next step.
Under FSDP2 the factor chooses, parameter by parameter, how its gradient goes in a step: factor 1 (or a hold) sends
it exact, any other the strategy's block code, as the DDP hook does with a block code. The coded collectives read the
decision once a call (:meth:`ShardedCompressionState.split`) and record what they sent; :meth:`take_stats` sums the
norms over every rank in one all-reduce of two floats, so every rank decides the same.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gravac.compressors.base import Compressor
from lightning_gravac.state import DENSE, GATHER, REDUCE, BucketRecord, CompressionState, StepStats


@dataclass(frozen=True)
class Split:
    """Which entries of a chunk go coded and which exact, as column indices of the chunk (each a parameter's piece)."""

    coded: Tensor
    exact: Tensor


#: Every parameter of the call coded, or every one exact: the two cases that need no columns.
CODED, EXACT = "coded", "exact"


class ShardedCompressionState(CompressionState):
    """The sharded strategy's :class:`~lightning_gravac.CompressionState`.

    Args:
        compressor: the strategy's block code, or ``"none"``'s method (every step exact).
        error_feedback: the strategy's.
        drop_residuals: the collectives' residuals dropped, called by :meth:`reset` (the divergence guard's remedy).

    Before any controller decides, every parameter goes at the code's own factor (``cf`` of the code). The norms are
    measured only on steps that code something and only while a controller reads them (:attr:`measures`): a
    measurement decodes each payload sent once more.
    """

    def __init__(self, compressor: Compressor, error_feedback: bool, drop_residuals: Callable[[], None]) -> None:
        super().__init__(compressor, error_feedback, cf=compressor.fixed_cf or DENSE)
        self.rows.enabled = False  # FSDP2 sends every gradient whole in its chunks: no table goes by its rows
        self._drop_residuals = drop_residuals
        #: Whether a controller reads the statistics (set by the strategy at setup): only then do the collectives
        #: record each call, and measure the norms of the calls that code.
        self.measures = False
        self._measured = 0  # calls since the last :meth:`take_stats` that measured norms
        #: Their ``(||fed||^2, ||sent||^2)`` summed, in float64 on the gradients' device: read on the host once a step,
        #: in :meth:`take_stats`, not once a call.
        self._norms: Tensor | None = None
        self._splits: dict[tuple[tuple[tuple[str, int], ...], tuple[bool, ...]], Split] = {}

    def split(self, layout: Sequence[tuple[str, int]], device: torch.device) -> str | Split:
        """How a collective of ``layout`` (each parameter's name and its entries in a chunk, in order) sends this
        call: :data:`CODED`, :data:`EXACT`, or the :class:`Split` of its columns. From the decision in force, the same
        on every rank."""
        factors = self.factors
        coded = tuple(not factors.half and self.cf_of(name) != DENSE for name, _ in layout)
        if all(coded):
            return CODED
        if not any(coded):
            return EXACT
        key = (tuple(layout), coded)
        found = self._splits.get(key)
        if found is None:
            columns = torch.arange(sum(width for _, width in layout), device=device)
            mask = torch.cat([torch.full((width,), c, dtype=torch.bool, device=device) for (_, width), c in zip(
                layout, coded, strict=True)])  # fmt: skip
            found = self._splits[key] = Split(columns[mask], columns[~mask])
        return found

    def record_call(
        self,
        sent: int,
        dense: int,
        sq_norm: Tensor | None = None,
        sq_sent: Tensor | None = None,
        began: float = 0.0,
        coded_at: float = 0.0,
    ) -> None:
        """Record one collective call: the bytes it sent and stock's, this rank's norms (``None``: not measured), when
        its work began and when its coding ended (``time.perf_counter``; ``coded_at`` 0: sent exact, by FSDP2's own
        collective, which sums on the wire; else the payloads were exchanged whole, as a gather's are). Nothing while
        no controller reads them (:attr:`measures`)."""
        if not self.measures:
            return
        now = time.perf_counter()
        compress_s = coded_at - began if began and coded_at else 0.0
        comm_s = now - (coded_at or began) if began else 0.0
        if sq_norm is not None and sq_sent is not None:
            pair = torch.stack([sq_norm, sq_sent]).to(torch.float64)
            self._norms = pair if self._norms is None else self._norms.add_(pair)
            self._measured += 1
        collective = GATHER if coded_at else REDUCE
        self.record(BucketRecord(sent, dense, collective, compress_s=compress_s, comm_s=comm_s))

    def take_stats(self) -> StepStats | None:
        """:meth:`CompressionState.take_stats`, the norms summed over the ranks that decide together (the state's
        process group: every rank, or a replica group's under local steps; one all-reduce, on the steps that measured
        any: whether one did is the same on those ranks, as their decision is)."""
        stats, measured, norms = super().take_stats(), self._measured, self._norms
        self._measured, self._norms = 0, None
        if stats is None or not measured or norms is None:
            return stats
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(norms, group=self.process_group)
        total, sent = norms.cpu().tolist()
        return replace(stats, sq_norm=total, sq_norm_sent=sent)

    def forget_splits(self) -> None:
        """Drop the column splits kept for an earlier fit's collectives (a new fit installs new ones)."""
        self._splits = {}

    def reset(self) -> None:
        super().reset()
        self._drop_residuals()
