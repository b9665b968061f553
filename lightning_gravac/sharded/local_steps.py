"""Local steps between replica groups: each group trains on its own, and every few optimizer steps each rank averages
the change of its parameter shards with its replicas' (DiLoCo's structure).

Each rank keeps an anchor, one fp32 copy of its local shards, taken at fit start and after each round. At the end
of a round the change since the anchor, all this rank's shards as one flat vector, is averaged with the replicas' in
the strategy's block code with error feedback (:class:`~lightning_gravac.sharded.replicas.CodedReplicaAllReduce`: one
collective a round; exact for ``"none"``), and the outer step moves the anchor by it, ``anchor <- anchor + lr *
update``, the update the averaged change itself or with the outer momentum (Nesterov's where asked; DiLoCo's outer
step is ``lr=0.7, momentum=0.9, nesterov=True``), as the DDP strategy's local steps do. Every shard becomes its
anchor: every replica of a shard ends the round with the same bits. The optimizers and their states stay each group's
own.
"""

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_gravac.adaptations.local_steps import outer_momentum
from lightning_gravac.adaptations.round_guard import LocalStepsDiverged
from lightning_gravac.compressors.blockwise import BlockCode
from lightning_gravac.sharded.replicas import CodedReplicaAllReduce

#: Prefixes of this rank's state in a checkpoint, by parameter name.
ANCHOR, OUTER, LOCAL, VELOCITY = "anchor.", "outer.", "local.", "velocity."
#: The round ends in a row lost to a non-finite change (:attr:`ReplicaRounds.stalled`), in a checkpoint.
STALLED = "stalled"


def _local(p: Tensor) -> Tensor:
    """The tensor this rank holds of ``p`` (a DTensor's local shard), itself: writing to it writes the parameter."""
    return p._local_tensor if isinstance(p, DTensor) else p


