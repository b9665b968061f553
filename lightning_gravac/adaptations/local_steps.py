"""Local steps with a compressed outer update: each rank takes ``every`` steps of the user's optimizer on its own
batches with nothing sent, then the ranks' parameter changes are compressed, averaged and applied by an outer step.

Within a round nothing crosses the network (the comm hook sends nothing). At the round's end each rank's change
since the round began, ``delta_i = anchor - x_i`` (a pseudo-gradient: it points where a gradient does), is compressed
by the strategy's method, with error feedback for a biased one, and averaged over ranks; the outer step moves the
anchor, ``anchor <- anchor - lr (avg + momentum terms)``, and every rank continues from it. At ``lr = 1`` without
momentum the outer step is the average of the ranks' parameters (post-local SGD) up to the compression; DiLoCo's
outer Nesterov step is ``lr=0.7, momentum=0.9, nesterov=True``. The inner optimizer's state stays each rank's own.

An embedding table (``nn.Embedding``, ``nn.EmbeddingBag`` with a dense gradient, untied) changes only in the rows
its round's batches looked up (under plain SGD; with momentum, also those a past step touched): a compressed round
sends each table by the rows some rank changed (which rows, one small all-reduce), the rest of its change exactly
zero on every rank. A table under weight decay, which moves every row, goes whole.

A round also ends at the last step of the budget (``max_steps``), at the last batch of a training epoch and when the
fit ends, so that the model a checkpoint or a validation at those points sees is the ranks' common one; with error
feedback the fit's last round goes with the residual in 8-bit block codes, what they leave (1/254 of a block's
largest entry at most) dropped, a quarter of the bytes of sending them whole. A
non-finite inner step is skipped on the rank that saw it (its parameters and optimizer state stay as they were;
no other rank saw its gradient).

Local steps can diverge where synchronous steps do not: each rank steps on its own batch, noisier than the ranks'
mean, at a learning rate tuned for the mean. A round the guard (:mod:`~lightning_gravac.adaptations.round_guard`)
finds diverged is undone: every rank goes back to the round's start, its parameters and its own inner optimizer state
(kept at each round's start: one more copy of the optimizer's state), error feedback's residual and the outer momentum
dropped. The next ``cooldown`` steps (doubled at each further trigger) are synchronous: each step's change averaged
whole, as a step of stock DDP averages its gradient; then the rounds go on. A run that cannot go on stops with
:class:`~lightning_gravac.adaptations.round_guard.LocalStepsDiverged` on every rank.
"""

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from lightning_gravac.adaptations.adaptation import Adaptation, Setup, register_adaptation
from lightning_gravac.adaptations.mid_round import MidRound
from lightning_gravac.adaptations.outer_exchange import OuterExchange, split_like
from lightning_gravac.adaptations.round_guard import RoundGuard
from lightning_gravac.compressors.base import Compressor, Pattern, all_finite
from lightning_gravac.staged import Staged
from lightning_gravac.tables import RowTables


@dataclass(frozen=True)
class LocalSteps:
    """How local steps run: pass to ``GraVACStrategy(local_steps=...)`` (an ``int`` is ``LocalSteps(every=int)``).

    Args:
        every: inner steps a round (``H``); the outer update follows each round.
        cf: the compression factor of the outer update (8: QSGD's 4-bit codes from fp32; 1 sends it whole). A block
            code (``int8``, ``int4``, ``int2``) sends at the factor its width fixes, unless ``cf`` is 1.
        lr: the outer step's learning rate (1: the anchor moves by the averaged change).
        momentum: the outer step's momentum (0: none).
        nesterov: Nesterov's form of the outer momentum (DiLoCo's outer step: ``lr=0.7, momentum=0.9``).
        overlap: send a round's change while the next round computes, and apply it one round late (Streaming
            DiLoCo's overlap): each rank then continues from the outer step plus its own progress since.
        guard: a round whose ranks' mean training loss is above this many times the lowest round's is undone (see
            the module's docstring); ``None``: no round is undone, and no optimizer state kept for it. 4x, the
            divergence guard's ratio for its loss: a few hard batches in a row lift a loss past twice its lowest.
        cooldown: the synchronous steps after a round is undone (doubled at each further one).

    Raises:
        ValueError: for a round shorter than one step, a factor below 1, a learning rate that is not positive, a
            momentum outside ``[0, 1)``, a guard not above 1 or a cooldown below one step.
    """

    every: int = 16
    cf: float = 8.0
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False
    overlap: bool = False
    guard: float | None = 4.0
    cooldown: int = 100

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"`LocalSteps.every` must be a whole number >= 1, got {self.every!r}.")
        if not (math.isfinite(self.cf) and self.cf >= 1):
            raise ValueError(f"`LocalSteps.cf` must be a finite number >= 1, got {self.cf!r}.")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"`LocalSteps.lr` must be a positive number, got {self.lr!r}.")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"`LocalSteps.momentum` must be in [0, 1), got {self.momentum!r}.")
        if self.guard is not None and not (math.isfinite(self.guard) and self.guard > 1):
            raise ValueError(f"`LocalSteps.guard` must be a finite number > 1 or None, got {self.guard!r}.")
        if isinstance(self.cooldown, bool) or not isinstance(self.cooldown, int) or self.cooldown < 1:
            raise ValueError(f"`LocalSteps.cooldown` must be a whole number >= 1, got {self.cooldown!r}.")


