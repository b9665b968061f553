"""The compressor interface and the name -> class registry.

A compressor is pure tensor math: ``compress`` turns one tensor into a :class:`Payload` whose wire
tensors have sizes fixed by ``(numel, cf, dtype)`` alone, and ``decompress`` turns a payload back into a
tensor of the input's shape and dtype. Compressors never talk to the network; the comm hook does.
"""

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.select import Scratch

#: Bytes of one index on the wire. Indices are int32 relative to the tensor they address.
INDEX_BYTES = 4


@dataclass(frozen=True)
class Payload:
    """One compressed tensor.

    Attributes:
        wire: the tensors that cross the network, in a fixed order. Their sizes depend on the input's numel,
            dtype and the compression factor only, so every rank sends the same number of bytes.
        shape: shape of the tensor that was compressed.
        dtype: dtype of the tensor that was compressed.
        derived: tensors needed to decode that never cross the network, because every rank can derive them
            (Random-K's indices come from a shared seed).
        basis: ``||x||^2`` (float64) of what the method selected from, when that is not the tensor it was given
            (DGC selects from its own accumulation); ``None`` means the input. Gains are relative to it.
        sent: ``||decompress(payload)||^2`` (float64) when compressing found it on the way (1-bit SGD's column
            counts give it), so that the header need not decode the payload again; ``None``: not known. This rank's
            own payload only: another rank's wire (:meth:`with_wire`) does not carry it.
    """

    wire: tuple[Tensor, ...]
    shape: torch.Size
    dtype: torch.dtype
    derived: tuple[Tensor, ...] = ()
    basis: Tensor | None = None
    sent: Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes this payload puts on the wire."""
        return sum(t.numel() * t.element_size() for t in self.wire)

    def with_wire(self, wire: Sequence[Tensor]) -> "Payload":
        """The same payload with other wire tensors: another rank's, unpacked from a gathered buffer."""
        return Payload(tuple(wire), self.shape, self.dtype, self.derived, self.basis)


class Pattern(Enum):
    """How a method's payloads cross the network: the comm hook hands a compressed bucket to the communicator of the
    pattern its method declares (``lightning_gravac.strategies.communicators``). What the bucket then took, a gather
    or an all-reduce, is recorded apart (``lightning_gravac.state.Collective``)."""

    #: Packed payloads all-gathered and decoded rank by rank, or (when that moves more bytes than a ring all-reduce of
    #: the dense bucket) decoded locally and all-reduced: Top-K, DGC, the quantizers.
    GATHER = "gather"
    #: Payloads summed element-wise by an all-reduce and decoded once: they share support across ranks (Random-K's
    #: seeded indices, a cast's every entry).
    SUM = "sum"
    #: Several all-reduces whose later payloads depend on earlier sums, for a method that implements
    #: :class:`~lightning_gravac.compressors.rounds.MultiRound` (PowerSGD: ``P``, then ``Q``).
    ROUNDS = "rounds"