def _padded(p: Tensor) -> int:
    """The entries of ``p``'s largest local shard (FSDP2's ``Shard(0)``: rows in chunks of the rounded-up share):
    every rank's tensor of ``p`` saved at this length has one shape, as a checkpoint's rows must."""
    if not isinstance(p, DTensor) or p.dim() == 0 or p.shape[0] == 0:
        return _local(p).numel()
    return -(-p.shape[0] // p.device_mesh.size()) * (p.numel() // p.shape[0])


def _pad(t: Tensor, entries: int) -> Tensor:
    flat = t.detach().reshape(-1)
    return torch.cat([flat, flat.new_zeros(entries - flat.numel())])


class ReplicaRounds:
    """The parameter average between replica groups every ``every`` optimizer steps, on ``model``'s local shards.

    Args:
        every: optimizer steps a round.
        code: the block code; ``None`` averages exactly.
        group: the ranks that hold this rank's shards, one in each replica group.
        error_feedback: keep what coding dropped and add it to the next round's change.
        model: the sharded module (its parameters' local shards are averaged in place).
        lr: the outer step's learning rate (1: the anchor moves by the averaged change).
        momentum: the outer step's momentum (0: none).
        nesterov: Nesterov's form of the outer momentum.
    """

    def __init__(
        self,
        every: int,
        code: BlockCode | None,
        group: dist.ProcessGroup,
        error_feedback: bool,
        model: nn.Module,
        lr: float = 1.0,
        momentum: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self.every, self.model = every, model
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        #: The outer momentum, flat, fp32, the anchor's layout (the same on every replica); ``None`` before a round.
        self.velocity: Tensor | None = None
        layout = [(OUTER + name, t.numel()) for name, t in self._locals()]
        #: The all-reduce of the change between replicas (its residual is the outer step's error feedback).
        self.average_changes = CodedReplicaAllReduce(code, group, error_feedback, layout)
        #: This rank's shards at the last average (or fit start), flat, fp32; ``None`` before fit start.
        self.anchor: Tensor | None = None
        #: Optimizer steps since the last average.
        self.since = 0
        #: Round ends in a row whose averaged change was not finite somewhere (each went on from the anchor).
        self.stalled = 0
        #: The divergence guard dropped the residuals in this rank's group: the outer momentum goes too, on every
        #: replica alike, at the round's end (:meth:`drop_momentum`).
        self._drop_velocity = False

    def _locals(self) -> list[tuple[str, Tensor]]:
        return [(name, _local(p)) for name, p in self.model.named_parameters()]

    def _flat(self) -> Tensor:
        return torch.cat([t.detach().reshape(-1).float() for _, t in self._locals()])

    def start(self) -> None:
        """Take the anchor unless a checkpoint restored one."""
        if self.anchor is None:
            self.anchor = self._flat()

    def stepped(self) -> None:
        """Count an optimizer step; at the round's end, average."""
        self.since += 1
        if self.since >= self.every:
            self.average()

    def finish(self) -> None:
        """Average a round left partial, so every replica ends with the same parameters."""
        if self.since > 0:
            self.average()

    def drop_momentum(self) -> None:
        """Drop the outer momentum at the round's end (the divergence guard's remedy, in one replica group: the
        round's end tells every replica, so all drop it together)."""
        self._drop_velocity = True

    @torch.no_grad()
    def average(self) -> None:
        """Average the change since the anchor over the replicas, take the outer step from it, and make every local
        shard the new anchor. Where any rank's averaged change is not finite, every rank goes on from its anchor
        instead (the round lost, the residual dropped), as the DDP strategy's local steps do.

        Raises:
            LocalStepsDiverged: on every rank, at the second round end in a row that was lost so.
        """
        assert self.anchor is not None, "ReplicaRounds.start() takes the anchor at fit start"
        change = self._flat().sub_(self.anchor)
        if change.numel():
            self.average_changes(change)
        # One decision for every rank (the shards differ between ranks; every rank ends its rounds at one step).
        flags = torch.stack(
            [change.isfinite().all().logical_not(), torch.tensor(self._drop_velocity, device=change.device)]
        ).float()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        lost, drop = (bool(v) for v in flags.tolist())
        self._drop_velocity = False
        if drop:
            self.velocity = None
        self.since = 0
        if lost:
            self.average_changes.residual = None
            self._write(self.anchor)
            self.stalled += 1
            if self.stalled >= 2:
                raise LocalStepsDiverged(
                    "Local steps between replica groups cannot go on: the last two rounds' averaged change was not "
                    "finite, so the parameters would stay where they are for the rest of the fit. Try a smaller "
                    "learning rate, shorter rounds, or `replica_every=None` (every step's gradients averaged)."
                )
            rank_zero_warn(
                "GraVACModelParallelStrategy: the replica groups' averaged change was not finite; every rank goes on "
                "from the last round's parameters."
            )
            return
        self.stalled = 0
        self._write(self.anchor.add_(self._outer_update(change), alpha=self.lr))
        self.anchor = self._flat()  # as the parameters hold it (rounded, for parameters below fp32)

    def _write(self, flat: Tensor) -> None:
        """Every local shard from ``flat`` (the anchor's layout)."""
        locals_ = self._locals()
        pieces = torch.split(flat, [t.numel() for _, t in locals_])
        for (_, t), piece in zip(locals_, pieces, strict=True):
            t.copy_(piece.view(t.shape))

    def _outer_update(self, change: Tensor) -> Tensor:
        """What the anchor moves by, over ``lr``: the averaged change, or with the outer momentum (SGD's recurrence on
        the change, whose first round's momentum is the change itself)."""
        if self.momentum == 0:
            return change
        update, self.velocity = outer_momentum(change, self.velocity, self.momentum, self.nesterov)
        return update

    def state_dict(self, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, Tensor]:
        """This rank's anchor, outer residual and momentum, local shards and optimizers' state, by parameter name,
        each flat and zero-padded to the largest rank's shard (:func:`_padded`).

        The shards and optimizer states differ between replica groups in a round (and the states always), where a
        Lightning checkpoint keeps one replica's: a run resumed from these is the uninterrupted run.
        """
        locals_ = self._locals()
        entries = {name: _padded(p) for name, p in self.model.named_parameters()}
        out = {name: _pad(t, entries[name[len(OUTER) :]]) for name, t in self.average_changes.state_dict().items()}
        if self.anchor is not None:
            pieces = torch.split(self.anchor, [t.numel() for _, t in locals_])
            for (name, _), piece in zip(locals_, pieces, strict=True):
                out[ANCHOR + name] = _pad(piece, entries[name])
        if self.velocity is not None:
            pieces = torch.split(self.velocity, [t.numel() for _, t in locals_])
            for (name, _), piece in zip(locals_, pieces, strict=True):
                out[VELOCITY + name] = _pad(piece, entries[name])
        out.update({LOCAL + name: _pad(t, entries[name]) for name, t in locals_})
        out[STALLED] = torch.tensor([self.stalled], dtype=torch.int64)
        names = {id(p): name for name, p in self.model.named_parameters()}
        for i, optimizer in enumerate(optimizers):
            for p, state in optimizer.state.items():
                for key, value in state.items():
                    if isinstance(value, Tensor) and id(p) in names:
                        name = names[id(p)]
                        slot = _pad(_local(value), entries[name]) if isinstance(value, DTensor) else value.clone()
                        out[f"optimizer{i}.{name}.{key}"] = slot
        return out

    def load_state_dict(
        self, state: dict[str, Tensor], since: int, optimizers: Sequence[torch.optim.Optimizer], device: torch.device
    ) -> None:
        """Restore :meth:`state_dict` (saved on this rank, the same world size) and the steps since the average."""
        locals_ = self._locals()
        with torch.no_grad():
            for name, t in locals_:
                if LOCAL + name in state:
                    t.copy_(state[LOCAL + name][: t.numel()].view(t.shape))
            names = {id(p): name for name, p in self.model.named_parameters()}
            for i, optimizer in enumerate(optimizers):
                for p, slots in optimizer.state.items():
                    for key, value in slots.items():
                        saved = state.get(f"optimizer{i}.{names.get(id(p))}.{key}")
                        if isinstance(value, Tensor) and saved is not None:
                            mine = _local(value)
                            mine.copy_(saved.reshape(-1)[: mine.numel()].view(mine.shape))
        if all(ANCHOR + name in state for name, _ in locals_):
            self.anchor = torch.cat([state[ANCHOR + name][: t.numel()].to(device) for name, t in locals_])
        if all(VELOCITY + name in state for name, _ in locals_):
            self.velocity = torch.cat([state[VELOCITY + name][: t.numel()].to(device) for name, t in locals_])
        outer = {OUTER + name: state[OUTER + name][: t.numel()] for name, t in locals_ if OUTER + name in state}
        self.average_changes.load_state_dict(outer, device)
        self.since = since
        self.stalled = int(state[STALLED].reshape(-1)[0]) if STALLED in state else 0
