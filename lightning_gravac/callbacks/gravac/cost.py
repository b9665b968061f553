"""GraVAC's model of a step's cost (:class:`CostModel`): what a window measured, the link fitted to it, the bytes a
collective moves."""

from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_gravac.callbacks.gravac.checkpoint import Checkpointed, checkpointed
from lightning_gravac.state import DENSE, HALF, StepStats, gathers, ring_share

#: The least share of a dense step a lossy step must be predicted to save to be sent: below it the saving is within
#: the spread of a step's time on a shared machine, and the step would spend accuracy for nothing measurable.
MIN_SAVING = 0.1


def saves_enough(seconds: float, dense_seconds: float) -> bool:
    """Whether a lossy step predicted at ``seconds`` saves at least :data:`MIN_SAVING` of a dense step's."""
    return seconds <= (1 - MIN_SAVING) * dense_seconds


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


def timed_link(timed: tuple[float, float] | None, buckets: int) -> Link | None:
    """The cost model of the fit-start timing's ``(seconds a message, seconds a moved byte)`` (``None`` when it did not
    run): a message a bucket and its seconds a moved byte; the rest of the step 0, for the caller to set once
    measured."""
    if timed is None:
        return None
    latency, per_byte = timed
    return Link(0.0, per_byte, latency * buckets)


def fit_step(measured: Measured, compress_seconds: float, timed: Link | None) -> Link | None:
    """The step's cost model from a window's steps (``measured``) and their seconds compressing: the link of the
    fit-start timing when it ran (``timed``), else fitted to the measured communication times; the rest of the step as
    measured minus communication and compression. ``None`` for a window without steps, or without bytes to fit to."""
    steps = sum(m[0] for m in measured.values())
    if steps == 0:
        return None
    if timed is None:
        link = fit_link(measured)
        if link is not None:
            link.other_seconds = max(0.0, link.other_seconds - compress_seconds / steps)
        return link
    comm = sum(n * timed.per_step + moved * timed.seconds_per_byte for n, _, _, moved in measured.values())
    seconds = sum(m[1] for m in measured.values())
    timed.other_seconds = max(0.0, (seconds - comm - compress_seconds) / steps)
    return timed


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


def _timed_unless_measured(measured: float, timed: float, fresh: bool) -> float:
    """What the fit-start timing measured (``timed``), unless a resumed run (not ``fresh``) holds a value ``measured``
    since on its own steps."""
    return timed if fresh or measured <= 0 else measured


def _link(saved: dict[str, float] | None) -> Link | None:
    return Link(**saved) if saved is not None else None


