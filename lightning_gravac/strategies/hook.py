"""The DDP communication hook: which path a bucket takes, and what it carries in.

Data flow for one bucket:

1. every factor is 1, no probe is asked for: plain all-reduce, bit for bit what stock DDP does (residuals left by
   earlier compressed steps are added in and dropped once the result is known finite);
2. otherwise the bucket is prepared as a :class:`~lightning_gravac.strategies.communicators.Work`: its segments (each
   layer, or the whole bucket) with their factors and methods (on a *half* step, ``state.half``, the fp16 cast
   whatever the factor: the controller's 16-bit rung), the probes of the step's own gradient when the controller
   asks for them, and how error feedback is applied;
3. the communicator of the method's pattern (:func:`~lightning_gravac.strategies.communicators.communicator_for`)
   error-feeds and compresses the segments, launches the collectives, decodes and averages into the bucket buffer,
   commits or discards the step's residuals and records its statistics.

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

from lightning_gravac.compressors.base import Communication, all_finite, sq_norm
from lightning_gravac.compressors.memory import Feedback
from lightning_gravac.state import HALF, REDUCE, BucketRecord, CompressionState
from lightning_gravac.strategies.communicators import Segment, Work, communicator_for, received_value, views_like


def gravac_hook(state: CompressionState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Compress, communicate and average one gradient bucket. Register with ``DDP.register_comm_hook(state, ...)``."""
    buffer = bucket.buffer()
    if buffer.is_sparse:  # a sparse gradient (`nn.Embedding(sparse=True)`): DDP gives it a bucket of its own
        return _sparse(state, buffer)
    names = [state.param_names[id(p)] for p in bucket.parameters()]
    grads = bucket.gradients()
    if state.local_sgd_from is not None and state.step >= state.local_sgd_from:
        return _local(state, names, grads, buffer)

    # A half step sends every parameter in fp16, a factor of 2 (the controller's 16-bit rung).
    cfs = [HALF if state.half else state.cf_of(name) for name in names]
    dense = all(cf == 1.0 for cf in cfs)
    momentum = state.momentum
    params = bucket.parameters() if momentum else []
    if state.adam.active(state.step):  # Adam's step direction, its second moment frozen: what is sent, on any path
        state.adam.local_(names, grads)
    if dense and not state.probe_cfs:
        return _dense(state, buffer, names, grads, params)

    start = time.perf_counter()
    if momentum:  # this rank's momentum before compression: what is compressed is the update direction
        momentum.local_(names, grads, params)
    # The gain of the step's own gradient is measured before any residual is added to it (in place, below).
    fresh, measuring = _fresh_gains(state, names, grads, buffer)
    start += measuring  # not compression's cost: the controller weighs what sending a factor costs, measuring aside
    # Per layer, the residual is added into the gradient in place, in the bucket, and the new residual is written over
    # the old one once the step is known finite (`communicators.land`): error feedback keeps one buffer a parameter.
    # PowerSGD's rounds write the residual before the step is known finite: the memory recycles a second buffer there.
    # Dense steps and whole buckets add it in place and copy the new residual.
    feedback: Feedback = "off"
    if state.error_feedback:
        feedback = "copy"
        if state.granularity == "layer" and not dense:
            rounds = state.compressor.communication is Communication.ROUNDS and not state.half
            feedback = "recycle" if rounds else "in_place"
        if feedback == "copy":
            for name, grad in zip(names, grads, strict=True):
                state.memory.compensate_(name, grad)
    segments = _segments(state, names, grads, cfs, buffer)
    work = Work(state, buffer, segments, names, grads, feedback, dense, fresh, start)
    return communicator_for(work).send(work)


def _dense(
    state: CompressionState, buffer: Tensor, names: list[str], grads: list[Tensor], params: list[Tensor]
) -> Future[Tensor]:
    """Every factor 1, nothing probed: the plain all-reduce, with the momentum moved into the hook if any."""
    momentum = state.momentum
    pending = state.error_feedback and any(name in state.memory for name in names)
    if momentum and momentum.in_sync(names) and not pending:  # the optimizer's momentum, after the all-reduce
        return _plain_allreduce(state, buffer, [], names, grads, params, exact=True)
    if momentum:
        momentum.local_(names, grads, params)
    return _plain_allreduce(state, buffer, _carry_residuals(state, names, grads), names, grads, params)


def _plain_allreduce(
    state: CompressionState,
    buffer: Tensor,
    carried: list[str],
    names: list[str],
    grads: list[Tensor],
    params: list[Tensor],
    exact: bool = False,
) -> Future[Tensor]:
    # Multiply by 1/N exactly as DDP's reducer does without a hook (``mul_out(bucket, grad, 1.0 / N)``), so the
    # result is bit-identical to stock DDP for every world size, not only powers of two.
    buffer.mul_(1.0 / state.world_size)
    nbytes = buffer.numel() * buffer.element_size()
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    momentum = state.momentum

    def done(fut: Future[list[Tensor]]) -> Tensor:
        result = received_value(fut, state, "dense all-reduce")[0]
        # No header on this path: whether some rank's gradient was not finite is read off the result itself (one sum
        # of the bucket), and only when something depends on it: residuals added into it (the first dense step after
        # compressed ones; a finite step has delivered them, a non-finite one keeps them) or momentum buffers. Without
        # either, plain steps pay nothing.
        if not (carried or momentum) or all_finite(result):
            for name in carried:
                state.memory.discard(name)
            if momentum:
                views = views_like(result, buffer, grads)
                if exact:
                    momentum.after_dense_(names, views, params)
                else:
                    if not carried:
                        momentum.resync(names, views)
                    momentum.commit(names)
        elif momentum and exact:
            # The averaged gradient goes back as it is, non-finite: the user's code may zero or clean it before the
            # optimizer steps, and the buffers then take what the optimizer sees, as stock SGD's buffer would.
            momentum.defer(names, params)
        elif momentum:
            momentum.discard(names)
        state.record(BucketRecord(bytes_sent=nbytes, bytes_dense=nbytes, collective=REDUCE))
        return result

    return work.get_future().then(done)


