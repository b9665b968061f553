"""Adam's first moment across the network, its second moment frozen: what lets Adam and AdamW compress.

An error-fed sparse or quantized gradient upsets Adam's per-coordinate normalisation: the second moment squares what
arrives, a delayed and lossy version of the gradient. The second moment settles early, though, and can then be held
(1-bit Adam, Tang et al. 2021): Adam becomes a momentum method with a fixed per-coordinate preconditioner, and
momentum compresses well with error feedback. From the step :attr:`AdamMoments.frozen_from` on:

- in the comm hook, each rank turns its gradient into its own first moment, ``u = b1 m + (1 - b1) g`` (with ``g + wd p``
  under Adam's L2 decay), from the shared ``m`` (the optimizer's ``exp_avg``, identical on every rank), divided by
  Adam's frozen per-coordinate scale ``s = sqrt(v_hat) + eps``: the step's direction. The method compresses ``u / s``
  with error feedback; the average that arrives is the new ``m / s`` (it is linear in ``g``, and ``s`` is the same on
  every rank). Compressing the direction rather than ``u`` keeps each coordinate's compression error in units of its
  own step: a scaled sign gives every coordinate a magnitude, and divided by a tiny ``v_hat`` (an embedding row seldom
  seen) after arrival it would be a huge step;
- at the optimizer's step, the strategy writes ``m`` into ``exp_avg``, holds the bias-corrected second moment where it
  was, and applies AdamW's update (decoupled decay for AdamW); the optimizer's own step skips these parameters.

The optimizer's state keeps torch's keys and meaning: ``exp_avg_sq`` is rescaled each step by
``(1 - b2^t) / (1 - b2^(t-1))``, so that torch's bias correction of it gives the held value, and a checkpoint resumed
without the strategy continues from an ordinary Adam state. Before ``frozen_from`` nothing changes: the optimizer runs
as it would under stock DDP.
"""

import math
from collections.abc import Sequence
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_gravac.adaptations.adaptation import Adaptation, Setup, register_adaptation
from lightning_gravac.tables import EMBEDDING_SHARE, embedding_share

#: Flags of a parameter group under which the optimizer's update is not the one reproduced here.
_UNSUPPORTED = ("amsgrad", "maximize", "differentiable", "capturable", "fused")
#: The share of the run's steps Adam runs unchanged (sent dense or in fp16) before its second moment is frozen.
WARMUP_SHARE = 0.1
#: The warm-up when the run's length is unknown (an iterable data set without a length and no ``max_steps``).
WARMUP_UNKNOWN_BUDGET = 1000


def warmup_steps(budget: float) -> int:
    """Steps of a run of ``budget`` steps before Adam's second moment is frozen: :data:`WARMUP_SHARE` of them, at least
    one (the second moment must exist), :data:`WARMUP_UNKNOWN_BUDGET` when the length is unknown."""
    if not math.isfinite(budget) or budget <= 0:
        return WARMUP_UNKNOWN_BUDGET
    return max(1, math.ceil(WARMUP_SHARE * budget))


def adam_groups_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is ``torch.optim.Adam`` or ``AdamW`` with no group flag whose update differs (AMSGrad,
    maximize, capturable, differentiable, fused): the update :class:`AdamMoments` applies is then the optimizer's."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(group.get(flag) for group in optimizer.param_groups for flag in _UNSUPPORTED)


