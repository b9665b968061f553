"""The compression's part of a Lightning checkpoint: every rank's state gathered to the one that writes, and
restored on any number of ranks.

What differs between ranks (the residuals, a method's own accumulation, an adaptation's ``per_rank`` state) is saved
stacked by rank; on as many ranks it restores bit for bit, on another number each rank starts from the mean of the
saved ones (:meth:`~lightning_gravac.adaptations.Adaptation.reshard`), which keeps the update the ranks owed in sum.
"""

import math
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_gravac.adaptations import Adaptation
from lightning_gravac.state import CompressionState

#: Where the strategy keeps the step counter and every rank's residuals in a Lightning checkpoint.
CHECKPOINT_KEY = "gravac"


def gather_rows(
    tensors: dict[str, Any], world_size: int, group: Any = None, device: torch.device | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """Every rank's tensors stacked along a leading rank dimension, on CPU, bit for bit, and the ranks that had no
    tensor of each name (their rows are zeros).

    The ranks first exchange their tensors' names, shapes and dtypes (a small object gather): where one rank has a
    tensor another lacks (an optimizer slot a rank has not made yet, having skipped every step so far as non-finite),
    the union is gathered and the absence recorded, where a single gather of unequal sizes would fail or
    hang. A name held in different shapes or dtypes is an error raised on every rank alike. Then one collective for
    all of them: their bytes concatenated into one ``uint8`` buffer, so a float64 residual, an integer counter or a
    bfloat16 buffer comes back exactly as it was, on ``device`` (the strategy's: the same kind on every rank, which
    NCCL needs; ``None``: an accelerator's where this rank holds a tensor on one). Every rank must call it.
    """
    mine = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    specs = {name: (tuple(t.shape), t.dtype) for name, t in mine.items()}
    every: list[Any] = [specs]
    if world_size > 1:
        # An object gather (pickled names, shapes and dtypes): the sizes must agree before the tensor gather can.
        every = [None] * world_size
        dist.all_gather_object(every, specs, group=group)
    union: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for rank_specs in every:
        for name, spec in rank_specs.items():
            if union.setdefault(name, spec) != spec:
                raise ValueError(
                    f"GraVACStrategy: the checkpoint's state {name!r} has shape and dtype {union[name]} on one rank "
                    f"and {spec} on another; every rank must hold a state of one shape and dtype."
                )
    if not union:
        return {}, {}
    names = sorted(union)
    if device is None:  # an accelerator's where any tensor is on one (a counter kept on the CPU joins it)
        device = next((t.device for t in mine.values() if t.device.type != "cpu"), torch.device("cpu"))
    local = torch.cat(
        [
            mine[n].detach().to(device).contiguous().reshape(-1).view(torch.uint8)
            if n in mine
            else torch.zeros(union[n][0], dtype=union[n][1], device=device).reshape(-1).view(torch.uint8)
            for n in names
        ]
    )
    if world_size > 1:
        gathered = torch.empty(world_size * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_single(gathered, local, group=group)
    else:
        gathered = local
    rows = gathered.view(world_size, local.numel()).cpu()
    out, offset = {}, 0
    for name in names:
        shape, dtype = union[name]
        numel = math.prod(shape)
        size = numel * dtype.itemsize
        # Copied into a tensor of the saved dtype through its bytes: a slice of the rows need not be aligned for one.
        stacked = torch.empty((world_size, *shape), dtype=dtype)
        stacked.view(world_size, numel).view(torch.uint8).copy_(rows[:, offset : offset + size])
        out[name] = stacked
        offset += size
    absent = {name: [r for r, rank_specs in enumerate(every) if name not in rank_specs] for name in names}
    return out, {name: ranks for name, ranks in absent.items() if ranks}


def saved_compression(state: CompressionState, world_size: int, device: torch.device | None = None) -> dict[str, Any]:
    """The compression's checkpoint entry: every rank's residuals, method state and per-rank adaptation state
    stacked by rank, the rest once, gathered through ``device`` (the strategy's). Every rank calls it (a
    collective), rank 0 writes it."""
    ranks = world_size if dist.is_initialized() else 1
    carry = state.carry.state_dict()
    saved: dict[str, Any] = {
        **state.carried.saved(),  # the step count and the units the residuals are in (fp16 scaling)
        "world_size": world_size,
    }
    absent: dict[str, dict[str, list[int]]] = {}  # by section, the names some rank had no tensor of

    def stacked(section: str, tensors: dict[str, Any]) -> None:
        saved[section], absent[section] = gather_rows(tensors, ranks, device=device)

    stacked("residuals", carry["residuals"])
    stacked("compressor", state.compressor.state_dict())
    for part in state.carry.adaptations:
        if part.per_rank:
            stacked(part.name, carry[part.name])
        else:
            saved[part.name] = carry[part.name]
    saved["absent"] = {section: names for section, names in absent.items() if names}
    return saved


def restore_compression(
    state: CompressionState, saved: dict[str, Any], world_size: int, rank: int, device: torch.device
) -> None:
    """Restore :func:`saved_compression`'s entry on this ``rank`` of ``world_size``, onto ``device``."""
    state.carried.restore(saved)
    residuals: dict[str, torch.Tensor] = saved["residuals"]
    same_world = saved["world_size"] == world_size
    if residuals and not same_world:
        # Every new rank starts from the mean of the old residuals: the sum over ranks of what is pending, divided
        # by the world size that averages it, is then exactly the update the old ranks still owed.
        rank_zero_warn(
            f"GraVACStrategy: resuming on {world_size} ranks from a checkpoint of {saved['world_size']}; "
            "each rank starts from the mean of the saved residuals, which preserves the pending update."
        )

    absent: dict[str, dict[str, list[int]]] = saved.get("absent", {})

    def mine(section: str, reshard: Any = Adaptation.reshard, owed: bool = False) -> dict[str, torch.Tensor]:
        """This rank's tensors of ``section``: none of a name this rank did not have (on as many ranks). On another
        number of ranks, the reshard of the rows of the ranks that had it, or with ``owed`` (a residual: a rank
        without one owed nothing) of every rank's floating rows, the zeros of those that had none counted in."""
        out = {}
        for name, stacked in saved.get(section, {}).items():
            missing = absent.get(section, {}).get(name, [])
            if same_world and rank in missing:
                continue
            rows = stacked
            if missing and not same_world and not (owed and stacked.is_floating_point()):
                rows = stacked[[r for r in range(stacked.shape[0]) if r not in missing]]
            out[name] = reshard(rows, rank, same_world).to(device)
        return out

    state.compressor.load_state_dict(dict(mine("compressor", owed=True)))
    restored: dict[str, dict[str, Any]] = {"residuals": mine("residuals", owed=True)}
    for part in state.carry.adaptations:
        restored[part.name] = mine(part.name, part.reshard) if part.per_rank else saved.get(part.name, {})
    state.carry.load_state_dict(restored)
