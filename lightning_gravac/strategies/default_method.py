"""The method a ``GraVACStrategy`` sends: the one it was given, checked against its other arguments, or when the user
names none, one chosen at setup by the optimizer and the model.

Top-K by default; QSGD under ``torch.optim.SGD`` on a model that is not mostly embedding tables (every entry every
step, unbiased, where Top-K's error feedback delays what it does not send); under an optimizer that scales each
coordinate (Adam, AdamW, RMSprop, Adagrad), the gradient in block codes with error feedback into the optimizer as the
user configured it (the controller sends each step dense, fp16 or the code, whichever the link makes fastest), except on
a model that is mostly embedding tables, whose steps go dense or fp16 by the rows they touched. Decided identically on
every rank (the model and the optimizers' classes are), before any gradient is sent. Measurements in BENCHMARKS.md
and ``docs/optimizers.md``.
"""

from collections.abc import Sequence

import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import nn

from lightning_gravac._validation import choice
from lightning_gravac.adaptations.adam import scales_per_coordinate
from lightning_gravac.compressors.base import Compressor, get_compressor
from lightning_gravac.state import CompressionState
from lightning_gravac.tables import EMBEDDING_SHARE, embedding_share, sparse_parameters

#: The method of ``GraVACStrategy()``, and the ones its zero-argument default sends under SGD, under SGD with clipped
#: gradients and under an optimizer that scales each coordinate (Adam).
DEFAULT_METHOD, SGD_METHOD, CLIPPED_METHOD, ADAM_METHOD = "topk", "qsgd", "int8", "int8"


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
) -> None:
    """Set ``state``'s method for the zero-argument default (no method, controller, ``error_feedback`` or
    ``momentum_masking`` given) by ``optimizers``; ``clips``: the trainer clips the gradients' norm."""
    _method_for_sgd(state, optimizers, module, clips)
    _method_for_adam(state, optimizers, module)


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
) -> None:
    """The block codes with error feedback under an optimizer that scales each coordinate, the optimizer left as it
    is; not where a gradient is sparse (sent as it is) or the model is mostly embedding tables (dense or fp16 steps
    send those by the rows they touched, fewer bytes than a code of the whole table)."""
    if not (optimizers and scales_per_coordinate(optimizers)) or state.local_sgd_from is not None:
        return
    if module is not None and (sparse_parameters(module) or embedding_share(module) >= EMBEDDING_SHARE):
        return
    method = get_compressor(ADAM_METHOD)
    state.use_method(method, error_feedback=True)
    rank_zero_info(
        f"GraVACStrategy: the optimizer is {type(optimizers[0]).__name__}, which scales each coordinate, so the "
        f"default sends the gradient into it unchanged, in {method!r} block codes with error feedback where the link "
        "makes them faster than dense or fp16. `GraVAC(adam='moment')` sends Adam's first moment in signs with its "
        "second moment frozen (1-bit Adam: fewer bytes, a changed optimizer; see docs/optimizers.md)."
    )