def scales_per_coordinate(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether one of ``optimizers`` divides each coordinate's step by a running second moment (Adam, AdamW, Adamax,
    NAdam, RAdam, RMSprop, Adagrad, Adadelta), whose normalisation a sparse or quantized gradient upsets."""
    adaptive = (torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta)
    for optimizer in optimizers:
        if isinstance(optimizer, adaptive) or any("betas" in group for group in optimizer.param_groups):
            return True
    return False


def why_moments_stay(module: nn.Module | None, trainer: Any = None) -> str | None:
    """Why Adam's moments cannot move into the hook for ``module``, or ``None``. Lightning clips what the parameters'
    ``.grad`` hold after backward, which are the averaged moments once they move; a model that is mostly embedding
    tables has rows that no warm-up sees, whose frozen second moment is none, and its inactive rows would take a sign's
    noise every step (the embedding bag ended at NaN under AdamW; docs/optimizers.md)."""
    if trainer is not None and trainer.gradient_clip_val:
        return "the trainer clips gradients (`gradient_clip_val`), which would clip Adam's moved moments instead"
    share = embedding_share(module) if module is not None else 0.0
    if share >= EMBEDDING_SHARE:
        return f"{share:.0%} of the trainable parameters are embedding tables, whose rows no warm-up sees all of"
    return None


def _scale(state: dict, group: dict) -> Tensor:
    """Adam's per-coordinate divisor, ``sqrt(v / (1 - b2^t)) + eps``: held constant once the second moment is frozen
    (the stored ``v`` is rescaled with ``t``), computed alike in the hook and at the step.

    A coordinate that saw no gradient before the freeze (an embedding row not yet read) has ``v = 0``: divided by
    ``eps``, its first gradient would be a step of millions. It takes its tensor's typical ``v`` instead (the mean of
    the entries that have one), so that its steps are of the tensor's size, as Adam's first steps on a new
    coordinate are."""
    v = state["exp_avg_sq"]
    unseen = v == 0
    # No host sync (CUDA): a tensor with no entry seen takes 1 (its steps are then the learning rate's size).
    typical = torch.nan_to_num(v.sum() / (~unseen).sum(), nan=1.0)
    v = torch.where(unseen, typical, v)
    bias2 = 1 - group["betas"][1] ** float(state["step"])
    return v.div(bias2).sqrt_().add_(group["eps"])


@register_adaptation
class AdamMoments(Adaptation):
    """Adam's first moment moved into the comm hook, its second moment frozen, from step :attr:`frozen_from` on.

    Which parameters are moved is fixed at setup (:meth:`take_from`); when is decided at fit start
    (:meth:`on_fit_start`) and checkpointed with the strategy, the same on every rank. Until then every step is sent
    whole (:attr:`sends_from`). The hook calls :meth:`own_moment_` on every step from ``frozen_from`` on, the strategy
    :meth:`step_` inside the optimizer's step.
    """

    name = "adam"
    per_rank = False

    def __init__(self) -> None:
        super().__init__()
        #: The first step (counted as ``CompressionState.step``) whose gradients are sent as moments; ``None``: never.
        self.frozen_from: int | None = None
        # name: (optimizer, index of its group, param). The group by index: a restored optimizer state replaces the
        # group dicts (and a scheduler then writes the learning rate into the new ones).
        self._groups: dict[str, tuple[torch.optim.Optimizer, int, Tensor]] = {}
        self._moved: list[str] = []  # this step's parameters whose gradients the hook turned into moments
        # This step's divisor of each moved parameter (`_scale`), computed in the hook from the optimizer's state and
        # used again at the step: one computation a step, from state a checkpoint restores bit for bit.
        self._scales: dict[str, Tensor] = {}
        self._hidden: list[tuple[Tensor, Tensor]] = []  # the gradients `step_` hid from the optimizer's own step

    @override
    def __bool__(self) -> bool:
        return bool(self._groups)

    @property
    @override
    def sends_from(self) -> int | None:
        return self.frozen_from

    @override
    def take_from(self, setup: Setup) -> list[str]:
        """All of ``setup``'s parameters (:meth:`take_from_optimizers`), where the moments can move at all
        (:func:`why_moments_stay`); their second moment is frozen from a step decided at fit start."""
        if why_moments_stay(setup.module, setup.trainer) is not None:
            return []
        return self.take_from_optimizers(list(setup.optimizers), setup.names)

    @override
    def on_fit_start(self, trainer: Any, compresses: bool, controller: str, method: str) -> None:
        """Set, once a run (a resumed run keeps its checkpoint's), the step from which the moments move: after
        :func:`warmup_steps` of the run's length, when the controller compresses at all. Until then every step is sent
        whole (or in fp16, by GraVAC's choice), so that the second moment settles on exact gradients. Said on rank 0."""
        if not (self and compresses) or self.frozen_from is not None:
            return
        self.frozen_from = warmup_steps(float(trainer.estimated_stepping_batches))
        rank_zero_info(
            f"{controller}: the optimizer is Adam-like: its first {self.frozen_from} steps are sent whole "
            "while its second moment settles; then the second moment is frozen and each rank's first moment is "
            f"compressed with {method!r} and error feedback (1-bit Adam's scheme). "
            "`GraVACStrategy(momentum_correction=False)` leaves Adam as it is."
        )

    def take_from_optimizers(self, optimizers: list[torch.optim.Optimizer], names: dict[int, str]) -> list[str]:
        """Take every parameter of ``optimizers`` if all are supported Adam(W) (:func:`adam_groups_supported`) and
        every parameter is one the hook sends dense (named in ``names``): all or nothing, so that no parameter is left
        to an Adam whose gradients are compressed. Returns the names taken."""
        if not optimizers or not all(adam_groups_supported(opt) for opt in optimizers):
            return []
        groups = [(opt, i, group) for opt in optimizers for i, group in enumerate(opt.param_groups)]
        params = [(opt, i, p) for opt, i, group in groups for p in group["params"]]
        if not all(id(p) in names for _, _, p in params):
            return []
        self._groups = {names[id(p)]: (opt, i, p) for opt, i, p in params}
        self._scales = {}
        return list(self._groups)

    @override
    def active(self, step: int) -> bool:
        """Whether the hook sends moments on step ``step`` (``CompressionState.step`` while it runs)."""
        return bool(self._groups) and self.frozen_from is not None and step >= self.frozen_from

    @override
    def direction_(self, names: list[str], grads: list[Tensor], step: int) -> None:
        """Adam's step direction in place of each moved gradient once the second moment is frozen (what is sent, on
        any path)."""
        if self.active(step):
            self.own_moment_(names, grads)

    def own_moment_(self, names: list[str], grads: list[Tensor]) -> None:
        """In the hook, before compression: each moved parameter's gradient becomes this rank's first moment, in
        place. A parameter the optimizer has not stepped yet (no second moment to hold) keeps its gradient and is
        stepped by the optimizer; which those are is the same on every rank (so is the optimizer's state)."""
        for name, grad in zip(names, grads, strict=True):
            entry = self._groups.get(name)
            if entry is None:
                continue
            optimizer, index, param = entry
            group, state = optimizer.param_groups[index], optimizer.state.get(param)
            if not state or "exp_avg_sq" not in state:
                continue
            beta1 = group["betas"][0]
            if group["weight_decay"] and not group.get("decoupled_weight_decay", False):
                grad.add_(param.detach().view_as(grad), alpha=group["weight_decay"])  # Adam's L2 decay, as torch's
            grad.mul_(1 - beta1).add_(state["exp_avg"].view_as(grad), alpha=beta1)
            scale = self._scales[name] = _scale(state, group)
            grad.div_(scale.view_as(grad))
            self._moved.append(name)

    def step_(self) -> list[tuple[Tensor, Tensor]]:
        """Inside the optimizer's step, after the closure: apply the update of every parameter the hook moved this
        step, from the averaged moment in its ``.grad``, and hide that gradient from the optimizer (``.grad`` set to
        ``None``, which torch's Adam skips). Returns ``(param, grad)`` pairs for :meth:`restore`."""
        moved, self._moved = self._moved, []
        hidden = []
        with torch.no_grad():
            for name in moved:
                optimizer, index, param = self._groups[name]
                group, grad = optimizer.param_groups[index], param.grad
                if grad is None:
                    continue
                state = optimizer.state[param]
                beta1, beta2 = group["betas"]
                lr, decay = float(group["lr"]), group["weight_decay"]
                # The averaged moment arrives divided by Adam's scale (see `local_`): the first moment is it times
                # the scale, the step is it times the learning rate.
                torch.mul(grad.view_as(param), self._scales.pop(name), out=state["exp_avg"])
                state["step"] += 1
                t = float(state["step"])
                state["exp_avg_sq"].mul_((1 - beta2**t) / (1 - beta2 ** (t - 1)))  # the bias-corrected value held
                if decay and group.get("decoupled_weight_decay", False):
                    param.mul_(1 - lr * decay)
                param.add_(grad.view_as(param), alpha=-lr / (1 - beta1**t))
                hidden.append((param, grad))
                param.grad = None
        return hidden

    @staticmethod
    def restore(hidden: list[tuple[Tensor, Tensor]]) -> None:
        """Give the hidden gradients back (DDP's bucket views stay the parameters' gradients)."""
        for param, grad in hidden:
            param.grad = grad

    @override
    def after_closure(self) -> None:
        self._hidden.extend(self.step_())

    @override
    def after_step(self) -> None:
        hidden, self._hidden = self._hidden, []
        self.restore(hidden)

    @override
    def begin_batch(self) -> None:
        """A new step began without the optimizer stepping (a skipped step): nothing moved is applied."""
        self._moved.clear()
        self._scales.clear()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self.frozen_from is None else {"frozen_from": self.frozen_from}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.frozen_from = state.get("frozen_from")
        self._moved.clear()
        self._scales.clear()
