"""The state the comm hook reads and the statistics it leaves for the controller."""

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum
from typing import Any, Generic, Literal, TypeVar, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gravac.adaptations import Carry
from lightning_gravac.compressors.base import Compressor
from lightning_gravac.compressors.cast import FP16
from lightning_gravac.compressors.none import NoCompression
from lightning_gravac.tables import RowTables

Granularity = Literal["layer", "bucket"]
GainOf = Literal["error_fed", "gradient"]
_T = TypeVar("_T")


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
    sq_norm_mean: float = 0.0  # on a step that probes: ``||result||^2`` of the bucket's average, else 0
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
    sq_norm_mean: float = 0.0  # on a step that probes, ``||average||^2`` of the buckets with a header; else 0
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

    def variance_weight(self, world_size: int) -> float | None:
        """How much a rank's unbiased code variance counts against the average's own noise:
        ``sum_i ||x_i||^2 / ||sum_i x_i||^2``, between ``1/N`` (no noise between the ranks' batches: the code's
        variance is averaged over the ``N`` ranks, the gradient is not) and 1 (the batches' noise dominates, as much
        again as the code adds). ``||sum_i x_i||^2`` is taken from the average received, less what the code's variance
        added to it (``(sent - basis) / N^2``, summed over ranks). ``None`` on a step without the average's norm."""
        n = world_size
        if self.sq_norm_mean <= 0 or self.sq_norm <= 0 or n < 2:
            return None
        signal = self.sq_norm_mean - (self.sq_norm_sent - self.sq_norm) / n**2
        if signal <= 0:  # the noise buries the average: the code's variance counts in full
            return 1.0
        return min(1.0, max(1.0 / n, self.sq_norm / (n**2 * signal)))

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
            stats.sq_norm_mean += r.sq_norm_mean
            stats.compress_s += r.compress_s
            stats.comm_s += r.comm_s
            stats.gathered += r.collective == GATHER
            if r.lossless:
                stats.lossless_sent += r.bytes_sent
                stats.lossless_dense += r.bytes_dense
        return stats


@dataclass
class Config:
    """What the hook does, fixed for the run: the strategy's arguments, and the methods a step sends with besides the
    run's. Two are settled later, once: the method, before any step (:meth:`CompressionState.use_method`), and the
    step local SGD starts from, when the default controller chooses local steps (``callbacks/gravac/rounds.py``)."""

    compressor: Compressor
    error_feedback: bool
    granularity: Granularity = "layer"
    local_sgd_from: int | None = None  # the step from which gradients stay local (periodic model averaging)
    identity: Compressor = field(default_factory=NoCompression)  # what a layer at factor 1 is sent with
    cast: Compressor = field(default_factory=FP16)  # what a ``half`` step sends with


@dataclass(frozen=True)
class Factors:
    """What the controller decided for the next step: the factors it sends at and the ones it measures. Identical on
    every rank. Handed to the hook whole (:meth:`CompressionState.decide`), never field by field, so that the hook
    reads one decision; the controller owns it (:attr:`~lightning_gravac.callbacks.Controller.decided`).

    Attributes:
        cf: the factor of every parameter without one of its own.
        param_cf: per-parameter factors, by name (Accordion's); a mapping the hook only reads.
        probe_cfs: factors whose gain the hook measures as well (GraVAC's candidates).
        gain_of: what the probes compress: the error-fed gradient, or the step's own gradient.
        half: send the step whole in fp16 (the model search's 16-bit rung), whatever the factors say.
    """

    cf: float = DENSE
    param_cf: Mapping[str, float] = field(default_factory=dict)
    probe_cfs: tuple[float, ...] = ()
    gain_of: GainOf = "error_fed"
    half: bool = False

    def dense(self, half: bool = False) -> "Factors":
        """These factors held whole: factor 1 everywhere and nothing probed, in fp16 if ``half``."""
        return replace(self, cf=DENSE, param_cf={}, probe_cfs=(), half=half)


@dataclass
class Binding:
    """What the hook learns at registration (:meth:`CompressionState.bind`): the process group, its size, the
    parameters' names and the embedding tables it may send by their rows. The group is a handle of this process:
    a pickled state (``ddp_spawn``) is bound again in the process that runs it."""

    process_group: dist.ProcessGroup | None = None
    world_size: int = 1
    param_names: dict[int, str] = field(default_factory=dict)
    rows: RowTables = field(default_factory=RowTables)  # embedding tables sent by their touched rows (`tables`)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "process_group": None}


#: The metadata of a :class:`Carried` field a checkpoint saves as it is (the same on every rank).
SAVED = {"saved": True}


