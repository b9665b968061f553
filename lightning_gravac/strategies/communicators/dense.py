"""The buckets sent dense: probed (every factor 1, with the header), as stock DDP sends them (whole, or embedding
tables by their touched rows), a sparse gradient; and local SGD's, which sends nothing."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_gravac.compressors.base import all_finite, sq_norm
from lightning_gravac.state import REDUCE
from lightning_gravac.strategies.communicators.communicator import Communicator
from lightning_gravac.strategies.communicators.header import Header
from lightning_gravac.strategies.communicators.settle import (
    failure,
    received_value,
    reduce_with_header,
    settle,
    views_like,
)
from lightning_gravac.strategies.communicators.work import Work
from lightning_gravac.tables import ByRows, row_mask, set_rows


class DenseProbed(Communicator):
    """Every factor is 1 while the controller measures what compression would keep: the error-fed bucket is sent
    dense with the header (the residuals it carried are sent in full and dropped)."""

    @override
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


class Plain(Communicator):
    """The bucket all-reduced as stock DDP does, bit for bit: every factor 1, nothing probed. Residuals carried in are
    sent in full; the moved momentum applies after the all-reduce (``work.plain.exact``) or moved before it; a
    method's own momentum was delivered into the bucket before it (``work.delivered``)."""

    @override
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
    it is launched from the hook's thread after waiting for the first, as :class:`~.in_rounds.InRounds` launches its
    rounds, and reading a union's size syncs the host with a CUDA device once a table."""

    @override
    def send(self, work: Work) -> Future[Tensor]:
        state, plain = work.state, work.plain
        assert plain is not None  # `communicator_for` sends only plain buckets here
        positions = plain.rows  # the tables by rows
        rows = [state.rows.rows[work.names[i]] for i in positions]
        chosen: dict[int, Tensor] = {}  # a table's position -> the rows it sends
        mask_bytes = 0
        if positions:  # else a half step whose tables all go whole this time
            touched = row_mask([work.grads[i] for i in positions], rows)
            mask_bytes = touched.numel()
            group = state.process_group
            first = dist.all_reduce(touched, op=dist.ReduceOp.MAX, group=group, async_op=True).get_future()
            try:
                first.wait()
            except Exception as error:
                raise failure(state, "all-reduce of the embedding tables' touched rows", error) from error
            for i, indices in zip(positions, set_rows(touched, rows), strict=True):
                if state.rows.observe(work.names[i], indices.numel(), state.step):
                    chosen[i] = indices
        by_rows = ByRows(chosen)
        flat = torch.cat(by_rows.select(work.grads))

        def scatter(summed: Tensor) -> Tensor:
            by_rows.place(summed, work.grads)  # a table's other rows are zero here as on every rank
            return work.buffer

        if plain.half:
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


def _settle_plain(work: Work, result: Tensor, bytes_sent: int) -> Tensor:
    """The end of a plain bucket, whose ``result`` already is the dense all-reduce's. No header on this path: whether
    some rank's gradient was not finite is read off the result itself (one sum of the bucket), and only when something
    depends on it: residuals carried in (a finite step has delivered them, a non-finite one keeps them), momentum
    buffers or the method's own delivered state. Without any, plain steps pay nothing."""
    moved = work.state.carry.follows_average
    finite = not (work.pending or moved or work.delivered) or all_finite(result)
    averaged = views_like(result, work.buffer, work.grads) if moved else None
    return settle(work, bytes_sent, REDUCE, finite=finite, averaged=averaged, lossless=True)


class SparseReduced(Communicator):
    """A sparse gradient (``nn.Embedding(sparse=True)``) as stock DDP sends it: divided by N, then summed over ranks
    (a sparse all-reduce: gloo has one, NCCL has none, as for stock DDP). It is already as small as the rows the step
    touched; compression, error feedback and momentum correction work on dense gradients and leave it alone (the
    strategy keeps such a parameter's momentum in the optimizer)."""

    @override
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


class LocalSGD(Communicator):
    """Local SGD: this rank's own gradient, nothing sent (the strategy averages the parameters periodically); recorded
    by its dense size, the same on every rank."""

    @override
    def send(self, work: Work) -> Future[Tensor]:
        future: Future[Tensor] = Future()
        future.set_result(settle(work, 0, REDUCE))
        return future
