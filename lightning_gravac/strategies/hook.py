"""The DDP communication hook: error feedback, compression, one collective, decoding.

Data flow for one bucket (see DESIGN.md):

1. every factor is 1 and no residual is pending: plain all-reduce, bit for bit what stock DDP does;
2. otherwise add each parameter's residual to its gradient (error feedback), compress each layer (or the
   whole bucket) to a fixed-size payload, and store the new residuals;
3. pick the cheapest collective: an all-reduce of the payloads when ranks share support (Random-K), an
   all-gather of the packed payloads when ``world_size x payload < 2 x dense`` (ring all-reduce moves twice
   the dense bytes), else a dense all-reduce of the locally decoded gradient (the same sum, fewer bytes);
4. decode and average into the bucket buffer, record the step's statistics, and hand the buffer to DDP.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gravac.compressors.base import Compressor, Payload
from lightning_gravac.compressors.packing import Layout
from lightning_gravac.strategies.state import GATHER, REDUCE, BucketRecord, CompressionState, sq_norm


@dataclass(frozen=True)
class _Segment:
    """One unit of compression: a layer's gradient, or the whole bucket."""

    key: str
    tensor: Tensor  # a view into the bucket buffer
    cf: float
    compressor: Compressor


def gravac_hook(state: CompressionState, bucket: dist.GradBucket) -> Future[Tensor]:
    """Compress, communicate and average one gradient bucket. Register with ``DDP.register_comm_hook(state, ...)``."""
    buffer = bucket.buffer()
    names = [state.param_names[id(p)] for p in bucket.parameters()]
    grads = bucket.gradients()
    cfs = [state.cf_of(name) for name in names]

    dense = all(cf == 1.0 for cf in cfs)
    if dense and not state.probe_cfs:
        _flush_residuals(state, names, grads)
        return _plain_allreduce(state, buffer)

    start = time.perf_counter()
    if dense:
        # Sending dense while the controller still measures what compression would keep.
        _flush_residuals(state, names, grads)
        segments = _segments(state, names, grads, cfs, buffer)
        probes = [state.compressor.probe(s.tensor, state.probe_cfs, key=s.key, step=state.step) for s in segments]
        header = _header(state, buffer, [sq_norm(buffer)], probes)
        buffer.mul_(1.0 / state.world_size)
        return _launch_reduce(state, buffer, header, start, buffer.numel() * buffer.element_size(), lambda: buffer)

    if state.error_feedback:
        for name, grad in zip(names, grads, strict=True):
            state.memory.compensate_(name, grad)
    segments = _segments(state, names, grads, cfs, buffer)
    payloads, probes = _compress(state, segments)
    sent = [s.compressor.sent_sq_norm(p) for s, p in zip(segments, payloads, strict=True)]
    header = _header(state, buffer, sent, probes)
    if state.error_feedback:
        _update_residuals(state, segments, payloads, names, grads, buffer)

    dense_bytes = buffer.numel() * buffer.element_size()
    world = state.world_size
    if all(s.compressor.summable for s in segments):
        return _reduce_payloads(state, buffer, segments, payloads, header, start, dense_bytes)
    layout = Layout.of(payloads, header_numel=header.numel() if header is not None else 0)
    if world * layout.nbytes < 2 * dense_bytes:
        return _gather_payloads(state, buffer, segments, payloads, header, layout, start, dense_bytes)
    return _reduce_decoded(state, buffer, segments, payloads, header, start, dense_bytes)


def _flush_residuals(state: CompressionState, names: list[str], grads: list[Tensor]) -> None:
    if state.error_feedback:
        # Going dense sends what was pending too: the residuals are added in and become zero.
        for name, grad in zip(names, grads, strict=True):
            state.memory.compensate_(name, grad)
            state.memory.discard(name)


