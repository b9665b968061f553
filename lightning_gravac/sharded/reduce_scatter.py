"""FSDP2's gradient reduce-scatter in block codes: each rank codes the chunk it sends to each other rank.

FSDP2 lays a module's gradients out as one flat buffer of ``world`` equal chunks, chunk ``d`` destined to rank ``d``
(each parameter padded along its first dimension, cut into ``world`` pieces, piece ``d`` in chunk ``d``). Here each
rank adds its error-feedback residual, codes every chunk but its own with a :class:`BlockCode` (``int8``/``int4``), and
the ranks exchange the codes in one ``all_to_all`` of bytes (every chunk's payload has one size). Each rank decodes
every payload it received to fp32 and adds them in rank order, its own chunk exact (it never crosses the network):
codes are never summed. What coding dropped stays in the residual for the next step, kept by parameter name.

Only ``all_to_all_single`` is needed, which gloo and NCCL both have; with no method (dense), the call is FSDP's own
``reduce_scatter_single``, so the run is stock FSDP2's bit for bit.
"""

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from lightning_gravac.compressors.base import Payload, sq_norm
from lightning_gravac.compressors.blockwise import BlockCode
from lightning_gravac.sharded._rows import coded, exact_tail, read_row, row_layout, write_row
from lightning_gravac.sharded.control import CODED, EXACT, ShardedCompressionState, Split


