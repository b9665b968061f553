"""HSDP's all-reduce across replica groups in block codes: each rank's reduced shard averaged with its replicas'.

Under hybrid sharding each group of ranks shards the model and the groups hold replicas of it. After a group's
reduce-scatter, each rank holds its shard's gradient averaged over the group; the ranks that hold the same shard in
the other groups average it with it across the (slower) link between groups. Here each codes its shard's gradient
plus its error-feedback residual with a :class:`BlockCode`, the replicas gather the codes, and each decodes every
payload, its own too, and adds them in replica order: every replica of a shard ends with the same bits. FSDP2 runs
this as a module's all-reduce hook (``FSDPModule.set_all_reduce_hook``) on its reduce-scatter's output.
"""

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gravac.compressors.base import Payload
from lightning_gravac.compressors.blockwise import BlockCode
from lightning_gravac.sharded._rows import all_gather_payload, coded, exact_tail, read_row, row_layout, write_row
from lightning_gravac.sharded.control import CODED, EXACT, ShardedCompressionState, Split


class CodedReplicaAllReduce:
    """The mean over ``group`` (the replicas of this rank's shard) of a reduced shard, in place, sent in ``code``.

    Args:
        code: the block code; ``None`` averages exactly (``all_reduce``).
        group: the process group of the ranks holding this rank's shard, one in each replica group.
        error_feedback: keep what coding dropped and add it to the next step's shard.
        layout: the module's parameters in FSDP's order, each as its name and its padded entries in the shard: how
            the residual is named in a checkpoint.
        state: the controllers' decision, read each call, as :class:`~lightning_gravac.sharded.CodedReduceScatter`
            reads it: a parameter at factor 1 averaged exact beside the codes. ``None``: always coded.
        decided_by: the parameters' names whose factors decide, each with its entries in the shard (``layout``'s
            when empty).
    """

    def __init__(
        self,
        code: BlockCode | None,
        group: dist.ProcessGroup,
        error_feedback: bool = True,
        layout: Sequence[tuple[str, int]] = (),
        state: ShardedCompressionState | None = None,
        decided_by: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.code, self.group, self.error_feedback = code, group, error_feedback
        self.layout = tuple(layout)
        self.state = state
        self.decided_by = tuple(decided_by) or self.layout
        #: What this rank still owes its replicas, in fp32, the shard's shape.
        self.residual: Tensor | None = None
        #: Bytes this rank has sent to its replicas since it was made.
        self.bytes_sent = 0

    def __call__(self, shard: Tensor) -> None:
        replicas = self.group.size()
        began = time.perf_counter()
        dense = shard.numel() * shard.element_size() * 2 * (replicas - 1) // replicas  # a ring's share
        how = CODED if self.state is None else self.state.split(self.decided_by, shard.device)
        if self.code is None or how == EXACT:
            sent, coded_at = self._exact(shard, dense), 0.0
        else:
            sent, coded_at = self._coded(shard, how)
        self.bytes_sent += sent
        if self.state is not None:
            self.state.record_call(sent, dense, began=began, coded_at=coded_at)

    def _exact(self, shard: Tensor, dense: int) -> int:
        """The exact average; what error feedback still owed goes with it (in fp32), and is owed no more. The bytes
        sent."""
        if self.residual is None:
            dist.all_reduce(shard, op=dist.ReduceOp.AVG, group=self.group)
        else:
            fed, self.residual = self.residual.add_(shard.view(self.residual.shape)), None
            dist.all_reduce(fed, op=dist.ReduceOp.AVG, group=self.group)
            shard.copy_(fed.view(shard.shape))
            return dense * fed.element_size() // shard.element_size()  # in fp32
        return dense

    def _coded(self, shard: Tensor, how: str | Split) -> tuple[int, float]:
        """The average in the code (``how`` a :class:`Split`: its exact columns in fp32 beside); the bytes sent and
        when coding ended (``time.perf_counter``)."""
        assert self.code is not None
        replicas = self.group.size()
        if self.error_feedback:
            if self.residual is None or self.residual.shape != shard.shape:
                self.residual = torch.zeros(shard.shape, dtype=torch.float32, device=shard.device)
            fed = self.residual.add_(shard)
        else:
            fed = shard.float()
        flat = fed.view(-1)
        coded_part = flat.index_select(0, how.coded) if isinstance(how, Split) else flat
        payload = coded(self.code, coded_part, self.error_feedback)
        coded_at = time.perf_counter()
        if isinstance(how, Split):
            rows, width = self._gather_split(payload, flat, how)
            if self.error_feedback:
                flat.index_copy_(0, how.coded, coded_part).index_fill_(0, how.exact, 0.0)
        else:
            rows, width = all_gather_payload(payload, self.group), None
        out = torch.zeros(shard.numel(), dtype=torch.float32, device=shard.device)
        part = out if width is None else torch.zeros(coded_part.numel(), dtype=torch.float32, device=shard.device)
        for received in rows:  # replica order: every replica adds in one order
            one = read_row(received[:width], payload)
            self.code.aggregate_(part, one.with_wire([w.unsqueeze(0) for w in one.wire]), 1.0 / replicas)
        if isinstance(how, Split) and width is not None:
            out.index_add_(0, how.coded, part)
            for received in rows:
                out.index_add_(0, how.exact, exact_tail(received, width), alpha=1.0 / replicas)
        shard.copy_(out.view(shard.shape))
        return rows.shape[1] * (replicas - 1), coded_at

    def _gather_split(self, payload: Payload, flat: Tensor, split: Split) -> tuple[Tensor, int]:
        """Every replica's row of ``payload`` (the coded columns) followed by its exact columns in fp32, gathered in
        one collective; the byte at which the exact columns begin."""
        width = row_layout(payload)[2]
        row = torch.empty(width + 4 * split.exact.numel(), dtype=torch.uint8, device=flat.device)
        row[:width].zero_()
        write_row(row[:width], payload)
        exact_tail(row, width).copy_(flat.index_select(0, split.exact))
        rows = torch.empty(self.group.size() * row.numel(), dtype=torch.uint8, device=row.device)
        dist.all_gather_single(rows, row, group=self.group)  # flat: gloo takes no rows
        return rows.view(self.group.size(), -1), width

    def state_dict(self) -> dict[str, Tensor]:
        """The residual by parameter name: this rank's padded piece of each parameter (it differs between ranks)."""
        if self.residual is None:
            return {}
        pieces = torch.split(self.residual.view(-1), [entries for _, entries in self.layout])
        return {name: piece.clone() for (name, _), piece in zip(self.layout, pieces, strict=True)}

    def load_state_dict(self, state: dict[str, Tensor], device: torch.device) -> None:
        """Restore :meth:`state_dict`'s residual (an empty ``state``: none yet) onto ``device``."""
        if not any(name in state for name, _ in self.layout):
            self.residual = None
            return
        pieces = [
            state[name].to(device) if name in state else torch.zeros(entries, device=device)
            for name, entries in self.layout
        ]
        self.residual = torch.cat(pieces)