def _compress(state: CompressionState, segments: list[_Segment]) -> tuple[list[Payload], list[Tensor]]:
    """Each segment's payload, and the norms at the probe factors (one multi-level selection where nested)."""
    payloads, probes = [], []
    for s in segments:
        if not state.probe_cfs:
            payloads.append(s.compressor.compress(s.tensor, s.cf, key=s.key, step=state.step))
        elif s.compressor is state.compressor:
            payload, probe = s.compressor.compress_and_probe(
                s.tensor, s.cf, state.probe_cfs, key=s.key, step=state.step
            )
            payloads.append(payload)
            probes.append(probe)
        else:  # a layer sent dense inside a compressed bucket: probe what the method would keep
            payloads.append(s.compressor.compress(s.tensor, s.cf, key=s.key, step=state.step))
            probes.append(state.compressor.probe(s.tensor, state.probe_cfs, key=s.key, step=state.step))
    return payloads, probes


def _plain_allreduce(state: CompressionState, buffer: Tensor) -> Future[Tensor]:
    # Multiply by 1/N exactly as DDP's reducer does without a hook (``mul_out(bucket, grad, 1.0 / N)``), so the
    # result is bit-identical to stock DDP for every world size, not only powers of two.
    buffer.mul_(1.0 / state.world_size)
    nbytes = buffer.numel() * buffer.element_size()
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)

    def done(fut: Future[list[Tensor]]) -> Tensor:
        state.record(BucketRecord(bytes_sent=nbytes, bytes_dense=nbytes, collective=REDUCE))
        return fut.value()[0]

    return work.get_future().then(done)


def _segments(
    state: CompressionState, names: list[str], grads: list[Tensor], cfs: list[float], buffer: Tensor
) -> list[_Segment]:
    if state.granularity == "bucket":
        # Per-layer factors need layer granularity; a whole bucket takes the global factor.
        return [_Segment(f"bucket:{names[0]}", buffer, state.cf, state.compressor)]
    return [
        _Segment(name, grad, cf, state.identity if cf == 1.0 else state.compressor)
        for name, grad, cf in zip(names, grads, cfs, strict=True)
    ]


def _header(state: CompressionState, buffer: Tensor, sent: list[Tensor], probes: list[Tensor]) -> Tensor | None:
    """``[||g||^2, ||C(g)||^2, *probe norms]`` in float64, this rank's part of the sums; ``None`` if not wanted."""
    if not state.collect_stats and not state.probe_cfs:
        return None
    parts = [sq_norm(buffer).view(1), torch.stack(sent).sum().view(1).to(buffer.device)]
    if probes:
        parts.append(torch.stack(probes).sum(0).to(buffer.device))
    return torch.cat(parts)


def _update_residuals(
    state: CompressionState,
    segments: list[_Segment],
    payloads: list[Payload],
    names: list[str],
    grads: list[Tensor],
    buffer: Tensor,
) -> None:
    if state.granularity == "layer":
        for segment, payload in zip(segments, payloads, strict=True):
            if segment.compressor.passthrough:
                state.memory.discard(segment.key)
            else:
                state.memory.update(segment.key, segment.compressor, segment.tensor, payload)
        return
    (segment,), (payload,) = segments, payloads
    residual = buffer.clone()
    segment.compressor.residual_(residual, payload)
    # Stored per parameter (views of one tensor): DDP may regroup parameters into other buckets.
    for name, grad in zip(names, grads, strict=True):
        offset = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
        state.memory.set(name, residual[offset : offset + grad.numel()].view_as(grad))


def _decode_into(segments: Sequence[_Segment], stacked: Sequence[Payload], scale: float) -> None:
    for segment, payload in zip(segments, stacked, strict=True):
        segment.compressor.aggregate_(segment.tensor.view(-1), payload, scale)


def _stack_one(payload: Payload) -> Payload:
    return payload.with_wire([w.unsqueeze(0) for w in payload.wire])


