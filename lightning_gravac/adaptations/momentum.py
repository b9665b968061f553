"""Momentum correction for any method with error feedback: the optimizer's momentum moves before compression.

Error feedback and heavy-ball momentum applied after communication interact badly: what a step does not send comes
back later, and momentum then amplifies the late arrivals (Top-K at 5% density diverges on a small regression with
SGD momentum 0.9, where it converges without momentum). Deep Gradient Compression's remedy, for every method: each
rank keeps its own momentum ``u <- m u + (1 - dampening) (g + wd p)`` and compresses ``u`` (``g + wd p + m u`` with
Nesterov), error feedback accumulating what is not sent; the optimizer, its momentum and weight decay set to 0 for
these parameters, applies the averaged result as a plain SGD step. The average over ranks of the local ``u`` is the
global momentum buffer (the update is linear), so nothing is lost by keeping it per rank.

Exactness: while every step is sent dense, the buffers stay identical on every rank ("in sync") and the update is
made after the all-reduce with the very operations ``torch.optim.SGD`` uses, so training equals stock DDP with SGD
momentum bit for bit. The first compressed step makes them local; a later dense step with no residual pending
brings them back in sync (the averaged ``u`` is the global buffer again), except with Nesterov, whose sent value is
not ``u``.

New buffers are pending until the step is known finite on every rank (as residuals are); a non-finite step leaves
them as they were. On the exact dense path a non-finite step defers the buffers' update to the optimizer's step
(:meth:`MomentumCorrection.apply_deferred`): the user's code between ``backward`` and the step (a callback that zeroes
or cleans non-finite gradients) decides what the momentum takes, as it decides what ``torch.optim.SGD``'s own buffer
takes under stock DDP.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_gravac.adaptations.adaptation import Adaptation, Setup, register_adaptation
from lightning_gravac.compressors.base import all_finite
from lightning_gravac.staged import Staged


def masking_retention(wait: float, momentum: float, nesterov: bool = False, random: bool = False) -> float:
    """The fraction of dense momentum's step that momentum factor masking leaves an entry sent once every ``wait``
    steps on average, in steady state under a constant gradient ``g``.

    Dense heavy-ball momentum applies ``g / (1 - m)`` a step once its buffer has filled. Masked, the buffer restarts
    at each send. Sent every ``T`` steps (an entry of steady size under a magnitude selection), the entry
    accumulates ``sum_k (1 - m^k) / (1 - m) g``, ``k = 1..T``, between two sends: ``r = 1 - m (1 - m^T) / ((1 - m)
    T)`` of dense's ``T g / (1 - m)``. At ``m = 0.9``: 0.61 for ``T = 20``, 0.89 for 80, 0.97 for 320 (Top-K at
    cf 10, 40 and 160 with fp32 values and int32 indices). Sent at random with probability ``1/T`` a step (Random-K),
    the buffer's age is geometric: ``r = (1 - m) / (1 - m + m / T)``. With Nesterov the step is ``g + m u``: ``1 - m
    (1 - r)``. Dampening and weight decay scale both sides alike. 1 without momentum, and for ``T <= 1`` (a factor of
    1 is the dense path, which never masks). A momentum of 0.999 or more has no steady state worth the name: weighed
    as 0.999.
    """
    if wait <= 1 or momentum <= 0:
        return 1.0
    m = min(float(momentum), 0.999)
    if random:
        kept = (1.0 - m) / (1.0 - m + m / wait)
    else:
        kept = 1.0 - m * (1.0 - m**wait) / ((1.0 - m) * wait)
    return 1.0 - m * (1.0 - kept) if nesterov else kept


@dataclass(frozen=True)
class SGDMomentum:
    """The momentum settings of the optimizer's parameter group a parameter belongs to."""

    momentum: float
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