class Compressor(ABC):
    """Base class of every gradient compressor.

    Subclasses set :attr:`name` and implement :meth:`compress` and :meth:`decompress`. The other methods have
    correct generic implementations that a method may override with a faster one.

    Class attributes:
        name: the registry name (``get_compressor(name)``).
        biased: whether the method is biased; error feedback defaults to on for biased methods.
        passthrough: whether the method sends the gradient unchanged; the hook then uses plain all-reduce.
        communication: how the payloads travel (:class:`Pattern`): gathered (the default), summed by an
            all-reduce (payloads that share support across ranks, as Random-K's seeded indices do), or in rounds.
        owns_feedback: whether the method keeps its own residual (DGC's accumulation), so that the strategy's error
            feedback must stay off.
        requires_feedback: whether the method is only defined with error feedback (1-bit SGD), so that turning it
            off is an error.
        layerwise: whether the method needs each parameter's own shape (PowerSGD's matrices), so that
            ``granularity="bucket"`` is an error.
        fixed_cf: the one factor the method sends at from fp32 whatever ``cf`` asks (a cast's 2, a sign's 32), or
            ``None`` when ``cf`` sets it. A strategy left without a controller then holds it (``Static``): there is
            no factor to search.
        near_lossless: whether what is sent is the gradient up to rounding (a 16-bit cast, or nothing done), so that
            an optimizer that scales each coordinate (Adam) trains as with dense gradients.
        near_exact: whether every entry is sent every step within a small bound of its block's scale (the block
            codes), so that the optimizer's state stays in the optimizer and an adaptive one (Adam) takes the decoded
            gradient as it takes a dense one; error feedback carries the rounding to the next step.
        wire_dtype: for a method whose payload is one tensor of the input's numel in this dtype (the casts), which
            :meth:`compress_into` writes into a buffer the caller keeps; ``None`` for every other method.
    """

    name: ClassVar[str]
    biased: bool = True
    communication: ClassVar[Pattern] = Pattern.GATHER
    passthrough: ClassVar[bool] = False
    owns_feedback: ClassVar[bool] = False
    requires_feedback: ClassVar[bool] = False
    layerwise: ClassVar[bool] = False
    fixed_cf: ClassVar[float | None] = None
    near_lossless: ClassVar[bool] = False
    near_exact: ClassVar[bool] = False
    wire_dtype: ClassVar[torch.dtype | None] = None

    @property
    def summable(self) -> bool:
        """Whether the payloads of different ranks are summed element-wise by an all-reduce and decoded once."""
        return self.communication is Pattern.SUM

    @property
    def error_feedback_default(self) -> bool:
        """Whether the strategy turns error feedback on when the user leaves it unset: for biased methods that keep
        no residual of their own."""
        return self.biased and not self.owns_feedback

    #: Whether :meth:`masked_wait`'s sends come at random (Random-K: geometric waits) rather than by magnitude (an entry
    #: of steady size is sent about periodically).
    random_sends: ClassVar[bool] = False

    def masked_wait(self, cf: float, dtype: torch.dtype) -> float | None:
        """The mean steps between two sends of an entry at ``cf``, for a method that sends entries exactly (its
        residual 0 there, where momentum factor masking restarts the momentum): ``numel / k``. ``None`` for methods
        that never do (quantizers, casts, low rank)."""
        return None

    def masked_momentum(self) -> float:
        """The momentum a method with an accumulation of its own restarts where it sends an entry (DGC's); 0 else."""
        return 0.0

    @abstractmethod
    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        """Compress ``tensor`` so that it costs about ``1/cf`` of its dense bytes on the wire.

        Args:
            tensor: the tensor to compress (any shape; fp32, fp16 or bf16).
            cf: compression factor, dense bytes / sent bytes, at least 1.
            key: a stable name of what is compressed (the parameter's name); methods with per-tensor state
                or shared randomness use it.
            step: the training step; methods with shared randomness use it so that all ranks agree.
        """

    @abstractmethod
    def decompress(self, payload: Payload) -> Tensor:
        """Decode ``payload`` to a dense tensor of the original shape and dtype."""

    def compress_into(self, tensor: Tensor, cf: float, out: Tensor, *, key: str = "", step: int = 0) -> Payload:
        """:meth:`compress`, the payload's one wire tensor written into ``out`` (flat, ``tensor.numel()`` entries of
        :attr:`wire_dtype`): a buffer the caller recycles, so that no payload-sized tensor is allocated a step. Only
        for a method with a :attr:`wire_dtype`."""
        raise NotImplementedError(f"{self.name} has no payload of a fixed dtype to write into a buffer")

    def compress_residual_(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload | None:
        """:meth:`compress`, ``tensor`` turned in place into ``tensor - decompress(payload)`` (what :meth:`residual_`
        leaves), in one pass where the method can (the block codes' compiled encode); ``None``, ``tensor`` untouched,
        where it cannot."""
        return None

    def probe(self, tensor: Tensor, cfs: Sequence[float], *, key: str = "", step: int = 0) -> Tensor:
        """``||C_cf(tensor)||^2`` for each factor in ``cfs``, as a float64 tensor; no side effects.

        The generic version compresses once per factor. Methods with state (momentum) must override it so that a
        probe does not advance that state.
        """
        norms = [self.sent_sq_norm(self.compress(tensor, cf, key=key, step=step)) for cf in cfs]
        return torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=tensor.device)

    def compress_and_probe(
        self, tensor: Tensor, cf: float, probe_cfs: Sequence[float], *, key: str = "", step: int = 0
    ) -> tuple[Payload, Tensor]:
        """:meth:`compress` at ``cf`` and :meth:`probe` at ``probe_cfs`` together (multi-level where nested)."""
        return self.compress(tensor, cf, key=key, step=step), self.probe(tensor, probe_cfs, key=key, step=step)

    def deliver_(
        self, units: Sequence[tuple[str, Tensor]], probe_cfs: Sequence[float] = (), *, step: int = 0
    ) -> dict[str, Tensor]:
        """Turn each ``(key, tensor)`` a step sends dense (factor 1) in place into what the method delivers there, for a
        method whose state of its own must reach the weights on dense steps too (DGC's momentum and accumulation); the
        new state is pending until :meth:`commit`. Returns, by key of each tensor changed, the kept squared norms at
        ``probe_cfs`` of the method's selection from what it delivers (float64, empty without factors). By default
        nothing changes: a dense step sends the tensor as it is."""
        return {}

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        """Add ``scale`` times the sum of several decoded payloads to the flat tensor ``out``.

        ``stacked`` holds the payloads of several ranks: each wire tensor has a leading rank dimension. The sum
        runs in rank order, so every rank computes the same bits.
        """
        for rank in range(stacked.wire[0].shape[0]):
            out.add_(self.decompress(stacked.with_wire([w[rank] for w in stacked.wire])).view(-1), alpha=scale)

    def decode_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        """Write ``scale`` times the sum of several decoded payloads into the flat tensor ``out``, whatever it held:
        :meth:`aggregate_` into ``out`` zeroed. A method that can write in one pass overrides it (the casts)."""
        out.zero_()
        self.aggregate_(out, stacked, scale)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        """Turn the error-fed ``tensor`` in place into the residual ``tensor - decompress(payload)``."""
        tensor.sub_(self.decompress(payload))

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        """Squared L2 norm of the decoded payload, in float64 (the statistics header's ``||C(g)||^2``). By default
        ``payload.sent`` when compressing found it, else of the payload decoded; a method whose decoded energy has a
        closed form overrides it (a decode is a gradient-sized allocation and pass)."""
        return payload.sent if payload.sent is not None else sq_norm(self.decompress(payload))

    # State. Methods with per-tensor state (momentum, factors) compute the new state in `compress` and keep it
    # pending; the hook commits it once every rank's gradient is known finite, or discards it.

    def commit(self, keys: Sequence[str]) -> None:
        """Make the pending state of ``keys`` current."""

    def discard(self, keys: Sequence[str]) -> None:
        """Drop the pending state of ``keys`` (the step was not finite on some rank)."""

    def setup(self, world_size: int, rank: int = 0) -> None:
        """Called once the process group exists, with its size and this process's rank."""

    def reset(self) -> None:
        """Drop the state kept across steps in gradient units (an accumulation that diverged); methods with such
        state override it."""

    def rescale_(self, factor: float) -> None:
        """Multiply the state kept in gradient units by ``factor``: the gradient scaler of mixed precision changed
        the scale the gradients carry (``factor`` = new scale / old). Methods that keep such state override it."""

    def on_epoch_start(self, epoch: int) -> None:
        """Called on every rank when a training epoch starts (schedules that follow epochs)."""

    def check_optimizer(self, optimizer: "torch.optim.Optimizer") -> None:
        """Raise ``ValueError`` if ``optimizer`` cannot be used with this method."""

    def state_dict(self) -> dict[str, object]:
        """This rank's method state, for checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`."""

    def factor_range(self, dtype: torch.dtype) -> tuple[float, float] | None:
        """The least and the most aggressive factor the method reaches on ``dtype`` gradients, when it clamps what it
        is asked for to a range (an adaptive controller's default bounds follow it); ``None`` when any factor from 1
        to the tensor's size can be sent."""
        return None

    def achieved_cf(self, payload: Payload) -> float:
        """Dense bytes / wire bytes of ``payload``."""
        dense = math.prod(payload.shape) * torch.empty((), dtype=payload.dtype).element_size()
        return dense / payload.nbytes

    @property
    def scratch(self) -> "Scratch":
        """Reused temporaries for this compressor's selections (created on first use)."""
        scratch = self.__dict__.get("_scratch")
        if scratch is None:
            scratch = self.__dict__["_scratch"] = Scratch()
        return scratch

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_CLAMPED: set[tuple[str, float]] = set()


