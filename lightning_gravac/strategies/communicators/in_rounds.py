"""The pattern of several rounds: a method's successive all-reduces, each computed from the sum of the one before."""

import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future
from typing_extensions import override

from lightning_gravac.compressors.base import sq_norm
from lightning_gravac.compressors.rounds import MultiRound
from lightning_gravac.state import REDUCE
from lightning_gravac.strategies.communicators.communicator import Communicator
from lightning_gravac.strategies.communicators.header import Header
from lightning_gravac.strategies.communicators.settle import Timing, all_received, failure, land, settle
from lightning_gravac.strategies.communicators.work import Work


class InRounds(Communicator):
    """The rounds of a method of several rounds (:class:`~lightning_gravac.compressors.rounds.MultiRound`): its
    first round's all-reduce carries the segments it does not take, sent dense; each round but the last is waited for
    before the next one is computed; the last one goes with the header."""

    @override
    def send(self, work: Work) -> Future[Tensor]:
        state, method = work.state, work.method
        assert isinstance(method, MultiRound)
        world, group = state.world_size, state.process_group
        fed_sq = _error_feed(work)
        taken = [s.compressor is method and method.takes(s.tensor) for s in work.segments]
        parts = [s for s, flag in zip(work.segments, taken, strict=True) if flag]
        dense = [s for s, flag in zip(work.segments, taken, strict=True) if not flag]
        rounds = method.rounds(parts, residual=state.error_feedback)
        payload = rounds.payload(0, None)
        probe_cfs = work.probe_cfs
        probes = [method.probe(s.tensor, probe_cfs, key=s.key) for s in work.segments] if probe_cfs else []
        norms = {s.key: _known_or(fed_sq.get(s.key), s.tensor) for s in work.segments}
        basis = torch.stack(list(norms.values())).sum()
        dense_sq = torch.stack([norms[s.key] for s in dense]).sum() if dense else basis.new_zeros(())
        flat = torch.cat([t.view(-1) for t in payload] + [s.tensor.reshape(-1).float() / world for s in dense])
        header_numel = Header.numel(len(state.factors.probe_cfs), work.fresh is not None)
        sent_bytes = flat.numel() * flat.element_size() + header_numel * 8
        encode_s = time.perf_counter() - work.start
        launched = time.perf_counter()

        # Each round needs the sum of the one before. It is launched here, on the thread that runs the hook, after
        # waiting for the one before: never from that one's callback. A callback runs on the thread that completes the
        # collective (gloo's worker): waiting there can stall the very collective waited on (the deadlock torch's own
        # low-rank hook risks), and a collective launched there is issued at a moment that differs between ranks, while
        # collectives are matched by the order each rank issues them. From the hook's thread every rank issues the same
        # collectives in the same order. The price: the first round does not overlap the rest of the backward pass.
        first = summed = _all_reduced(work, flat, 0, rounds.count)
        for index in range(1, rounds.count):
            payload = rounds.payload(index, summed)
            flat = torch.cat([t.view(-1) for t in payload]) if payload else summed.new_zeros(0)
            sent_bytes += flat.numel() * flat.element_size()
            if index < rounds.count - 1:
                summed = _all_reduced(work, flat, index, rounds.count)
        for s in parts if state.error_feedback else ():
            work.pending[s.key] = s.tensor  # turned into its residual by the rounds
        for s in dense:
            work.pending[s.key] = None
        work.header = header = Header.pack(basis, [dense_sq, *rounds.sent_sq_norms()], probes, work.fresh)
        last = flat
        futures = [dist.all_reduce(header, group=group, async_op=True).get_future()]
        if last.numel():  # a bucket of segments sent dense alone has nothing in its last round
            futures.append(dist.all_reduce(last, group=group, async_op=True).get_future())

        def finish(both: Future[list[Future[Tensor]]]) -> Tensor:
            all_received(both, state, f"all-reduce of round {rounds.count} of {rounds.count} and the header")
            rounds.finish(last, world)
            offset = first.numel() - sum(s.tensor.numel() for s in dense)
            for s in dense:
                s.out.view(-1).copy_(first[offset : offset + s.tensor.numel()])
                offset += s.tensor.numel()
            received = time.perf_counter()
            timing = Timing(encode_s, launched, received)
            return settle(work, sent_bytes, REDUCE, header=land(work, header), timing=timing)

        return torch.futures.collect_all(futures).then(finish)


def _all_reduced(work: Work, flat: Tensor, index: int, count: int) -> Tensor:
    """``flat`` summed over ranks, waited for on the calling thread (the hook's)."""
    state = work.state
    handle = dist.all_reduce(flat, group=state.process_group, async_op=True).get_future()
    try:
        return handle.wait()[0]
    except Exception as error:
        raise failure(state, f"all-reduce of round {index + 1} of {count}", error) from error


def _error_feed(work: Work) -> dict[str, Tensor | None]:
    """With recycled error feedback, each segment's tensor replaced by its error-fed gradient, in the memory's buffer
    that becomes the residual; returns ``||x||^2`` of each where the sum's kernel found it (else ``None``, or no
    entry without error feedback)."""
    if work.residual_mode != "recycle":
        return {}
    fed = [work.state.carry.error_fed_sq(s.key, s.tensor) for s in work.segments]
    work.segments = [replace(s, tensor=x) for s, (x, _) in zip(work.segments, fed, strict=True)]
    return {s.key: sq for s, (_, sq) in zip(work.segments, fed, strict=True)}


def _known_or(sq: Tensor | None, tensor: Tensor) -> Tensor:
    """``sq`` when a kernel found ``||tensor||^2`` already, else the eager norm."""
    return sq if sq is not None else sq_norm(tensor)
