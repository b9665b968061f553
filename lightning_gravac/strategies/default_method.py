"""The method a ``GraVACStrategy`` sends: the one it was given, checked against its other arguments, or when the user
names none, one chosen at setup by the optimizer and the model.

Top-K by default; QSGD under ``torch.optim.SGD`` on a model that is not mostly embedding tables (every entry every
step, unbiased, where Top-K's error feedback delays what it does not send); under Adam or AdamW, its first moment as
scaled signs with error feedback once the second moment is frozen (1-bit Adam's compression). Decided identically on
every rank (the model and the optimizers' classes are), before any gradient is sent. Measurements in BENCHMARKS.md
and ``docs/optimizers.md``.
"""

from collections.abc import Sequence
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import nn

from lightning_gravac._validation import choice
from lightning_gravac.adaptations.adam import adam_groups_supported, why_moments_stay
from lightning_gravac.compressors.base import Compressor, get_compressor
from lightning_gravac.state import CompressionState
from lightning_gravac.tables import EMBEDDING_SHARE, embedding_share, sparse_parameters

#: The method of ``GraVACStrategy()``, and the ones its zero-argument default sends under SGD and, as Adam's first
#: moment, under Adam and AdamW.
DEFAULT_METHOD, SGD_METHOD, ADAM_METHOD = "topk", "qsgd", "efsignsgd"


_GRANULARITIES = ("layer", "bucket")


def method_of(compressor: str | Compressor | None, granularity: str, error_feedback: bool | None) -> Compressor:
    """The method the strategy was given (``None``: :data:`DEFAULT_METHOD`), checked against its other arguments.

    Raises:
        ValueError: for an unknown compressor or granularity, or an ``error_feedback`` or ``granularity`` the method
            does not allow.
    """
    if compressor is None:
        compressor = DEFAULT_METHOD
    if isinstance(compressor, str):
        compressor = get_compressor(compressor)
    elif not isinstance(compressor, Compressor):
        raise ValueError(f"`compressor` must be a compressor name or a Compressor, got {compressor!r}.")
    choice(granularity, "granularity", _GRANULARITIES)
    if error_feedback and compressor.owns_feedback:
        raise ValueError(
            f"`error_feedback=True` with {compressor!r}: the method keeps its own residual, which error feedback "
            "would add a second time. Leave `error_feedback` unset."
        )
    if error_feedback is False and compressor.requires_feedback:
        raise ValueError(f"`error_feedback=False` with {compressor!r}: the method is defined with error feedback only.")
    if granularity == "bucket" and compressor.layerwise:
        raise ValueError(
            f"`granularity='bucket'` with {compressor!r}: the method needs each parameter's shape. "
            "Use granularity='layer'."
        )
    return compressor


def choose_method(
    state: CompressionState,
    optimizers: Sequence[torch.optim.Optimizer],
    module: nn.Module | None,
    trainer: Any,
    movable: bool,
) -> None:
    """Set ``state``'s method for the zero-argument default (no method, controller, ``error_feedback`` or
    ``momentum_masking`` given) by ``optimizers``. ``movable``: whether the optimizer's state may move into the hook
    (``momentum_correction``, no gradient scaler, no local SGD)."""
    _method_for_sgd(state, optimizers, module)
    if movable:
        _method_for_adam(state, optimizers, module, trainer)


def _method_for_sgd(
    state: CompressionState, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module | None
) -> None:
    """QSGD instead of Top-K under ``torch.optim.SGD``, any momentum left in the optimizer, unless most trainable
    parameters are embedding tables."""
    if state.local_sgd_from is not None:
        return
    if not (optimizers and all(isinstance(opt, torch.optim.SGD) for opt in optimizers)):
        return
    share = embedding_share(module) if module is not None else 0.0
    if share >= EMBEDDING_SHARE:
        rank_zero_info(
            f"GraVACStrategy: {share:.0%} of the trainable parameters are embedding tables, whose gradient is "
            "mostly zero rows: the default sends Top-K, which sends those nearly exactly."
        )
        return
    method = get_compressor(SGD_METHOD)
    state.use_method(method, error_feedback=method.error_feedback_default)
    rank_zero_info(
        f"GraVACStrategy: the optimizer is SGD and the gradient dense, so the default sends {method!r}: every "
        "entry every step, unbiased, any momentum staying in the optimizer; a run of the length asked for ends "
        "where dense training would, where Top-K's error feedback delays what it does not send. "
        "`GraVACStrategy('topk')` sends Top-K."
    )


def _method_for_adam(
    state: CompressionState, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module | None, trainer: Any
) -> None:
    """Adam's first moment as scaled signs with error feedback once its second is frozen, where Top-K's few entries a
    step left the moment behind; only where the moments can move (no sparse gradient, supported Adam flags,
    :func:`~lightning_gravac.adaptations.adam.why_moments_stay`)."""
    if (module is not None and sparse_parameters(module)) or not optimizers:
        return
    if not all(adam_groups_supported(opt) for opt in optimizers):
        return
    why = why_moments_stay(module, trainer)
    if why is not None:
        tables = " (its embedding tables by the rows each step touched: the same sum)" if state.rows.rows else ""
        rank_zero_info(
            f"GraVACStrategy: {why}: Adam keeps its moments, and each step is sent dense or in fp16{tables}."
        )
        return
    method = get_compressor(ADAM_METHOD)
    state.use_method(method, error_feedback=True)
    rank_zero_info(
        f"GraVACStrategy: the optimizer is {type(optimizers[0]).__name__}, so the default sends its first "
        f"moment as {method!r} with error feedback once its second moment is frozen (1-bit Adam's scheme), dense "
        "or fp16 before. `GraVACStrategy('fp16')` casts every step instead."
    )
