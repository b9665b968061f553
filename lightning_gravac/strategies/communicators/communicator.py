"""The interface every communicator implements."""

from abc import ABC, abstractmethod

from torch import Tensor
from torch.futures import Future

from lightning_gravac.strategies.communicators.work import Work


class Communicator(ABC):
    """How a bucket crosses the network: its collectives (and a compressed one's header), ending in :func:`settle`."""

    @abstractmethod
    def send(self, work: Work) -> Future[Tensor]:
        """Launch the bucket's collectives (from the calling thread) and return the future of its averaged result."""
