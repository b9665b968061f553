"""The communicators: how one bucket crosses the network, one per pattern.

The comm hook (:mod:`lightning_gravac.strategies.hook`) prepares a bucket as a :class:`Work` (its segments: each layer,
or the whole bucket; their factors and methods; the step's own-gradient probes) and hands it to
:func:`communicator_for`. Buckets that are not compressed: :class:`Local` (local SGD: nothing sent),
:class:`SparseReduced` (a sparse gradient's all-reduce), :class:`Plain` (stock DDP's all-reduce, bit for bit) and
:class:`RowsReduced` (the same sum, of embedding tables by the rows their step touched). The compressed
ones, by the method's :class:`~lightning_gravac.compressors.base.Communication`:

- :class:`Gathered` (``GATHER``): error feedback, compression and residuals (:func:`encode`), then an all-gather of
  the packed payloads and the header, decoded rank by rank in rank order; or, when the gather would move more bytes
  than a ring all-reduce of the dense bucket, the payloads decoded locally and the bucket all-reduced with the header.
- :class:`Summed` (``SUM``): the same encoding; the payloads all-reduced element-wise (they share support), decoded
  once.
- :class:`LowRank` (``ROUNDS``): PowerSGD's two all-reduces, ``P`` with the dense parts, then ``Q`` with the header.
- :class:`DenseProbed`: every factor 1 but the controller measures what compression would keep: the dense bucket
  all-reduced with the header (residuals are sent in full and dropped).

A layer or bucket sent dense under a method with momentum of its own (DGC) holds what the method delivers there
(``Work.delivered``, prepared by the hook); the method's new state is committed or discarded by :func:`settle`.

Each compressed communicator builds the bucket's :class:`Header` (this rank's norms, summed over ranks by a
collective). Every communicator ends in :func:`settle`: a finite step commits the method's state and the feedback
part stores the pending residuals and momentum; a non-finite one (some rank's gradient was not) discards them (and a
compressed bucket is poisoned with NaN); the bucket's :class:`BucketRecord` is recorded.

Two rules keep the collectives from hanging. Every collective is launched from the thread that runs the hook, so
every rank issues them in the same order (collectives are matched by that order; a collective launched from a
future's callback, which runs on whichever thread completes the previous one, would not be). And no callback waits
for anything: callbacks only decode and record.
"""

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from lightning_gravac.compressors.base import Communication, Compressor, Payload, all_finite, sq_norm
from lightning_gravac.compressors.packing import Layout
from lightning_gravac.compressors.powersgd import PowerSGD, add_product_, as_matrix, average_product_, right_factor
from lightning_gravac.feedback import ErrorFeedback, FeedMode, encode
from lightning_gravac.state import GATHER, REDUCE, BucketRecord, Collective, CompressionState, gathers


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
class Segment:
    """One unit of compression: a layer's gradient, or the whole bucket."""

    key: str
    tensor: Tensor  # what is compressed: the gradient (error-fed on the way, by `Work.mode`), or the bucket
    cf: float
    compressor: Compressor
    out: Tensor  # where the averaged result goes: a view into the bucket buffer


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
    mode: FeedMode = "off"  # how each segment is error-fed (`encode`)
    dense: bool = False  # every factor is 1: sent dense while the controller probes
    fresh: tuple[Tensor, Tensor] | None = None  # the probes of the step's own gradient and its ||grad||^2
    start: float = field(default_factory=time.perf_counter)
    payloads: list[Payload] = field(default_factory=list)
    wire: Tensor | None = None  # the recycled buffer that holds every segment's payload in order (summed casts)
    header: Tensor | None = None
    pending: dict[str, Tensor | None] = field(default_factory=dict)
    # Segments error-fed in place (``feedback="in_place"``) whose residual is taken once the step is known finite,
    # before the decoded average overwrites them (`land`): (key, error-fed tensor, its method, its payload).
    deferred: list[tuple[str, Tensor, Compressor, Payload]] = field(default_factory=list)
    # A bucket sent as stock DDP sends it (`Plain`): its parameters when momentum is moved into the hook, and whether
    # that momentum applies after the all-reduce (buffers in sync, nothing carried in).
    plain: bool = False
    params: list[Tensor] = field(default_factory=list)
    exact: bool = False
    # Of a plain bucket: the positions in `names` of the embedding tables sent by their touched rows (`RowsReduced`),
    # and whether it goes in fp16 (a half step).
    rows: list[int] = field(default_factory=list)
    half: bool = False
    local: bool = False  # local SGD: nothing is sent (`Local`)
    # The units sent dense that hold what their method delivers there (DGC's momentum and accumulation), by key, with
    # the probes of it (`Compressor.deliver_`); the method's state of those keys is pending until `settle`.
    delivered: dict[str, Tensor] = field(default_factory=dict)

    @property
    def dense_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def probe_cfs(self) -> tuple[float, ...]:
        """The factors the header's probes are of, when measured here (not from the step's own gradient)."""
        return () if self.fresh is not None else self.state.probe_cfs

    @property
    def method(self) -> Compressor:
        """The method that compresses this step's segments: the strategy's, or the cast of a half step."""
        return next((s.compressor for s in self.segments if not s.compressor.passthrough), self.state.compressor)


