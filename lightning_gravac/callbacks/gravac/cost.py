"""GraVAC's model of a step's cost: what a window measured, the link fitted to it, the bytes a collective moves."""

from dataclasses import dataclass

from lightning_gravac.state import DENSE, StepStats, gathers, ring_share


@dataclass
class Tally:
    """What one factor cost and kept while it was sent during the current window."""

    steps: int = 0
    seconds: float = 0.0  # this rank's; reduced with MAX at the window's end
    comm_seconds: float = 0.0  # this rank's; reduced with MAX at the window's end
    gain: float = 0.0
    moved_bytes: float = 0.0  # bytes a rank moves on the link, ring model
    compress_seconds: float = 0.0  # this rank's selection and encoding (probes included); reduced with MAX
    plain_steps: int = 0  # steps without probes, and their compression seconds: what sending the factor costs
    plain_compress_seconds: float = 0.0
    samples: int = 0  # this rank's; summed over ranks at the window's end

    def add(
        self,
        seconds: float,
        comm_seconds: float,
        compress_seconds: float,
        samples: int,
        gain: float,
        moved: float,
        probed: bool,
    ) -> None:
        """One more step sent at this factor; ``probed``: it measured the probes' gains too."""
        self.steps += 1
        self.samples += samples
        self.seconds += seconds
        self.comm_seconds += comm_seconds
        self.compress_seconds += compress_seconds
        if not probed:
            self.plain_steps += 1
            self.plain_compress_seconds += compress_seconds
        self.gain += gain
        self.moved_bytes += moved


@dataclass
class Link:
    """A fitted model of a step: ``seconds = other + per_step + moved_bytes * seconds_per_byte``."""

    other_seconds: float
    seconds_per_byte: float
    per_step: float = 0.0  # communication time that does not grow with the bytes (latency, the header)


#: A window's steps by factor: ``(steps, seconds, comm seconds, moved bytes)``, summed.
Measured = dict[float, tuple[int, float, float, float]]


def fit_link(tallies: Measured) -> Link | None:
    """The link model from ``{cf: (steps, seconds, comm_seconds, moved_bytes)}`` summed over a window's steps.

    Communication a step is fitted as ``per_step + bytes * seconds_per_byte`` by least squares over the factors
    sent (weighted by their steps) when they moved different byte counts and the slope comes out positive; else as
    proportional to the bytes. ``other`` is the mean of the rest of the step. ``None`` when nothing was moved.
    """
    rows = [(n, sec / n, comm / n, moved / n) for n, sec, comm, moved in tallies.values() if n > 0]
    steps = sum(r[0] for r in rows)
    moved_total = sum(r[0] * r[3] for r in rows)
    if not rows or moved_total <= 0:
        return None
    other = max(0.0, sum(n * (sec - comm) for n, sec, comm, _ in rows) / steps)
    mean_x = moved_total / steps
    mean_y = sum(n * comm for n, _, comm, _ in rows) / steps
    spread = sum(n * (x - mean_x) ** 2 for n, _, _, x in rows)
    if spread > 0:
        slope = sum(n * (x - mean_x) * (y - mean_y) for n, _, y, x in rows) / spread
        if slope > 0:
            return Link(other, slope, max(0.0, mean_y - slope * mean_x))
    return Link(other, mean_y / mean_x)


def probed_link(probed: tuple[float, float] | None, buckets: int) -> Link | None:
    """The cost model of the fit-start probe's ``(seconds a message, seconds a moved byte)`` (``None`` when it did not
    run): a message a bucket and its seconds a moved byte; the rest of the step 0, for the caller to set once
    measured."""
    if probed is None:
        return None
    latency, per_byte = probed
    return Link(0.0, per_byte, latency * buckets)


def fit_step(measured: Measured, compress_seconds: float, probed: Link | None) -> Link | None:
    """The step's cost model from a window's steps (``measured``) and their seconds compressing: the link of the
    fit-start probe when it ran (``probed``), else fitted to the measured communication times; the rest of the step as
    measured minus communication and compression. ``None`` for a window without steps, or without bytes to fit to."""
    steps = sum(m[0] for m in measured.values())
    if steps == 0:
        return None
    if probed is None:
        link = fit_link(measured)
        if link is not None:
            link.other_seconds = max(0.0, link.other_seconds - compress_seconds / steps)
        return link
    comm = sum(n * probed.per_step + moved * probed.seconds_per_byte for n, _, _, moved in measured.values())
    seconds = sum(m[1] for m in measured.values())
    probed.other_seconds = max(0.0, (seconds - comm - compress_seconds) / steps)
    return probed


def regime(cf: float, rungs: tuple[float, ...]) -> str:
    """``"dense"``, ``"fp16"`` (a rung: the whole gradient cast) or ``"compressed"``."""
    return "dense" if cf == DENSE else "fp16" if cf in rungs else "compressed"


def moved_bytes(payload_bytes: float, dense_bytes: float, world_size: int) -> float:
    """Bytes one rank moves on the link for one bucket, with the hook's choice of collective.

    Ring all-reduce moves ``2 (N-1)/N`` of the buffer; all-gather moves ``(N-1)`` payloads. The hook gathers when
    that is fewer bytes, so the cost is the smaller of the two.
    """
    n = world_size
    return (n - 1) * payload_bytes if gathers(payload_bytes, dense_bytes, n) else ring_share(n) * dense_bytes


def moved_in_step(stats: StepStats, world_size: int) -> float:
    """Bytes a rank moved in the step of ``stats``: ``(N-1)`` payloads for the buckets gathered, a ring all-reduce's
    ``2 (N-1)/N`` of what was sent for the others (dense buckets, and summable payloads: Random-K's, a half step's)."""
    share = stats.gathered / stats.buckets if stats.buckets else 0.0
    return stats.bytes_sent * (share * (world_size - 1) + (1 - share) * ring_share(world_size))
