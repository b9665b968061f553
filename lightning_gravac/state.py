"""The state the comm hook reads and the statistics it leaves for the controller."""

import math
import threading
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gravac.compressors.base import Compressor
from lightning_gravac.compressors.cast import FP16
from lightning_gravac.compressors.none import NoCompression
from lightning_gravac.feedback import Feedback
from lightning_gravac.tables import RowTables

Granularity = Literal["layer", "bucket"]
GainOf = Literal["error_fed", "gradient"]


class Collective(IntEnum):
    """How a bucket crossed the network: its packed payloads all-gathered, or an all-reduce (of the dense bucket, of
    summable payloads, or of the locally decoded gradient)."""

    GATHER = 0
    REDUCE = 1


GATHER, REDUCE = Collective.GATHER, Collective.REDUCE


def ring_share(world_size: int) -> float:
    """The share of an all-reduced buffer each rank moves in a ring all-reduce: ``2 (N-1)/N``."""
    return 2 * (world_size - 1) / world_size


def gathers(payload_bytes: float, dense_bytes: float, world_size: int) -> bool:
    """Whether the hook all-gathers a bucket's payloads rather than all-reducing it dense: when each rank then moves
    fewer bytes, ``(N-1)`` payloads against a ring all-reduce's ``2 (N-1)/N`` of the dense buffer, i.e. when
    ``N x payload < 2 x dense``."""
    return world_size * payload_bytes < 2 * dense_bytes


#: The factor of a ``half`` step: fp16 on the wire from an fp32 gradient.
HALF = 2.0
#: The factor of a dense step: the gradient as it is.
DENSE = 1.0


@dataclass
class BucketRecord:
    """What one bucket of one step cost and kept. Norms are summed over ranks, so equal on every rank."""

    bytes_sent: int
    bytes_dense: int
    collective: Collective
    sq_norm: float = 0.0
    sq_norm_sent: float = 0.0
    compress_s: float = 0.0
    comm_s: float = 0.0
    probe_sq: tuple[float, ...] = ()
    probe_basis: float = 0.0  # what the probes are relative to: ``sq_norm``, or ``||grad||^2`` for the fresh gradient
    lossless: bool = False  # the dense all-reduce's sum, in whatever bytes it took (embedding tables by their rows)


