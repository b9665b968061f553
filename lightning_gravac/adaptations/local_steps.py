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
feedback the fit's last round is sent whole (its change and the residual), so nothing is left unsent. A
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

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from lightning_gravac.adaptations.adaptation import Adaptation, Setup, register_adaptation
from lightning_gravac.adaptations.round_guard import RoundGuard
from lightning_gravac.compressors.base import Compressor, Pattern, Payload, all_finite
from lightning_gravac.compressors.packing import Layout
from lightning_gravac.staged import Staged
from lightning_gravac.tables import ByRows, RowTables, row_mask, set_rows


@dataclass(frozen=True)
class LocalSteps:
    """How local steps run: pass to ``GraVACStrategy(local_steps=...)`` (an ``int`` is ``LocalSteps(every=int)``).

    Args:
        every: inner steps a round (``H``); the outer update follows each round.
        cf: the compression factor of the outer update (8: QSGD's 4-bit codes from fp32; 1 sends it whole).
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

    State: the anchor (the ranks' common parameters at the round's start), the outer momentum and the guard's counts,
    the same on every rank; error feedback's residual, the round's loss so far, the inner optimizer state as the round
    began (with the guard) and, in a checkpoint, this rank's parameters and inner optimizer state mid-round, its own.
    All by parameter name.
    """

    name = "outer"
    per_rank = True

    def __init__(self) -> None:
        super().__init__()
        self.config: LocalSteps | None = None
        self.compressor: Compressor | None = None
        self.error_feedback = False
        self.anchor: Staged
        self.velocity: Staged
        self.residual: Staged
        self.began: Staged
        self.landed: Staged
        # Changes of parameters, not gradients: a gradient scaler leaves them alone; the controller's divergence guard
        # drops the residual and the outer momentum, and the round goes on (a round undone drops them too).
        self.add_state("anchor", "anchor", reset=False)
        self.add_state("velocity", "velocity")
        self.add_state("residual", "residual")
        self.add_state("began", "began", reset=False)  # with overlap: this rank's parameters as the round began
        self.add_state("landed", "landed", reset=False)  # with overlap: the change in flight, landed for a checkpoint
        self.since = 0  # inner steps taken in the current round
        self.rounds = 0  # rounds ended: seeds the method's draws
        self.budget = 0  # the fit's last step (``max_steps``), 0 when none
        self.steps = 0  # inner steps taken in the fit (Lightning's global step)
        self.epoch_ends: Callable[[], bool] = _never  # set at fit start (module-level defaults: the strategy pickles)
        self.bytes_sent = 0  # this fit's outer updates, as each rank put them into the collectives
        self.guard = RoundGuard()  # undoes a round that diverged; stops a run that cannot go on
        self._inner: dict[str, dict[str, Any]] = {}  # this rank's inner optimizer state as the round began
        self._step_loss: Tensor | None = None  # the closure's loss this step (:meth:`take_loss`)
        #: Told of each outer update's bytes and whether they were gathered (the strategy records them as a step's).
        self.sent: Callable[[int, bool], None] = _unrecorded
        self._params: dict[str, nn.Parameter] = {}
        self._buffers: list[Tensor] = []  # floating buffers (running statistics): averaged whole at each round's end
        self._optimizer: torch.optim.Optimizer | None = None
        self._resumed: dict[str, Tensor] = {}  # this rank's parameters and inner state, for after Lightning's restore
        self._pending: list[_Exchange] = []  # with overlap: the last round's averaging, in flight
        #: The embedding tables a compressed round sends by the rows some rank changed (the strategy's, found when DDP
        #: wraps the model; ``GraVACStrategy(embedding_rows=False)`` sends them whole).
        self.tables = RowTables(enabled=False)

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
        self.config, self.compressor, self.error_feedback = config, compressor, error_feedback
        self.guard.configure(config.guard, config.cooldown)

    @override
    def __bool__(self) -> bool:
        return self.config is not None

    def start(self, config: LocalSteps, compressor: Compressor, error_feedback: bool, steps: int) -> None:
        """From the next step on, run local steps as ``config`` says (the default's choice mid-fit, once every rank's
        parameters are one after ``steps`` steps): the round starts from the parameters as they are."""
        self.configure(config, compressor, error_feedback)
        self.steps, self.since = steps, 0
        self._set_anchor()
        self._keep_inner()

    @override
    def take_from(self, setup: Setup) -> list[str]:
        if len(setup.optimizers) != 1:
            if self.config is not None:
                raise ValueError(f"Local steps run one optimizer; the model configures {len(setup.optimizers)}.")
            return []
        assert setup.module is not None
        self._optimizer = setup.optimizers[0]
        self._params = {name: p for name, p in setup.module.named_parameters() if p.requires_grad}
        self._buffers = [b for b in setup.module.buffers() if b.is_floating_point()]
        device = next(iter(self._params.values())).device if self._params else torch.device("cpu")
        self.guard.to(device)
        return []

    def begin_fit(self, steps: int, budget: int, epoch_ends: Callable[[], bool]) -> None:
        """At fit start, after Lightning restored a checkpoint: the global step, the budget and how to tell an
        epoch's last batch; a resumed rank takes back its own parameters and inner state."""
        self.steps, self.budget, self.epoch_ends = steps, max(budget, 0), epoch_ends
        if self.config is None:
            return
        if self._resumed:
            self._restore_rank()
        if not self.anchor.kept:
            self._set_anchor()
            self._keep_inner()

    def take_loss(self, loss: Any) -> None:
        """What the step's closure returned (Lightning's: its training loss; ``None`` under manual optimization): the
        round's loss counts it if the step steps. The strategy wraps the closure, so the loss is seen however the step
        runs it (under fp16's gradient scaler, the precision plugin calls it before the optimizer's step)."""
        self._step_loss = loss if isinstance(loss, Tensor) and loss.numel() == 1 else None

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
            self.end_round(whole=last and self.error_feedback, drain=last or epoch_ends)

    def finish(self) -> None:
        """The fit ends: a round begun, or one in flight, is closed; sent whole where error feedback holds a residual
        (an unbiased code leaves nothing owed)."""
        if self.config is not None and (self.since > 0 or self._pending or self.landed.kept):
            self.end_round(whole=self.error_feedback, drain=True)

    def end_round(self, whole: bool = False, drain: bool = False, synchronous: bool = False) -> None:
        """End a round; every rank calls it (collectives). Each rank's change over the round is compressed and
        averaged, the outer step taken, and the next round starts from it; with ``overlap``, the change is sent while
        the next round computes and applied at its end, each rank then rebased on the outer step. ``whole``: the
        change and the residual sent uncompressed; ``drain`` (or ``whole``): nothing left in flight, every rank on the
        common parameters; ``synchronous``: a step of the hold after a round undone, averaged as it is."""
        assert self.config is not None
        overlap = self.config.overlap and not (whole or drain)
        with torch.no_grad():
            loss = self.guard.close(1 if synchronous else self.since, synchronous)
            applied = self._outer_step(self._take_pending()) if self._pending or self.landed.kept else True
            if not applied and self.config.guard is None:  # the round in flight is lost; this one goes on
                self.guard.lost()
                applied = True
            if not applied or self.guard.diverged(loss):
                self._undo(loss)
            else:
                # A round with a change in flight began at `began` (its own progress is measured from there), which the
                # outer step just taken leaves as it was; any other began at the anchor.
                starts = self.began.kept or self.anchor.kept
                exchanges = [self._launch(names, starts, whole, overlap) for names in self._groups()]
                if overlap:
                    self._pending = exchanges
                else:
                    averaged = {n: avg for ex in exchanges for n, avg in zip(ex.names, self._land(ex), strict=True)}
                    if self._outer_step(averaged, plain=synchronous):
                        self.began.clear()
                        for name, p in self._params.items():
                            p.copy_(self.anchor.kept[name])
                    else:
                        self._undo(None)
            self._average_buffers()
            if not self.guard.holding:  # a round begins next (a hold's steps keep the state its last one leaves)
                self._keep_inner()
        self.guard.ended()
        self.since = 0
        self.rounds += 1

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
        self._restore_inner()
        self.reset()  # the residual and the outer momentum
        self.guard.undo(loss, self.steps)

    def _groups(self) -> list[list[str]]:
        """The parameters' names by dtype: one flat tensor each."""
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name, p in self._params.items():
            by_dtype.setdefault(p.dtype, []).append(name)
        return list(by_dtype.values())

    def _take_pending(self) -> dict[str, Tensor]:
        """The averaged changes of the round in flight (waited for), or those a checkpoint landed."""
        averaged = dict(self.landed.kept) or {
            n: a for ex in self._pending for n, a in zip(ex.names, self._land(ex), strict=True)
        }
        self._pending = []
        self.landed.load({})  # let go, not kept as spares: nothing is landed into them again until a checkpoint
        return averaged

    def _average_buffers(self) -> None:
        """Floating buffers averaged whole: DDP does not sync them at each forward in this mode (the strategy sets
        ``forward_sync_buffers=False``)."""
        if self._buffers and dist.is_initialized():
            flat = torch.cat([b.reshape(-1).double() for b in self._buffers])
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            for b, mean in zip(self._buffers, _split(flat, self._buffers), strict=True):
                b.copy_(mean)

    def _launch(self, names: list[str], starts: dict[str, Tensor], whole: bool, rebase: bool) -> "_Exchange":
        """Start averaging the changes of ``names`` since ``starts`` (error-fed for a biased method; the new residuals
        kept): an all-reduce of the whole change, or an all-gather of the compressed one. ``rebase`` (overlap): each
        rank continues from the outer step just taken plus its own progress since ``starts``.

        The change is written once, into one flat tensor: it is what an all-reduce sums, what the method compresses
        and, with error feedback, the new residual, written over it in place."""
        assert self.compressor is not None and self.config is not None
        like = [self._params[n] for n in names]
        delta = torch.empty(sum(p.numel() for p in like), dtype=like[0].dtype, device=like[0].device)
        parts = _split(delta, like)
        for name, part, p in zip(names, parts, like, strict=True):
            torch.sub(starts[name], p, out=part)
        if rebase:
            for name, part, p in zip(names, parts, like, strict=True):
                torch.sub(self.anchor.kept[name], part, out=p)  # rebased on the outer step, own progress kept
                self._hold(self.began, name, p)
        if self.error_feedback:
            for n, part in zip(names, parts, strict=True):
                residual = self.residual.kept.pop(n, None)  # added in: this round's residual replaces it
                if residual is not None:
                    part.add_(residual)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if whole or self.config.cf <= 1 or self.compressor.passthrough:
            for n in names:
                self.residual.kept.pop(n, None)
            self.bytes_sent += delta.numel() * delta.element_size()
            self.sent(delta.numel() * delta.element_size(), False)
            handle = dist.all_reduce(delta, async_op=True) if world > 1 else None
            return _Exchange(names, like, world, handle, delta)
        rows = self._changed_rows(names, parts, world)
        selected = torch.cat(rows.select(parts)) if rows.chosen else delta
        payload = self.compressor.compress(selected, self.config.cf, key="outer", step=self.rounds)
        layout = Layout.of([payload])
        packed = layout.pack([payload])
        if self.error_feedback:  # the change becomes its residual in place: what was not sent (none of the rows none
            # changed, where nothing was sent)
            self.compressor.residual_(selected, payload)
            if rows.chosen:
                rows.place(selected, parts)
            for n, rest in zip(names, parts, strict=True):
                self.residual.kept[n] = rest
        gathered = torch.empty(world * layout.nbytes, dtype=torch.uint8, device=packed.device)
        self.bytes_sent += layout.nbytes
        self.sent(layout.nbytes, True)
        handle = dist.all_gather_single(gathered, packed, async_op=True) if world > 1 else None
        if handle is None:
            gathered.copy_(packed)
        free = not self.error_feedback  # the change is sent: its tensor can hold the ranks' mean
        return _Exchange(names, like, world, handle, delta, gathered, layout, payload, rows, free)

    def _changed_rows(self, names: list[str], parts: list[Tensor], world: int) -> ByRows:
        """Which rows of the tables among ``names`` (their changes ``parts``) some rank changed: a MAX all-reduce of a
        byte a row, the same on every rank. A table none of whose rows stayed unchanged goes whole; so does one under
        weight decay, which moves every row each step."""
        positions = [i for i, n in enumerate(names) if n in self.tables.rows and self._undecayed(n)]
        if not positions:
            return ByRows()
        rows = [self.tables.rows[names[i]] for i in positions]
        mask = row_mask([parts[i] for i in positions], rows)
        self.bytes_sent += mask.numel()
        self.sent(mask.numel(), False)
        if world > 1:
            dist.all_reduce(mask, op=dist.ReduceOp.MAX)
        # One host sync a table a round (on CUDA): how many rows go decides the payload's size.
        changed = zip(positions, set_rows(mask, rows), strict=True)
        by_rows = ByRows({i: idx for i, idx in changed if idx.numel() < parts[i].shape[0]})
        return by_rows if by_rows.numel(parts) else ByRows()  # nothing changed anywhere: the method gets something

    def _undecayed(self, name: str) -> bool:
        """Whether the inner optimizer leaves parameter ``name`` without weight decay (the same on every rank)."""
        p = self._params[name]
        groups = self._optimizer.param_groups if self._optimizer is not None else []
        return all(not g.get("weight_decay") for g in groups if any(q is p for q in g["params"]))

    def _land(self, exchange: "_Exchange") -> list[Tensor]:
        """Wait for ``exchange`` and decode the ranks' mean change, one tensor a parameter (into the change's own
        tensor where nothing else holds it)."""
        if exchange.handle is not None:
            exchange.handle.wait()
        world = exchange.world
        if exchange.payload is None:
            return _split(exchange.buffer.div_(world), exchange.like)
        assert self.compressor is not None and exchange.layout is not None and exchange.gathered is not None
        assert exchange.rows is not None
        _, (stacked,) = exchange.layout.unpack(
            exchange.gathered.view(world, exchange.layout.nbytes), [exchange.payload]
        )
        buffer, rows = exchange.buffer, exchange.rows
        if exchange.free and not rows.chosen:
            self.compressor.decode_(buffer, stacked, 1.0 / world)
            return _split(buffer, exchange.like)
        mean = torch.empty(rows.numel(exchange.like), dtype=buffer.dtype, device=buffer.device)
        self.compressor.decode_(mean, stacked, 1.0 / world)
        if not rows.chosen:
            return _split(mean, exchange.like)
        out = buffer.zero_() if exchange.free else torch.zeros_like(buffer)  # zero in the rows no rank changed
        rows.place(mean, _split(out, exchange.like))
        return _split(out, exchange.like)

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
                if velocity is None:
                    velocity = self.velocity.kept[name] = change.clone()
                else:
                    velocity.mul_(mu).add_(change)
                update = change.add(velocity, alpha=mu) if self.config.nesterov else velocity
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

    def _keep_inner(self) -> None:
        """This rank's inner optimizer state as a round begins, for the guard to undo the round (nothing without
        it), written over what the last round's start kept."""
        if self.config is None or self.config.guard is None or self._optimizer is None:
            return
        state = self._optimizer.state
        self._inner = {
            name: _copied(state[p], into=self._inner.get(name)) for name, p in self._params.items() if state.get(p)
        }

    def _restore_inner(self) -> None:
        """This rank's inner optimizer state as the round began (a parameter that had none then has none again),
        written into the optimizer's own tensors where they fit."""
        if self._optimizer is None:
            return
        for name, p in self._params.items():
            kept = self._inner.get(name)
            if kept is None:
                self._optimizer.state.pop(p, None)
            else:
                self._optimizer.state[p] = _copied(kept, into=self._optimizer.state.get(p))

    @override
    def reset(self) -> None:
        # Let go, not kept as spares: neither is written into a freed tensor again (the residual's are views of one).
        self.velocity.load({})
        self.residual.load({})

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.config is None:
            return {}
        if self._pending:  # the same bits decoded now or at the round's end: a checkpoint holds the average
            with torch.no_grad():
                averaged = self._take_pending()  # before `landed`: taking it replaces `landed.kept` with a new dict
                self.landed.kept.update(averaged)
        state = super().state_dict()
        state["since"] = torch.tensor(self.since)
        state["rounds"] = torch.tensor(self.rounds)
        state.update(self.guard.state_dict())
        for name, kept in self._inner.items():
            for key, value in kept.items():
                if isinstance(value, Tensor):
                    state[f"began_inner/{name}/{key}"] = value
        for name, p in self._params.items():
            state[f"params/{name}"] = p.detach()
        if self._optimizer is not None:
            for name, p in self._params.items():
                for key, value in self._optimizer.state.get(p, {}).items():
                    if isinstance(value, Tensor):
                        state[f"inner/{name}/{key}"] = value.detach()
        return state

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.since = int(state["since"]) if "since" in state else 0
        self.rounds = int(state["rounds"]) if "rounds" in state else 0
        self.guard.load_state_dict(state)
        self._resumed = {k: v for k, v in state.items() if k.startswith(("params/", "inner/", "began_inner/"))}

    def _restore_rank(self) -> None:
        """This rank's own parameters and inner optimizer state, saved mid-round (Lightning restored rank 0's)."""
        began: dict[str, dict[str, Tensor]] = {}
        inner: dict[str, dict[str, Tensor]] = {}
        with torch.no_grad():
            for key, value in self._resumed.items():
                kind, rest = key.split("/", 1)
                if kind == "params" and rest in self._params:
                    self._params[rest].copy_(value)
                elif kind in ("began_inner", "inner"):
                    name, slot = rest.rsplit("/", 1)
                    if name in self._params:
                        (began if kind == "began_inner" else inner).setdefault(name, {})[slot] = value
            if self._optimizer is not None and any(k.startswith("params/") for k in self._resumed):
                # Lightning restored rank 0's optimizer state on every rank: each parameter's becomes this rank's own,
                # none where this rank had none (it had skipped every step so far as non-finite).
                for name, p in self._params.items():
                    if name not in inner:
                        self._optimizer.state.pop(p, None)
                        continue
                    live = self._optimizer.state[p]
                    for slot, value in inner[name].items():
                        held = live.get(slot)
                        if isinstance(held, Tensor) and held.shape == value.shape:
                            held.copy_(value)  # in place: the optimizer's own tensor
                        else:
                            live[slot] = _placed(value, p)
            self._inner = {name: self._kept_as_saved(name, slots) for name, slots in began.items()}
        self._resumed = {}

    def _kept_as_saved(self, name: str, saved: dict[str, Tensor]) -> dict[str, Any]:
        """Parameter ``name``'s inner state as its round began, from a checkpoint's tensors (``saved``): each on the
        device and in the dtype the optimizer holds that slot in (Adam's step count stays on the CPU), its other
        slots (not tensors) as the optimizer holds them now."""
        live = self._optimizer.state.get(self._params[name], {}) if self._optimizer is not None else {}
        kept: dict[str, Any] = {k: copy.deepcopy(v) for k, v in live.items() if not isinstance(v, Tensor)}
        for slot, value in saved.items():
            held = live.get(slot)
            if isinstance(held, Tensor) and held.shape == value.shape:
                kept[slot] = held.detach().clone().copy_(value)
            else:
                kept[slot] = _placed(value, self._params[name])
        return kept


