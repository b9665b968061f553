"""The DDP communication hook: which path a bucket takes, and what it carries in.

Every bucket leaves through a communicator (:func:`~lightning_gravac.strategies.communicators.communicator_for`),
and every communicator ends in the same ``settle``, which hands the outcome to the carry
(:class:`~lightning_gravac.adaptations.Carry`, which stores or drops residuals and moved momentum). The hook decides the
path and prepares the bucket as a :class:`~lightning_gravac.strategies.communicators.Work`:

1. local SGD (from ``state.config.local_sgd_from``): nothing is sent; pending residuals go into the local step;
2. a sparse gradient: summed over ranks as stock DDP does;
3. every factor is 1, no probe is asked for: the plain all-reduce, bit for bit what stock DDP does (residuals left
   by earlier compressed steps are carried in and dropped once the result is known finite; a method with momentum of
   its own, DGC, delivers it first); embedding tables whose step touched few rows go by those rows (the same sum),
   on a half step too (what the fp16 rung's cast gives and keeps);
4. otherwise its segments (each layer, or the whole bucket) with their factors and methods (on a *half* step,
   ``state.factors.half``, the fp16 cast whatever the factor: the controller's 16-bit rung), the probes of the step's
   own gradient when the controller asks for them, and how error feedback is applied; the communicator of the
   method's pattern error-feeds and compresses the segments, launches the collectives and decodes the average into
   the bucket.

On every path that sends a layer or a bucket dense (factor 1), a method with momentum of its own (DGC) first turns it
into what it delivers there, its momentum and accumulation (``Compressor.deliver_``), its new state committed with the
rest by ``settle``.

Every compressed bucket carries a float64 header (``communicators.Header``), summed over ranks: ``||g||^2``,
``||C(g)||^2`` and the norms at the controller's probe factors; those are of the error-fed gradient by default and,
when the controller asks for the gain of the step's own gradient (``gain_of="gradient"``), of the gradient before the
residual is added, followed by its ``||grad||^2``. A non-finite ``||g||^2`` means some rank's gradient was not
finite: then the new residuals are dropped (the old ones stay, as if the step had not happened) and the bucket is
returned as NaN on every rank, so that a mixed-precision scaler skips the step as it would with stock DDP.

Collectives are launched from the thread that runs the hook, never from a future's callback, and no callback waits
for anything (``communicators`` says why). A collective that fails (a rank died, or stalled past the process group's
timeout) surfaces from ``backward`` as an error naming the compressor and what was waited for.
"""

import time

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gravac.adaptations import ResidualMode
from lightning_gravac.compressors.base import Pattern, sq_norm
from lightning_gravac.state import HALF, CompressionState, Factors
from lightning_gravac.strategies.communicators import PlainSend, Segment, Work, communicator_for


