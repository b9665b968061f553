"""Every bucket's end (:func:`settle`), the all-reduce with the header that most communicators end with, and the
checks that turn a failed collective into an error naming what was waited for."""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gravac.compressors.base import sq_norm
from lightning_gravac.state import REDUCE, BucketRecord, Collective, CompressionState
from lightning_gravac.strategies.communicators.header import Header
from lightning_gravac.strategies.communicators.work import Work


def reduce_with_header(
    work: Work, tensor: Tensor, finish: Callable[[], Tensor], extra_bytes: int = 0
) -> Future[Tensor]:
    """All-reduce ``tensor`` and the float64 header beside it, then ``finish`` makes the bucket's result;
    ``extra_bytes``: what the bucket sent before (a first round)."""
    assert work.header is not None
    header = work.header
    encode_s = time.perf_counter() - work.start
    launched = time.perf_counter()
    group = work.state.process_group
    # The header goes in a separate float64 all-reduce: the statistics need a range and precision that an fp16 or
    # bf16 bucket does not have. Both are launched at once, so they are in flight together.
    futures = [
        dist.all_reduce(tensor, group=group, async_op=True).get_future(),
        dist.all_reduce(header, group=group, async_op=True).get_future(),
    ]
    sent = tensor.numel() * tensor.element_size() + header.numel() * 8 + extra_bytes

    def done(fut: Future[list[Future[object]]]) -> Tensor:
        all_received(fut, work.state, "all-reduce of the bucket and its header")
        received = time.perf_counter()
        landed = land(work, header)
        finish()
        return settle(work, sent, REDUCE, header=landed, timing=Timing(encode_s, launched, received))

    return torch.futures.collect_all(futures).then(done)


def land(work: Work, norms: Tensor) -> Header:
    """The summed header of an arrived bucket, before its decoded average overwrites the bucket: on a finite step the
    residuals of the segments error-fed in place are taken into the carry (over the ones they replace); on
    a non-finite one they are dropped and the stored residuals stay as they were."""
    header = Header.unpack(norms, work.fresh is not None)
    if math.isfinite(header.basis):
        work.pending.update(work.state.carry.absorb(work.deferred))
    work.deferred = []
    return header


@dataclass(frozen=True)
class Timing:
    """A compressed bucket's clock: the seconds its encoding took, and when its collectives were launched and
    received (``time.perf_counter``)."""

    encode_s: float
    launched: float
    received: float


def settle(
    work: Work,
    bytes_sent: int,
    collective: Collective,
    *,
    bytes_dense: int | None = None,
    header: Header | None = None,
    finite: bool = True,
    timing: Timing | None = None,
    averaged: list[Tensor] | None = None,
    lossless: bool = False,
) -> Tensor:
    """Every bucket's end: commit the method's state and hand the outcome to the carry (which stores or drops
    the pending residuals and momentum), then record the bucket's statistics.

    A compressed bucket's ``header`` says whether every rank's gradient was finite; a non-finite step poisons the
    result with NaN on every rank, so that a mixed-precision scaler skips it. Without a header (a plain all-reduce,
    whose result already is stock DDP's) the caller says ``finite``. ``averaged``: the averaged gradients of a bucket
    sent dense, for the moved momentum. ``bytes_dense``: what stock DDP would have sent, where it is not the bucket's
    dense size (a sparse gradient's rows). ``lossless``: the result is the dense all-reduce's, whatever was sent.
    """
    state = work.state
    if header is not None:
        finite = math.isfinite(header.basis)
    keys = list(dict.fromkeys([*(s.key for s in work.segments), *work.delivered]))
    if finite:
        state.compressor.commit(keys)
    else:
        state.compressor.discard(keys)
    if work.plain is None:
        state.carry.settle(work.names, work.pending, finite)
    else:
        state.carry.settle(work.names, work.pending, finite, averaged, work.plain.params, work.plain.exact)
    if header is not None and not finite:
        work.buffer.fill_(math.nan)
    dense = work.dense_bytes if bytes_dense is None else bytes_dense
    record = BucketRecord(bytes_sent=bytes_sent, bytes_dense=dense, collective=collective, lossless=lossless)
    if header is not None:
        record.sq_norm, record.sq_norm_sent = header.basis, header.sent
        record.probe_sq, record.probe_basis = header.probes, header.probe_basis
        if header.probes and finite:  # what the noise of the ranks' batches is weighed from (one pass, probe steps)
            record.sq_norm_mean = float(sq_norm(work.buffer))
    if timing is not None:
        record.compress_s = timing.encode_s + time.perf_counter() - timing.received
        record.comm_s = timing.received - timing.launched
    state.record(record)
    return work.buffer


def views_like(result: Tensor, buffer: Tensor, grads: list[Tensor]) -> list[Tensor]:
    """The parts of ``result`` (a tensor shaped as the bucket's ``buffer``) where each gradient view lies."""
    views = []
    for grad in grads:
        offset = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
        views.append(result.view(-1)[offset : offset + grad.numel()].view_as(grad))
    return views


def received_value(fut: Future[Any], state: CompressionState, what: str) -> Any:
    """``fut``'s value, which must be complete (as in its own callback): a failed collective (a peer that died or
    stalled past the process group's timeout) is re-raised naming the compressor and what was waiting for it."""
    try:
        return fut.value()
    except Exception as error:
        raise failure(state, what, error) from error


def all_received(fut: Future[list[Future[Any]]], state: CompressionState, what: str) -> None:
    """Every future of a completed ``collect_all``, each checked as :func:`received_value` checks one."""
    for each in received_value(fut, state, what):
        received_value(each, state, what)


def failure(state: CompressionState, what: str, error: Exception) -> RuntimeError:
    """The error a failed collective surfaces as, naming the compressor, the step and what was waited for."""
    return RuntimeError(
        f"GraVACStrategy's comm hook ({state.compressor!r}, step {state.step}): the {what} failed; "
        f"a rank may have died or stalled past the process group's timeout. {error}"
    )