class CodedReduceScatter(ReduceScatter):
    """A custom reduce-scatter for :meth:`FSDPModule.set_custom_reduce_scatter` that sends block codes.

    Args:
        code: the block code the chunks travel in; ``None`` sends them as they are (FSDP's own collective).
        error_feedback: keep what coding dropped from each chunk sent and add it to the next step's.
        layout: the module's parameters in FSDP's order, each as its name, its entry count and its entries in one
            chunk (``padded first dimension / world`` rows): how the residual is named in a checkpoint.
        state: the controllers' decision, read each call: a parameter at factor 1 goes exact, in fp32 beside the
            codes; every one at factor 1 is FSDP's own collective on the error-fed chunks. ``None``: always coded.
    """

    def __init__(
        self,
        code: BlockCode | None,
        error_feedback: bool = True,
        layout: Sequence[tuple[str, int, int]] = (),
        state: ShardedCompressionState | None = None,
    ) -> None:
        self.code = code
        self.error_feedback = error_feedback
        self.layout = tuple(layout)
        self.state = state
        #: Each parameter's name and its entries in a chunk, the columns a controller's decision splits.
        self.widths = tuple((name, per_chunk) for name, _, per_chunk in self.layout)
        #: ``(world, chunk)`` fp32: what this rank still owes each destination (its own row zero after every coded
        #: call; non-zero only as laid out from a checkpoint of another world size, and paid at the next call).
        self.residual: Tensor | None = None
        #: Bytes this rank has sent to the other ranks since it was made.
        self.bytes_sent = 0

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> dist.Work | None:
        world, rank = group.size(), group.rank()
        began = time.perf_counter()
        dense = input_tensor.numel() * input_tensor.element_size() * (world - 1) // world
        how = CODED if self.state is None else self.state.split(self.widths, input_tensor.device)
        if self.code is None or how == EXACT:
            return self._exact(output_tensor, input_tensor, group, op, async_op, dense, began)
        if op == dist.ReduceOp.AVG:
            scale = 1.0 / world
        elif op == dist.ReduceOp.SUM:
            scale = 1.0
        else:
            raise ValueError(f"CodedReduceScatter: `op` must be SUM or AVG, got {op!r}.")
        rows = input_tensor.view(world, -1)
        fed = self._error_fed(rows)
        # This rank's own chunk, with what is still owed to it (non-zero only when a residual saved on another world
        # size was laid out again), is added exact, and its row of the residual zeroed once added.
        own = fed[rank]
        measures = self.state is not None and self.state.measures
        sq = sq_norm(fed) if measures else None
        if isinstance(how, Split):
            send, like, exact = self._encode_split(fed, rank, how)
        else:
            send, like = self._encode(fed, rank)
            exact = None
        sent_sq = self._sent_sq(send, like, rank, own, exact) if measures else None
        coded_at = time.perf_counter()
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=group)
        sent = send[0].numel() * (world - 1)
        self.bytes_sent += sent
        out = self._sum(receive, rank, own, how, like, exact, scale)
        if self.error_feedback:  # sent exact: nothing owed
            own.zero_()
            if isinstance(how, Split):
                fed.index_fill_(1, how.exact, 0.0)
        output_tensor.copy_(out)
        if self.state is not None:
            self.state.record_call(sent, dense, sq, sent_sq, began, coded_at)
        return None

    def _sum(
        self, receive: Tensor, rank: int, own: Tensor, how: str | Split, like: Payload, exact: int | None, scale: float
    ) -> Tensor:
        """``scale`` times the sum of this rank's ``own`` chunk and every other rank's row of ``receive``, decoded
        (``how`` a :class:`Split`: each row's exact columns from the byte ``exact`` on), in fp32."""
        out = torch.zeros(own.numel(), dtype=torch.float32, device=own.device)
        for source in range(receive.shape[0]):  # rank order: every rank adds in one order
            if source == rank:
                out.add_(own, alpha=scale)
            elif isinstance(how, Split):
                assert exact is not None
                part = torch.zeros(how.coded.numel(), dtype=torch.float32, device=own.device)
                self._add_row(part, receive[source], like, scale)
                out.index_add_(0, how.coded, part)
                out.index_add_(0, how.exact, exact_tail(receive[source], exact), alpha=scale)
            else:
                self._add_row(out, receive[source], like, scale)
        return out

    def _add_row(self, out: Tensor, row: Tensor, like: Payload, scale: float) -> None:
        """Add ``scale`` times the payload another rank wrote as ``row`` (``like``'s layout), decoded, to ``out``."""
        assert self.code is not None
        received = read_row(row, like)
        self.code.aggregate_(out, received.with_wire([w.unsqueeze(0) for w in received.wire]), scale)

    def _exact(
        self,
        output: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool,
        dense: int,
        began: float,
    ) -> dist.Work | None:
        """FSDP's own reduce-scatter; what error feedback still owed goes with it, exact (in fp32), and is owed no
        more."""
        if self.residual is None:
            work = dist.reduce_scatter_single(output=output, input=input_tensor, group=group, op=op, async_op=async_op)
            self._count(dense, dense, began)  # after the collective when it is synchronous (FSDP2 calls it so)
            return work
        fed = self.residual.add_(input_tensor.view(self.residual.shape))
        self.residual = None
        out = torch.empty(output.shape, dtype=torch.float32, device=output.device)
        dist.reduce_scatter_single(output=out, input=fed.view(-1), group=group, op=op)
        output.copy_(out)
        self._count(dense * fed.element_size() // input_tensor.element_size(), dense, began)
        return None

    def _count(self, sent: int, dense: int, began: float) -> None:
        self.bytes_sent += sent
        if self.state is not None:
            self.state.record_call(sent, dense, began=began)

    def _error_fed(self, rows: Tensor) -> Tensor:
        """The chunks plus the residual, in fp32: the residual's own buffer, which coding turns into the next one."""
        if not self.error_feedback:
            return rows.float()
        if self.residual is None or self.residual.shape != rows.shape:
            self.residual = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        return self.residual.add_(rows)

    def _encode(self, fed: Tensor, rank: int) -> tuple[Tensor, Payload]:
        """Every other chunk's payload as one row of bytes; with error feedback ``fed``'s other rows become the
        residual (this rank's own row is left as it was). Returns the rows and one payload, whose layout every row
        shares."""
        assert self.code is not None
        payloads: list[Payload | None] = []
        for destination, chunk in enumerate(fed):
            if destination == rank:
                payloads.append(None)
                continue
            payloads.append(coded(self.code, chunk, self.error_feedback))
        like = next(p for p in payloads if p is not None)
        send = torch.zeros(len(payloads), row_layout(like)[2], dtype=torch.uint8, device=fed.device)
        for row, payload in zip(send, payloads, strict=True):
            if payload is not None:
                write_row(row, payload)
        return send, like

    def _encode_split(self, fed: Tensor, rank: int, split: Split) -> tuple[Tensor, Payload, int]:
        """:meth:`_encode` of ``split``'s coded columns, each row followed by its exact columns in fp32; the byte at
        which those begin. With error feedback ``fed``'s coded columns of the other rows become their rounding (the
        caller zeroes the exact ones once the sum has read this rank's own row)."""
        coded_part = fed.index_select(1, split.coded)
        codes, like = self._encode(coded_part, rank)
        exact = codes.shape[1]  # a whole number of fp32s (`row_layout`)
        send = torch.empty(fed.shape[0], exact + 4 * split.exact.numel(), dtype=torch.uint8, device=fed.device)
        send[:, :exact].copy_(codes)
        exact_tail(send, exact).copy_(fed.index_select(1, split.exact))
        if self.error_feedback:
            fed.index_copy_(1, split.coded, coded_part)
        return send, like, exact

    def _sent_sq(self, send: Tensor, like: Payload, rank: int, own: Tensor, exact: int | None) -> Tensor:
        """``||what this rank sent, decoded||^2``, its own chunk included (exact): a decode of each payload sent
        (``exact``: the byte its rows' exact entries begin at, ``None`` without)."""
        assert self.code is not None
        total = sq_norm(own)
        for destination, row in enumerate(send):
            if destination == rank:
                continue
            total += self.code.sent_sq_norm(read_row(row, like))
            if exact is not None:
                total += sq_norm(exact_tail(row, exact))
        return total

    def state_dict(self) -> dict[str, Tensor]:
        """Every parameter's residual by name, flat, in its own entries' order (its padding dropped): each rank's
        whole share of what it still owes, independent of the world size."""
        if self.residual is None:
            return {}
        out, offset = {}, 0
        for name, numel, per_chunk in self.layout:
            # A fresh contiguous tensor: a one-entry slice of the columns keeps the rows' stride through `clone()`.
            flat = self.residual[:, offset : offset + per_chunk].reshape(-1)[:numel]
            out[name] = flat.clone(memory_format=torch.contiguous_format)
            offset += per_chunk
        return out

    def load_state_dict(self, state: dict[str, Tensor], world: int, device: torch.device) -> None:
        """Restore :meth:`state_dict`'s residuals (an empty ``state``: none yet) on ``world`` ranks, onto ``device``."""
        mine = [name for name, _, _ in self.layout if name in state]
        if not mine:
            self.residual = None
            return
        chunk = sum(per_chunk for _, _, per_chunk in self.layout)
        self.residual = torch.zeros(world, chunk, dtype=torch.float32, device=device)
        offset = 0
        for name, numel, per_chunk in self.layout:
            if name in state:
                padded = torch.zeros(world * per_chunk, dtype=torch.float32, device=device)
                padded[:numel].copy_(state[name].reshape(-1))
                self.residual[:, offset : offset + per_chunk].copy_(padded.view(world, per_chunk))
            offset += per_chunk
