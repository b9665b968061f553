"""GraVAC's steps and windows: what each step cost and kept, tallied by the factor sent, the probes' spacing, and at
a window's end each factor's throughput and what compressing costs, from the slowest rank's times and every rank's
samples."""

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_gravac.callbacks.gravac.cost import DENSE, Measured, Tally, moved_in_step
from lightning_gravac.callbacks.gravac.prediction import say_choice
from lightning_gravac.callbacks.gravac.state import GraVACState
from lightning_gravac.state import HALF, CompressionState, StepStats

if TYPE_CHECKING:
    from lightning_gravac.callbacks.gravac.controller import GraVAC

#: ``values`` reduced over the compression's ranks by an operation (MAX, SUM), the same on every rank.
Reduce = Callable[[torch.Tensor, dist.ReduceOp.RedOpType], torch.Tensor]


def record_step(c: "GraVAC", stats: StepStats) -> bool:
    """Take the step of ``stats`` into ``c``'s state: the gains it probed, what it sent beyond ``dense / cf``, and
    (unless it is a fit's first) its cost and gain in the tally of the factor sent. Returns whether it probed."""
    s = c.search_state
    s.steps += 1
    c.bytes_dense = stats.bytes_dense
    gains = stats.probe_gains()
    if gains:
        weight = _probe_weight(s, c.ewma_alpha)
        for cf, gain in gains.items():
            c.rule.smooth(c, cf, gain, weight)
    s.buckets = max(1, stats.buckets)
    compressed = c.cf not in (DENSE, *c.rungs)
    if compressed and stats.bytes_sent and stats.bytes_dense:
        # What a step sends beyond dense/cf: headers, at least one entry a tensor, rounding to whole entries.
        s.payload_fixed = max(0.0, stats.bytes_sent - stats.bytes_dense / c.cf)
    seconds = c.step_seconds(stats)
    if c.first_step is None:
        c.first_step_local = seconds
    if c.warm_up:  # a fit's first step allocates, builds DDP's buckets, warms caches: not a step's cost
        c.warm_up = False
        return bool(gains)
    # The sent factor's gain, measured on what the gains are of: the error-fed gradient (what was sent of it), or the
    # step's own gradient (the probes' smoothed value).
    gain = s.gains.get(c.cf, stats.gain) if s.gain_of == "gradient" and compressed else stats.gain
    s.tally.setdefault(c.cf, Tally()).add(
        seconds=seconds,
        comm_seconds=stats.comm_s,
        compress_seconds=c.compress_seconds(stats),
        samples=c.batch_size,
        gain=gain,
        moved=moved_in_step(stats, c.world_size),
        probed=bool(gains),
    )
    return bool(gains)


def after_step(c: "GraVAC", reduce: Reduce | None, probed: bool) -> None:
    """After a step (``probed``: it measured the gains): count it, end the window when it is full, choose the next
    factor, space the probes, and say a change of regime. ``reduce`` is ``None`` without a trainer (one process)."""
    s = c.search_state
    probed = probed and s.windows > 0  # the first window probes every step: no back-off from those
    if c.first_step is None and s.link is None and c.probed is not None:
        # The first window's choice needs a step's computation: the slowest rank's first step, the same on every rank.
        local = torch.tensor([c.first_step_local], dtype=torch.float64)
        c.first_step = (float((local if reduce is None else reduce(local, dist.ReduceOp.MAX))[0]), c.cf)
    if c.interval == "step":
        s.progress += 1
        if s.progress >= c.window_length:
            end_window(c, reduce)
    sent, c.cf = c.cf, c.choose()
    s.probe_interval = _next_spacing(s.probe_interval, c.cf != sent, probed, c.probe_every, c.probe_backoff)
    say_choice(c, sent)


def end_window(c: "GraVAC", reduce: Reduce | None) -> None:
    """End ``c``'s window: the throughputs and costs of the factors it sent, then what the search rule changes at a
    window's end, and whether it settles."""
    s = c.search_state
    s.progress = 0
    if not s.tally:
        return
    factors, local, samples = _window_totals(s.tally)
    # Step times are this rank's own: the slowest rank sets the pace, and every rank must see the same value. So must
    # the samples: a rank's batches may differ from another's (batching by tokens, an uneven last batch of an iterable
    # data set), and the sequential search settles on these throughputs.
    if reduce is not None:
        local, samples = reduce(local, dist.ReduceOp.MAX), reduce(samples, dist.ReduceOp.SUM)
    else:
        samples = samples * c.world_size
    slowest = local.tolist()
    measured = _close_window(s, factors, slowest, samples.tolist(), c.fp16_rung)
    c.rule.end_window(c, measured, slowest, factors)
    s.settled = _plateau(s.throughput, c.omega)