@dataclass
class StepStats:
    """One step's statistics, summed over its buckets.

    ``bytes_sent`` counts what this rank put into the collectives: values and int32 indices (or packed bits),
    the 16-byte statistics header of each compressed bucket and the padding to 8 bytes. ``bytes_dense`` is what
    plain DDP would have sent (numel x element size). Both are identical on every rank; so are the norms,
    which crossed the network. The timings are this rank's own. ``probe_sq[i]`` is ``sum_ranks ||C(g)||^2`` at the
    factor ``probe_cfs[i]`` the controller asked the hook to measure, of the gradient ``probe_basis`` is the squared
    norm of: the error-fed gradient (``== sq_norm``) or, with ``gain_of="gradient"``, the step's own.
    """

    bytes_sent: int = 0
    bytes_dense: int = 0
    sq_norm: float = 0.0
    sq_norm_sent: float = 0.0
    compress_s: float = 0.0
    comm_s: float = 0.0
    gathered: int = 0
    buckets: int = 0
    probe_cfs: tuple[float, ...] = ()
    probe_sq: list[float] = field(default_factory=list)
    probe_basis: float = 0.0
    lossless_sent: int = 0  # of the buckets that sent the dense sum (`BucketRecord.lossless`)
    lossless_dense: int = 0

    def probe_gains(self) -> dict[float, float]:
        """The gain at each probed factor, ``sum ||C_cf(g)||^2 / sum ||g||^2``."""
        if self.probe_basis <= 0:
            return dict.fromkeys(self.probe_cfs, 1.0)
        return {cf: sq / self.probe_basis for cf, sq in zip(self.probe_cfs, self.probe_sq, strict=True)}

    @property
    def finite(self) -> bool:
        """Whether every rank's gradient was finite this step (a NaN or Inf anywhere makes the sums non-finite)."""
        return math.isfinite(self.sq_norm) and all(math.isfinite(v) for v in self.probe_sq)

    @property
    def compressed(self) -> bool:
        """Whether the step's lossy buckets sent fewer bytes than dense, and some (a step that only carried probes for
        the controller sent more; a local SGD step sends none; embedding tables sent by their rows are the dense
        sum in fewer bytes, not compression)."""
        return 0 < self.bytes_sent - self.lossless_sent < self.bytes_dense - self.lossless_dense

    @property
    def gain(self) -> float:
        """``sum_ranks ||C(g)||^2 / sum_ranks ||g||^2`` for the error-fed gradient ``g``; 1.0 when dense."""
        return self.sq_norm_sent / self.sq_norm if self.sq_norm > 0 else 1.0

    @property
    def achieved_cf(self) -> float:
        """Dense bytes / bytes sent."""
        return self.bytes_dense / self.bytes_sent if self.bytes_sent else 1.0

    @classmethod
    def of(cls, records: list[BucketRecord], probe_cfs: tuple[float, ...] = ()) -> "StepStats":
        stats = cls(buckets=len(records), probe_cfs=probe_cfs, probe_sq=[0.0] * len(probe_cfs))
        for r in records:
            if r.probe_sq:
                stats.probe_sq = [a + b for a, b in zip(stats.probe_sq, r.probe_sq, strict=True)]
            stats.bytes_sent += r.bytes_sent
            stats.bytes_dense += r.bytes_dense
            stats.sq_norm += r.sq_norm
            stats.sq_norm_sent += r.sq_norm_sent
            stats.probe_basis += r.probe_basis
            stats.compress_s += r.compress_s
            stats.comm_s += r.comm_s
            stats.gathered += r.collective == GATHER
            if r.lossless:
                stats.lossless_sent += r.bytes_sent
                stats.lossless_dense += r.bytes_dense
        return stats


