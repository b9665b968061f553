"""The method a ``GraVACStrategy`` sends: the one it was given, checked against its other arguments, or when the user
names none, one chosen at setup by the optimizer and the model.

Top-K by default; QSGD under ``torch.optim.SGD`` on a model that is not mostly embedding tables (every entry every
step, unbiased, where Top-K's error feedback delays what it does not send), 8-bit block codes with error feedback where
the trainer clips gradients; under an optimizer that scales each coordinate (Adam, AdamW, RMSprop, Adagrad), no
method: the controller sends each step dense or fp16 (:data:`ADAM_POLICY`), the optimizer exact. Decided identically
on every rank (the model and the optimizers' classes are), before any gradient is sent. The rules in one table:
``docs/default.md``; measurements in BENCHMARKS.md.
"""

from collections.abc import Sequence

import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import nn

from lightning_gravac._validation import choice
from lightning_gravac.adaptations.adam import scales_per_coordinate
from lightning_gravac.callbacks.gravac.hold import AdamPolicy
from lightning_gravac.compressors.base import Compressor, get_compressor
from lightning_gravac.state import CompressionState
from lightning_gravac.tables import EMBEDDING_SHARE, embedding_share

#: The method of ``GraVACStrategy()``, and the ones its zero-argument default sends under SGD and under SGD with
#: clipped gradients.
DEFAULT_METHOD, SGD_METHOD, CLIPPED_METHOD = "topk", "qsgd", "int8"
#: What the default's controller sends under an optimizer that scales each coordinate: dense or fp16 by the link
#: (GraVAC's ``adam`` policy), Adam exact; ``int8`` missed an MLP regression under AdamW by 1.5% (BENCHMARKS.md).
ADAM_POLICY: AdamPolicy = "fp16"


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
    state: CompressionState, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module | None, clips: bool
) -> bool:
    """Set ``state``'s method for the zero-argument default (no method, controller, ``error_feedback`` or
    ``momentum_masking`` given) by ``optimizers``; ``clips``: the trainer clips the gradients' norm. Returns whether
    the controller is to hold the optimizer exact (:data:`ADAM_POLICY`)."""
    _method_for_sgd(state, optimizers, module, clips)
    return _method_for_adam(state, optimizers, module)


def _method_for_sgd(
    state: CompressionState, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module | None, clips: bool
) -> None:
    """QSGD instead of Top-K under ``torch.optim.SGD``, any momentum left in the optimizer, unless most trainable
    parameters are embedding tables; with clipped gradients, 8-bit block codes with error feedback (a clip shortens
    QSGD's noisy average, and rounds of local steps lost there; 4-bit codes came within 1% of dense only at the end of
    a long run: BENCHMARKS.md), held against dense and fp16 by the link, without local steps."""
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
    if clips:
        method = get_compressor(CLIPPED_METHOD)
        state.use_method(method, error_feedback=True)
        rank_zero_info(
            f"GraVACStrategy: the optimizer is SGD and the trainer clips the gradients' norm, so the default sends "
            f"{method!r} block codes with error feedback every step (dense or fp16 where the link makes those faster), "
            "each entry within half a level of its block's largest: QSGD's noisier average would be clipped shorter, "
            "and rounds of local steps are not taken."
        )
        return
    method = get_compressor(SGD_METHOD)
    state.use_method(method, error_feedback=method.error_feedback_default)
    rank_zero_info(
        f"GraVACStrategy: the optimizer is SGD and the gradient dense, so a step it compresses sends {method!r}: every "
        "entry every step, unbiased, any momentum staying in the optimizer; a run of the length asked for ends "
        "where dense training would, where Top-K's error feedback delays what it does not send. "
        "`GraVACStrategy('topk')` sends Top-K."
    )


def _method_for_adam(
    state: CompressionState, optimizers: Sequence[torch.optim.Optimizer], module: nn.Module | None
) -> bool:
    """Whether the optimizer scales each coordinate: the default's controller then holds it exact (dense or fp16 by the
    link, :data:`ADAM_POLICY`), said here."""
    if not (optimizers and scales_per_coordinate(optimizers)) or state.local_sgd_from is not None:
        return False
    tables = " (embedding tables by the rows each step touched: the same sum)" if state.rows.rows else ""
    rank_zero_info(
        f"GraVACStrategy: the optimizer is {type(optimizers[0]).__name__}, which scales each coordinate, so the "
        f"default sends the gradient into it unchanged, each step dense or whole in fp16{tables}, whichever the "
        "measured link makes faster. `GraVACStrategy('int8')` sends 8-bit block codes instead (3.9x fewer bytes; "
        "see docs/optimizers.md for what they were measured to cost)."
    )
    return True