def _warn_sparse_groups(optimizers: Sequence[torch.optim.Optimizer], sparse: frozenset[int]) -> None:
    """Say so where a sparse gradient keeps a whole group's momentum in the optimizer: its dense, compressed
    parameters then have error feedback under the optimizer's momentum, which momentum correction is for."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params = group["params"]
            if group.get("momentum", 0) and any(id(p) in sparse for p in params) and len(params) > 1:
                rank_zero_warn(
                    "GraVACStrategy: an optimizer group holds a sparse embedding (`sparse=True`) and other "
                    "parameters: the whole group keeps its momentum in the optimizer, so its compressed "
                    "gradients get no momentum correction. Give the embedding a parameter group of its own."
                )
                return


@register_adaptation
class MomentumCorrection(Adaptation):
    """Per-parameter momentum buffers kept by the comm hook instead of the optimizer.

    Args:
        masking: momentum factor masking (DGC): restart a buffer from 0 where its entry was just sent exactly (see
            :meth:`mask_` for what it trades).
    """

    name = "momentum"

    def __init__(self, masking: bool = True) -> None:
        super().__init__()
        self.masking = masking
        self.settings: dict[str, SGDMomentum] = {}
        self.buffers: Staged
        self.add_state("buffers", "u", gradient_units=True)  # each rank's own once a step compressed: `_own`
        self._own: set[str] = set()  # parameters whose buffers differ between ranks
        self._optimizers: list[tuple[torch.optim.Optimizer, dict[int, str]]] = []  # those momentum was taken from
        # In-sync buffers whose update waits for the gradient the optimizer will see (a non-finite dense step).
        self._deferred: list[tuple[str, Tensor]] = []

    @override
    def __bool__(self) -> bool:
        return bool(self.settings)

    @property
    @override
    def follows_average(self) -> bool:
        return bool(self)

    @override
    def take_from(self, setup: Setup) -> list[str]:
        """The momentum of every ``torch.optim.SGD`` group whose parameters the hook sends dense
        (:meth:`take_from_optimizer`). Said on rank 0, and where a sparse gradient keeps a whole group's momentum."""
        moved = [name for optimizer in setup.optimizers for name in self.take_from_optimizer(optimizer, setup.names)]
        _warn_sparse_groups(setup.optimizers, setup.sparse)
        if moved:
            rank_zero_info(
                f"GraVACStrategy: momentum correction: the optimizer's momentum (and weight decay) for "
                f"{len(moved)} parameters is applied in the comm hook before compression and set to 0 in the "
                "optimizer. `GraVACStrategy(momentum_correction=False)` leaves the optimizer alone."
            )
        return moved

    def take_from_optimizer(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
        """Move the momentum (and weight decay, which SGD applies before it) of every ``torch.optim.SGD`` group with
        ``momentum > 0`` into the hook, for the parameters in ``names``; set the group's to 0. Returns their names.

        Groups with ``maximize`` or ``fused`` keep their momentum (the hook reproduces neither), and so do groups with
        parameters the hook never sees."""
        if not isinstance(optimizer, torch.optim.SGD):
            return []
        self._optimizers.append((optimizer, names))
        return self._move(optimizer, names)

    def _move(self, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
        moved = []
        for group in optimizer.param_groups:
            if not group.get("momentum", 0) or group.get("maximize") or group.get("fused"):
                continue
            if not all(id(p) in names for p in group["params"]):
                continue
            setting = SGDMomentum(group["momentum"], group["dampening"], group["nesterov"], group["weight_decay"])
            previous = self.settings.get(names[id(group["params"][0])]) if group["params"] else None
            if previous is not None:  # set again: what is 0 in the group is what the hook zeroed, not a new value
                setting = SGDMomentum(
                    setting.momentum,
                    setting.dampening or previous.dampening,
                    setting.nesterov or previous.nesterov,
                    setting.weight_decay or previous.weight_decay,
                )
            for p in group["params"]:
                name = names[id(p)]
                self.settings[name] = setting
                moved.append(name)
                # A buffer the optimizer holds (a stock DDP checkpoint resumed here) is the global one: kept, in sync.
                held = optimizer.state.get(p, {}).pop("momentum_buffer", None)
                if held is not None and name not in self.buffers.kept:
                    self.buffers.kept[name] = held.detach().clone()
            group.update(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)
        return moved

    def refresh(self) -> list[str]:
        """Take back momentum set in the optimizer again since the last step, by a restored optimizer state (a
        checkpoint's param groups) or a momentum schedule (``OneCycleLR``, ``CyclicLR``): its values become the
        hook's and the group's go back to 0, so momentum never applies twice. Returns the parameters it took."""
        return [name for optimizer, names in self._optimizers for name in self._move(optimizer, names)]

    @override
    def saved_groups(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """``state`` (``optimizer.state_dict()``) with the moved settings written back into its param groups, so that a
        checkpoint shows the optimizer the user configured (resumed without the correction, momentum applies again)."""
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            setting = self.settings.get(self._name_of(optimizer, group))
            if setting is not None:
                saved.update(
                    momentum=setting.momentum,
                    dampening=setting.dampening,
                    nesterov=setting.nesterov,
                    weight_decay=setting.weight_decay,
                )
        return state

    def _name_of(self, optimizer: torch.optim.Optimizer, group: dict) -> str:
        names = next((n for o, n in self._optimizers if o is optimizer), {})
        return names.get(id(group["params"][0]), "") if group["params"] else ""

    def mask_(self, residuals: dict[str, Tensor | None]) -> None:
        """Momentum factor masking (DGC), when ``masking`` is on: where an entry was sent exactly (its new residual is
        0), this rank's pending buffer restarts from 0 there, so that stale momentum does not keep pushing a
        coordinate that was just updated. Sparsifiers send entries exactly; quantizers almost never do.

        A trade: without masking the update is heavy-ball momentum delayed by error feedback, faster well inside
        dense's stable learning rates; near the largest rate dense survives it diverged where masking trained. Masking
        stays on: slow training is the milder failure (measurements in ``docs/optimizers.md``)."""
        if not self.masking:
            return
        for name, residual in residuals.items():
            pending = self.buffers.pending.get(name)
            if residual is not None and pending is not None:
                pending.masked_fill_(residual.view_as(pending) == 0, 0.0)

    def masked_settings(self) -> set[SGDMomentum]:
        """The distinct momentum settings that masking restarts (none with masking off or no momentum moved): what a
        decision weighs a factor's loss of momentum by (:func:`masking_retention`). The same on every rank: the
        optimizer's settings are."""
        return set(self.settings.values()) if self.masking else set()

    def in_sync(self, names: Iterable[str]) -> bool:
        """Whether the buffers of ``names`` are identical on every rank (the exact dense path applies)."""
        return not any(name in self._own for name in names)

    @override
    def exact(self, names: Sequence[str]) -> bool:
        return bool(self) and self.in_sync(names)

    def _decayed_(self, name: str, d: Tensor, param: Tensor) -> Tensor:
        decay = self.settings[name].weight_decay
        return d.add_(param.detach().view_as(d), alpha=decay) if decay else d

    @override
    def before_compression_(self, names: list[str], grads: list[Tensor], params: list[Tensor]) -> None:
        if self:
            self.own_direction_(names, grads, params)

    def own_direction_(self, names: list[str], grads: list[Tensor], params: list[Tensor]) -> None:
        """Before compression: each gradient becomes this rank's update direction, in place, from its own buffers.

        The new buffers are written into recycled spares (no allocation once running) and kept pending."""
        for name, grad, param in zip(names, grads, params, strict=True):
            s = self.settings.get(name)
            if s is None:
                continue
            d = self._decayed_(name, grad, param)  # the gradient is overwritten below anyway
            old, spare = self.buffers.kept.get(name), self.buffers.take(name, d)
            if old is None:
                new = spare.copy_(d)
            else:
                new = torch.mul(old, s.momentum, out=spare).add_(d, alpha=1 - s.dampening)
            if s.nesterov:
                grad.add_(new, alpha=s.momentum)
            else:
                grad.copy_(new)
            self.buffers.stage(name, new)
            self._own.add(name)

    def after_dense_(self, names: list[str], averaged: list[Tensor], params: list[Tensor]) -> None:
        """After the all-reduce of plain gradients, with buffers in sync and the step known finite: the averaged
        gradient becomes the update direction in place, with ``torch.optim.SGD``'s own operations in its order
        (``d = g + wd p``; ``buf = clone(d)`` at first, then ``buf = m buf + (1 - dampening) d``; ``d + m buf`` with
        Nesterov, else ``buf``), so the result is bit for bit SGD's. The buffers are updated in place."""
        for name, avg, param in zip(names, averaged, params, strict=True):
            s = self.settings.get(name)
            if s is None:
                continue
            d = self._decayed_(name, avg, param)
            buffer = self.buffers.kept.get(name)
            if buffer is None:
                buffer = self.buffers.kept[name] = torch.clone(d).detach()
            else:
                buffer.mul_(s.momentum).add_(d, alpha=1 - s.dampening)
            if s.nesterov:
                d.add_(buffer, alpha=s.momentum)
            else:
                d.copy_(buffer)

    def defer(self, names: list[str], params: list[Tensor]) -> None:
        """A dense step with buffers in sync came back non-finite: the buffers stay as they are until
        :meth:`apply_deferred` sees the gradients the optimizer is about to apply."""
        self._deferred.extend((name, param) for name, param in zip(names, params, strict=True) if name in self.settings)

    @override
    def settle(
        self,
        names: list[str],
        pending: dict[str, Tensor | None],
        finite: bool,
        averaged: list[Tensor] | None,
        params: list[Tensor],
        exact: bool,
    ) -> None:
        """On the ``exact`` path the averaged gradients become SGD's update direction in place (a non-finite step
        defers that to the gradients the optimizer sees: :meth:`after_closure`); else a finite step keeps the new
        buffers, masked where an entry was sent exactly, and in sync again where a dense step carried no residual."""
        if not finite:
            if exact:
                self.defer(names, params)
            elif self:
                self.buffers.discard(names)
            return
        if exact:
            assert averaged is not None
            self.after_dense_(names, averaged, params)
        elif self:  # nothing moved: no buffer to mask, resync or commit (every bucket of every step)
            self.mask_(pending)
            if averaged is not None and not pending:
                self.resync(names, averaged)
            self.buffers.commit(names)

    @override
    def begin_batch(self) -> None:
        """Momentum set in the optimizer again (a restored checkpoint's param groups, a momentum schedule) is taken
        into the hook, so it never applies twice; what a skipped step deferred is dropped."""
        self.refresh()
        self._deferred.clear()

    @override
    def after_closure(self) -> None:
        self.apply_deferred()

    def apply_deferred(self) -> None:
        """Just before the optimizer's step, after the user's code has seen the gradients: each deferred parameter
        whose gradient is now finite (zeroed or cleaned by the user) takes it into its buffer as ``torch.optim.SGD``
        would (:meth:`after_dense_`, bit for bit); one still non-finite leaves its buffer as it was (the weights then
        take the NaN, as stock SGD's would). Called by the strategy inside the optimizer's step, after the closure."""
        deferred, self._deferred = self._deferred, []
        for name, param in deferred:
            grad = param.grad
            if grad is not None and not grad.is_sparse and all_finite(grad):
                self.after_dense_([name], [grad], [param])

    def resync(self, names: list[str], averaged: list[Tensor]) -> None:
        """After a dense all-reduce of local directions with no residual in them: the average is the global buffer."""
        for name, avg in zip(names, averaged, strict=True):
            pending = self.buffers.pending.get(name)
            if pending is not None and not self.settings[name].nesterov:
                pending.copy_(avg)
                self._own.discard(name)

    @override
    def reset(self) -> None:
        """Drop every buffer (the divergence guard: they hold the accumulation that exploded). With none on any rank
        the buffers are in sync again: the next dense step starts them afresh, as ``torch.optim.SGD`` starts its own."""
        super().reset()
        self._own = set()
        self._deferred.clear()

    @override
    def state_dict(self) -> dict[str, Tensor]:
        """This rank's buffers (``u/<name>``) and whether each is local to it (``local/<name>``)."""
        out = super().state_dict()
        kept = self.buffers.kept
        out.update({f"local/{n}": torch.tensor(n in self._own, device=t.device) for n, t in kept.items()})
        return out

    @override
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        super().load_state_dict(state)
        self._own = {k[6:] for k, t in state.items() if k.startswith("local/") and bool(t)}
        self._deferred.clear()
