"""What a rank carries from one step to the next because it compresses, and the part that stores and drops it."""

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload
from lightning_gravac.feedback.adam import AdamMoments
from lightning_gravac.feedback.momentum import MomentumCorrection
from lightning_gravac.feedback.residuals import ErrorFeedback


class Feedback:
    """Error feedback's residuals, the SGD momentum moved into the hook and Adam's moved first moment.

    The comm hook's communicators hand each bucket's outcome to :meth:`settle`, the strategy tells it of the training
    loop's events (:meth:`begin_batch`, :meth:`after_closure`, :meth:`rescale_`) and checkpoints, and the divergence
    guard calls :meth:`reset`: nothing else writes a residual or a moved buffer. Everything is keyed by parameter name,
    never by bucket (DDP rebuilds its buckets after the first iteration; a checkpoint names what it restores).
    """

    def __init__(self) -> None:
        self.residuals = ErrorFeedback()
        self.momentum = MomentumCorrection()  # the optimizer's SGD momentum, when moved here
        self.adam = AdamMoments()  # Adam's first moment, when moved here

    def direction_(self, names: list[str], grads: list[Tensor], step: int) -> None:
        """Adam's step direction in place of each moved gradient once its second moment is frozen (what is sent, on
        any path)."""
        if self.adam.active(step):
            self.adam.local_(names, grads)

    def owes(self, names: Sequence[str]) -> bool:
        """Whether a residual is pending for any of ``names``."""
        return any(name in self.residuals for name in names)

    def local_(self, names: list[str], grads: list[Tensor], params: list[Tensor]) -> None:
        """Before compression: each gradient with moved momentum becomes this rank's update direction, in place."""
        if self.momentum:
            self.momentum.local_(names, grads, params)

    def carry_(self, names: list[str], grads: list[Tensor]) -> list[str]:
        """Add every pending residual into its gradient, in place; the names that had one. They stay stored until
        :meth:`settle` knows the step finite (a dense step that sends them in full drops them then)."""
        return [name for name, grad in zip(names, grads, strict=True) if self.residuals.compensate_(name, grad)]

    def flush_(self, names: list[str], grads: list[Tensor]) -> None:
        """Add every pending residual into its gradient and drop it: a step that keeps the gradient local (local SGD)
        takes what compression still owed."""
        for name in self.carry_(names, grads):
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
        (``None`` drops one: it was sent in full) and its new momentum buffers kept; on a non-finite one both are
        dropped and the stored ones stay, as if the step had not happened.

        ``averaged``, the bucket's averaged gradients when it was sent dense: on the ``exact`` path they become SGD's
        update direction in place (a non-finite step defers that to the gradients the optimizer sees:
        :meth:`after_closure`); with no residual in them, the local buffers are in sync again.
        """
        momentum, params = self.momentum, params or []
        if not finite:
            if exact:
                momentum.defer(names, params)
            elif momentum:
                momentum.discard(names)
            return
        if exact:
            assert averaged is not None
            momentum.after_dense_(names, averaged, params)
        elif momentum:  # nothing moved: no buffer to mask, resync or commit (every bucket of every step)
            momentum.mask_(pending)
            if averaged is not None and not pending:
                momentum.resync(names, averaged)
            momentum.commit(names)
        for key, residual in pending.items():
            if residual is None:
                self.residuals.discard(key)
            else:
                self.residuals.set(key, residual)

    def begin_batch(self) -> None:
        """Before a batch's backward: momentum set in the optimizer again (a restored checkpoint's param groups, a
        momentum schedule) is taken into the hook, so it never applies twice; what a skipped step left is dropped."""
        self.momentum.refresh()
        self.momentum.drop_deferred()
        self.adam.drop_moved()

    def after_closure(self) -> list[tuple[Tensor, Tensor]]:
        """Inside the optimizer's step, after the closure (the user has seen the gradients): a deferred momentum update
        takes them, and Adam's moved parameters are updated from the averaged direction. Returns what
        :meth:`AdamMoments.restore` puts back after the optimizer's own step."""
        self.momentum.apply_deferred()
        return self.adam.step_()

    @property
    def moves_optimizer_state(self) -> bool:
        """Whether some optimizer state lives here: the optimizer's step is then wrapped (:meth:`after_closure`)."""
        return bool(self.momentum or self.adam)

    def rescale_(self, factor: float) -> None:
        """The gradients' scale changed by ``factor`` (fp16 mixed precision): the residuals follow, so the pending
        update is neither doubled nor halved."""
        self.residuals.scale_(factor)

    def reset(self) -> None:
        """Drop the residuals and the moved momentum (the divergence guard: they hold the accumulation that exploded).
        Adam's moments stay: they are the optimizer's, not an accumulation of compression."""
        self.residuals.load_state_dict({})
        self.momentum.reset()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """This rank's ``residuals`` and ``momentum`` buffers, and ``adam``'s state (the same on every rank)."""
        return {
            "residuals": self.residuals.state_dict(),
            "momentum": self.momentum.state_dict(),
            "adam": self.adam.state_dict(),
        }

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Restore what :meth:`state_dict` returned (a part missing from an older checkpoint restores empty)."""
        self.residuals.load_state_dict(state.get("residuals", {}))
        self.momentum.load_state_dict(state.get("momentum", {}))
        self.adam.load_state_dict(state.get("adam", {}))