def gravac_hook(state: CompressionState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Compress, communicate and average one gradient bucket. Register with ``DDP.register_comm_hook(state, ...)``."""
    buffer = bucket.buffer()
    local = state.local_sgd_from is not None and state.step >= state.local_sgd_from
    if buffer.is_sparse:  # a sparse gradient (`nn.Embedding(sparse=True)`): DDP gives it a bucket of its own
        sparse = Work(state, buffer, [], [], [], local_sgd=local)
        return communicator_for(sparse).send(sparse)
    names = [state.param_names[id(p)] for p in bucket.parameters()]
    grads = bucket.gradients()
    carry = state.carry
    if local:
        if state.error_feedback:  # what compression still owed goes into the local step
            carry.flush_(names, grads)
        work = Work(state, buffer, [], names, grads, local_sgd=True)
        return communicator_for(work).send(work)

    # One decision for the whole bucket. A half step sends every parameter in fp16, a factor of 2 (the 16-bit rung).
    factors = state.factors
    cfs = [HALF if factors.half else state.cf_of(name) for name in names]
    dense = all(cf == 1.0 for cf in cfs)
    params = bucket.parameters() if carry.follows_average else []
    carry.direction_(names, grads, state.step)  # what an adaptation sends instead (Adam's direction once frozen)
    if not factors.probe_cfs:
        if dense:
            return _plain(state, buffer, names, grads, params, state.rows.in_bucket(names, state.step))
        # A half step of a bucket with embedding tables, by their rows where few were touched (`RowsReduced`: the
        # fp16 rung's sum, its rounding not kept), where no SGD momentum moved into the hook has to follow the cast.
        if factors.half and not carry.follows_average and state.rows.holds_table(names):
            return _plain(state, buffer, names, grads, params, state.rows.in_bucket(names, state.step), half=True)

    start = time.perf_counter()
    carry.before_compression_(names, grads, params)  # this rank's momentum: what is compressed is the update direction
    # The gain of the step's own gradient is measured before any residual is added to it (in place, below).
    fresh, measuring = _fresh_gains(state, factors, names, grads, buffer)
    start += measuring  # not compression's cost: the controller weighs what sending a factor costs, measuring aside
    # Per layer, the residual is added into the gradient in place, in the bucket, and the new residual is written over
    # the old one once the step is known finite (`communicators.land`): error feedback keeps one buffer a parameter.
    # PowerSGD's rounds write the residual before the step is known finite: the memory recycles a second buffer there.
    # Dense steps and whole buckets add it in place and copy the new residual.
    residual_mode: ResidualMode = "off"
    if state.error_feedback:
        residual_mode = "copy"
        if state.granularity == "layer" and not dense:
            rounds = state.compressor.communication is Pattern.ROUNDS and not factors.half
            residual_mode = "recycle" if rounds else "in_place"
        if residual_mode == "copy":
            carry.compensate_(names, grads)
    segments = _segments(state, factors, names, grads, cfs, buffer)
    work = Work(state, buffer, segments, names, grads, residual_mode, dense, fresh, start)
    sent_dense = [(s.key, s.tensor) for s in segments if dense or s.compressor is state.identity]
    work.delivered = state.compressor.deliver_(sent_dense, work.probe_cfs, step=state.step)
    return communicator_for(work).send(work)


def _plain(
    state: CompressionState,
    buffer: Tensor,
    names: list[str],
    grads: list[Tensor],
    params: list[Tensor],
    rows: list[int],
    half: bool = False,
) -> Future[Tensor]:
    """Every factor 1 (or a half step of ``rows``), nothing probed: the plain all-reduce, of the embedding tables at
    ``rows`` by the rows their step touched. With buffers in sync and no residual pending, the moved momentum applies
    after it, bit for bit as the optimizer's would; else each rank's momentum moves first and the pending residuals
    are carried in, sent in full. A method with momentum of its own delivers it (DGC)."""
    carry = state.carry
    carried = state.error_feedback and carry.owes(names)
    exact = carry.exact(names) and not carried
    work = Work(state, buffer, [], names, grads, plain=PlainSend(params, exact, rows, half))
    if not half:  # a half step sends the cast, as the rung's own path does, not what a method delivers dense
        work.delivered = state.compressor.deliver_(_units(state, names, grads, buffer), step=state.step)
    if not exact:
        carry.before_compression_(names, grads, params)
        if state.error_feedback:
            work.pending = dict.fromkeys(carry.compensate_(names, grads))
    return communicator_for(work).send(work)


def _segments(
    state: CompressionState, factors: Factors, names: list[str], grads: list[Tensor], cfs: list[float], buffer: Tensor
) -> list[Segment]:
    """The bucket's units of compression: each layer at its factor (a factor of 1 sends it unchanged), or the whole
    bucket at the global factor (per-layer factors need layer granularity)."""
    method = state.cast if factors.half else state.compressor
    if state.granularity == "bucket":
        return [Segment(_bucket_key(names), buffer, cfs[0] if factors.half else factors.cf, method, buffer)]
    return [
        Segment(name, grad, cf, state.identity if cf == 1.0 else method, grad)
        for name, grad, cf in zip(names, grads, cfs, strict=True)
    ]


def _fresh_gains(
    state: CompressionState, factors: Factors, names: list[str], grads: list[Tensor], buffer: Tensor
) -> tuple[tuple[Tensor, Tensor] | None, float]:
    """The probes of the step's own gradient when the controller asks for them, and the seconds they took."""
    if not (factors.probe_cfs and factors.gain_of == "gradient"):
        return None, 0.0
    started = time.perf_counter()
    fresh = _fresh_probes(state, factors.probe_cfs, names, grads, buffer)
    return fresh, time.perf_counter() - started


def _fresh_probes(
    state: CompressionState, probe_cfs: tuple[float, ...], names: list[str], grads: list[Tensor], buffer: Tensor
) -> tuple[Tensor, Tensor]:
    """``(sum ||C_cf(grad)||^2 at the probe factors, ||grad||^2)`` of this rank's own gradient, unit by unit as it
    is compressed (each layer, or the whole bucket)."""
    units = _units(state, names, grads, buffer)
    probes = [state.compressor.probe(t, probe_cfs, key=key, step=state.step) for key, t in units]
    return torch.stack(probes).sum(0), sq_norm(buffer)


def _units(state: CompressionState, names: list[str], grads: list[Tensor], buffer: Tensor) -> list[tuple[str, Tensor]]:
    """The bucket's units of compression by key: each layer's gradient, or the whole bucket."""
    if state.granularity == "bucket":
        return [(_bucket_key(names), buffer)]
    return list(zip(names, grads, strict=True))


def _bucket_key(names: list[str]) -> str:
    """The key of a whole bucket's state, named by its first parameter."""
    return f"bucket:{names[0]}"
