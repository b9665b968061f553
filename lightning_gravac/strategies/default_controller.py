"""The compression controller a ``GraVACStrategy`` runs with when the trainer has none, and the check that it has at
most one."""

from typing import Any

import pytorch_lightning as pl
import torch
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn
from pytorch_lightning.callbacks import Callback, Checkpoint

from lightning_gravac._flavours import mixed_up, other
from lightning_gravac.adaptations import LocalSteps
from lightning_gravac.callbacks.controller import Controller, controllers_of
from lightning_gravac.callbacks.gravac import GraVAC
from lightning_gravac.callbacks.static import Static
from lightning_gravac.compressors.base import Compressor
from lightning_gravac.state import CompressionState
from lightning_gravac.strategies.default_method import ADAM_POLICY


def attach_controller(trainer: Any, method: Compressor, alone: bool, local_steps: LocalSteps | None = None) -> bool:
    """Check that ``trainer`` has at most one controller, and add the default when it has none: GraVAC with its
    defaults, or a ``Static`` one where there is no factor to choose (one process, a method that sends the gradient
    unchanged, or one whose size its encoding fixes, ``local_steps``, whose steps send nothing and whose rounds'
    code their configuration fixes). ``alone``: the trainer runs one process. Returns whether the default was added.

    Raises:
        ValueError: when the trainer has several controllers, or a callback of the other Lightning package.
    """
    # A callback of the other flavour is not found among the controllers: it would run beside a default one.
    given: list[object] = trainer.callbacks  # set by the callback connector
    if stray := next((c for c in given if not isinstance(c, pl.Callback)), None):
        raise mixed_up(type(stray).__name__, other(pl.__name__))
    controllers = controllers_of(trainer)
    if len(controllers) > 1:
        names = ", ".join(type(c).__name__ for c in controllers)
        raise ValueError(
            f"GraVACStrategy takes one compression controller, the trainer has {len(controllers)}: {names}. Keep one."
        )
    if controllers and alone and not (isinstance(controllers[0], Static) and controllers[0].cf == 1):
        rank_zero_warn(
            f"GraVACStrategy runs on one process: nothing crosses a network, so {controllers[0]!r} saves no time; "
            "its compression only changes the training, as it would on several processes. Give the Trainer "
            "`devices=2` or more (or `num_nodes`) to communicate less."
        )
    if controllers:
        return False
    if local_steps is not None:  # a controller at cf 1 only reports: the line says what the rounds send
        default: Controller = Static(cf=1)
        rank_zero_info(f"GraVACStrategy: no controller among the callbacks; {_rounds_said(local_steps, method)}.")
    else:
        default = _default_controller(method, alone)
        rank_zero_info(f"GraVACStrategy: no controller among the callbacks, using {default!r}.")
    # Before the checkpoint callbacks, which Lightning has already moved last: a checkpoint then holds the step's
    # decisions, and a `ModelCheckpoint(monitor="gravac/...")` sees the step's values.
    # `Trainer.callbacks` is public but assigned by Lightning's connector, invisible to type checkers.
    callbacks: list[Callback] = trainer.callbacks
    first_checkpoint = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
    callbacks.insert(first_checkpoint, default)
    return True


def _rounds_said(rounds: LocalSteps, method: Compressor) -> str:
    """What local steps send, in a few words: the rounds' length and the code of each round's change."""
    code = "whole" if rounds.cf <= 1 or method.passthrough else f"in {method.name!r} codes at cf {rounds.cf:g}"
    late = ", one round late" if rounds.overlap else ""
    each = f"each round's change averaged {code}{late}"
    return f"local steps in rounds of {rounds.every}, {each} (nothing is sent within a round)"


def _default_controller(method: Compressor, alone: bool) -> Controller:
    """A method that sends the gradient unchanged has no factor to choose: a controller at cf 1 only reports. One whose
    size is fixed by its encoding (a cast, signs) is held there: a search would only ask for factors it clamps."""
    if alone:
        rank_zero_info(
            "GraVACStrategy runs on one process: nothing crosses a network, so the gradients are sent dense "
            "(cf 1), as compressing would save nothing. Pass a controller (e.g. `callbacks=[Static(cf=100)]`) "
            "to see a factor's effect on accuracy."
        )
        return Static(cf=1)
    if method.passthrough:
        return Static(cf=1)
    if method.fixed_cf:
        # Never above the model's largest trainable tensor (a factor the controller checks, and a cast ignores):
        # fitted at setup, when the model exists (also one built in `configure_model`).
        return Static(cf=method.fixed_cf, cap_to_model=True)
    return GraVAC()


def allow_rounds(trainer: Any, state: CompressionState, optimizers: list[Any]) -> None:
    """Let the default controller switch to local steps (:mod:`~lightning_gravac.callbacks.gravac.rounds`) where they
    were measured to keep dense's accuracy: the zero-argument default under SGD (QSGD, or Top-K on a model that is
    mostly embedding tables; one optimizer, nothing of it moved into the hook), on several ranks."""
    if state.compressor.name not in ("qsgd", "topk") or state.carry.moves_optimizer_state or len(optimizers) != 1:
        return
    if not isinstance(optimizers[0], torch.optim.SGD) or state.world_size < 2:
        return
    for controller in controllers_of(trainer):
        if isinstance(controller, GraVAC):
            controller.rounds.allowed = True


def hold_exact(trainer: Any) -> None:
    """Have the default's controller hold an optimizer that scales each coordinate exact: each step dense or fp16 by
    the link (:data:`~lightning_gravac.strategies.default_method.ADAM_POLICY`), said by the default's own line."""
    for controller in controllers_of(trainer):
        if isinstance(controller, GraVAC):
            controller.hold.policy, controller.hold.said = ADAM_POLICY, True
