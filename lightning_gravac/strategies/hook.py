"""The DDP communication hook: error feedback, compression, one collective, decoding.

Data flow for one bucket:

1. every factor is 1, no probe is asked for: plain all-reduce, bit for bit what stock DDP does (residuals left by
   earlier compressed steps are added in and dropped once the result is known finite);
2. otherwise add each parameter's residual to its gradient (error feedback), compress each layer (or the
   whole bucket) to a fixed-size payload, and compute the new residuals (on a *half* step, ``state.half``, the
   method is the fp16 cast whatever the factor: the controller's 16-bit rung);
3. pick the cheapest collective: an all-reduce of the payloads when ranks share support (Random-K), an
   all-gather of the packed payloads when ``world_size x payload < 2 x dense`` (ring all-reduce moves twice
   the dense bytes), else a dense all-reduce of the locally decoded gradient (the same sum, fewer bytes);
4. decode and average into the bucket buffer, record the step's statistics, and hand the buffer to DDP.

Every compressed bucket carries a float64 header (:class:`Header`), summed over ranks: ``||g||^2``, ``||C(g)||^2``
and the norms at the controller's probe factors; those are of the error-fed gradient by default and, when the
controller asks for the gain of the step's own gradient (``gain_of="gradient"``), of the gradient before the
residual is added, followed by its ``||grad||^2``. A non-finite ``||g||^2`` means some rank's gradient was not
finite: then the new residuals are dropped (the old ones stay, as if the step had not happened) and the bucket is
returned as NaN on every rank, so that a mixed-precision scaler skips the step as it would with stock DDP.

Two rules keep the collectives from hanging. Every collective is launched from the thread that runs the hook, so
every rank issues them in the same order (collectives are matched by that order; a collective launched from a
future's callback, which runs on whichever thread completes the previous one, would not be). And no callback waits
for anything: callbacks only decode and record. A collective that fails (a rank died, or stalled past the process
group's timeout) surfaces from ``backward`` as an error naming the compressor and what was waited for.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gravac.compressors.base import Compressor, Payload, sq_norm
from lightning_gravac.compressors.memory import ErrorFeedback
from lightning_gravac.compressors.packing import Layout
from lightning_gravac.compressors.powersgd import PowerSGD, as_matrix
from lightning_gravac.state import GATHER, HALF, REDUCE, BucketRecord, Collective, CompressionState, gathers


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


@dataclass(frozen=True)
class _Segment:
    """One unit of compression: a layer's gradient, or the whole bucket."""

    key: str
    tensor: Tensor  # what is compressed: the error-fed gradient (a buffer of the memory's, or the bucket's view)
    cf: float
    compressor: Compressor
    out: Tensor  # where the averaged result goes: a view into the bucket buffer


