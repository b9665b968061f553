"""The compression's part of a Lightning checkpoint: every rank's state gathered to the one that writes, and
restored on any number of ranks.

What differs between ranks (the residuals, a method's own accumulation, an adaptation's ``per_rank`` state) is saved
stacked by rank; on as many ranks it restores bit for bit, on another number each rank starts from the mean of the
saved ones (:meth:`~lightning_gravac.adaptations.Adaptation.reshard`), which keeps the update the ranks owed in sum.
"""

from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_gravac.adaptations import Adaptation
from lightning_gravac.state import CompressionState

#: Where the strategy keeps the step counter and every rank's residuals in a Lightning checkpoint.
CHECKPOINT_KEY = "gravac"


def gather_rows(tensors: dict[str, Any], world_size: int, group: Any = None) -> dict[str, torch.Tensor]:
    """Every rank's tensors (the same names, shapes and dtypes on each), stacked along a leading rank dimension, on CPU,
    bit for bit.

    One collective for all of them: their bytes are concatenated into one ``uint8`` buffer, so a float64 residual, an
    integer counter or a bfloat16 buffer comes back exactly as it was (a float32 buffer would round the first and
    could not hold the second). Every rank must call it, on the same names.
    """
    names = sorted(name for name, t in tensors.items() if isinstance(t, torch.Tensor))
    if not names:
        return {}
    # One buffer on one device: an accelerator's where any tensor is on one (a counter kept on the CPU joins it).
    device = next((tensors[n].device for n in names if tensors[n].device.type != "cpu"), torch.device("cpu"))
    local = torch.cat([tensors[n].detach().to(device).contiguous().reshape(-1).view(torch.uint8) for n in names])
    if world_size > 1:
        gathered = torch.empty(world_size * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_single(gathered, local, group=group)
    else:
        gathered = local
    rows = gathered.view(world_size, local.numel()).cpu()
    out, offset = {}, 0
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        # Copied into a tensor of the saved dtype through its bytes: a slice of the rows need not be aligned for one.
        stacked = torch.empty((world_size, *tensor.shape), dtype=tensor.dtype)
        stacked.view(world_size, tensor.numel()).view(torch.uint8).copy_(rows[:, offset : offset + size])
        out[name] = stacked
        offset += size
    return out


def saved_compression(state: CompressionState, world_size: int) -> dict[str, Any]:
    """The compression's checkpoint entry: every rank's residuals, method state and per-rank adaptation state
    stacked by rank, the rest once. Every rank calls it (a collective), rank 0 writes it."""
    ranks = world_size if dist.is_initialized() else 1
    carry = state.carry.state_dict()
    saved: dict[str, Any] = {
        **state.carried.saved(),  # the step count and the units the residuals are in (fp16 scaling)
        "world_size": world_size,
        "residuals": gather_rows(carry["residuals"], ranks),
        "compressor": gather_rows(state.compressor.state_dict(), ranks),
    }
    for part in state.carry.adaptations:
        saved[part.name] = gather_rows(carry[part.name], ranks) if part.per_rank else carry[part.name]
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

    def mine(stacked: dict[str, torch.Tensor], reshard: Any = Adaptation.reshard) -> dict[str, torch.Tensor]:
        return {name: reshard(t, rank, same_world).to(device) for name, t in stacked.items()}

    state.compressor.load_state_dict(dict(mine(saved.get("compressor", {}))))
    restored: dict[str, dict[str, Any]] = {"residuals": mine(residuals)}
    for part in state.carry.adaptations:
        entry = saved.get(part.name, {})
        restored[part.name] = mine(entry, part.reshard) if part.per_rank else entry
    state.carry.load_state_dict(restored)
