"""HSDP's all-reduce across replica groups in block codes: each rank's reduced shard averaged with its replicas'.

Under hybrid sharding each group of ranks shards the model and the groups hold replicas of it. After a group's
reduce-scatter, each rank holds its shard's gradient averaged over the group; the ranks that hold the same shard in
the other groups average it with it across the (slower) link between groups. Here each codes its shard's gradient
plus its error-feedback residual with a :class:`BlockCode`, the replicas gather the codes, and each decodes every
payload, its own too, and adds them in replica order: every replica of a shard ends with the same bits. FSDP2 runs
this as a module's all-reduce hook (``FSDPModule.set_all_reduce_hook``) on its reduce-scatter's output.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gravac.compressors.blockwise import BlockCode
from lightning_gravac.sharded._rows import all_gather_payload, coded, read_row


class CodedReplicaAllReduce:
    """The mean over ``group`` (the replicas of this rank's shard) of a reduced shard, in place, sent in ``code``.

    Args:
        code: the block code; ``None`` averages exactly (``all_reduce``).
        group: the process group of the ranks holding this rank's shard, one in each replica group.
        error_feedback: keep what coding dropped and add it to the next step's shard.
        layout: the module's parameters in FSDP's order, each as its name and its padded entries in the shard: how
            the residual is named in a checkpoint.
    """

    def __init__(
        self,
        code: BlockCode | None,
        group: dist.ProcessGroup,
        error_feedback: bool = True,
        layout: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.code, self.group, self.error_feedback = code, group, error_feedback
        self.layout = tuple(layout)
        #: What this rank still owes its replicas, in fp32, the shard's shape.
        self.residual: Tensor | None = None
        #: Bytes this rank has sent to its replicas since it was made.
        self.bytes_sent = 0

    def __call__(self, shard: Tensor) -> None:
        replicas = self.group.size()
        if self.code is None:
            self.bytes_sent += shard.numel() * shard.element_size() * 2 * (replicas - 1) // replicas  # a ring's share
            dist.all_reduce(shard, op=dist.ReduceOp.AVG, group=self.group)
            return
        if self.error_feedback:
            if self.residual is None or self.residual.shape != shard.shape:
                self.residual = torch.zeros(shard.shape, dtype=torch.float32, device=shard.device)
            fed = self.residual.add_(shard)
        else:
            fed = shard.float()
        payload = coded(self.code, fed, self.error_feedback)
        rows = all_gather_payload(payload, self.group)
        self.bytes_sent += rows.shape[1] * (replicas - 1)
        out = torch.zeros(shard.numel(), dtype=torch.float32, device=shard.device)
        for received in rows:  # replica order: every replica adds in one order
            one = read_row(received, payload)
            self.code.aggregate_(out, one.with_wire([w.unsqueeze(0) for w in one.wire]), 1.0 / replicas)
        shard.copy_(out.view(shard.shape))

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