def note_clamped(method: "Compressor", requested: float, achieved: float) -> None:
    """Warn, once per ``(method, requested)``, that a factor was clamped to one the method can reach.

    Methods with a fixed or stepped factor (1-bit, TernGrad, QSGD's bit widths, fp16) call it when they differ from
    the request by more than 10%; the step's ``gravac/achieved_cf`` metric logs what was achieved. A request of the
    method's own fixed factor is not a clamp: a small tensor's scale and padding only make it send a little more.
    """
    name = method.name
    if abs(achieved - requested) <= 0.1 * requested or requested == method.fixed_cf or (name, requested) in _CLAMPED:
        return
    _CLAMPED.add((name, requested))
    warnings.warn(
        f"{name}: a compression factor of {requested:g} is out of the method's reach; it sends at {achieved:.3g} "
        "instead for this tensor (every step's gravac/achieved_cf logs the whole model's).",
        stacklevel=3,
    )


#: Entries per partial norm in :func:`sq_norm`.
_NORM_CHUNK = 1024


def all_finite(tensor: Tensor) -> bool:
    """Whether every entry is finite, read off the float32 sum (NaN and Inf reach it; one pass, no allocation)."""
    return bool(torch.isfinite(tensor.sum(dtype=torch.float32)))


def sq_norm(tensor: Tensor) -> Tensor:
    """Squared L2 norm as a float64 0-d tensor.

    Contiguous fp32 on CPU: the compiled kernel's, each square exact in float64, summed in a fixed order (the norm
    error feedback's fused sum finds, bit for bit). Elsewhere, fp32 norms of 1024-entry chunks, their squares summed
    in float64: a float64 norm of the whole (``vector_norm(dtype=float64)``) converts every entry first, 20 times
    slower on a CPU; a float32 norm of the whole loses 0.3% over 25M entries. Chunks keep a relative error near 1e-7.
    """
    flat = tensor.reshape(-1)
    if kernels.usable(flat):
        return kernels.add_sq(flat, None, None)
    dtype = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else None
    whole = flat.numel() - flat.numel() % _NORM_CHUNK
    chunks = torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_CHUNK), dim=1, dtype=dtype)
    total = chunks.double().square().sum()
    if whole < flat.numel():
        total = total + torch.linalg.vector_norm(flat[whole:], dtype=dtype).double().square()
    return total