class Communicator(ABC):
    """How a bucket crosses the network: its collectives (and a compressed one's header), ending in :func:`settle`."""

    @abstractmethod
    def send(self, work: Work) -> Future[Tensor]:
        """Launch the bucket's collectives (from the calling thread) and return the future of its averaged result."""


class _Encoded(Communicator):
    """A pattern whose payloads are computed in one go before any collective: error feedback, compression, probes,
    residuals and the header of every segment (:func:`encode`), then :meth:`exchange`."""

    def send(self, work: Work) -> Future[Tensor]:
        state, probe_cfs = work.state, work.probe_cfs
        basis, sent, probes = [], [], []
        outs = self.wire_views(work)
        for s, out in zip(work.segments, outs, strict=True):
            delivered = work.delivered.get(s.key)  # probed as it was delivered: the tensor holds it, not the input
            encoded = encode(
                s.compressor, s.tensor, s.cf, key=s.key, step=state.step, feedback=work.mode,
                memory=state.feedback.residuals, probe_cfs=probe_cfs if delivered is None else (),
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


class Gathered(_Encoded):
    """Packed payloads all-gathered with the header and decoded rank by rank; or, when that moves more bytes than a
    ring all-reduce of the dense bucket (``N x payload >= 2 x dense``), decoded locally and all-reduced."""

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


class Summed(_Encoded):
    """Payloads that share support across ranks, summed by one all-reduce (with the header beside it) and decoded
    once."""

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


class DenseProbed(Communicator):
    """Every factor is 1 while the controller measures what compression would keep: the error-fed bucket is sent
    dense with the header (the residuals it carried are sent in full and dropped)."""

    def send(self, work: Work) -> Future[Tensor]:
        state, probe_cfs = work.state, work.probe_cfs
        probes = []
        for s in work.segments if probe_cfs else ():
            found = work.delivered.get(s.key)  # probed as it was delivered: the tensor holds what the method sends
            if found is None:
                found = state.compressor.probe(s.tensor, probe_cfs, key=s.key, step=state.step)
            probes.append(found)
        norm = sq_norm(work.buffer)  # sent dense: what is sent is all there is
        work.header = Header.pack(norm, [norm], probes, work.fresh)
        if state.error_feedback:
            work.pending = dict.fromkeys(work.names)
        work.buffer.mul_(1.0 / state.world_size)
        return reduce_with_header(work, work.buffer, lambda: work.buffer)


class LowRank(Communicator):
    """PowerSGD's two all-reduces: ``P = M Q`` with the bucket's dense parts, then ``Q = M^T P`` with the header."""

    def send(self, work: Work) -> Future[Tensor]:
        state, method = work.state, work.state.compressor
        assert isinstance(method, PowerSGD)
        world, group = state.world_size, state.process_group
        fed_sq = _error_feed(work)
        is_low = [s.compressor is method and method.low_rank(s.tensor) for s in work.segments]
        low = [s for s, flag in zip(work.segments, is_low, strict=True) if flag]
        full = [s for s, flag in zip(work.segments, is_low, strict=True) if not flag]
        matrices = [as_matrix(s.tensor) for s in low]  # views of the inputs for fp32
        ranks = [method.rank_for(s.tensor.shape, s.cf) for s in low]
        ps = [method.project(m, r, s.key) for s, m, r in zip(low, matrices, ranks, strict=True)]
        probe_cfs = work.probe_cfs
        probes = [method.probe(s.tensor, probe_cfs, key=s.key) for s in work.segments] if probe_cfs else []
        norms = {s.key: _known_or(fed_sq.get(s.key), s.tensor) for s in work.segments}
        basis = torch.stack(list(norms.values())).sum()
        dense_sq = torch.stack([norms[s.key] for s in full]).sum() if full else basis.new_zeros(())
        first = torch.cat([p.view(-1) for p in ps] + [s.tensor.reshape(-1).float() / world for s in full])
        second_numel = sum(m.shape[1] * p.shape[1] for m, p in zip(matrices, ps, strict=True))
        header_bytes = Header.numel(len(state.probe_cfs), work.fresh is not None) * 8
        sent_bytes = (first.numel() + second_numel) * first.element_size() + header_bytes
        encode_s = time.perf_counter() - work.start
        launched = time.perf_counter()

        # The second all-reduce needs the first one's result. It is launched here, on the thread that runs the hook,
        # after waiting for the first: never from the first one's callback. A callback runs on the thread that
        # completes the collective (gloo's worker): waiting there can stall the very collective waited on (the
        # deadlock torch's own PowerSGD hook risks), and a collective launched there is issued at a moment that differs
        # between ranks, while collectives are matched by the order each rank issues them. From the hook's thread
        # every rank issues the same collectives in the same order. The price: the first round does not overlap the
        # rest of the backward pass.
        first_round = dist.all_reduce(first, group=group, async_op=True).get_future()
        try:
            summed = first_round.wait()[0]
        except Exception as error:
            raise failure(state, "first all-reduce (P and the dense parts)", error) from error
        qs = _right_factors(work, method, low, ps, matrices, summed)
        for s in full:
            work.pending[s.key] = None
        sent = [dense_sq] + [q.double().square().sum() for q in qs]  # ||P Q^T|| = ||Q|| for orthonormal P
        work.header = header = Header.pack(basis, sent, probes, work.fresh)
        second = torch.cat([q.view(-1) for q in qs]) if qs else summed.new_zeros(0)
        futures = [dist.all_reduce(header, group=group, async_op=True).get_future()]
        if qs:  # a bucket of biases alone has no second factor
            futures.append(dist.all_reduce(second, group=group, async_op=True).get_future())

        def finish(both: Future[list[Future[Tensor]]]) -> Tensor:
            all_received(both, state, "second all-reduce (Q and the header)")
            offset = 0
            for s, p, q in zip(low, ps, qs, strict=True):
                q_sum = second[offset : offset + q.numel()].view_as(q)
                offset += q.numel()
                method.keep(s.key, q_sum)
                if s.out.dtype == p.dtype and s.out.is_contiguous():  # P Q^T written into the bucket, then averaged
                    average_product_(s.out.view(p.shape[0], -1), p, q_sum, world)
                else:
                    s.out.copy_((p @ q_sum.T).div_(world).view_as(s.out))
            offset = first.numel() - sum(s.tensor.numel() for s in full)
            for s in full:
                s.out.view(-1).copy_(summed[offset : offset + s.tensor.numel()])
                offset += s.tensor.numel()
            received = time.perf_counter()
            timing = Timing(encode_s, launched, received)
            return settle(work, sent_bytes, REDUCE, header=land(work, header), timing=timing)

        return torch.futures.collect_all(futures).then(finish)


class Plain(Communicator):
    """The bucket all-reduced as stock DDP does, bit for bit: every factor 1, nothing probed. Residuals carried in are
    sent in full; the moved momentum applies after the all-reduce (``work.exact``) or moved before it; a method's own
    momentum was delivered into the bucket before it (``work.delivered``)."""

    def send(self, work: Work) -> Future[Tensor]:
        state = work.state
        # Multiply by 1/N exactly as DDP's reducer does without a hook (``mul_out(bucket, grad, 1.0 / N)``), so the
        # result is bit-identical to stock DDP for every world size, not only powers of two.
        work.buffer.mul_(1.0 / state.world_size)
        handle = dist.all_reduce(work.buffer, group=state.process_group, async_op=True)

        def done(fut: Future[list[Tensor]]) -> Tensor:
            result = received_value(fut, state, "dense all-reduce")[0]
            return _settle_plain(work, result, work.dense_bytes)

        return handle.get_future().then(done)


class RowsReduced(Communicator):
    """A bucket sent dense, or whole in fp16 on a half step, with embedding tables whose step touched few rows: one
    all-reduce of which rows any rank touched (a byte a row), then one of those rows and the bucket's other parameters.
    A row no rank touched is zero on every rank, so the sum is the whole bucket's: bit for bit on two ranks, up to the
    order of the sum on more (the ring adds the same values at other offsets). A half step sends what the fp16 rung's
    `Summed` sends, with its header, but keeps no rounding (:func:`_half_rows`). A table whose touched rows are more
    than :data:`~lightning_gravac.tables.ROWS_SHARE` of it goes whole. The second all-reduce needs the first's result:
    it is launched from the hook's thread after waiting for the first, as :class:`LowRank` does, and reading a union's
    size syncs the host with a CUDA device once a table."""

    def send(self, work: Work) -> Future[Tensor]:
        state, tables = work.state, _tables_of(work)
        chosen: dict[int, Tensor] = {}  # a table's position -> the rows it sends
        mask_bytes = 0
        if tables:  # else a half step whose tables all go whole this time
            touched = torch.cat([work.grads[i].view(rows, -1).ne(0).any(1) for i, rows in tables]).to(torch.uint8)
            mask_bytes = touched.numel()
            group = state.process_group
            first = dist.all_reduce(touched, op=dist.ReduceOp.MAX, group=group, async_op=True).get_future()
            try:
                first.wait()
            except Exception as error:
                raise failure(state, "all-reduce of the embedding tables' touched rows", error) from error
            offset = 0
            for i, rows in tables:
                union = touched[offset : offset + rows].bool()
                offset += rows
                indices = union.nonzero().view(-1)
                if state.rows.observe(work.names[i], indices.numel(), state.step):
                    chosen[i] = indices
        parts = [
            work.grads[i].view(work.grads[i].shape[0], -1).index_select(0, chosen[i]) if i in chosen else grad
            for i, grad in enumerate(work.grads)
        ]
        flat = torch.cat([part.reshape(-1) for part in parts])

        def scatter(summed: Tensor) -> Tensor:
            at = 0
            for i, (grad, part) in enumerate(zip(work.grads, parts, strict=True)):
                values = summed[at : at + part.numel()].view_as(part)
                at += part.numel()
                if i in chosen:  # the other rows are zero here as on every rank
                    grad.view(grad.shape[0], -1).index_copy_(0, chosen[i], values.to(grad.dtype))
                else:
                    grad.copy_(values)
            return work.buffer

        if work.half:
            return _half_rows(work, flat, scatter, mask_bytes)
        # Divided before summing as `Plain` does: bit for bit what the whole bucket would have given.
        flat.mul_(1.0 / state.world_size)
        second = dist.all_reduce(flat, group=state.process_group, async_op=True).get_future()
        sent = mask_bytes + flat.numel() * flat.element_size()

        def done(fut: Future[list[Tensor]]) -> Tensor:
            scatter(received_value(fut, state, "all-reduce of the embedding tables' touched rows")[0])
            return _settle_plain(work, work.buffer, sent)

        return second.then(done)


def _half_rows(work: Work, flat: Tensor, scatter: Callable[[Tensor], Tensor], mask_bytes: int) -> Future[Tensor]:
    """The half step of :class:`RowsReduced`: cast, then divided, as `Summed` sends the fp16 rung (the same sum), with
    the header of the values and of what was sent. The cast's rounding is not kept (as torch's fp16 hook keeps none):
    kept, it would make every row it was left on look touched at the next step, and residuals carried in are dropped
    once the step is known finite, as on a dense step."""
    state = work.state
    wire = flat.to(state.cast.wire_dtype)
    work.header = Header.pack(sq_norm(flat), [sq_norm(wire.to(flat.dtype))], [], None)
    wire.div_(state.world_size)
    return reduce_with_header(work, wire, lambda: scatter(wire), extra_bytes=mask_bytes)


def _tables_of(work: Work) -> list[tuple[int, int]]:
    """``(position, rows)`` of each table of ``work`` sent by its rows."""
    return [(i, work.state.rows.rows[work.names[i]]) for i in work.rows]


def _settle_plain(work: Work, result: Tensor, bytes_sent: int) -> Tensor:
    """The end of a plain bucket, whose ``result`` already is the dense all-reduce's. No header on this path: whether
    some rank's gradient was not finite is read off the result itself (one sum of the bucket), and only when something
    depends on it: residuals carried in (a finite step has delivered them, a non-finite one keeps them), momentum
    buffers or the method's own delivered state. Without any, plain steps pay nothing."""
    moved = work.state.feedback.follows_average
    finite = not (work.pending or moved or work.delivered) or all_finite(result)
    averaged = views_like(result, work.buffer, work.grads) if moved else None
    return settle(work, bytes_sent, REDUCE, finite=finite, averaged=averaged, lossless=True)


class SparseReduced(Communicator):
    """A sparse gradient (``nn.Embedding(sparse=True)``) as stock DDP sends it: divided by N, then summed over ranks
    (a sparse all-reduce: gloo has one, NCCL has none, as for stock DDP). It is already as small as the rows the step
    touched; compression, error feedback and momentum correction work on dense gradients and leave it alone (the
    strategy keeps such a parameter's momentum in the optimizer)."""

    def send(self, work: Work) -> Future[Tensor]:
        state = work.state
        work.buffer.div_(state.world_size)
        handle = dist.all_reduce(work.buffer, group=state.process_group, async_op=True)

        def done(fut: Future[list[Tensor]]) -> Tensor:
            result = received_value(fut, state, "sparse all-reduce")[0]
            # Its bytes, as the sum's (each rank's own rows differ in number; the sum is the same on every rank):
            # values and int64 indices, sent as they are, so dense and sent alike.
            nbytes = result._values().numel() * result.element_size() + result._indices().numel() * 8
            settle(work, nbytes, REDUCE, bytes_dense=nbytes)
            return result

        return handle.get_future().then(done)


class Local(Communicator):
    """Local SGD: this rank's own gradient, nothing sent (the strategy averages the parameters periodically); recorded
    by its dense size, the same on every rank."""

    def send(self, work: Work) -> Future[Tensor]:
        future: Future[Tensor] = Future()
        future.set_result(settle(work, 0, REDUCE))
        return future


_BY_PATTERN: dict[Communication, Communicator] = {
    Communication.GATHER: Gathered(),
    Communication.SUM: Summed(),
    Communication.ROUNDS: LowRank(),
}
_DENSE_PROBED, _PLAIN, _ROWS, _SPARSE, _LOCAL = DenseProbed(), Plain(), RowsReduced(), SparseReduced(), Local()


def communicator_for(work: Work) -> Communicator:
    """The communicator of a bucket: nothing sent under local SGD; a sparse gradient's all-reduce; stock DDP's
    all-reduce (of embedding tables by their touched rows, where some are); dense with probes; PowerSGD's rounds; the
    all-reduce of payloads when every segment's are summable (a layer sent dense is); else the gather."""
    if work.local:
        return _LOCAL
    if work.buffer.is_sparse:
        return _SPARSE
    if work.plain:
        return _ROWS if work.rows or work.half else _PLAIN
    if work.dense:
        return _DENSE_PROBED
    if work.method.communication is Communication.ROUNDS:
        return _BY_PATTERN[Communication.ROUNDS]
    # `summable` rather than the declared pattern: a method that sets `summable = True` itself is summed as before.
    summed = all(s.compressor.summable for s in work.segments)
    return _BY_PATTERN[Communication.SUM if summed else Communication.GATHER]


def _keep_residual(work: Work, segment: Segment, residual: Tensor | None) -> None:
    """The pending residual(s) of one encoded segment: a layer's own, or a whole bucket's split by parameter (views of
    one tensor: DDP may regroup parameters into other buckets)."""
    if work.state.granularity == "layer":
        work.pending[segment.key] = residual
    elif residual is None:
        work.pending.update(dict.fromkeys(work.names))
    else:
        work.pending.update(zip(work.names, views_like(residual, work.buffer, work.grads), strict=True))


def _error_feed(work: Work) -> dict[str, Tensor | None]:
    """With recycled error feedback, each segment's tensor replaced by its error-fed gradient, in the memory's buffer
    that becomes the residual; returns ``||x||^2`` of each where the sum's kernel found it (else ``None``, or no
    entry without error feedback)."""
    if work.mode != "recycle":
        return {}
    fed = [work.state.feedback.error_fed_sq(s.key, s.tensor) for s in work.segments]
    work.segments = [replace(s, tensor=x) for s, (x, _) in zip(work.segments, fed, strict=True)]
    return {s.key: sq for s, (_, sq) in zip(work.segments, fed, strict=True)}


def _known_or(sq: Tensor | None, tensor: Tensor) -> Tensor:
    """``sq`` when a kernel found ``||tensor||^2`` already, else the eager norm."""
    return sq if sq is not None else sq_norm(tensor)


def _right_factors(
    work: Work, method: PowerSGD, low: list[Segment], ps: list[Tensor], matrices: list[Tensor], summed: Tensor
) -> list[Tensor]:
    """``Q = M^T P`` of each low-rank segment from the summed ``P`` (orthonormalized in place); with error feedback,
    what this rank's gradient has outside the shared subspace becomes its pending residual, in place."""
    qs, offset = [], 0
    for s, p, m in zip(low, ps, matrices, strict=True):
        p.copy_(summed[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
        method.orthonormalize_(p)
        q = right_factor(m, p)
        if work.state.error_feedback:
            add_product_(m, p, q, -1.0)  # M - P Q^T in place: no decoded matrix allocated
            if m.data_ptr() != s.tensor.data_ptr():  # not fp32: `m` was a copy
                s.tensor.copy_(m.view_as(s.tensor))
            work.pending[s.key] = s.tensor
        qs.append(q)
    return qs


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


def _materialize(work: Work) -> None:
    """The residuals of the segments error-fed in place, as pending tensors of their own: for a path that overwrites
    the bucket before the step is known finite."""
    for key, error_fed, method, payload in work.deferred:
        work.pending[key] = ErrorFeedback.residual_of(method, error_fed, payload)
    work.deferred = []


def land(work: Work, norms: Tensor) -> Header:
    """The summed header of an arrived bucket, before its decoded average overwrites the bucket: on a finite step the
    residuals of the segments error-fed in place are taken into the feedback part (over the ones they replace); on
    a non-finite one they are dropped and the stored residuals stay as they were."""
    header = Header.unpack(norms, work.fresh is not None)
    if math.isfinite(header.basis):
        work.pending.update(work.state.feedback.absorb(work.deferred))
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
    """Every bucket's end: commit the method's state and hand the outcome to the feedback part (which stores or drops
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
    state.feedback.settle(work.names, work.pending, finite, averaged, work.params, work.exact)
    if header is not None and not finite:
        work.buffer.fill_(math.nan)
    dense = work.dense_bytes if bytes_dense is None else bytes_dense
    record = BucketRecord(bytes_sent=bytes_sent, bytes_dense=dense, collective=collective, lossless=lossless)
    if header is not None:
        record.sq_norm, record.sq_norm_sent = header.basis, header.sent
        record.probe_sq, record.probe_basis = header.probes, header.probe_basis
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
