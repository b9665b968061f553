"""The protocol of an optimizer adaptation: state the optimizer would keep, carried by the comm hook instead so that
compression acts on it (SGD momentum, Adam's moments), and the registry of adaptations :class:`Carry` holds.

An adaptation is one file: a subclass of :class:`Adaptation` decorated with :func:`register_adaptation`, imported once
in ``lightning_gravac/adaptations/__init__.py``. Its state is declared once (:meth:`Adaptation.add_state`): a dict of
tensors by parameter name, in gradient units or not, dropped by the divergence guard or not; reset, rescale,
``state_dict`` and a checkpoint's reshard onto another number of ranks follow from the declaration.

Where the training loop calls it, in order within a step:

1. :meth:`~Adaptation.take_from` at setup, once the optimizers exist: what moves from the optimizer into the hook;
2. :meth:`~Adaptation.on_fit_start` at fit start (when it acts: a warm-up);
3. :meth:`~Adaptation.begin_batch` before each batch's backward;
4. in the comm hook: :meth:`~Adaptation.direction_` on every bucket that communicates, then
   :meth:`~Adaptation.before_compression_` (not on the plain all-reduce that :meth:`~Adaptation.exact` claims);
5. :meth:`~Adaptation.settle` once a bucket's step is known finite or not (commit or drop what the step staged);
6. inside the optimizer's step: :meth:`~Adaptation.after_closure` (the user has seen the gradients), the optimizer's
   own step, then :meth:`~Adaptation.after_step`.
"""

from abc import ABC
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from lightning_gravac.staged import Staged


@dataclass(frozen=True)
class Setup:
    """What an adaptation may take state from, at setup.

    Attributes:
        optimizers: the trainer's optimizers.
        names: the parameters the hook sends dense, by ``id``: the only ones whose state can move.
        module: the model (unwrapped).
        trainer: the trainer, when there is one.
        sparse: the parameters whose gradients are sparse (sent as they are), by ``id``.
    """

    optimizers: Sequence[torch.optim.Optimizer]
    names: dict[int, str]
    module: nn.Module | None = None
    trainer: Any = None
    sparse: frozenset[int] = frozenset()


@dataclass(frozen=True)
class _Declared:
    prefix: str  # its entries' keys in `state_dict`: ``<prefix>/<parameter name>``
    gradient_units: bool  # rescaled when the gradients' scale changes
    reset: bool  # dropped by the divergence guard


