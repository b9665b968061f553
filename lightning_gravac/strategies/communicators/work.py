"""One bucket on its way through a communicator: its segments, and what the communicator leaves to settle."""

import time
from dataclasses import dataclass, field

from torch import Tensor

from lightning_gravac.adaptations import ResidualMode
from lightning_gravac.compressors.base import Compressor, Payload
from lightning_gravac.state import CompressionState


@dataclass(frozen=True)
class Segment:
    """One unit of compression: a layer's gradient, or the whole bucket."""

    key: str
    tensor: Tensor  # what is compressed: the gradient (error-fed on the way, by `Work.residual_mode`), or the bucket
    cf: float
    compressor: Compressor
    out: Tensor  # where the averaged result goes: a view into the bucket buffer


@dataclass(frozen=True)
class PlainSend:
    """How a bucket sent as stock DDP sends it goes (`Plain`, or `RowsReduced` with ``rows`` or ``half``).

    Attributes:
        params: its parameters, when SGD momentum is moved into the hook.
        exact: that momentum applies after the all-reduce (buffers in sync, nothing carried in).
        rows: the positions in the bucket's ``names`` of the embedding tables sent by their touched rows.
        half: it goes in fp16 (a half step).
    """

    params: list[Tensor] = field(default_factory=list)
    exact: bool = False
    rows: list[int] = field(default_factory=list)
    half: bool = False


@dataclass
class Work:
    """One bucket on its way through a communicator.

    Written by the hook: everything up to ``start``. Written by the communicator: the payloads, the header and the
    pending residuals (by parameter; ``None`` drops one), committed by :func:`settle` once the step is known finite
    on every rank.
    """

    state: CompressionState
    buffer: Tensor
    segments: list[Segment]
    names: list[str]  # the bucket's parameters
    grads: list[Tensor]  # their gradients: views into `buffer`
    residual_mode: ResidualMode = "off"  # how each segment's residual is added and kept (`encode`)
    dense_probed: bool = False  # every factor is 1: sent dense while the controller probes (`DenseProbed`)
    fresh: tuple[Tensor, Tensor] | None = None  # the probes of the step's own gradient and its ||grad||^2
    start: float = field(default_factory=time.perf_counter)
    payloads: list[Payload] = field(default_factory=list)
    wire: Tensor | None = None  # the recycled buffer that holds every segment's payload in order (summed casts)
    header: Tensor | None = None
    pending: dict[str, Tensor | None] = field(default_factory=dict)
    # Segments error-fed in place (``residual_mode="in_place"``) whose residual is taken once the step is known finite,
    # before the decoded average overwrites them (`land`): (key, error-fed tensor, its method, its payload).
    deferred: list[tuple[str, Tensor, Compressor, Payload]] = field(default_factory=list)
    plain: PlainSend | None = None  # a bucket sent as stock DDP sends it; `None`: any other path
    local_sgd: bool = False  # local SGD: nothing is sent (`LocalSGD`)
    # The units sent dense that hold what their method delivers there (DGC's momentum and accumulation), by key, with
    # the probes of it (`Compressor.deliver_`); the method's state of those keys is pending until `settle`.
    delivered: dict[str, Tensor] = field(default_factory=dict)

    @property
    def dense_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def probe_cfs(self) -> tuple[float, ...]:
        """The factors the header's probes are of, when measured here (not from the step's own gradient)."""
        return () if self.fresh is not None else self.state.factors.probe_cfs

    @property
    def method(self) -> Compressor:
        """The method that compresses this step's segments: the strategy's, or the cast of a half step."""
        return next((s.compressor for s in self.segments if not s.compressor.passthrough), self.state.compressor)
