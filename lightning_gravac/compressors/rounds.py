"""Methods of several rounds: a bucket's payloads cross the network in successive all-reduces, each one computed from
the sum of the one before (:attr:`~lightning_gravac.compressors.base.Pattern.ROUNDS`).

The method stays pure tensor math: it says which tensors it compresses, what each round all-reduces and what is done
between two rounds. The communicator that runs the rounds (``strategies.communicators.InRounds``) launches the
all-reduces, each from the hook's thread, and hands every sum back.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from torch import Tensor


class Part(Protocol):
    """One tensor a method of several rounds compresses."""

    @property
    def key(self) -> str:
        """A stable name of the tensor (its parameter's), for the method's state."""

    @property
    def tensor(self) -> Tensor:
        """What is compressed: the gradient, error-fed."""

    @property
    def cf(self) -> float:
        """Its compression factor."""

    @property
    def out(self) -> Tensor:
        """Where the averaged result goes."""


class Rounds(ABC):
    """One bucket's rounds under a method of several rounds.

    Round 0's payload is all-reduced (with the bucket's tensors sent dense beside it), the sum handed to the payload of
    round 1, and so on; every round but the last is waited for before the next one is computed, and the last one's sum
    goes to :meth:`finish`. A payload is a list of tensors laid out in order at the start of what its round all-reduces.
    """

    #: The all-reduces a bucket takes (at least two: a method of one is gathered or summed).
    count: int

    @abstractmethod
    def payload(self, round: int, summed: Tensor | None) -> list[Tensor]:
        """This rank's tensors of round ``round`` (from 0), computed from ``summed``: what round ``round - 1``
        all-reduced, summed over ranks, its payload first (``None`` for round 0). Empty: the round sends nothing of
        the method's."""

    @abstractmethod
    def sent_sq_norms(self) -> list[Tensor]:
        """``||C(x)||^2`` (float64) of what this rank sends of each part, known once the last round's payload is."""

    @abstractmethod
    def finish(self, summed: Tensor, ranks: int) -> None:
        """Write the average over ``ranks`` decoded from the last round's ``summed`` into each part's ``out``; the
        method's new state is pending until :meth:`~lightning_gravac.compressors.base.Compressor.commit`."""


class MultiRound(ABC):
    """The interface of a method of several rounds: which tensors it compresses, and a bucket's :class:`Rounds`."""

    @abstractmethod
    def takes(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is compressed; the others are sent dense, beside the first round."""

    @abstractmethod
    def rounds(self, parts: Sequence[Part], residual: bool) -> Rounds:
        """The rounds of ``parts`` (tensors it takes). With ``residual``, each part's tensor is turned in place into
        its residual, what this rank's payloads do not carry, once the round that fixes them has been computed."""