def _copied(state: dict[str, Any], into: dict[str, Any] | None = None) -> dict[str, Any]:
    """One parameter's optimizer state, copied: each tensor into ``into``'s of that slot where it fits, else cloned."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(value, Tensor):
            out[key] = copy.deepcopy(value)
            continue
        held = None if into is None else into.get(key)
        if _fits(held, value):
            out[key] = held.copy_(value)
        else:
            out[key] = value.detach().clone()
    return out


def _fits(held: Any, value: Tensor) -> TypeGuard[Tensor]:
    """Whether ``held`` is another tensor that ``value`` can be copied into exactly."""
    return (
        isinstance(held, Tensor)
        and held is not value
        and (held.shape, held.dtype, held.device) == (value.shape, value.dtype, value.device)
    )


def _placed(value: Tensor, param: Tensor) -> Tensor:
    """A saved optimizer slot the live state lacks, where torch's optimizers keep it: a step count (a scalar) on the
    CPU (unless capturable or fused; untested on CUDA here: no GPU), any other with its parameter."""
    return value.cpu().clone() if value.dim() == 0 else value.to(param.device)


def _never() -> bool:
    return False


def _unrecorded(nbytes: int, gathered: bool) -> None:
    """Bytes not recorded anywhere (before the strategy's setup)."""


@dataclass
class _Exchange:
    """One flat tensor's averaging in flight: its names and shapes, the collective's handle, the change (summed in
    place when sent whole) and, compressed, the gathered payloads."""

    names: list[str]
    like: list[nn.Parameter]
    world: int
    handle: Any
    buffer: Tensor
    gathered: Tensor | None = None
    layout: Layout | None = None
    payload: Payload | None = None
    rows: ByRows | None = None
    free: bool = False  # whether nothing but the exchange holds ``buffer`` (the mean is decoded into it)


def _split(flat: Tensor, like: list[Tensor] | list[nn.Parameter]) -> list[Tensor]:
    """``flat`` cut into views shaped as ``like``."""
    out, offset = [], 0
    for p in like:
        out.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return out