def _sparse(state: CompressionState, buffer: Tensor) -> Future[Tensor]:
    """A sparse gradient goes as it is, as stock DDP sends it: divided by N, then summed over ranks (a sparse
    all-reduce: gloo has one, NCCL has none, as for stock DDP). It is already as small as the rows the step touched;
    the compressors, error feedback and momentum correction work on dense gradients and leave it alone (the strategy
    keeps such a parameter's momentum in the optimizer). Under local SGD it stays this rank's own."""
    if state.local_sgd_from is not None and state.step >= state.local_sgd_from:
        # No residual to flush (none is kept for it); recorded by its dense size, the same on every rank.
        return _local(state, [], [], buffer)
    buffer.div_(state.world_size)
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)

    def done(fut: Future[list[Tensor]]) -> Tensor:
        result = received_value(fut, state, "sparse all-reduce")[0]
        # Its bytes, as the sum's (each rank's own rows differ in number; the sum is the same on every rank): values
        # and int64 indices, sent as they are, so dense and sent alike.
        nbytes = result._values().numel() * result.element_size() + result._indices().numel() * 8
        state.record(BucketRecord(bytes_sent=nbytes, bytes_dense=nbytes, collective=REDUCE))
        return result

    return work.get_future().then(done)


def _carry_residuals(state: CompressionState, names: list[str], grads: list[Tensor]) -> list[str]:
    """Add every pending residual into its gradient, which is then sent in full; the names that had one.

    The residuals stay in the memory until the step is known finite (:func:`_plain_allreduce` drops them then).
    """
    if not state.error_feedback:
        return []
    carried = []
    for name, grad in zip(names, grads, strict=True):
        if state.memory.compensate_(name, grad):
            carried.append(name)
    return carried


def _flush_residuals(state: CompressionState, names: list[str], grads: list[Tensor]) -> None:
    """Add every pending residual into its gradient and drop it: what is sent now in full carries it."""
    for name in _carry_residuals(state, names, grads):
        state.memory.discard(name)


def _local(state: CompressionState, names: list[str], grads: list[Tensor], buffer: Tensor) -> Future[Tensor]:
    """Local SGD: this rank's own gradient, nothing sent (the strategy averages the parameters periodically)."""
    _flush_residuals(state, names, grads)  # what compression still owed goes into the local step
    nbytes = buffer.numel() * buffer.element_size()
    state.record(BucketRecord(bytes_sent=0, bytes_dense=nbytes, collective=REDUCE))
    future: Future[Tensor] = Future()
    future.set_result(buffer)
    return future


def _segments(
    state: CompressionState, names: list[str], grads: list[Tensor], cfs: list[float], buffer: Tensor
) -> list[Segment]:
    """The bucket's units of compression: each layer at its factor (a factor of 1 sends it unchanged), or the whole
    bucket at the global factor (per-layer factors need layer granularity)."""
    method = state.cast if state.half else state.compressor
    if state.granularity == "bucket":
        return [Segment(f"bucket:{names[0]}", buffer, cfs[0] if state.half else state.cf, method, buffer)]
    return [
        Segment(name, grad, cf, state.identity if cf == 1.0 else method, grad)
        for name, grad, cf in zip(names, grads, cfs, strict=True)
    ]


def _fresh_gains(
    state: CompressionState, names: list[str], grads: list[Tensor], buffer: Tensor
) -> tuple[tuple[Tensor, Tensor] | None, float]:
    """The probes of the step's own gradient when the controller asks for them, and the seconds they took."""
    if not (state.probe_cfs and state.gain_of == "gradient"):
        return None, 0.0
    started = time.perf_counter()
    fresh = _fresh_probes(state, names, grads, buffer)
    return fresh, time.perf_counter() - started


def _fresh_probes(
    state: CompressionState, names: list[str], grads: list[Tensor], buffer: Tensor
) -> tuple[Tensor, Tensor]:
    """``(sum ||C_cf(grad)||^2 at the probe factors, ||grad||^2)`` of this rank's own gradient, unit by unit as it
    is compressed (each layer, or the whole bucket)."""
    units = [(f"bucket:{names[0]}", buffer)] if state.granularity == "bucket" else list(zip(names, grads, strict=True))
    probes = [state.compressor.probe(t, state.probe_cfs, key=key, step=state.step) for key, t in units]
    return torch.stack(probes).sum(0), sq_norm(buffer)