@register_adaptation
class OuterUpdate(Adaptation):
    """The rounds of local steps and their outer update (see the module's docstring); inactive unless configured.

    The round and its outer step are this part's: the anchor (the ranks' common parameters at the round's start) and
    the outer momentum, the same on every rank, and with overlap this rank's parameters as the round began, by
    parameter name. It composes the parts that own the rest: the exchange (:class:`OuterExchange`: the residual, the
    averaging in flight), the guard (:class:`RoundGuard`: its decisions and counts, the round's loss so far) and this
    rank's own round (:class:`MidRound`: the inner optimizer's state as the round began, and what a checkpoint carries
    mid-round).
    """

    name = "outer"
    per_rank = True

    def __init__(self) -> None:
        super().__init__()
        self.config: LocalSteps | None = None
        self.anchor: Staged
        self.velocity: Staged
        self.began: Staged
        # Changes of parameters, not gradients: a gradient scaler leaves them alone; the controller's divergence guard
        # drops the residual and the outer momentum, and the round goes on (a round undone drops them too).
        self.add_state("anchor", "anchor", reset=False)
        self.add_state("velocity", "velocity")
        self.add_state("began", "began", reset=False)  # with overlap: this rank's parameters as the round began
        self.since = 0  # inner steps taken in the current round
        self.rounds = 0  # rounds ended: seeds the method's draws
        self.sent_steps = 0  # the steps the last change sent covers (a round's inner steps; 1 a step of a hold)
        self.budget = 0  # the fit's last step (``max_steps``), 0 when none
        self.steps = 0  # inner steps taken in the fit (Lightning's global step)
        self.epoch_ends: Callable[[], bool] = _never  # set at fit start (module-level defaults: the strategy pickles)
        self.exchange = OuterExchange()  # sends each round's change and lands the ranks' mean
        self.guard = RoundGuard()  # undoes a round that diverged; stops a run that cannot go on
        self.mid_round = MidRound()  # this rank's own round: what the guard's undo and a checkpoint mid-round need
        self._step_loss: Tensor | None = None  # the closure's loss this step (:meth:`take_loss`)
        self._params: dict[str, nn.Parameter] = {}
        self._buffers: list[Tensor] = []  # floating buffers (running statistics): averaged whole at each round's end

    def configure(self, config: LocalSteps, compressor: Compressor, error_feedback: bool) -> None:
        """Run local steps as ``config`` says, sending the outer update with ``compressor``.

        Raises:
            ValueError: for a method whose payloads need several rounds (PowerSGD) or keep a momentum of their own
                (DGC): the outer update is one flat tensor sent once a round.
        """
        if compressor.communication is Pattern.ROUNDS or compressor.owns_feedback:
            raise ValueError(
                f"Local steps send the outer update with a one-round method; {compressor.name!r} is not one. Use "
                "'qsgd' (the default), 'topk', 'randomk', 'signsgd', 'onebit', 'fp16' or 'none'."
            )
        self.config = config
        fixed = compressor.fixed_cf if compressor.near_exact and config.cf > 1 else None  # a block code's own factor
        self.exchange.configure(compressor, fixed or config.cf, error_feedback)
        self.guard.configure(config.guard, config.cooldown)

    @property
    def compressor(self) -> Compressor | None:
        """The method the outer update is sent with (``None`` before :meth:`configure`)."""
        return self.exchange.compressor

    @property
    def error_feedback(self) -> bool:
        """Whether the outer update is error-fed."""
        return self.exchange.error_feedback

    @property
    def bytes_sent(self) -> int:
        """This fit's outer updates, as each rank put them into the collectives."""
        return self.exchange.bytes_sent

    @property
    def cf(self) -> float:
        """The factor the current round's change goes at: the code's (``LocalSteps.cf``), 1 where it goes whole (a
        factor of 1, a method that sends its input as it is, a step of the guard's hold)."""
        return self.exchange.cf if self.exchange.compresses and not self.guard.holding else 1.0

    @property
    def sent_cf(self) -> float:
        """The factor the last change sent went at (1: whole)."""
        return self.exchange.sent_cf

    @property
    def sent(self) -> Callable[[int, bool], None]:
        """Told of each outer update's bytes and whether they were gathered (the strategy records them as a step's)."""
        return self.exchange.sent

    @sent.setter
    def sent(self, record: Callable[[int, bool], None]) -> None:
        self.exchange.sent = record

    @property
    def tables(self) -> RowTables:
        """The embedding tables a compressed round sends by the rows some rank changed (the strategy's)."""
        return self.exchange.tables

    @tables.setter
    def tables(self, tables: RowTables) -> None:
        self.exchange.tables = tables

    @override
    def __bool__(self) -> bool:
        return self.config is not None

    def start(self, config: LocalSteps, compressor: Compressor, error_feedback: bool, steps: int) -> None:
        """From the next step on, run local steps as ``config`` says (the default's choice mid-fit, once every rank's
        parameters are one after ``steps`` steps): the round starts from the parameters as they are."""
        self.configure(config, compressor, error_feedback)
        self.steps, self.since = steps, 0
        self._set_anchor()
        self._round_begins()

    @override
    def take_from(self, setup: Setup) -> list[str]:
        if len(setup.optimizers) != 1:
            if self.config is not None:
                raise ValueError(f"Local steps run one optimizer; the model configures {len(setup.optimizers)}.")
            return []
        assert setup.module is not None
        optimizer = setup.optimizers[0]
        self._params = {name: p for name, p in setup.module.named_parameters() if p.requires_grad}
        self._buffers = [b for b in setup.module.buffers() if b.is_floating_point()]
        self.exchange.take_from(self._params, optimizer)
        self.mid_round.take_from(self._params, optimizer)
        device = next(iter(self._params.values())).device if self._params else torch.device("cpu")
        self.guard.to(device)
        return []

    def begin_fit(self, steps: int, budget: int, epoch_ends: Callable[[], bool]) -> None:
        """At fit start, after Lightning restored a checkpoint: the global step, the budget and how to tell an
        epoch's last batch; a resumed rank takes back its own parameters and inner state."""
        self.steps, self.budget, self.epoch_ends = steps, max(budget, 0), epoch_ends
        if self.config is None:
            return
        if self.mid_round.resumed:
            self.mid_round.restore_rank()
        if not self.anchor.kept:
            self._set_anchor()
            self._round_begins()

    def take_loss(self, loss: Any) -> None:
        """What the step's closure returned (Lightning's: its training loss; ``None`` under manual optimization): the
        round's loss counts it if the step steps. The strategy's closure is wrapped (:meth:`watching`), so the loss is
        seen however the step runs it (under fp16's gradient scaler, the precision plugin calls it before the
        optimizer's step)."""
        self._step_loss = loss if isinstance(loss, Tensor) and loss.numel() == 1 else None

    def watching(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The optimizer step's ``closure``, handing what it returns to :meth:`take_loss` under local steps (their
        guard watches the training loss); as it is without them."""
        if not self:
            return closure

        def closure_seen() -> Any:
            result = closure()
            self.take_loss(result)
            return result

        return closure_seen

    @override
    def after_closure(self) -> None:
        loss, self._step_loss = self._step_loss, None
        if self.config is None:  # every step communicates: the hook handles a non-finite step
            return
        grads = [p.grad for p in self._params.values() if p.grad is not None and p.grad.numel()]
        # Each gradient's least and largest entries: NaN propagates into them, an infinity is one of them. An exact
        # test in one pass without allocating, where `isfinite(g).all()` fills a gradient-sized mask.
        # One host sync a step (on CUDA): whether to step is decided on the host.
        if grads and not bool(torch.isfinite(torch.stack([m for g in grads for m in torch.aminmax(g)])).all()):
            rank = dist.get_rank() if dist.is_initialized() else 0
            warnings.warn(f"Local steps: a non-finite gradient on rank {rank}, which skips this step.", stacklevel=1)
            for p in self._params.values():
                p.grad = None  # the optimizer skips a parameter without a gradient: nothing of it is applied
        else:
            self.guard.stepped(loss)

    @override
    def after_step(self) -> None:
        if self.config is None:
            return
        self.steps += 1
        if self.guard.hold():  # after a round undone: each step's change averaged whole
            self.end_round(whole=True, drain=True, synchronous=True)
            return
        self.since += 1
        last = self.budget > 0 and self.steps >= self.budget
        epoch_ends = self.epoch_ends()
        if self.since >= self.config.every or last or epoch_ends:
            self.end_round(final=last, drain=last or epoch_ends)

    def finish(self) -> None:
        """The fit ends: a round begun, one in flight, or a residual error feedback still holds (a fit that ended at an
        epoch's end, its last round closed there) is closed, the residual sent with it (an unbiased code leaves nothing
        owed). Every rank holds a residual alike: each compressed round leaves one on every rank."""
        owed = self.error_feedback and bool(self.exchange.residual.kept)
        if self.config is not None and (self.since > 0 or self.exchange.in_flight or owed):
            self.end_round(final=True, drain=True)

    def end_round(
        self, whole: bool = False, drain: bool = False, synchronous: bool = False, final: bool = False
    ) -> None:
        """End a round; every rank calls it (collectives). Each rank's change over the round is compressed and
        averaged, the outer step taken, and the next round starts from it; with ``overlap``, the change is sent while
        the next round computes and applied at its end, each rank then rebased on the outer step. ``whole``: the
        change and the residual sent uncompressed; ``drain`` (or ``whole``, ``final``): nothing left in flight, every
        rank on the common parameters; ``synchronous``: a step of the hold after a round undone, averaged as it is;
        ``final``: the fit's last round, error feedback's residual sent with it (:meth:`OuterExchange.send`)."""
        assert self.config is not None
        overlap = self.config.overlap and not (whole or drain or final)
        with torch.no_grad():
            loss = self.guard.close(1 if synchronous else self.since, synchronous)
            applied = self._outer_step(self.exchange.take()) if self.exchange.in_flight else True
            if not applied and self.config.guard is None:  # the round in flight is lost; this one goes on
                self.guard.lost()
                applied = True
            if not applied or self.guard.diverged(loss):
                self._undo(loss)
            else:
                # A round with a change in flight began at `began` (its own progress is measured from there), which the
                # outer step just taken leaves as it was; any other began at the anchor.
                starts = self.began.kept or self.anchor.kept
                self.sent_steps = 1 if synchronous else self.since
                for names in self._groups():
                    delta = self.exchange.change(names, starts)
                    if overlap:
                        self._rebase(names, delta)
                    del delta  # the exchange holds it, and lets it go once sent where nothing else needs it
                    self.exchange.send(names, whole, self.rounds, final=final)
                if not overlap:
                    if self._outer_step(self.exchange.take(), plain=synchronous):
                        self.began.clear()
                        for name, p in self._params.items():
                            p.copy_(self.anchor.kept[name])
                    else:
                        self._undo(None)
            self._average_buffers()
            if not self.guard.holding:  # a round begins next (a hold's steps keep the state its last one leaves)
                self._round_begins()
        self.guard.ended()
        self.since = 0
        self.rounds += 1

    def _rebase(self, names: list[str], delta: Tensor) -> None:
        """With overlap, ``names`` rebased on the outer step just taken, each rank's own progress (``delta``, its
        change over the round) kept, and held as the next round's start."""
        for name, part in zip(names, split_like(delta, [self._params[n] for n in names]), strict=True):
            torch.sub(self.anchor.kept[name], part, out=self._params[name])
            self._hold(self.began, name, self._params[name])

    def _undo(self, loss: float | None) -> None:
        """Every rank back at the round's start (the anchor; its own inner optimizer state as the round began), the
        residual and the outer momentum dropped, and the next steps synchronous (``cooldown``, doubled each time)."""
        assert self.config is not None
        for name, p in self._params.items():
            p.copy_(self.anchor.kept[name])
        self.began.clear()
        if self.config.guard is None:
            self.guard.lost()
            return
        self.mid_round.restore()
        self.reset()  # the residual and the outer momentum
        self.guard.undo(loss, self.steps)

    def _groups(self) -> list[list[str]]:
        """The parameters' names by dtype: one flat tensor each."""
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, p in self._params.items():
            by_dtype.setdefault(p.dtype, []).append(name)
        return list(by_dtype.values())

    def _average_buffers(self) -> None:
        """Floating buffers averaged whole: DDP does not sync them at each forward in this mode (the strategy sets
        ``forward_sync_buffers=False``)."""
        if self._buffers and dist.is_initialized():
            flat = torch.cat([b.reshape(-1).double() for b in self._buffers])
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            for b, mean in zip(self._buffers, split_like(flat, self._buffers), strict=True):
                b.copy_(mean)

    def _outer_step(self, averaged: dict[str, Tensor], plain: bool = False) -> bool:
        """``anchor <- anchor - lr * update``, with the outer momentum where asked (``plain``: the average itself);
        identical on every rank. Whether it was taken: a non-finite average leaves the anchor where it was."""
        assert self.config is not None
        if not all(all_finite(a) for a in averaged.values()):
            return False
        lr, mu = (1.0, 0.0) if plain else (self.config.lr, self.config.momentum)
        for name, change in averaged.items():
            update = change
            if mu > 0:
                velocity = self.velocity.kept.get(name)
                update, self.velocity.kept[name] = outer_momentum(change, velocity, mu, self.config.nesterov)
            self.anchor.kept[name].sub_(update, alpha=lr)
        return True

    def _set_anchor(self) -> None:
        for name, p in self._params.items():
            self._hold(self.anchor, name, p)

    @staticmethod
    def _hold(staged: Staged, name: str, value: Tensor) -> None:
        """Keep a copy of ``value`` as ``staged``'s ``name``, written over the one kept (or a freed one) where it fits:
        a round's end allocates no parameter-sized tensor to keep."""
        held = staged.kept.get(name)
        if held is None or held.shape != value.shape or held.dtype != value.dtype or held.device != value.device:
            held = staged.take(name, value)
        staged.kept[name] = held.copy_(value)

    def _round_begins(self) -> None:
        """A round begins: this rank's inner optimizer state kept for the guard to undo it (nothing without it)."""
        if self.config is not None and self.config.guard is not None:
            self.mid_round.keep()

    @override
    def reset(self) -> None:
        self.velocity.load({})  # let go, not kept as spares: the velocity is never written into a freed tensor
        self.exchange.reset()

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.config is None:
            return {}
        state = {**self.exchange.state_dict(), **super().state_dict()}
        state["since"] = torch.tensor(self.since)
        state["rounds"] = torch.tensor(self.rounds)
        state.update(self.guard.state_dict())
        state.update(self.mid_round.state_dict())
        return state

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.exchange.load_state_dict(state)
        self.since = int(state["since"]) if "since" in state else 0
        self.rounds = int(state["rounds"]) if "rounds" in state else 0
        self.guard.load_state_dict(state)
        self.mid_round.load_state_dict(state)


def outer_momentum(change: Tensor, velocity: Tensor | None, momentum: float, nesterov: bool) -> tuple[Tensor, Tensor]:
    """SGD's momentum on an outer step's averaged ``change``: the update and the velocity (the change itself at the
    first round, ``velocity`` updated in place after; Nesterov's update where asked)."""
    if velocity is None:
        velocity = change.clone()
    else:
        velocity.mul_(momentum).add_(change)
    return (change.add(velocity, alpha=momentum) if nesterov else velocity), velocity


def _never() -> bool:
    return False