@dataclass
class _Work:
    """One compressed bucket on its way through the hook."""

    state: CompressionState
    buffer: Tensor
    segments: list[_Segment]
    payloads: list[Payload]
    header: Tensor
    fresh: bool = False  # the header's probes are of the step's own gradient, with its squared norm last
    names: list[str] = field(default_factory=list)  # the bucket's parameters
    # New residuals by parameter, committed only once the step is known finite on every rank; None drops one.
    pending: dict[str, Tensor | None] = field(default_factory=dict)
    start: float = field(default_factory=time.perf_counter)

    @property
    def dense_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def gravac_hook(state: CompressionState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Compress, communicate and average one gradient bucket. Register with ``DDP.register_comm_hook(state, ...)``."""
    buffer = bucket.buffer()
    names = [state.param_names[id(p)] for p in bucket.parameters()]
    grads = bucket.gradients()
    if state.local_sgd_from is not None and state.step >= state.local_sgd_from:
        return _local(state, names, grads, buffer)

    # A half step sends every parameter in fp16, a factor of 2 (the controller's 16-bit rung).
    cfs = [HALF if state.half else state.cf_of(name) for name in names]
    dense = all(cf == 1.0 for cf in cfs)
    momentum = state.momentum
    params = bucket.parameters() if momentum else []
    if dense and not state.probe_cfs:
        return _dense(state, buffer, names, grads, params)

    start = time.perf_counter()
    if momentum:  # this rank's momentum before compression: what is compressed is the update direction
        momentum.local_(names, grads, params)
    # The gain of the step's own gradient is measured before any residual is added to it (in place, below).
    fresh, measuring = _fresh_gains(state, names, grads, buffer)
    start += measuring  # not compression's cost: the controller weighs what sending a factor costs, measuring aside
    probe_cfs = () if fresh is not None else state.probe_cfs
    # Per layer, the error-fed gradient goes into a buffer the memory recycles, which then becomes the new residual
    # in place: no copy of the gradient and no allocation. Dense steps and whole buckets add the residual in place.
    recycled = state.error_feedback and state.granularity == "layer" and not dense
    if state.error_feedback and not recycled:
        for name, grad in zip(names, grads, strict=True):
            state.memory.compensate_(name, grad)
    segments = _segments(state, names, grads, cfs, buffer, recycled)
    if isinstance(state.compressor, PowerSGD) and not (dense or state.half):
        return _low_rank(state, segments, buffer, start, probe_cfs, fresh)
    if dense:
        # Sending dense while the controller still measures what compression would keep: residuals drop.
        probe = state.compressor.probe
        probes = [probe(s.tensor, probe_cfs, key=s.key, step=state.step) for s in segments] if probe_cfs else []
        norm = sq_norm(buffer)  # sent dense: what is sent is all there is
        header = Header.pack(norm, [norm], probes, fresh)
        work = _Work(state, buffer, segments, [], header, fresh is not None, names, start=start)
        if state.error_feedback:
            work.pending = dict.fromkeys(names)
        buffer.mul_(1.0 / state.world_size)
        return _launch_reduce(work, buffer, lambda: buffer)

    payloads, probes = _compress(state, segments, probe_cfs)
    sent = [s.compressor.sent_sq_norm(p) for s, p in zip(segments, payloads, strict=True)]
    # Gains are relative to what each method selects from: the error-fed gradient, or DGC's accumulation.
    basis = torch.stack([s.compressor.basis_sq_norm(s.tensor, s.key) for s in segments]).sum()
    header = Header.pack(basis, sent, probes, fresh)
    work = _Work(state, buffer, segments, payloads, header, fresh is not None, names, start=start)
    if state.error_feedback:
        work.pending = _new_residuals(work, names, grads)
        if momentum:
            momentum.mask_(work.pending)

    if all(s.compressor.summable for s in segments):
        return _reduce_payloads(work)
    layout = Layout.of(payloads, header_numel=work.header.numel())
    if gathers(layout.nbytes, work.dense_bytes, state.world_size):
        return _gather_payloads(work, layout)
    return _reduce_decoded(work)


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
        result = _received(fut, state, "dense all-reduce")[0]
        # No header on this path: whether some rank's gradient was not finite is read off the result itself, and only
        # when something depends on it: residuals added into it (the first dense step after compressed ones; a
        # finite step has delivered them, a non-finite one keeps them) or momentum buffers. Plain steps pay nothing.
        # With the momentum in sync, a non-finite step is no concern of the hook's: there is no gradient scaler to skip
        # it (momentum correction is off under one), and stock SGD's buffer takes a NaN as well.
        check = carried or (momentum and not exact)
        if not check or _finite(result):
            for name in carried:
                state.memory.discard(name)
            if momentum:
                views = _views_like(result, buffer, grads)
                if exact:
                    momentum.after_dense_(names, views, params)
                else:
                    if not carried:
                        momentum.resync(names, views)
                    momentum.commit(names)
        elif momentum:
            momentum.discard(names)
        state.record(BucketRecord(bytes_sent=nbytes, bytes_dense=nbytes, collective=REDUCE))
        return result

    return work.get_future().then(done)


def _finite(tensor: Tensor) -> bool:
    """Whether every entry is finite, read off the float32 sum (NaN and Inf reach it; one pass, no allocation)."""
    return bool(torch.isfinite(tensor.sum(dtype=torch.float32)))


def _views_like(result: Tensor, buffer: Tensor, grads: list[Tensor]) -> list[Tensor]:
    """The parts of ``result`` (a tensor shaped as the bucket's ``buffer``) where each gradient view lies."""
    views = []
    for grad in grads:
        offset = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
        views.append(result.view(-1)[offset : offset + grad.numel()].view_as(grad))
    return views


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


def _received(fut: Future[Any], state: CompressionState, what: str) -> Any:
    """``fut``'s value, which must be complete (as in its own callback): a failed collective (a peer that died or
    stalled past the process group's timeout) is re-raised naming the compressor and what was waiting for it."""
    try:
        return fut.value()
    except Exception as error:
        raise _failure(state, what, error) from error


def _failure(state: CompressionState, what: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"GraVACStrategy's comm hook ({state.compressor!r}, step {state.step}): the {what} failed; "
        f"a rank may have died or stalled past the process group's timeout. {error}"
    )


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
    state: CompressionState, names: list[str], grads: list[Tensor], cfs: list[float], buffer: Tensor, recycled: bool
) -> list[_Segment]:
    if state.granularity == "bucket":
        # Per-layer factors need layer granularity; a whole bucket takes the global factor.
        method = state.cast if state.half else state.compressor
        return [_Segment(f"bucket:{names[0]}", buffer, cfs[0] if state.half else state.cf, method, buffer)]
    return [
        _Segment(
            name,
            state.memory.error_fed(name, grad) if recycled else grad,
            cf,
            state.identity if cf == 1.0 else state.cast if state.half else state.compressor,
            grad,
        )
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


def _compress(
    state: CompressionState, segments: list[_Segment], probe_cfs: tuple[float, ...]
) -> tuple[list[Payload], list[Tensor]]:
    """Each segment's payload, and the norms at ``probe_cfs`` (one multi-level selection where nested)."""
    payloads, probes = [], []
    step = state.step
    for s in segments:
        if not probe_cfs:
            payloads.append(s.compressor.compress(s.tensor, s.cf, key=s.key, step=step))
        elif s.compressor is state.compressor:
            payload, probe = s.compressor.compress_and_probe(s.tensor, s.cf, probe_cfs, key=s.key, step=step)
            payloads.append(payload)
            probes.append(probe)
        else:  # a layer sent dense inside a compressed bucket: probe what the method would keep
            payloads.append(s.compressor.compress(s.tensor, s.cf, key=s.key, step=step))
            probes.append(state.compressor.probe(s.tensor, probe_cfs, key=s.key, step=step))
    return payloads, probes


def _new_residuals(work: _Work, names: list[str], grads: list[Tensor]) -> dict[str, Tensor | None]:
    """``g - decoded`` for every parameter, computed before the buffer is overwritten; not stored yet."""
    pending: dict[str, Tensor | None] = {}
    if work.state.granularity == "layer":
        # The error-fed inputs are the memory's own buffers: each becomes its residual in place.
        for s, p in zip(work.segments, work.payloads, strict=True):
            if not s.compressor.passthrough:
                s.compressor.residual_(s.tensor, p)
            pending[s.key] = None if s.compressor.passthrough else s.tensor
        return pending
    (segment,), (payload,) = work.segments, work.payloads
    residual = ErrorFeedback.residual_of(segment.compressor, work.buffer, payload)
    # Stored per parameter (views of one tensor): DDP may regroup parameters into other buckets.
    pending.update(zip(names, _views_like(residual, work.buffer, grads), strict=True))
    return pending


def _decode_into(work: _Work, stacked: list[Payload], scale: float) -> None:
    """The average of every rank's payloads into the bucket: written segment by segment where the segments cover the
    buffer (each layer's gradient, or the whole bucket), else added into the zeroed buffer."""
    if sum(s.out.numel() for s in work.segments) == work.buffer.numel():
        for segment, payload in zip(work.segments, stacked, strict=True):
            segment.compressor.decode_(segment.out.view(-1), payload, scale)
        return
    work.buffer.zero_()
    for segment, payload in zip(work.segments, stacked, strict=True):
        segment.compressor.aggregate_(segment.out.view(-1), payload, scale)


def _gather_payloads(work: _Work, layout: Layout) -> Future[Tensor]:
    state, world = work.state, work.state.world_size
    packed = layout.pack(work.payloads, work.header)
    gathered = torch.empty(world * layout.nbytes, dtype=torch.uint8, device=work.buffer.device)
    encode_s = time.perf_counter() - work.start
    launched = time.perf_counter()
    handle = dist.all_gather_single(gathered, packed, group=state.process_group, async_op=True)

    def decode(fut: Future[object]) -> Tensor:
        _received(fut, state, "all-gather of the packed payloads")
        received = time.perf_counter()
        headers, stacked = layout.unpack(gathered.view(world, layout.nbytes), work.payloads)
        _decode_into(work, stacked, 1.0 / world)
        return _settle(work, layout.nbytes, GATHER, headers.sum(0), encode_s, received, launched)

    return handle.get_future().then(decode)


def _reduce_decoded(work: _Work) -> Future[Tensor]:
    _decode_into(work, [_stack_one(p) for p in work.payloads], 1.0 / work.state.world_size)
    return _launch_reduce(work, work.buffer, lambda: work.buffer)


def _reduce_payloads(work: _Work) -> Future[Tensor]:
    # Divide before summing: a half-precision sum of N undivided gradients can overflow.
    flat = torch.cat([w.reshape(-1) for p in work.payloads for w in p.wire]).div_(work.state.world_size)

    def decode() -> Tensor:
        summed, offset = [], 0
        for payload in work.payloads:
            views = []
            for w in payload.wire:
                views.append(flat[offset : offset + w.numel()].view(1, *w.shape))
                offset += w.numel()
            summed.append(payload.with_wire(views))
        _decode_into(work, summed, 1.0)
        return work.buffer

    return _launch_reduce(work, flat, decode)


def _low_rank(
    state: CompressionState,
    segments: list[_Segment],
    buffer: Tensor,
    start: float,
    probe_cfs: tuple[float, ...],
    fresh: tuple[Tensor, Tensor] | None,
) -> Future[Tensor]:
    """PowerSGD's two all-reduces: ``P = M Q`` with the bucket's dense parts, then ``Q = M^T P`` with the header."""
    method = state.compressor
    assert isinstance(method, PowerSGD)
    world, group = state.world_size, state.process_group
    low = [s for s in segments if s.compressor is method and method.low_rank(s.tensor)]
    full = [s for s in segments if not (s.compressor is method and method.low_rank(s.tensor))]
    matrices = [as_matrix(s.tensor) for s in low]  # views of the inputs for fp32
    ps = [method.project(m, method.rank_for(s.tensor.shape, s.cf), s.key) for s, m in zip(low, matrices, strict=True)]
    probes = [method.probe(s.tensor, probe_cfs, key=s.key) for s in segments] if probe_cfs else []
    norms = {s.key: sq_norm(s.tensor) for s in segments}
    basis = torch.stack(list(norms.values())).sum()
    dense_sq = torch.stack([norms[s.key] for s in full]).sum() if full else basis.new_zeros(())
    first = torch.cat([p.view(-1) for p in ps] + [s.tensor.reshape(-1).float() / world for s in full])
    names = [s.key for s in segments]  # per layer: the parameters' names
    work = _Work(state, buffer, segments, [], basis.new_zeros(0), fresh is not None, names, start=start)
    second_numel = sum(m.shape[1] * p.shape[1] for m, p in zip(matrices, ps, strict=True))
    header_bytes = Header.numel(len(state.probe_cfs), work.fresh) * 8
    sent_bytes = (first.numel() + second_numel) * first.element_size() + header_bytes
    encode_s = time.perf_counter() - start
    launched = time.perf_counter()

    # The second all-reduce needs the first one's result. It is launched here, on the thread that runs the hook, after
    # waiting for the first: never from the first one's callback. A callback runs on the thread that completes the
    # collective (gloo's worker): waiting there can stall the very collective waited on (the deadlock torch's own
    # PowerSGD hook risks), and a collective launched there is issued at a moment that differs between ranks, while
    # collectives are matched by the order each rank issues them. From the hook's thread every rank issues the same
    # collectives in the same order. The price: the first round does not overlap the rest of the backward pass.
    first_round = dist.all_reduce(first, group=group, async_op=True).get_future()
    try:
        summed = first_round.wait()[0]
    except Exception as error:
        raise _failure(state, "first all-reduce (P and the dense parts)", error) from error
    qs = _right_factors(work, method, low, ps, matrices, summed)
    for s in full:
        work.pending[s.key] = None
    sent = [dense_sq] + [q.double().square().sum() for q in qs]  # ||P Q^T|| = ||Q|| for orthonormal P
    work.header = Header.pack(basis, sent, probes, fresh)
    second = torch.cat([q.view(-1) for q in qs]) if qs else summed.new_zeros(0)
    futures = [dist.all_reduce(work.header, group=group, async_op=True).get_future()]
    if qs:  # a bucket of biases alone has no second factor
        futures.append(dist.all_reduce(second, group=group, async_op=True).get_future())

    def finish(both: Future[list[Future[Tensor]]]) -> Tensor:
        for fut in _received(both, state, "second all-reduce (Q and the header)"):
            _received(fut, state, "second all-reduce (Q and the header)")
        offset = 0
        for s, p, q in zip(low, ps, qs, strict=True):
            q_sum = second[offset : offset + q.numel()].view_as(q)
            offset += q.numel()
            method.keep(s.key, q_sum)
            s.out.copy_((p @ q_sum.T).div_(world).view_as(s.out))
        offset = first.numel() - sum(s.tensor.numel() for s in full)
        for s in full:
            s.out.view(-1).copy_(summed[offset : offset + s.tensor.numel()])
            offset += s.tensor.numel()
        received = time.perf_counter()
        return _settle(work, sent_bytes, REDUCE, work.header, encode_s, received, launched)

    return torch.futures.collect_all(futures).then(finish)


def _right_factors(
    work: _Work, method: PowerSGD, low: list[_Segment], ps: list[Tensor], matrices: list[Tensor], summed: Tensor
) -> list[Tensor]:
    """``Q = M^T P`` of each low-rank segment from the summed ``P`` (orthonormalized in place); with error feedback,
    what this rank's gradient has outside the shared subspace becomes its pending residual, in place."""
    qs, offset = [], 0
    for s, p, m in zip(low, ps, matrices, strict=True):
        p.copy_(summed[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
        method.orthonormalize_(p)
        q = m.T @ p
        if work.state.error_feedback:
            m.sub_(p @ q.T)
            if m.data_ptr() != s.tensor.data_ptr():  # not fp32: `m` was a copy
                s.tensor.copy_(m.view_as(s.tensor))
            work.pending[s.key] = s.tensor
        qs.append(q)
    return qs


def _stack_one(payload: Payload) -> Payload:
    return payload.with_wire([w.unsqueeze(0) for w in payload.wire])


def _launch_reduce(work: _Work, tensor: Tensor, finish: Callable[[], Tensor]) -> Future[Tensor]:
    """All-reduce ``tensor`` and the float64 header beside it, then ``finish`` makes the bucket's result."""
    encode_s = time.perf_counter() - work.start
    launched = time.perf_counter()
    group = work.state.process_group
    # The header goes in a separate float64 all-reduce: the statistics need a range and precision that an fp16 or
    # bf16 bucket does not have. Both are launched at once, so they are in flight together.
    futures = [
        dist.all_reduce(tensor, group=group, async_op=True).get_future(),
        dist.all_reduce(work.header, group=group, async_op=True).get_future(),
    ]
    sent = tensor.numel() * tensor.element_size() + work.header.numel() * 8

    def done(fut: Future[list[Future[object]]]) -> Tensor:
        for each in _received(fut, work.state, "all-reduce of the bucket and its header"):
            _received(each, work.state, "all-reduce of the bucket and its header")
        received = time.perf_counter()
        finish()
        return _settle(work, sent, REDUCE, work.header, encode_s, received, launched)

    return torch.futures.collect_all(futures).then(done)


def _settle(
    work: _Work,
    bytes_sent: int,
    collective: Collective,
    norms: Tensor,
    encode_s: float,
    received: float,
    launched: float,
) -> Tensor:
    """Commit the residuals of a finite step (or poison the result of a non-finite one) and record the stats."""
    header = Header.unpack(norms, work.fresh)
    keys = [s.key for s in work.segments]
    if math.isfinite(header.basis):
        work.state.compressor.commit(keys)
        work.state.momentum.commit(work.names)
        for key, residual in work.pending.items():
            if residual is None:
                work.state.memory.discard(key)
            else:
                work.state.memory.set(key, residual)
    else:
        work.state.compressor.discard(keys)
        work.state.momentum.discard(work.names)
        work.buffer.fill_(math.nan)
    compress_s = encode_s + time.perf_counter() - received
    record = BucketRecord(
        bytes_sent=bytes_sent,
        bytes_dense=work.dense_bytes,
        collective=collective,
        sq_norm=header.basis,
        sq_norm_sent=header.sent,
        compress_s=compress_s,
        comm_s=received - launched,
        probe_sq=header.probes,
        probe_basis=header.probe_basis,
    )
    work.state.record(record)
    return work.buffer