def validate_cf(cf: float, argument: str = "cf") -> float:
    """Check that a compression factor is a finite number of at least 1 and return it as a float."""
    if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf) or cf < 1:
        raise ValueError(f"`{argument}` must be a finite number >= 1 (1 means dense), got {cf!r}.")
    return float(cf)


def sparse_k(numel: int, cf: float, dtype: torch.dtype, index_bytes: int = INDEX_BYTES) -> int:
    """Number of entries a sparsifier keeps so that values plus indices cost ``1/cf`` of the dense bytes.

    ``cf`` is a ratio of bytes, so with fp32 values and int32 indices an entry costs two elements and
    ``cf=100`` keeps ``numel/200`` entries; without indices (``index_bytes=0``) it keeps ``numel/100``.
    Rounded up (never compress harder than asked), at least one entry, at most ``numel``.
    """
    value_bytes = torch.empty((), dtype=dtype).element_size()
    k = math.ceil(numel * value_bytes / (cf * (value_bytes + index_bytes)))
    return max(1, min(numel, k))


_REGISTRY: dict[str, type[Compressor]] = {}
_C = TypeVar("_C", bound=type[Compressor])


def register_compressor(cls: _C) -> _C:
    """Class decorator: make ``cls`` available to :func:`get_compressor` under ``cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"A compressor named {cls.name!r} is already registered ({_REGISTRY[cls.name].__name__}).")
    _REGISTRY[cls.name] = cls
    return cls


def list_compressors() -> list[str]:
    """Names of all registered compressors, sorted."""
    return sorted(_REGISTRY)


def get_compressor(name: str, **options: object) -> Compressor:
    """Instantiate the compressor registered as ``name`` with ``options``.

    Raises:
        ValueError: if no compressor is registered under ``name``; the message lists the known names.
    """
    try:
        cls: Callable[..., Compressor] = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"Unknown compressor {name!r}. Known compressors: {', '.join(list_compressors())}.") from None
    return cls(**options)
