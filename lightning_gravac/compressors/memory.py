"""Error feedback: the residual memory that wraps any compressor."""

from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload


class ErrorFeedback:
    """Per-parameter residuals: what compression left out, added back into the next gradient.

    Residuals are keyed by parameter name, never by bucket: DDP rebuilds its buckets after the first iteration,
    and a checkpoint must name what it restores.

    With ``g = grad + residual`` the error-fed gradient and ``d`` its decoded payload, the new residual is
    ``g - d``, so ``residual + d == g`` and nothing the compressor dropped is lost, only delayed.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, Tensor] = {}
        # Residuals replaced or dropped, kept to hold the next error-fed gradient: a gradient-sized allocation each
        # step costs page faults on CPU. At most one a parameter, the size of the residual it replaced.
        self._spare: dict[str, Tensor] = {}

    def error_fed(self, key: str, grad: Tensor) -> Tensor:
        """``grad`` + the residual of ``key`` in a buffer of the memory's (recycled), to become the next residual.

        The stored residual and ``grad`` are left as they are, so a step that is later dropped loses nothing.
        """
        out = self._spare.pop(key, None)
        if out is None or out.shape != grad.shape or out.dtype != grad.dtype or out.device != grad.device:
            out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        residual = self._residuals.get(key)
        if residual is None:
            return out.copy_(grad)
        return torch.add(grad, residual.view_as(grad), out=out)

    def compensate_(self, key: str, tensor: Tensor) -> bool:
        """Add the stored residual of ``key`` to ``tensor`` in place; whether there was one."""
        residual = self._residuals.get(key)
        if residual is not None:
            tensor.add_(residual.view_as(tensor))
        return residual is not None

    @staticmethod
    def residual_of(compressor: Compressor, error_fed: Tensor, payload: Payload) -> Tensor:
        """``error_fed - decompress(payload)`` as a new tensor; ``error_fed`` is left untouched."""
        residual = error_fed.clone()
        compressor.residual_(residual, payload)
        return residual

    def scale_(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (the gradients' scale changed; a power of 2 is exact)."""
        for residual in self._residuals.values():
            residual.mul_(factor)

    def set(self, key: str, residual: Tensor) -> None:
        """Store ``residual`` as the residual of ``key``."""
        self._recycle(key, self._residuals.get(key), residual)
        self._residuals[key] = residual

    def discard(self, key: str) -> None:
        """Forget the residual of ``key``: it was sent in full."""
        self._recycle(key, self._residuals.pop(key, None))

    def _recycle(self, key: str, old: Tensor | None, new: Tensor | None = None) -> None:
        # Only a tensor of its own: whole-bucket residuals are views of one tensor, shared between parameters.
        if old is not None and old is not new and old._base is None:
            self._spare[key] = old

    def get(self, key: str) -> Tensor | None:
        """The residual of ``key``, or ``None``."""
        return self._residuals.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self._residuals

    def __iter__(self) -> Iterator[str]:
        return iter(self._residuals)

    def __len__(self) -> int:
        return len(self._residuals)

    def state_dict(self) -> dict[str, Tensor]:
        """The residuals, as detached copies, by parameter name."""
        return {key: residual.detach().clone() for key, residual in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Replace all residuals with ``state``."""
        self._residuals = {key: residual.clone() for key, residual in state.items()}
        self._spare = {}