@dataclass
class Carried:
    """What the hook carries from step to step: residuals and moved moments (written by ``adaptations/``'s code alone),
    and the step's bookkeeping. A checkpoint saves the carry rank by rank (``strategies/checkpoint.py``) and
    the fields declared ``SAVED`` once."""

    carry: Carry = field(default_factory=Carry)
    step: int = field(default=0, metadata=SAVED)  # steps that communicated: advanced by `end_step` only (seeds draws)
    grad_scale: float | None = field(default=None, metadata=SAVED)  # the mixed-precision scale the residuals are in
    # The training epoch the compressor was last told of (`begin_step`): not saved, a resumed fit tells it again.
    epoch: int = -1

    def saved(self) -> dict[str, Any]:
        """The fields a checkpoint saves as they are, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("saved")}

    def restore(self, saved: dict[str, Any]) -> None:
        """The fields :meth:`saved` wrote; one a checkpoint lacks takes its default."""
        for f in fields(self):
            if f.metadata.get("saved"):
                setattr(self, f.name, saved.get(f.name, f.default))


class Scratch:
    """What one step leaves behind for the next reader: the buckets' records and the recycled wire buffers. Never
    saved; pickled empty (its lock cannot be pickled, and its buffers are not state)."""

    def __init__(self) -> None:
        self.records: list[BucketRecord] = []  # this step's buckets, from the hook's callbacks
        self.done: list[BucketRecord] = []  # ended steps' buckets, not yet read by the controller
        self.lock = threading.Lock()
        self.wires: dict[str, Tensor] = {}  # summed payloads' buffers by bucket, recycled each step
        self.wires_used: set[str] = set()  # the buckets whose buffer this step wrote

    def __reduce__(self) -> tuple[type["Scratch"], tuple[()]]:
        return Scratch, ()  # unpickled empty

    def record(self, record: BucketRecord) -> None:
        # Records arrive from the hook's future callbacks, which may run on the backend's thread.
        with self.lock:
            self.records.append(record)

    def record_ended(self, record: BucketRecord) -> None:
        """See :meth:`CompressionState.record_ended`."""
        with self.lock:
            self.done.append(record)

    def wire_buffer(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """See :meth:`CompressionState.wire_buffer`."""
        self.wires_used.add(key)
        buffer = self.wires.get(key)
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self.wires[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer

    def end_step(self) -> bool:
        """The step's records move to :attr:`done`, and a step that wrote wire buffers drops those it did not write;
        whether it communicated (left any record)."""
        with self.lock:
            records, self.records = self.records, []
        if self.wires_used:
            self.wires = {key: buffer for key, buffer in self.wires.items() if key in self.wires_used}
            self.wires_used = set()
        self.done += records
        return bool(records)

    def take_done(self) -> list[BucketRecord]:
        """The ended steps' records, once."""
        records, self.done = self.done, []
        return records


