"""Error feedback: the residual memory that wraps any compressor, and :func:`encode`, the one sequence of error
feedback, compression and residual that the comm hook and the benchmarks share."""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Compressor, Payload, sq_norm

ResidualMode = Literal["in_place", "recycle", "copy", "off"]


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

    def error_fed_sq(self, key: str, grad: Tensor) -> tuple[Tensor, Tensor | None]:
        """``x = grad`` + the residual of ``key``, in a buffer of the memory's (recycled) that becomes the next
        residual, and ``||x||^2`` (float64, 0-d) where the compiled kernel found it in the same pass (contiguous fp32
        CPU tensors), else ``None``. The stored residual and ``grad`` are left as they are, so a step that is later
        dropped loses nothing."""
        out = self._spare.pop(key, None)
        if out is None or out.shape != grad.shape or out.dtype != grad.dtype or out.device != grad.device:
            out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        residual = self._residuals.get(key)
        residual = None if residual is None else residual.view_as(grad)
        if kernels.usable(grad) and kernels.usable(out) and (residual is None or kernels.usable(residual)):
            return out, kernels.add_sq(grad.view(-1), None if residual is None else residual.view(-1), out.view(-1))
        if residual is None:
            return out.copy_(grad), None
        return torch.add(grad, residual, out=out), None

    def error_fed_in_place_(self, key: str, tensor: Tensor) -> Tensor | None:
        """Add the residual of ``key`` into ``tensor`` in place (the stored residual is left as it is); ``||x||^2`` of
        the result (float64, 0-d) where the compiled kernel found it in the same pass, else ``None``."""
        residual = self._residuals.get(key)
        residual = None if residual is None else residual.view_as(tensor)
        if kernels.usable(tensor) and (residual is None or kernels.usable(residual)):
            flat = tensor.view(-1)
            return kernels.add_sq(flat, None if residual is None else residual.view(-1), flat)
        if residual is not None:
            tensor.add_(residual)
        return None

    def absorb(self, key: str, error_fed: Tensor, compressor: Compressor, payload: Payload) -> Tensor:
        """Make ``error_fed - decompress(payload)`` the residual of ``key``, written over the residual it replaces
        (its own buffer: a step known finite needs the old one no more), so that error feedback keeps one buffer a
        parameter. ``error_fed`` is left as it is. Returns the new residual."""
        residual = self._residuals.get(key)
        if not _fits(residual, error_fed):
            residual = self._spare.pop(key, None)
            if not _fits(residual, error_fed):
                residual = torch.empty_like(error_fed, memory_format=torch.contiguous_format)
        assert residual is not None
        self._spare.pop(key, None)  # one buffer a parameter: a spare another path left is let go
        residual.copy_(error_fed)
        compressor.residual_(residual, payload)
        self._residuals[key] = residual
        return residual

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

    def nbytes(self) -> int:
        """Bytes the memory holds: its residuals and the spare buffers it keeps to recycle."""
        held = {t.data_ptr(): t.untyped_storage().nbytes() for t in (*self._residuals.values(), *self._spare.values())}
        return sum(held.values())

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


def _fits(buffer: Tensor | None, like: Tensor) -> bool:
    """Whether ``buffer`` is a tensor of its own (not a view into a bucket's shared residual) shaped as ``like``."""
    return (
        buffer is not None
        and buffer._base is None
        and buffer.shape == like.shape
        and buffer.dtype == like.dtype
        and buffer.device == like.device
        and buffer.is_contiguous()
    )


@dataclass(frozen=True)
class Encoded:
    """One tensor error-fed and compressed.

    Attributes:
        payload: what is sent.
        basis: ``||x||^2`` (float64) of what the method selected from (the error-fed tensor, or the method's own
            accumulation): the denominator of the gain.
        probes: the kept squared norms at the probe factors (float64), or ``None`` when none were asked for.
        residual: ``x - decompress(payload)``, the next residual, not stored yet (the caller stores it once the step
            is known finite); ``None`` without error feedback, when the method sends ``x`` unchanged, or when it is
            left in ``error_fed``.
        error_fed: with ``residual_mode="in_place"``, ``x`` itself (the input, error-fed in place) when the method
            leaves a residual: the caller makes it the residual with :meth:`ErrorFeedback.absorb` once the step is
            known finite, before anything overwrites ``x``; else ``None``.
    """

    payload: Payload
    basis: Tensor
    probes: Tensor | None
    residual: Tensor | None
    error_fed: Tensor | None = None


