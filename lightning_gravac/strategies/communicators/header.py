"""The statistics header a compressed bucket carries beside its payload."""

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Header:
    """The float64 statistics a compressed bucket carries beside its payload, summed over ranks by the collective.

    Laid out ``[basis, sent, *probes, grad_sq]``: ``basis`` is ``||g||^2`` of what the method selects from (the
    error-fed gradient, or the method's own accumulation), ``sent`` is ``||C(g)||^2``, ``probes`` the kept squared
    norms at the controller's probe factors, and ``grad_sq``, present only when the probes are of the step's own
    gradient, that gradient's ``||grad||^2`` (the probes are then relative to it, else to ``basis``). A non-finite
    ``basis`` means some rank's gradient was not finite.
    """

    basis: float
    sent: float
    probes: tuple[float, ...]
    grad_sq: float | None = None

    @staticmethod
    def numel(probes: int, fresh: bool) -> int:
        """Entries of a header with ``probes`` probe norms, of the step's own gradient if ``fresh``."""
        return 2 + probes + int(fresh)

    @staticmethod
    def pack(basis: Tensor, sent: list[Tensor], probes: list[Tensor], fresh: tuple[Tensor, Tensor] | None) -> Tensor:
        """This rank's part of the sums, from ``basis``, the sent norms of each segment, each segment's probe norms,
        or ``fresh``: the probe norms of the step's own gradient and its ``||grad||^2`` (then ``probes`` is unused)."""
        parts = [basis.view(1), torch.stack(sent).sum().view(1).to(basis.device)]
        if fresh is not None:
            parts += [fresh[0].to(basis.device), fresh[1].view(1).to(basis.device)]
        elif probes:
            parts.append(torch.stack(probes).sum(0).to(basis.device))
        return torch.cat(parts)

    @classmethod
    def unpack(cls, summed: Tensor, fresh: bool) -> "Header":
        """The header of the summed tensor (one device read)."""
        values = summed.tolist()
        if fresh:
            return cls(values[0], values[1], tuple(values[2:-1]), values[-1])
        return cls(values[0], values[1], tuple(values[2:]))

    @property
    def probe_basis(self) -> float:
        """What the probes are relative to: ``grad_sq`` when they are of the step's own gradient, else ``basis``."""
        return self.basis if self.grad_sq is None else self.grad_sq
