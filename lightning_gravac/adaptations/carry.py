"""What a rank carries from one step to the next because it compresses, and the part that stores and drops it."""

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_gravac.adaptations.adaptation import Adaptation, Setup, adaptations
from lightning_gravac.adaptations.residuals import ErrorFeedback
from lightning_gravac.compressors.base import Compressor, Payload
from lightning_gravac.tables import sparse_parameters

_A = TypeVar("_A", bound=Adaptation)


class Carry:
    """What a rank carries from one step to the next because it compresses: error feedback's residuals and the
    optimizer adaptations (:mod:`~lightning_gravac.adaptations.adaptation`): the SGD momentum moved into the hook,
    Adam's moved first moment, and any other registered.

    The comm hook's communicators hand each bucket's outcome to :meth:`settle`, the strategy tells it of the training
    loop's events (:meth:`begin_batch`, :meth:`stepping`, :meth:`rescale_`) and checkpoints, and the divergence guard
    calls :meth:`reset`: nothing else writes a residual or a moved buffer. Everything is keyed by parameter name,
    never by bucket (DDP rebuilds its buckets after the first iteration; a checkpoint names what it restores).
    """

    def __init__(self) -> None:
        self.residuals = ErrorFeedback()
        self.adaptations: list[Adaptation] = [make() for make in adaptations()]

    def get(self, kind: type[_A]) -> _A:
        """The adaptation of class ``kind``.

        Raises:
            KeyError: when none is registered.
        """
        found = next((part for part in self.adaptations if isinstance(part, kind)), None)
        if found is None:
            raise KeyError(f"No adaptation {kind.__name__}; registered: {[type(p).__name__ for p in self.adaptations]}")
        return found

    def take_from(self, setup: Setup) -> dict[str, list[str]]:
        """Every adaptation takes what it carries from ``setup``'s optimizers: the parameters each took, by its name."""
        return {part.name: part.take_from(setup) for part in self.adaptations}

    def take_optimizer_state(
        self, setup: Setup, method: Compressor, error_feedback: bool, *, asked: bool, local_sgd: bool, scaled: bool
    ) -> None:
        """Move the optimizer's state into the hook (:meth:`take_from`) where it may go: asked for (``asked``, the
        strategy's ``momentum_correction``), every step reaching the hook (no ``local_sgd``), and gradients in one unit
        from step to step (not ``scaled`` by a gradient scaler, whose changing factor a state kept here would mix up).
        Unbiased methods, casts, signSGD, DGC and the block codes keep the optimizer's state: it moves only under
        ``error_feedback`` with a ``method`` that keeps no residual of its own and is not near exact.

        ``setup.names``: every parameter the hook sends, by ``id``. A sparse gradient (``nn.Embedding(sparse=True)``)
        is sent as it is: its parameters keep their state.
        """
        if not asked or local_sgd or scaled or not error_feedback:
            return
        if method.passthrough or method.owns_feedback or method.near_exact:
            return
        sparse = sparse_parameters(setup.module) if setup.module is not None else set()
        dense = {i: name for i, name in setup.names.items() if i not in sparse}
        self.take_from(replace(setup, names=dense, sparse=frozenset(sparse)))

    def on_fit_start(self, trainer: Any, compresses: bool, controller: str, method: str) -> None:
        """At fit start, under an optimizer that scales each coordinate: each adaptation decides when it acts."""
        for part in self.adaptations:
            part.on_fit_start(trainer, compresses, controller, method)

    @property
    def sends_from(self) -> int | None:
        """The first step from which the hook sends what an adaptation makes of the gradient after a warm-up sent
        whole (Adam's frozen second moment), or ``None``."""
        return min((s for part in self.adaptations if (s := part.sends_from) is not None), default=None)

    def warming_up(self, step: int) -> bool:
        """Whether step ``step`` is sent whole for an adaptation's warm-up."""
        return any(part.sends_from is not None and not part.active(step) for part in self.adaptations)

    def sends_moved(self, step: int) -> bool:
        """Whether step ``step`` sends what an adaptation made of the gradient after its warm-up."""
        return any(part.sends_from is not None and part.active(step) for part in self.adaptations)

    @property
    def follows_average(self) -> bool:
        """Whether an adaptation needs each bucket's parameters and a plain all-reduce's average (moved momentum)."""
        return any(part.follows_average for part in self.adaptations)

    def exact(self, names: Sequence[str]) -> bool:
        """Whether a plain all-reduce of ``names`` can apply an adaptation after it, identically on every rank."""
        return any(part.exact(names) for part in self.adaptations)

    def direction_(self, names: list[str], grads: list[Tensor], step: int) -> None:
        """What is sent in place of each gradient, on any path (Adam's step direction once its second moment is
        frozen)."""
        for part in self.adaptations:
            part.direction_(names, grads, step)

    def owes(self, names: Sequence[str]) -> bool:
        """Whether a residual is pending for any of ``names``."""
        return any(name in self.residuals for name in names)

    def before_compression_(self, names: list[str], grads: list[Tensor], params: list[Tensor]) -> None:
        """Before compression: each gradient with moved momentum becomes this rank's update direction, in place."""
        for part in self.adaptations:
            part.before_compression_(names, grads, params)

    def compensate_(self, names: list[str], grads: list[Tensor]) -> list[str]:
        """Add every pending residual into its gradient, in place; the names that had one. They stay stored until
        :meth:`settle` knows the step finite (a dense step that sends them in full drops them then)."""
        return [name for name, grad in zip(names, grads, strict=True) if self.residuals.compensate_(name, grad)]

    def flush_(self, names: list[str], grads: list[Tensor]) -> None:
        """Add every pending residual into its gradient and drop it: a step that keeps the gradient local (local SGD)
        takes what compression still owed."""
        for name in self.compensate_(names, grads):
            self.residuals.discard(name)

    def error_fed_sq(self, key: str, grad: Tensor) -> tuple[Tensor, Tensor | None]:
        """``grad`` plus the residual of ``key`` in a buffer that becomes the new residual in place (PowerSGD's rounds
        write it before the step is known finite), and its ``||x||^2`` where a kernel found it
        (:meth:`ErrorFeedback.error_fed_sq`)."""
        return self.residuals.error_fed_sq(key, grad)

    def absorb(self, deferred: Iterable[tuple[str, Tensor, Compressor, Payload]]) -> dict[str, Tensor]:
        """The step is known finite on every rank, and the decoded average is about to overwrite the tensors that
        were error-fed in place: their residuals ``x - decode(payload)``, written over the ones they replace (one
        buffer a parameter), by key."""
        return {key: self.residuals.absorb(key, x, method, payload) for key, x, method, payload in deferred}

    def settle(
        self,
        names: list[str],
        pending: dict[str, Tensor | None],
        finite: bool,
        averaged: list[Tensor] | None = None,
        params: list[Tensor] | None = None,
        exact: bool = False,
    ) -> None:
        """A bucket arrived: on a finite step (every rank's gradient was) its ``pending`` residuals are stored
        (``None`` drops one: it was sent in full) and each adaptation commits what the step staged; on a non-finite one
        both are dropped and the stored ones stay, as if the step had not happened.

        ``averaged``, the bucket's averaged gradients when it was sent dense; ``exact``: the plain all-reduce that an
        adaptation applies after (:meth:`exact`).
        """
        for part in self.adaptations:
            part.settle(names, pending, finite, averaged, params or [], exact)
        if not finite:
            return
        for key, residual in pending.items():
            if residual is None:
                self.residuals.discard(key)
            else:
                self.residuals.set(key, residual)

    def begin_batch(self) -> None:
        """Before a batch's backward: what a skipped step left is dropped, optimizer settings set again are taken."""
        for part in self.adaptations:
            part.begin_batch()

    @property
    def moves_optimizer_state(self) -> bool:
        """Whether some optimizer state lives here: the optimizer's step is then wrapped (:meth:`stepping`)."""
        return any(bool(part) for part in self.adaptations)

    @contextmanager
    def stepping(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """``optimizer.step`` calls each adaptation's ``after_closure`` right after its closure, and ``after_step``
        follows the step, within this context.

        A non-finite dense step defers the moved momentum's update to the gradients the optimizer applies, and Adam's
        moved moments are applied there, the optimizer skipping their parameters. Both need the gradients after
        Lightning's closure, which runs inside ``optimizer.step`` and ends with the user's ``on_before_optimizer_step``
        (where a guard may zero them, clipping clip them); Lightning has no hook between that and the step, so the
        optimizer's ``step`` is wrapped for this call alone.
        """
        if not self.moves_optimizer_state:
            yield
            return
        step = optimizer.step
        parts = self.adaptations

        def step_after_closure(closure: Callable[[], Any] | None = None, **step_kwargs: Any) -> Any:
            def run() -> Any:
                result = closure() if closure is not None else None
                for part in parts:
                    part.after_closure()
                return result

            return step(closure=run, **step_kwargs)

        wrapped = optimizer.__dict__.get("step")  # a wrapper of someone else's, put back as it was
        optimizer.step = step_after_closure  # type: ignore[method-assign]
        try:
            yield
        finally:
            for part in parts:
                part.after_step()
            if wrapped is None:
                del optimizer.step
            else:
                optimizer.step = wrapped  # type: ignore[method-assign]

    def saved_groups(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """``state`` (``optimizer.state_dict()``) as a checkpoint shows it: the user's settings written back."""
        for part in self.adaptations:
            state = part.saved_groups(optimizer, state)
        return state

    def rescale_(self, factor: float) -> None:
        """The gradients' scale changed by ``factor`` (fp16 mixed precision): the residuals follow, so the pending
        update is neither doubled nor halved, and so does what an adaptation keeps in gradient units."""
        self.residuals.scale_(factor)
        for part in self.adaptations:
            part.rescale_(factor)

    def reset(self) -> None:
        """Drop the residuals and what the adaptations accumulated (the divergence guard: they hold what exploded).
        Adam's moments stay: they are the optimizer's, not an accumulation of compression."""
        self.residuals.load_state_dict({})
        for part in self.adaptations:
            part.reset()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """This rank's ``residuals`` and each adaptation's state, by its name."""
        return {"residuals": self.residuals.state_dict(), **{p.name: p.state_dict() for p in self.adaptations}}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Restore what :meth:`state_dict` returned (a part missing from an older checkpoint restores empty)."""
        self.residuals.load_state_dict(state.get("residuals", {}))
        for part in self.adaptations:
            part.load_state_dict(state.get(part.name, {}))
