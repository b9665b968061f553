"""The DDP options GraVACStrategy sets, keeps off or refuses: post-local SGD's, the keyword arguments its DDP model is
built with and the buffer sync that local steps do without."""

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
from torch.nn.parallel import DistributedDataParallel

from lightning_gravac._validation import argument_names, whole

#: DDP's switch for syncing buffers at every forward: ``forward_sync_buffers`` where torch has it, else the older
#: ``broadcast_buffers`` (both a constructor argument and an attribute).
_BUFFER_SYNC = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)

_OWN_HOOK_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")


def refuse_own_hook(kwargs: dict[str, Any]) -> None:
    """Refuse a comm hook of the user's own among ``kwargs``, the strategy's DDP keyword arguments.

    Raises:
        ValueError: naming each of ``ddp_comm_hook``, ``ddp_comm_state`` and ``ddp_comm_wrapper`` that was passed.
    """
    if clashing := [name for name in _OWN_HOOK_ARGS if kwargs.get(name) is not None]:
        raise ValueError(
            f"GraVACStrategy registers its own DDP comm hook; remove {', '.join(clashing)} "
            "or use DDPStrategy for a hook of your own."
        )


def refuse_arguments(kwargs: dict[str, Any], *takers: Callable[..., Any]) -> None:
    """Refuse, among ``kwargs``, a comm hook of the user's own (:func:`refuse_own_hook`) and a keyword argument that
    neither ``takers`` (the strategy's and DDPStrategy's ``__init__``) nor ``DistributedDataParallel`` take: at
    construction, not when the DDP model is built at fit start, on every rank, with a traceback through Lightning.

    Raises:
        ValueError: naming the argument, with the closest name where one is near, else where a factor is set.
    """
    refuse_own_hook(kwargs)
    known = argument_names(*takers, DistributedDataParallel.__init__, skip=("self", "module"))
    for name in kwargs:
        if name in known:
            continue
        near = difflib.get_close_matches(name, sorted(known), n=1)
        hint = (
            f"did you mean `{near[0]}`?"
            if near
            else "a factor is set by a controller callback, e.g. "
            "`Trainer(strategy=GraVACStrategy('topk'), callbacks=[Static(cf=10)])` or `callbacks=[GraVAC(cf_max=100)]`."
        )
        raise ValueError(
            f"GraVACStrategy takes no argument `{name}` (nor do DDPStrategy and DistributedDataParallel): {hint}"
        )


def post_local_sgd(period: int | None, start: int) -> tuple[dict[str, Any], PostLocalSGDState | None]:
    """Post-local SGD from step ``start``, parameters averaged every ``period`` steps (``None``: off): the DDP keyword
    arguments it adds and the state the strategy's comm hook is registered with.

    Raises:
        ValueError: for a ``period`` below 1 or a ``start`` below 0.
    """
    if period is None:
        return {}, None
    whole(period, "model_averaging_period", minimum=1)
    whole(start, "start_local_sgd_step", minimum=0)
    # With this state DDPStrategy builds a PeriodicModelAverager averaging every period; Lightning's matching gradient
    # hook is CUDA-only: ours stops communicating gradients once local SGD starts, on every device.
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=start)
    return {"model_averaging_period": period}, state


def built_with(passed: dict[str, Any], local_steps: bool) -> dict[str, Any]:
    """The keyword arguments the DDP model is built with: ``passed`` (what the user gave, which wins) over this
    strategy's defaults.

    Gradients as views into DDP's buckets: no copy of each gradient into its bucket and back. A Python comm hook pays
    one pass over the bucket for the 1/N that DDP's C++ reducer fuses into that copy; dropping the copies more than pays
    for it (BENCHMARKS.md). ``gradient_as_bucket_view=False`` turns it off. Under ``local_steps``, the buffers are
    averaged at each round's end, not with a collective at every forward.
    """
    local = {_BUFFER_SYNC: False} if local_steps else {}
    return {"gradient_as_bucket_view": True, **local, **passed}


def stop_buffer_sync(model: nn.Module | None, passed: dict[str, Any]) -> None:
    """Local steps the default started mid-fit: DDP was built syncing buffers at every forward, a collective a step
    that local steps do without (their rounds average the buffers). Turned off on ``model`` unless the user set it in
    ``passed``, the strategy's DDP keyword arguments."""
    asked = _BUFFER_SYNC in passed or "broadcast_buffers" in passed
    if not asked and isinstance(model, DistributedDataParallel) and getattr(model, _BUFFER_SYNC):
        setattr(model, _BUFFER_SYNC, False)