def probing(c: "GraVAC", state: CompressionState) -> bool:
    """Whether the next step measures the gains: every step of the first window; then one step in
    ``probe_interval`` (the gains are smoothed anyway), so that a settled or dense choice stops paying for the
    measurement on the other steps; fewer while probes change nothing, none while no factor could pay whatever it
    kept. Once Adam's moments move, the first step that sends them; none under a method of one factor."""
    s = c.search_state
    probes = s.windows == 0 or (s.steps % s.probe_interval == 0 and c.gains_can_matter())
    if c.moments_moved():
        fixed = state.compressor.fixed_cf is not None
        probes = not fixed and (probes or state.step == state.feedback.sends_from)
    return probes


def _probe_weight(state: GraVACState, alpha: float) -> float:
    """The weight of this step's probe in the smoothed gains, which decay per step: a probe after ``p`` steps without
    one weighs ``1 - (1 - alpha)^p``. This step becomes the last probe's."""
    weight = 1 - (1 - alpha) ** (state.steps - state.last_probe)
    state.last_probe = state.steps
    return weight


def _next_spacing(interval: int, changed: bool, probed: bool, probe_every: int, probe_backoff: int) -> int:
    """The probes' spacing after a step: a probe after the first window that leaves the choice as it was
    (``probed``) doubles it, up to ``probe_every x probe_backoff`` steps; a change of choice brings it back to
    ``probe_every``."""
    if changed:
        return probe_every
    if probed:
        return min(2 * interval, probe_every * probe_backoff)
    return interval


def _window_totals(tally: dict[float, Tally]) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """The factors sent in the window, sorted; this rank's times of each (seconds, communication, compression, and
    compression on the steps without probes) and its samples, as float64 tensors to reduce over ranks."""
    factors = sorted(tally)
    times = torch.tensor(
        [[t.seconds, t.comm_seconds, t.compress_seconds, t.plain_compress_seconds]
         for t in (tally[f] for f in factors)],
        dtype=torch.float64,
    )  # fmt: skip
    samples = torch.tensor([float(tally[f].samples) for f in factors], dtype=torch.float64)
    return factors, times, samples


def _close_window(
    state: GraVACState, factors: list[float], slowest: list[list[float]], samples: list[float], half: bool
) -> Measured:
    """End the window: each factor's throughput ``samples / seconds x mean gain`` and what compressing costs a step,
    from the slowest rank's rows of the window's totals and every rank's ``samples`` (``half``: the fp16 rung is on,
    its casts costed apart); clear the tallies and count the window. Returns its steps by factor."""
    measured: Measured = {}
    compress, plain = [0.0, 0], [0.0, 0]
    for f, (seconds, comm_seconds, compress_s, plain_s), total in zip(factors, slowest, samples, strict=True):
        tally = state.tally[f]
        state.throughput[f] = total / seconds * (tally.gain / tally.steps)
        measured[f] = (tally.steps, seconds, comm_seconds, tally.moved_bytes)
        if f == HALF and half:  # the casts' cost, kept apart from the method's
            state.cast_cost = (plain_s / tally.plain_steps) if tally.plain_steps else compress_s / tally.steps
        elif f != DENSE:
            compress = [compress[0] + compress_s, compress[1] + tally.steps]
            plain = [plain[0] + plain_s, plain[1] + tally.plain_steps]
    if plain[1] or compress[1]:  # what compressing costs a step: from steps without probes when there were any
        state.compress_cost = plain[0] / plain[1] if plain[1] else compress[0] / compress[1]
    state.tally.clear()
    state.windows += 1
    return measured


def _plateau(throughput: dict[float, float], omega: float) -> float | None:
    """The less aggressive of the two best factors when their throughputs agree within ``omega``, else ``None``."""
    ranked = sorted(throughput.items(), key=lambda item: item[1], reverse=True)
    if len(ranked) >= 2 and ranked[0][1] > 0 and (ranked[0][1] - ranked[1][1]) / ranked[0][1] <= omega:
        return min(ranked[0][0], ranked[1][0])
    return None