def _gather_payloads(
    state: CompressionState,
    buffer: Tensor,
    segments: list[_Segment],
    payloads: list[Payload],
    header: Tensor | None,
    layout: Layout,
    start: float,
    dense_bytes: int,
) -> Future[Tensor]:
    world = state.world_size
    packed = layout.pack(payloads, header)
    gathered = torch.empty(world * layout.nbytes, dtype=torch.uint8, device=buffer.device)
    encode_s = time.perf_counter() - start
    launched = time.perf_counter()
    work = dist.all_gather_single(gathered, packed, group=state.process_group, async_op=True)

    def decode(fut: Future[object]) -> Tensor:
        received = time.perf_counter()
        headers, stacked = layout.unpack(gathered.view(world, layout.nbytes), payloads)
        buffer.zero_()
        _decode_into(segments, stacked, 1.0 / world)
        _record(
            state,
            layout.nbytes,
            dense_bytes,
            GATHER,
            headers.sum(0) if header is not None else None,
            encode_s + time.perf_counter() - received,
            received - launched,
        )
        return buffer

    return work.get_future().then(decode)


def _reduce_decoded(
    state: CompressionState,
    buffer: Tensor,
    segments: list[_Segment],
    payloads: list[Payload],
    header: Tensor | None,
    start: float,
    dense_bytes: int,
) -> Future[Tensor]:
    buffer.zero_()
    _decode_into(segments, [_stack_one(p) for p in payloads], 1.0 / state.world_size)
    return _launch_reduce(state, buffer, header, start, dense_bytes, lambda: buffer)


def _reduce_payloads(
    state: CompressionState,
    buffer: Tensor,
    segments: list[_Segment],
    payloads: list[Payload],
    header: Tensor | None,
    start: float,
    dense_bytes: int,
) -> Future[Tensor]:
    wires = [w.reshape(-1) for p in payloads for w in p.wire]
    # Divide before summing: a half-precision sum of N undivided gradients can overflow.
    flat = torch.cat(wires).div_(state.world_size)

    def decode() -> Tensor:
        buffer.zero_()
        summed, offset = [], 0
        for payload in payloads:
            views = []
            for w in payload.wire:
                views.append(flat[offset : offset + w.numel()].view(1, *w.shape))
                offset += w.numel()
            summed.append(payload.with_wire(views))
        _decode_into(segments, summed, 1.0)
        return buffer

    return _launch_reduce(state, flat, header, start, dense_bytes, decode)


def _launch_reduce(
    state: CompressionState,
    tensor: Tensor,
    header: Tensor | None,
    start: float,
    dense_bytes: int,
    finish: Callable[[], Tensor],
) -> Future[Tensor]:
    """All-reduce ``tensor`` (and the float64 header beside it), then run ``finish`` for the bucket's result."""
    encode_s = time.perf_counter() - start
    launched = time.perf_counter()
    futures = [dist.all_reduce(tensor, group=state.process_group, async_op=True).get_future()]
    if header is not None:
        # A separate float64 all-reduce: the statistics need a range and precision that an fp16 or bf16
        # bucket does not have. It is launched at once, so both collectives are in flight together.
        futures.append(dist.all_reduce(header, group=state.process_group, async_op=True).get_future())
    sent = tensor.numel() * tensor.element_size() + (header.numel() * 8 if header is not None else 0)

    def done(fut: Future[list[Future[object]]]) -> Tensor:
        received = time.perf_counter()
        result = finish()
        _record(
            state, sent, dense_bytes, REDUCE, header, encode_s + time.perf_counter() - received, received - launched
        )
        return result

    return torch.futures.collect_all(futures).then(done)


def _record(
    state: CompressionState,
    bytes_sent: int,
    dense_bytes: int,
    collective: int,
    norms: Tensor | None,
    compress_s: float,
    comm_s: float,
) -> None:
    values = norms.tolist() if norms is not None else [0.0, 0.0]
    state.record(
        BucketRecord(bytes_sent, dense_bytes, collective, values[0], values[1], compress_s, comm_s, tuple(values[2:]))
    )