@dataclass
class CompressionState:
    """Everything the comm hook needs, owned by :class:`~lightning_gravac.GraVACStrategy`.

    Created with the strategy (so it pickles with it for ``ddp_spawn``) and bound to the DDP model and process
    group when the hook is registered.
    """

    # What to do: fixed for the run (the strategy's arguments).
    compressor: Compressor
    error_feedback: bool
    granularity: Granularity = "layer"

    # What the controller decides (written by the controller only); must be identical on every rank.
    cf: float = 1.0
    param_cf: dict[str, float] = field(default_factory=dict)
    probe_cfs: tuple[float, ...] = ()  # factors whose gain the hook measures as well (GraVAC's candidates)
    gain_of: GainOf = "error_fed"  # what the probes compress: the error-fed gradient, or the step's own gradient
    half: bool = False  # send this step whole in fp16 (the model search's 16-bit rung), whatever the factors say
    # Fixed by the strategy at setup.
    local_sgd_from: int | None = None  # the step from which gradients stay local (periodic model averaging)
    rows: RowTables = field(default_factory=RowTables)  # embedding tables sent by their touched rows (`tables`)

    # Bound at hook registration (by the strategy).
    process_group: dist.ProcessGroup | None = None
    world_size: int = 1
    param_names: dict[int, str] = field(default_factory=dict)

    # Carried across steps: residuals and moved moments (written by `feedback/`'s code alone), the step's bookkeeping.
    feedback: Feedback = field(default_factory=Feedback)
    step: int = 0  # steps that communicated: advanced by `end_step` only (it seeds every method's draws)
    epoch: int = -1  # the training epoch the compressor was last told of (`begin_step`)
    grad_scale: float | None = None  # the mixed-precision gradient scale the residuals are in (None: none or unknown)

    _records: list[BucketRecord] = field(default_factory=list)  # this step's buckets, from the hook's callbacks
    _done: list[BucketRecord] = field(default_factory=list)  # ended steps' buckets, not yet read by the controller
    _lock: threading.Lock = field(default_factory=threading.Lock)
    identity: Compressor = field(default_factory=NoCompression)
    cast: Compressor = field(default_factory=FP16)  # what a ``half`` step sends with
    _wires: dict[str, Tensor] = field(default_factory=dict)  # summed payloads' buffers by bucket, recycled each step
    _wires_used: set[str] = field(default_factory=set)  # the buckets whose buffer this step wrote

    def bind(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        """Name the parameters of ``module`` (the unwrapped model) and remember the group."""
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.compressor.setup(self.world_size, dist.get_rank(process_group))
        self.param_names = {id(p): name for name, p in module.named_parameters()}
        self.rows.find(module, self.world_size)

    def use_method(self, compressor: Compressor, error_feedback: bool) -> None:
        """Send with ``compressor`` from now on (set up for this process group when bound); before any step."""
        self.compressor, self.error_feedback = compressor, error_feedback
        if self.world_size and dist.is_initialized():
            compressor.setup(self.world_size, dist.get_rank(self.process_group))

    def reset(self) -> None:
        """Drop what compression accumulated across steps in gradient units: the residuals, the moved momentum and the
        method's own accumulations (the divergence guard's remedy: they hold what exploded)."""
        self.feedback.reset()
        self.compressor.reset()

    def rescale_(self, factor: float) -> None:
        """The gradients' scale changed by ``factor`` (a mixed-precision scaler): what is kept in gradient units, the
        residuals and the method's own accumulations, follows it."""
        self.feedback.rescale_(factor)
        self.compressor.rescale_(factor)

    def follow_scale(self, scale: float) -> None:
        """Keep the residuals (and a method's own accumulations) in the units of the gradients the hook will see.

        Under fp16 mixed precision the hook sees gradients multiplied by the scaler's ``scale``, which halves after a
        skipped step and grows after a run of good ones. What error feedback carries over was stored in the old
        units: rescaled here by new / old (powers of 2, exact), so the pending update is neither doubled nor halved.
        """
        if self.grad_scale is not None and scale != self.grad_scale:
            self.rescale_(scale / self.grad_scale)
        self.grad_scale = scale

    def cf_of(self, name: str) -> float:
        """The factor in force for parameter ``name``: its own if the controller set one, else the global one."""
        if self.compressor.passthrough:
            return 1.0
        return self.param_cf.get(name, self.cf)

    def wire_buffer(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat buffer for bucket ``key``'s summed payloads, the same one step after step while its size and type
        stay (a bucket's collectives end before the next step's hook for it starts): a payload-sized allocation and
        its page faults saved a step, at the price of keeping it between steps. A step that wrote any drops those of
        buckets it did not write (DDP's rebuilt buckets leave the first step's behind: :meth:`end_step`)."""
        self._wires_used.add(key)
        buffer = self._wires.get(key)
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self._wires[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer

    def record(self, record: BucketRecord) -> None:
        # Records arrive from the hook's future callbacks, which may run on the backend's thread.
        with self._lock:
            self._records.append(record)

    def begin_step(self, epoch: int) -> None:
        """Called by the strategy before each batch: tells the compressor when the training epoch changed (epoch-driven
        schedules such as DGC's warm-up)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.compressor.on_epoch_start(epoch)

    def end_step(self) -> None:
        """Called by the strategy after each backward pass: a pass that communicated (not a gradient-accumulation one)
        is a step; :attr:`step` advances and its buckets wait for :meth:`take_stats`."""
        with self._lock:
            records, self._records = self._records, []
        if self._wires_used:
            self._wires = {key: buffer for key, buffer in self._wires.items() if key in self._wires_used}
            self._wires_used = set()
        if records:
            self.step += 1
            self._done += records

    def take_stats(self) -> StepStats | None:
        """The statistics of the steps ended since the last call (one, but for several backward passes in a batch
        under manual optimization), or ``None`` if none communicated. Reading them changes nothing else."""
        records, self._done = self._done, []
        return StepStats.of(records, self.probe_cfs) if records else None

    def pop_stats(self) -> StepStats | None:
        """:meth:`end_step` and :meth:`take_stats` at once, for the hook used without the strategy (torch DDP)."""
        self.end_step()
        return self.take_stats()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_lock")
        state["process_group"] = None
        state["_wires"], state["_wires_used"] = {}, set()  # scratch: recycled buffers, not state
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
