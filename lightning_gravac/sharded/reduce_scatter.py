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

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from lightning_gravac.compressors.base import Payload
from lightning_gravac.compressors.blockwise import BlockCode
from lightning_gravac.sharded._rows import coded, read_row, row_layout, write_row


class CodedReduceScatter(ReduceScatter):
    """A custom reduce-scatter for :meth:`FSDPModule.set_custom_reduce_scatter` that sends block codes.

    Args:
        code: the block code the chunks travel in; ``None`` sends them as they are (FSDP's own collective).
        error_feedback: keep what coding dropped from each chunk sent and add it to the next step's.
        layout: the module's parameters in FSDP's order, each as its name, its entry count and its entries in one
            chunk (``padded first dimension / world`` rows): how the residual is named in a checkpoint.
    """

    def __init__(
        self, code: BlockCode | None, error_feedback: bool = True, layout: Sequence[tuple[str, int, int]] = ()
    ) -> None:
        self.code = code
        self.error_feedback = error_feedback
        self.layout = tuple(layout)
        #: ``(world, chunk)`` fp32: what this rank still owes each destination (its own row stays zero).
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
        if self.code is None:
            self.bytes_sent += input_tensor.numel() * input_tensor.element_size() * (world - 1) // world
            return dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
            )
        if op == dist.ReduceOp.AVG:
            scale = 1.0 / world
        elif op == dist.ReduceOp.SUM:
            scale = 1.0
        else:
            raise ValueError(f"CodedReduceScatter: `op` must be SUM or AVG, got {op!r}.")
        rows = input_tensor.view(world, -1)
        own = rows[rank].float()
        fed = self._error_fed(rows)
        send, like = self._encode(fed, rank)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=group)
        self.bytes_sent += send[0].numel() * (world - 1)
        out = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
        for source in range(world):  # rank order: every rank adds in one order
            if source == rank:
                out.add_(own, alpha=scale)
            else:
                received = read_row(receive[source], like)
                self.code.aggregate_(out, received.with_wire([w.unsqueeze(0) for w in received.wire]), scale)
        output_tensor.copy_(out)
        return None

    def _error_fed(self, rows: Tensor) -> Tensor:
        """The chunks plus the residual, in fp32: the residual's own buffer, which coding turns into the next one."""
        if not self.error_feedback:
            return rows.float()
        if self.residual is None or self.residual.shape != rows.shape:
            self.residual = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
        return self.residual.add_(rows)

    def _encode(self, fed: Tensor, rank: int) -> tuple[Tensor, Payload]:
        """Every other chunk's payload as one row of bytes; with error feedback ``fed`` becomes the residual. Returns
        the rows and one payload, whose layout every row shares."""
        assert self.code is not None
        payloads: list[Payload | None] = []
        for destination, chunk in enumerate(fed):
            if destination == rank:
                payloads.append(None)
                continue
            payloads.append(coded(self.code, chunk, self.error_feedback))
        if self.error_feedback:
            fed[rank].zero_()  # sent exact: nothing owed
        like = next(p for p in payloads if p is not None)
        send = torch.zeros(len(payloads), row_layout(like)[2], dtype=torch.uint8, device=fed.device)
        for row, payload in zip(send, payloads, strict=True):
            if payload is not None:
                write_row(row, payload)
        return send, like

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
