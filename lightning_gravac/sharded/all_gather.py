"""FSDP2's parameter all-gather in block codes: each rank sends its shard coded, every rank decodes every shard.

Before a module's forward (and again before its backward, where FSDP freed the whole parameters after the forward),
FSDP2 gathers every rank's shard of its parameters. Here each rank codes its shard with a :class:`BlockCode` and the
ranks gather the codes; every rank decodes all of them, its own too, so every rank computes with the same whole
parameters. The shards themselves, which the optimizer updates, stay exact: only the forward and backward see the
rounding (ZeRO++'s quantized weight all-gather). Deterministic, so a module's backward sees its forward's weights.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from lightning_gravac.compressors.blockwise import BlockCode
from lightning_gravac.sharded._rows import all_gather_payload, read_row
from lightning_gravac.sharded.control import EXACT, ShardedCompressionState


class CodedAllGather(AllGather):
    """A custom all-gather for :meth:`FSDPModule.set_custom_all_gather` that sends each shard in block codes.

    Args:
        code: the block code the shards travel in. Shards of another dtype than fp32 and bf16 (FSDP gathers mixed
            dtypes as bytes) go as they are.
        state: the controllers' decision: a call whose every parameter (``decided_by``: their names and entries in
            the shard) is at factor 1 gathers them exact, FSDP2's own collective. ``None``: always coded.
        decided_by: see ``state``.
    """

    def __init__(
        self,
        code: BlockCode,
        state: ShardedCompressionState | None = None,
        decided_by: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.code = code
        self.state, self.decided_by = state, tuple(decided_by)
        #: Bytes this rank has sent to the other ranks since it was made.
        self.bytes_sent = 0

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        world = group.size()
        exact = self.state is not None and self.state.split(self.decided_by, input_tensor.device) == EXACT
        if exact or input_tensor.dtype not in (torch.float32, torch.bfloat16):
            self.bytes_sent += input_tensor.numel() * input_tensor.element_size() * (world - 1)
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        payload = self.code.compress(input_tensor, self.code.fixed_cf or 1.0)
        rows = all_gather_payload(payload, group)
        self.bytes_sent += rows.shape[1] * (world - 1)
        for shard, received in zip(output_tensor.view(world, -1), rows, strict=True):
            shard.copy_(self.code.decompress(read_row(received, payload)))
        return None
