"""The patterns of one round: every segment's payload computed before any collective, then exchanged at once."""

import time
from abc import abstractmethod

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_gravac.adaptations import ErrorFeedback, encode
from lightning_gravac.compressors.base import Payload
from lightning_gravac.compressors.packing import Layout
from lightning_gravac.state import GATHER, gathers
from lightning_gravac.strategies.communicators.communicator import Communicator
from lightning_gravac.strategies.communicators.header import Header
from lightning_gravac.strategies.communicators.settle import (
    Timing,
    land,
    received_value,
    reduce_with_header,
    settle,
    views_like,
)
from lightning_gravac.strategies.communicators.work import Segment, Work


class OneRound(Communicator):
    """A pattern whose payloads are computed in one go before any collective: error feedback, compression, probes,
    residuals and the header of every segment (:func:`encode`), then :meth:`exchange`."""

    @override
    def send(self, work: Work) -> Future[Tensor]:
        state, probe_cfs = work.state, work.probe_cfs
        basis, sent, probes = [], [], []
        outs = self.wire_views(work)
        for s, out in zip(work.segments, outs, strict=True):
            delivered = work.delivered.get(s.key)  # probed as it was delivered: the tensor holds it, not the input
            encoded = encode(
                s.compressor, s.tensor, s.cf, key=s.key, step=state.step, residual_mode=work.residual_mode,
                memory=state.carry.residuals, probe_cfs=probe_cfs if delivered is None else (),
                prober=state.compressor, out=out,
            )  # fmt: skip
            work.payloads.append(encoded.payload)
            basis.append(encoded.basis)
            sent.append(s.compressor.sent_sq_norm(encoded.payload))
            if encoded.probes is not None:
                probes.append(encoded.probes)
            elif delivered is not None and probe_cfs:
                probes.append(delivered)
            if encoded.error_fed is not None:
                work.deferred.append((s.key, encoded.error_fed, s.compressor, encoded.payload))
            elif state.error_feedback:
                _keep_residual(work, s, encoded.residual)
        work.header = Header.pack(torch.stack(basis).sum(), sent, probes, work.fresh)
        return self.exchange(work)

    def wire_views(self, work: Work) -> list[Tensor | None]:
        """Where each segment's payload is written (``None``: the method allocates it)."""
        return [None] * len(work.segments)

    @abstractmethod
    def exchange(self, work: Work) -> Future[Tensor]:
        """Launch the collectives of the encoded ``work``."""


class Gathered(OneRound):
    """Packed payloads all-gathered with the header and decoded rank by rank; or, when that moves more bytes than a
    ring all-reduce of the dense bucket (``N x payload >= 2 x dense``), decoded locally and all-reduced."""

    @override
    def exchange(self, work: Work) -> Future[Tensor]:
        assert work.header is not None
        layout = Layout.of(work.payloads, header_numel=work.header.numel())
        if not gathers(layout.nbytes, work.dense_bytes, work.state.world_size):
            _materialize(work)  # the bucket, which holds the error-fed gradients, is overwritten before the collective
            _decode_into(work, [_stack_one(p) for p in work.payloads], 1.0 / work.state.world_size)
            return reduce_with_header(work, work.buffer, lambda: work.buffer)
        state, world = work.state, work.state.world_size
        packed = layout.pack(work.payloads, work.header)
        gathered = torch.empty(world * layout.nbytes, dtype=torch.uint8, device=work.buffer.device)
        encode_s = time.perf_counter() - work.start
        launched = time.perf_counter()
        handle = dist.all_gather_single(gathered, packed, group=state.process_group, async_op=True)

        def decode(fut: Future[object]) -> Tensor:
            received_value(fut, state, "all-gather of the packed payloads")
            received = time.perf_counter()
            headers, stacked = layout.unpack(gathered.view(world, layout.nbytes), work.payloads)
            header = land(work, headers.sum(0))
            _decode_into(work, stacked, 1.0 / world)
            return settle(work, layout.nbytes, GATHER, header=header, timing=Timing(encode_s, launched, received))

        return handle.get_future().then(decode)


class Summed(OneRound):
    """Payloads that share support across ranks, summed by one all-reduce (with the header beside it) and decoded
    once."""

    @override
    def wire_views(self, work: Work) -> list[Tensor | None]:
        # Payloads of one dtype written straight into the bucket's recycled buffer (the casts): no payload is
        # allocated and none is copied into the buffer the all-reduce sends.
        dtypes = {s.compressor.wire_dtype for s in work.segments}
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        if dtype is None:
            return super().wire_views(work)
        sizes = [s.tensor.numel() for s in work.segments]
        work.wire = work.state.wire_buffer(work.names[0], sum(sizes), dtype, work.buffer.device)
        return list(work.wire.split(sizes))

    @override
    def exchange(self, work: Work) -> Future[Tensor]:
        # Divide before summing: a half-precision sum of N undivided gradients can overflow.
        if work.wire is not None:
            _materialize(work)  # the payloads are the wire itself, which the collective overwrites
            flat = work.wire.div_(work.state.world_size)
        else:
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

        return reduce_with_header(work, flat, decode)


def _keep_residual(work: Work, segment: Segment, residual: Tensor | None) -> None:
    """The pending residual(s) of one encoded segment: a layer's own, or a whole bucket's split by parameter (views of
    one tensor: DDP may regroup parameters into other buckets)."""
    if work.state.granularity == "layer":
        work.pending[segment.key] = residual
    elif residual is None:
        work.pending.update(dict.fromkeys(work.names))
    else:
        work.pending.update(zip(work.names, views_like(residual, work.buffer, work.grads), strict=True))


def _decode_into(work: Work, stacked: list[Payload], scale: float) -> None:
    """The average of every rank's payloads into the bucket: written segment by segment where the segments cover the
    buffer (each layer's gradient, or the whole bucket), else added into the zeroed buffer."""
    if sum(s.out.numel() for s in work.segments) == work.buffer.numel():
        for segment, payload in zip(work.segments, stacked, strict=True):
            segment.compressor.decode_(segment.out.view(-1), payload, scale)
        return
    work.buffer.zero_()
    for segment, payload in zip(work.segments, stacked, strict=True):
        segment.compressor.aggregate_(segment.out.view(-1), payload, scale)


def _stack_one(payload: Payload) -> Payload:
    return payload.with_wire([w.unsqueeze(0) for w in payload.wire])


def _materialize(work: Work) -> None:
    """The residuals of the segments error-fed in place, as pending tensors of their own: for a path that overwrites
    the bucket before the step is known finite."""
    for key, error_fed, method, payload in work.deferred:
        work.pending[key] = ErrorFeedback.residual_of(method, error_fed, payload)
    work.deferred = []