class Adaptation(ABC):
    """An optimizer's state carried by the comm hook. Every method has a default that does nothing, so a part
    implements only the points of the step it acts at (see the module's docstring for their order).

    Class attributes:
        name: the part's key in the strategy's checkpoint.
        per_rank: whether its state differs between ranks (gathered from every rank on save, resharded on load);
            ``False``: the same on every rank, saved once.
    """

    name: ClassVar[str]
    per_rank: ClassVar[bool] = True

    def __init__(self) -> None:
        self._declared: dict[str, _Declared] = {}

    def add_state(self, attribute: str, prefix: str, *, gradient_units: bool = False, reset: bool = True) -> None:
        """Declare ``self.<attribute>``, a :class:`Staged` of tensors by parameter name, as state carried from step to
        step: saved as ``<prefix>/<name>``, multiplied when the gradients' scale changes if ``gradient_units``, dropped
        by the divergence guard if ``reset``."""
        setattr(self, attribute, Staged())
        self._declared[attribute] = _Declared(prefix, gradient_units, reset)

    def _staged(self) -> dict[str, tuple[Staged, _Declared]]:
        return {attribute: (getattr(self, attribute), declared) for attribute, declared in self._declared.items()}

    def __bool__(self) -> bool:
        """Whether the part holds some optimizer state (the optimizer's step is then wrapped)."""
        return False

    @property
    def follows_average(self) -> bool:
        """Whether the part needs each bucket's parameters and, on a plain all-reduce, its averaged gradient."""
        return False

    @property
    def sends_from(self) -> int | None:
        """The step from which the hook sends what the part makes of the gradient, after a warm-up sent whole;
        ``None``: no warm-up."""
        return None

    def active(self, step: int) -> bool:
        """Whether the part acts in the hook on step ``step``."""
        return bool(self)

    def take_from(self, setup: Setup) -> list[str]:
        """Move what the part carries out of ``setup``'s optimizers; the names of the parameters it took."""
        return []

    def on_fit_start(self, trainer: Any, compresses: bool, controller: str, method: str) -> None:
        """At fit start, under an optimizer that scales each coordinate: decide when the part acts (``compresses``:
        whether ``controller`` sends anything but whole gradients, with ``method``)."""

    def begin_batch(self) -> None:
        """Before a batch's backward: what a skipped step left is dropped."""

    def direction_(self, names: list[str], grads: list[Tensor], step: int) -> None:
        """In the hook, on every bucket that communicates: what is sent in place of each gradient."""

    def before_compression_(self, names: list[str], grads: list[Tensor], params: list[Tensor]) -> None:
        """In the hook, before compression: each gradient becomes this rank's update direction, in place."""

    def exact(self, names: Sequence[str]) -> bool:
        """Whether a plain all-reduce of ``names`` can apply the part after it, identically on every rank."""
        return False

    def settle(
        self,
        names: list[str],
        pending: dict[str, Tensor | None],
        finite: bool,
        averaged: list[Tensor] | None,
        params: list[Tensor],
        exact: bool,
    ) -> None:
        """A bucket arrived: commit what the step staged when ``finite``, drop it when not (``pending``: the bucket's
        new residuals, ``None`` where sent in full; ``averaged``: its averaged gradients when sent dense)."""

    def after_closure(self) -> None:
        """Inside the optimizer's step, after the closure: the gradients the optimizer is about to apply are final."""

    def after_step(self) -> None:
        """After the optimizer's own step."""

    def saved_groups(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """``state`` (``optimizer.state_dict()``) as a checkpoint shows it: the user's settings."""
        return state

    def rescale_(self, factor: float) -> None:
        """The gradients' scale changed by ``factor``: state in gradient units follows."""
        for staged, declared in self._staged().values():
            if declared.gradient_units:
                staged.scale_(factor)

    def reset(self) -> None:
        """Drop what the divergence guard drops (state that accumulated what exploded)."""
        for staged, declared in self._staged().values():
            if declared.reset:
                staged.clear()

    def state_dict(self) -> dict[str, Any]:
        """The declared state, as detached copies."""
        return {
            f"{declared.prefix}/{key}": tensor.detach().clone()
            for staged, declared in self._staged().values()
            for key, tensor in staged.kept.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty dict: nothing kept)."""
        for staged, declared in self._staged().values():
            start = len(declared.prefix) + 1
            staged.load({key[start:]: t for key, t in state.items() if key.startswith(f"{declared.prefix}/")})

    @staticmethod
    def reshard(stacked: Tensor, rank: int, same_world: bool) -> Tensor:
        """This rank's entry of a state tensor saved stacked by rank: its own row on the same number of ranks, else
        the mean over the saved ranks (in float64, which rounds no float32 or float64 sum; an integer or flag takes
        the first rank's), so that what the ranks owed in sum is owed still."""
        if same_world:
            return stacked[rank]
        return stacked.double().mean(0).to(stacked.dtype) if stacked.is_floating_point() else stacked[0]


_REGISTRY: list[type[Adaptation]] = []
_A = TypeVar("_A", bound=type[Adaptation])


def register_adaptation(cls: _A) -> _A:
    """Class decorator: every :class:`Carry` holds an instance of ``cls`` (in registration order).

    Raises:
        ValueError: if an adaptation of the same :attr:`~Adaptation.name` is registered.
    """
    if any(other.name == cls.name for other in _REGISTRY):
        raise ValueError(f"An adaptation named {cls.name!r} is already registered.")
    _REGISTRY.append(cls)
    return cls


def adaptations() -> list[Callable[[], Adaptation]]:
    """The registered adaptations' classes, in registration order."""
    return list(_REGISTRY)