class _Of(Generic[_T]):
    """A field of one of the state's parts, read through the state (``state.step`` is ``state.carried.step``). Written
    through its part alone, so that every write names the part it changes."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, state: None, owner: type) -> "_Of[_T]": ...

    @overload
    def __get__(self, state: object, owner: type) -> _T: ...

    def __get__(self, state: object | None, owner: type) -> "_T | _Of[_T]":
        if state is None:
            return self
        value: _T = getattr(getattr(state, self.part), self.name)
        return value

    def __set__(self, state: object, value: _T) -> None:
        raise AttributeError(f"`{self.name}` is written through its part: `state.{self.part}.{self.name}`.")


class CompressionState:
    """Everything the comm hook needs, owned by :class:`~lightning_gravac.GraVACStrategy`, in parts by who writes
    them and how long they live:

    - :attr:`config` (:class:`Config`): what to do, fixed for the run (the strategy's arguments);
    - :attr:`factors` (:class:`Factors`): what the controller decided for the next step (:meth:`decide`, its only
      writer); identical on every rank;
    - :attr:`binding` (:class:`Binding`): the process group and the model's names, set at hook registration;
    - :attr:`carried` (:class:`Carried`): residuals, moved moments and the step count, carried across steps and saved;
    - :attr:`scratch` (:class:`Scratch`): the records and buffers one step leaves, never saved.

    Each field reads through the state too (``state.compressor``, ``state.step``, ``state.cf``); writes go through
    its part. Created with the strategy (so it pickles with it for ``ddp_spawn``: the group and the scratch stay
    behind) and bound to the DDP model and process group when the hook is registered.

    Args:
        compressor: the method.
        error_feedback: keep what compression dropped and add it to the next gradient.
        granularity: ``"layer"`` or ``"bucket"``.
        cf: the factor before any controller decides.
        local_sgd_from: the step from which gradients stay local; ``None``: never.
        carry: what the hook carries from step to step (a fresh one by default).
    """

    compressor: _Of[Compressor] = _Of("config")
    error_feedback: _Of[bool] = _Of("config")
    granularity: _Of[Granularity] = _Of("config")
    local_sgd_from: _Of[int | None] = _Of("config")
    identity: _Of[Compressor] = _Of("config")
    cast: _Of[Compressor] = _Of("config")
    cf: _Of[float] = _Of("factors")
    param_cf: _Of[Mapping[str, float]] = _Of("factors")
    probe_cfs: _Of[tuple[float, ...]] = _Of("factors")
    gain_of: _Of[GainOf] = _Of("factors")
    half: _Of[bool] = _Of("factors")
    process_group: _Of[dist.ProcessGroup | None] = _Of("binding")
    world_size: _Of[int] = _Of("binding")
    param_names: _Of[dict[int, str]] = _Of("binding")
    rows: _Of[RowTables] = _Of("binding")
    carry: _Of[Carry] = _Of("carried")
    step: _Of[int] = _Of("carried")
    grad_scale: _Of[float | None] = _Of("carried")
    epoch: _Of[int] = _Of("carried")

    def __init__(
        self,
        compressor: Compressor,
        error_feedback: bool,
        granularity: Granularity = "layer",
        *,
        cf: float = DENSE,
        local_sgd_from: int | None = None,
        carry: Carry | None = None,
    ) -> None:
        self.config = Config(compressor, error_feedback, granularity, local_sgd_from)
        self.factors = Factors(cf=cf)
        self.binding = Binding()
        self.carried = Carried(Carry() if carry is None else carry)
        self.scratch = Scratch()

    def decide(self, factors: Factors) -> None:
        """Send the next steps at ``factors`` (the controller's decision, or a hold of it): the one write of them."""
        self.factors = factors

    def bind(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        """Name the parameters of ``module`` (the unwrapped model) and remember the group."""
        binding = self.binding
        binding.process_group = process_group
        binding.world_size = dist.get_world_size(process_group)
        self.compressor.setup(binding.world_size, dist.get_rank(process_group))
        binding.param_names = {id(p): name for name, p in module.named_parameters()}
        binding.rows.find(module, binding.world_size)

    def use_method(self, compressor: Compressor, error_feedback: bool) -> None:
        """Send with ``compressor`` from now on (set up for this process group when bound); before any step."""
        self.config.compressor, self.config.error_feedback = compressor, error_feedback
        if self.world_size and dist.is_initialized():
            compressor.setup(self.world_size, dist.get_rank(self.process_group))

    def reset(self) -> None:
        """Drop what compression accumulated across steps in gradient units: the residuals, the moved momentum and the
        method's own accumulations (the divergence guard's remedy: they hold what exploded)."""
        self.carry.reset()
        self.compressor.reset()

    def rescale_(self, factor: float) -> None:
        """The gradients' scale changed by ``factor`` (a mixed-precision scaler): what is kept in gradient units, the
        residuals and the method's own accumulations, follows it."""
        self.carry.rescale_(factor)
        self.compressor.rescale_(factor)

    def follow_scale(self, scale: float) -> None:
        """Keep the residuals (and a method's own accumulations) in the units of the gradients the hook will see.

        Under fp16 mixed precision the hook sees gradients multiplied by the scaler's ``scale``, which halves after a
        skipped step and grows after a run of good ones. What error feedback carries over was stored in the old
        units: rescaled here by new / old (powers of 2, exact), so the pending update is neither doubled nor halved.
        """
        if self.grad_scale is not None and scale != self.grad_scale:
            self.rescale_(scale / self.grad_scale)
        self.carried.grad_scale = scale

    def cf_of(self, name: str) -> float:
        """The factor in force for parameter ``name``: its own if the controller set one, else the global one."""
        if self.compressor.passthrough:
            return 1.0
        return self.factors.param_cf.get(name, self.factors.cf)

    def wire_buffer(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat buffer for bucket ``key``'s summed payloads, the same one step after step while its size and type
        stay (a bucket's collectives end before the next step's hook for it starts): a payload-sized allocation and
        its page faults saved a step, at the price of keeping it between steps. A step that wrote any drops those of
        buckets it did not write (DDP's rebuilt buckets leave the first step's behind: :meth:`end_step`)."""
        return self.scratch.wire_buffer(key, numel, dtype, device)

    def record(self, record: BucketRecord) -> None:
        """Keep one bucket's record of this step (from a future's callback, on whichever thread runs it)."""
        self.scratch.record(record)

    def record_ended(self, record: BucketRecord) -> None:
        """Keep a record of what the step that just ended sent after its backward pass (a round of local steps ends
        after the optimizer's step): read with that step's buckets, without making a step of its own, so that
        :attr:`step` advances once an optimizer step, as Lightning's ``global_step`` does."""
        self.scratch.record_ended(record)

    def begin_step(self, epoch: int) -> None:
        """Called by the strategy before each batch: tells the compressor when the training epoch changed (epoch-driven
        schedules such as DGC's warm-up)."""
        if epoch != self.epoch:
            self.carried.epoch = epoch
            self.compressor.on_epoch_start(epoch)

    def end_step(self) -> None:
        """Called by the strategy after each backward pass: a pass that communicated (not a gradient-accumulation one)
        is a step; :attr:`step` advances and its buckets wait for :meth:`take_stats`."""
        if self.scratch.end_step():
            self.carried.step += 1

    def take_stats(self) -> StepStats | None:
        """The statistics of the steps ended since the last call (one, but for several backward passes in a batch
        under manual optimization), or ``None`` if none communicated. Reading them changes nothing else."""
        records = self.scratch.take_done()
        return StepStats.of(records, self.factors.probe_cfs) if records else None

    def pop_stats(self) -> StepStats | None:
        """:meth:`end_step` and :meth:`take_stats` at once, for the hook used without the strategy (torch DDP)."""
        self.end_step()
        return self.take_stats()