def encode(
    compressor: Compressor,
    tensor: Tensor,
    cf: float,
    *,
    key: str = "",
    step: int = 0,
    residual_mode: ResidualMode = "off",
    memory: ErrorFeedback | None = None,
    probe_cfs: Sequence[float] = (),
    prober: Compressor | None = None,
    out: Tensor | None = None,
) -> Encoded:
    """Error feedback, compression and the new residual of one tensor, in that order.

    ``residual_mode`` says where the error-fed ``x`` comes from and where its residual goes:

    - ``"recycle"``: ``x = tensor + memory's residual of key``, in a buffer ``memory`` recycles, which then becomes
      the new residual in place (no copy, no allocation; ``tensor`` is left as it is);
    - ``"in_place"``: ``x = tensor + memory's residual of key``, added into ``tensor`` in place; the stored
      residual is left as it is and the new one is not computed here (``Encoded.error_fed``): the caller takes it
      with :meth:`ErrorFeedback.absorb` once the step is known finite, so a residual needs no second buffer;
    - ``"copy"``: ``tensor`` is already error-fed (the caller added the residuals in place); the residual is a copy;
    - ``"off"``: no error feedback; ``x = tensor`` and no residual.

    ``probe_cfs`` asks for the kept norms at other factors too, measured by ``prober`` (default: ``compressor``, in
    one multi-level selection where the method nests them; another method when ``compressor`` only stands in for it
    this step, as a layer sent dense inside a compressed bucket).

    ``out``, for a method with a ``wire_dtype`` (the casts), is where its payload is written
    (:meth:`~lightning_gravac.compressors.base.Compressor.compress_into`); other methods ignore it.
    """
    x, fed_sq = _error_fed(tensor, key, residual_mode, memory)  # ||x||^2 where a kernel found it with the sum
    prober = compressor if prober is None else prober
    probes = None
    if out is not None and compressor.wire_dtype is not None:
        payload = compressor.compress_into(x, cf, out, key=key, step=step)
        if probe_cfs:
            probes = prober.probe(x, probe_cfs, key=key, step=step)
    elif probe_cfs and prober is compressor:
        payload, probes = compressor.compress_and_probe(x, cf, probe_cfs, key=key, step=step)
    elif residual_mode == "recycle" and not probe_cfs and fed_sq is not None:
        # Coded and turned into the residual in one pass where the method can (the block codes).
        fused = compressor.compress_residual_(x, cf, key=key, step=step)
        if fused is not None:
            return Encoded(fused, fed_sq, None, x, None)
        payload = compressor.compress(x, cf, key=key, step=step)
    else:
        payload = compressor.compress(x, cf, key=key, step=step)
        if probe_cfs:
            probes = prober.probe(x, probe_cfs, key=key, step=step)
    basis = payload.basis if payload.basis is not None else fed_sq if fed_sq is not None else sq_norm(x)
    residual = None
    if residual_mode == "recycle" and not compressor.passthrough:
        compressor.residual_(x, payload)  # the recycled buffer becomes the residual in place
        residual = x
    elif residual_mode == "copy" and not compressor.passthrough:
        residual = ErrorFeedback.residual_of(compressor, x, payload)
    error_fed = x if residual_mode == "in_place" and not compressor.passthrough else None
    return Encoded(payload, basis, probes, residual, error_fed)


def _error_fed(
    tensor: Tensor, key: str, residual_mode: ResidualMode, memory: ErrorFeedback | None
) -> tuple[Tensor, Tensor | None]:
    """:func:`encode`'s ``x`` and its ``||x||^2`` where a kernel found it with the error feedback's sum."""
    if residual_mode in ("recycle", "in_place") and memory is None:
        raise ValueError(f"encode(residual_mode={residual_mode!r}) needs the `memory` whose residual is added.")
    if residual_mode == "recycle":
        assert memory is not None
        return memory.error_fed_sq(key, tensor)
    if residual_mode == "in_place":
        assert memory is not None
        return tensor, memory.error_fed_in_place_(key, tensor)
    return tensor, None