@dataclass(kw_only=True)
class CostModel(Checkpointed):
    """What a step costs, as far as GraVAC has measured it: the link timed at fit start, the model of a step fitted at
    each window's end, what compressing and the fp16 rung's casts cost, and the bytes a step moves. Every value is the
    same on every rank, so every rank predicts alike.

    Attributes:
        link: the step's cost model fitted at the last window's end, or the first step's estimate where the default
            switched to local steps after it; ``None`` before either (checkpointed).
        compress_cost: the seconds a step the method's selection, encoding and decoding cost when compressing: timed at
            fit start, then measured on the steps sent compressed (checkpointed).
        cast_cost: the seconds of the fp16 rung's casts a step (checkpointed).
        payload_fixed: the bytes a compressed step sends beyond ``dense / cf`` (headers, minimum entries; checkpointed).
        buckets: the buckets a step all-reduces: a message each (checkpointed).
        timed: the fit-start timing's ``(seconds a message, seconds a moved byte)``; ``None``: not run.
        half_per_byte: seconds a moved byte of an fp16 all-reduce (timed at fit start); ``None``: the rung is unknown.
        world_size: the ranks that share the link (set at setup).
        bytes_dense: the last step's dense bytes; ``model_bytes``: the trainable parameters' (set at fit start).
        first_step: the slowest rank's seconds of a fit's first step and the factor it sent, which the first window
            decides from (model search on a timed link; ``None`` before it).
    """

    link: Link | None = field(default=None, metadata=checkpointed(restore=_link))
    compress_cost: float = field(default=0.0, metadata=checkpointed(added=True))
    cast_cost: float = field(default=0.0, metadata=checkpointed(added=True))
    payload_fixed: float = field(default=0.0, metadata=checkpointed(added=True))
    buckets: int = field(default=1, metadata=checkpointed(added=True))
    timed: tuple[float, float] | None = None
    half_per_byte: float | None = None
    world_size: int = 1
    bytes_dense: int = 0
    model_bytes: int = 0
    first_step: tuple[float, float] | None = None

    @property
    def dense_bytes(self) -> int:
        """A dense step's bytes: the last step's, else the trainable parameters'."""
        return self.bytes_dense or self.model_bytes

    def seconds(self, link: Link, cf: float, dense_bytes: float, rungs: tuple[float, ...]) -> float:
        """A step's seconds at ``cf`` by ``link``: the rest, compressing, a message a bucket, the bytes (``rungs``: the
        factors sent whole in fp16, all-reduced: their cost a byte, and the casts)."""
        per_byte = link.seconds_per_byte
        if cf == DENSE:
            moved, extra = moved_bytes(dense_bytes, dense_bytes, self.world_size), 0.0
        elif cf in rungs:
            moved, extra = ring_share(self.world_size) * dense_bytes / cf, self.cast_cost
            per_byte = self.half_per_byte if self.half_per_byte is not None else per_byte
        else:
            moved = moved_bytes(dense_bytes / cf + self.payload_fixed, dense_bytes, self.world_size)
            extra = self.compress_cost
        return link.other_seconds + link.per_step + moved * per_byte + extra

    def timed_link(self) -> Link | None:
        """The cost model of the fit-start timing (:func:`timed_link`), ``None`` when it did not run."""
        return timed_link(self.timed, self.buckets)

    def first_step_link(self, rungs: tuple[float, ...]) -> Link | None:
        """The fit-start timing's link with the rest of a step taken from the fit's first step (the slowest rank's
        seconds less what the link predicts it spent sending, rungs ``rungs``): an estimate above a step's computation,
        the first step's allocations and warm-up counted in it. ``None`` before that step, or without the timing."""
        link = self.timed_link()
        if link is None or self.first_step is None:
            return None
        seconds, sent = self.first_step
        link.other_seconds = max(0.0, seconds - self.seconds(link, sent, self.dense_bytes, rungs))
        return link

    def known_link(self) -> Link | None:
        """The step's cost model (:attr:`link`), else the fit-start timing's; ``None`` before both."""
        return self.link if self.link is not None else self.timed_link()

    def seconds_by_factor(self, rungs: tuple[float, ...]) -> Callable[[float], float] | None:
        """A step's predicted seconds by factor on the link known so far, of :attr:`dense_bytes`; ``None`` while the
        link is unknown."""
        link, dense_bytes = self.known_link(), self.dense_bytes
        return None if link is None else lambda cf: self.seconds(link, cf, dense_bytes, rungs)

    def take_half(self, half_per_byte: float, cast_cost: float, fresh: bool) -> None:
        """What the fit-start timing measured of an fp16 step: its seconds a moved byte, and those of its casts, which a
        resumed run (not ``fresh``) keeps, measured since on the steps it sent in fp16, unless it has none (a
        checkpoint of a run whose rung was off, or of a version that did not measure it)."""
        self.half_per_byte = half_per_byte
        self.cast_cost = _timed_unless_measured(self.cast_cost, cast_cost, fresh)

    def take_compression(self, seconds: float, fresh: bool) -> None:
        """What the fit-start timing measured of compressing a step, which a resumed run (not ``fresh``) keeps, measured
        since on the steps it sent compressed, unless it has none."""
        self.compress_cost = _timed_unless_measured(self.compress_cost, seconds, fresh)

    def take_step(self, stats: StepStats, cf: float, compressed: bool) -> None:
        """What the step of ``stats``, sent at ``cf``, tells of the cost: its buckets and dense bytes, and
        (``compressed``) what it sent beyond ``dense / cf``: headers, at least one entry a tensor, whole entries."""
        self.bytes_dense, self.buckets = stats.bytes_dense, max(1, stats.buckets)
        if compressed and stats.bytes_sent and stats.bytes_dense:
            self.payload_fixed = max(0.0, stats.bytes_sent - stats.bytes_dense / cf)

    def refit(self, measured: Measured, compress_seconds: float) -> None:
        """Fit the step's cost model to a window's steps (``measured``, and their ``compress_seconds``, the slowest
        rank's): the link of the fit-start timing when it ran, else fitted to the measured communication; the rest of
        the step as measured minus communication and compression. A window without a fit keeps the last."""
        self.link = fit_step(measured, compress_seconds, self.timed_link()) or self.link

    def take_window(self, rows: list[tuple[float, int, int, float, float]], half: bool) -> None:
        """What compressing costs a step, from a window's rows ``(cf, steps, steps without probes, seconds compressing,
        those steps' seconds compressing)`` of each factor sent, the slowest rank's: from the steps without probes when
        there were any. ``half``: the fp16 rung is on, its casts costed apart from the method's."""
        compress, plain = [0.0, 0], [0.0, 0]
        for cf, steps, plain_steps, compress_s, plain_s in rows:
            if cf == HALF and half:
                self.cast_cost = (plain_s / plain_steps) if plain_steps else compress_s / steps
            elif cf != DENSE:
                compress = [compress[0] + compress_s, compress[1] + steps]
                plain = [plain[0] + plain_s, plain[1] + plain_steps]
        if plain[1] or compress[1]:
            self.compress_cost = plain[0] / plain[1] if plain[1] else compress[0] / compress[1]
