"""GraVAC: gradient-variance-aware adaptive compression (Tyagi & Swany, IEEE CLOUD 2023)."""

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from pytorch_lightning.utilities.data import extract_batch_size
from typing_extensions import override

from lightning_gravac._validation import choice, fraction, whole
from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.compressors.base import validate_cf
from lightning_gravac.strategies.state import CompressionState, GainOf, StepStats

Policy = Literal["exponential", "geometric"]
Search = Literal["sequential", "model"]
Interval = Literal["step", "epoch"]

DENSE = 1.0
#: The factors GraVAC searches between by default (each capped at the size of the model's largest gradient).
DEFAULT_CF_MIN, DEFAULT_CF_MAX = 10.0, 1000.0


@dataclass
class _Tally:
    """What one factor cost and kept while it was sent during the current window."""

    steps: int = 0
    seconds: float = 0.0  # this rank's; reduced with MAX at the window's end
    comm_seconds: float = 0.0  # this rank's; reduced with MAX at the window's end
    gain: float = 0.0
    moved_bytes: float = 0.0  # bytes a rank moves on the link, ring model


@dataclass
class _Link:
    """A fitted model of a step: ``seconds = other + per_step + moved_bytes * seconds_per_byte``."""

    other_seconds: float
    seconds_per_byte: float
    per_step: float = 0.0  # communication time that does not grow with the bytes (latency, the header)


def fit_link(tallies: dict[float, tuple[int, float, float, float]]) -> _Link | None:
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
            return _Link(other, slope, max(0.0, mean_y - slope * mean_x))
    return _Link(other, mean_y / mean_x)


def moved_bytes(payload_bytes: float, dense_bytes: float, world_size: int) -> float:
    """Bytes one rank moves on the link for one bucket, with the hook's choice of collective.

    Ring all-reduce moves ``2 (N-1)/N`` of the buffer; all-gather moves ``(N-1)`` payloads. The hook gathers when
    that is fewer bytes, so the cost is the smaller of the two.
    """
    n = world_size
    return min((n - 1) * payload_bytes, 2 * (n - 1) / n * dense_bytes)


class GraVAC(Controller):
    """Adapt the compression factor to what compression loses (gain) and what the link costs (throughput).

    Every step the hook measures, summed over ranks, the *gain* ``||C_cf(g)||^2 / ||g||^2`` of the error-fed gradient
    ``g`` at ``cf_min`` and at a more aggressive *candidate* (multi-level: Top-K selects once, at ``cf_min``, and the
    candidate is a prefix of that selection). The next step sends the candidate if its gain is at least ``epsilon``,
    else ``cf_min`` if that is, else the dense gradient. Decisions use the gains the previous step brought through the
    collective, so every rank decides the same. Every ``window`` steps (or epochs) it measures each sent factor's
    *compression throughput* ``Tc = N * batch / t_step * gain`` (``t_step`` of the slowest rank), promotes the
    candidate to ``cf_min`` when their gains are within ``omega``, advances the candidate (``policy``: exponential
    ``cf_min * 2, 4, 16, 256...`` or geometric ``cf_min * 2, 4, 8, ...``, never above ``cf_max``), and settles on the
    less aggressive of the two best factors when their throughputs are within ``omega`` (checked again every window).

    ``search="model"`` goes beyond the paper: the hook measures the gain of every factor on the policy's ladder each
    step (one selection serves them all for Top-K), a link model ``t_step = other + per_step + bytes * s_per_byte``
    is fitted to each window from the measured communication times (:func:`fit_link`), and the factor with the
    highest predicted ``Tc`` (dense among them) is sent from the first window's end on. Since the link is measured,
    not searched, that first window can be short (``first_window``, 10 steps by default).

    ``gain_of="gradient"`` goes beyond the paper too: the gains are measured on the step's own gradient,
    ``sum_ranks ||C_cf(grad)||^2 / sum_ranks ||grad||^2``, instead of the error-fed ``grad + residual``. Under error
    feedback the residual holds what earlier steps did not send; at an aggressive factor it grows to many times the
    gradient's norm and stays there on models with rarely-touched rows (embeddings), so the error-fed gain of every
    factor falls far below ``epsilon`` while training loses nothing (``benchmarks/gains.py`` measures both). The
    gradient's own gain asks what the factor keeps of each step's new information. It costs one more selection per
    probe step, and is not defined for methods that select from their own accumulation (DGC).

    Tuning: ``epsilon`` is the share of the gradient's energy a step must keep (lower it for methods or models
    whose gradients are not heavy-tailed); ``window`` should cover enough steps for a stable step time (hundreds
    on a busy cluster, tens on a quiet one); ``alpha`` smooths the gains (default ``N/100`` clamped to
    [0.02, 0.5], the paper's choice, so small jobs react within tens of steps).

    Args:
        cf_min: least aggressive factor, where compression starts. ``None``: 10, or the size of the model's largest
            gradient if that is smaller.
        cf_max: most aggressive factor ever used. ``None``: 1000, or the size of the model's largest gradient if that
            is smaller (no tensor can be compressed further: at least one entry is always sent). A value passed
            explicitly is never changed: one the model cannot honour raises at setup.
        epsilon: minimum gain a factor must keep to be sent, in (0, 1].
        omega: relative tolerance for promotion and plateau, in (0, 1].
        window: steps (or epochs) between search decisions.
        policy: how the candidate advances, ``"exponential"`` or ``"geometric"``.
        alpha: EWMA factor of the gains, in (0, 1]; ``None`` for the paper's default.
        interval: unit of ``window``, ``"step"`` or ``"epoch"``.
        search: ``"sequential"`` (the paper) or ``"model"``.
        probe_every: after the first window, measure the probe factors' gains on one step in this many (1: every
            step, as the paper). Steps without probes send at the chosen factor alone: dense then costs what
            stock DDP costs. The smoothing still runs per step: a probe after ``p`` steps weighs
            ``1 - (1 - alpha)^p``.
        first_window: length of the first window; ``None`` for ``window`` with the sequential search and
            ``min(window, 10)`` with the model search, whose first decision needs only the link's cost.
        gain_of: what the gains are measured on, ``"error_fed"`` (the paper: gradient plus residual) or
            ``"gradient"`` (the step's own gradient).

    Raises:
        ValueError: for a factor below 1, ``cf_min > cf_max``, ``epsilon``/``omega``/``alpha`` outside (0, 1], a
            window or first window below 1, or an unknown policy, interval, search or ``gain_of``; at setup,
            ``gain_of="gradient"`` with a method that keeps its own accumulation (DGC).
    """

    def __init__(
        self,
        cf_min: float | None = None,
        cf_max: float | None = None,
        epsilon: float = 0.7,
        omega: float = 0.01,
        window: int = 500,
        policy: Policy = "exponential",
        alpha: float | None = None,
        interval: Interval = "step",
        search: Search = "sequential",
        probe_every: int = 1,
        first_window: int | None = None,
        gain_of: GainOf = "error_fed",
    ) -> None:
        # Which bounds are defaults, fitted to the model at setup (`fit_to_model`), and which the user chose.
        self._fitted = {"cf_min": cf_min is None, "cf_max": cf_max is None}
        cf_min = DEFAULT_CF_MIN if cf_min is None else validate_cf(cf_min, "cf_min")
        cf_max = DEFAULT_CF_MAX if cf_max is None else validate_cf(cf_max, "cf_max")
        if cf_min > cf_max:
            raise ValueError(f"`cf_min` ({cf_min:g}) must not exceed `cf_max` ({cf_max:g}).")
        super().__init__(cf=cf_min)
        self.window = whole(window, "window")
        self.epsilon = fraction(epsilon, "epsilon")
        self.omega = fraction(omega, "omega")
        self.alpha = None if alpha is None else fraction(alpha, "alpha")
        self.policy = choice(policy, "policy", ("exponential", "geometric"))
        self.interval = choice(interval, "interval", ("step", "epoch"))
        self.search = choice(search, "search", ("sequential", "model"))
        self.probe_every = whole(probe_every, "probe_every")
        self.gain_of: GainOf = choice(gain_of, "gain_of", ("error_fed", "gradient"))
        default_first = min(self.window, 10) if self.search == "model" else self.window
        self.first_window = default_first if first_window is None else whole(first_window, "first_window")
        self.cf_max = cf_max
        self.ladder = self._ladder(cf_min, cf_max)

        # The search; identical on every rank.
        self.cf_min = cf_min
        self.scale = 2.0
        self.candidate = min(cf_min * self.scale, cf_max)
        self.settled: float | None = None
        self.gains: dict[float, float] = {}
        self.throughput: dict[float, float] = {}
        self.link: _Link | None = None
        self.windows = 0

        # The current window.
        self._tally: dict[float, _Tally] = {}
        self._progress = 0
        self._world_size = 1
        self._batch_size = 1
        self._bytes_dense = 0
        self._step_start = 0.0
        self._steps = 0
        self._last_probe = 0  # the step of the last probe

    @override
    def fit_to_model(self, largest: int) -> None:
        """Cap the default bounds (those not passed) at ``largest``, the size of the model's largest gradient."""
        capped = []
        if self._fitted["cf_max"] and self.cf_max > largest:
            self.cf_max = float(largest)
            capped.append("cf_max")
        if self._fitted["cf_min"] and self.cf_min > self.cf_max:
            self.cf_min = self.cf_max
            capped.append("cf_min")
        if not capped:
            return
        self.ladder = self._ladder(self.cf_min, self.cf_max)
        self.candidate = min(self.candidate, self.cf_max)
        self.cf = min(self.cf, self.cf_max)
        rank_zero_info(
            f"GraVAC: the model's largest gradient has {largest} entries; {' and '.join(capped)} fitted to it "
            f"(factors {', '.join(f'{f:g}' for f in self.ladder)})."
        )

    def _ladder(self, cf_min: float, cf_max: float) -> tuple[float, ...]:
        factors, scale = [cf_min], 2.0
        while factors[-1] < cf_max:
            factors.append(min(cf_min * scale, cf_max))
            scale = self._next_scale(scale)
        return tuple(factors)

    def _next_scale(self, scale: float) -> float:
        """The policy: exponential squares the scale (2, 4, 16, 256, ...), geometric doubles it."""
        return scale * scale if self.policy == "exponential" else 2 * scale

    @property
    def probe_cfs(self) -> tuple[float, ...]:
        """The factors whose gain the hook measures each step."""
        if self.search == "model":
            return self.ladder
        factors = {self.cf_min, self.candidate}
        if self.settled is not None and self.settled != DENSE:
            factors.add(self.settled)
        return tuple(sorted(factors))

    @property
    @override
    def max_cf(self) -> tuple[str, float]:
        return "cf_max", self.cf_max

    @property
    def ewma_alpha(self) -> float:
        """The gains' smoothing factor in force."""
        return self.alpha if self.alpha is not None else max(0.02, min(0.5, self._world_size / 100))

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._world_size = trainer.world_size
        super().setup(trainer, pl_module, stage)
        method = self.state.compressor
        if self.gain_of == "gradient" and method.owns_feedback:
            raise ValueError(
                f"`gain_of='gradient'` measures what a factor keeps of the step's own gradient, but {method.name!r} "
                "selects from an accumulation of its own, not from the gradient. Use `gain_of='error_fed'`."
            )

    @override
    def apply(self, state: CompressionState) -> None:
        super().apply(state)
        # Every step of the first window; then one step in `probe_every` (the gains are smoothed anyway), so that a
        # settled or dense choice stops paying for the measurement on the other steps.
        probing = self.windows == 0 or self._steps % self.probe_every == 0
        state.probe_cfs = self.probe_cfs if probing else ()
        state.gain_of = self.gain_of

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, *args: Any
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, *args)
        self._step_start = time.perf_counter()
        try:
            self._batch_size = extract_batch_size(batch)
        except Exception:
            self._batch_size = 1

    def step_seconds(self, stats: StepStats) -> float:
        """This rank's time for the step that produced ``stats`` (forward, backward, communication, optimizer).

        A subclass may model it instead, e.g. to simulate a slower link in a test.
        """
        return time.perf_counter() - self._step_start

    @override
    def observe(self, stats: StepStats, trainer: "pl.Trainer | None") -> None:
        self._steps += 1
        self._bytes_dense = stats.bytes_dense
        gains = stats.probe_gains()
        if gains:  # the EWMA decays per step: a probe after p steps without one weighs 1 - (1 - alpha)^p
            weight = 1 - (1 - self.ewma_alpha) ** (self._steps - self._last_probe)
            self._last_probe = self._steps
            for cf, gain in gains.items():
                self.gains[cf] = gain if cf not in self.gains else (1 - weight) * self.gains[cf] + weight * gain
        tally = self._tally.setdefault(self.cf, _Tally())
        tally.steps += 1
        tally.seconds += self.step_seconds(stats)
        tally.comm_seconds += stats.comm_s
        # The sent factor's gain, measured on what the gains are of: the error-fed gradient (what was sent of it), or
        # the step's own gradient (the probes' smoothed value).
        fresh = self.gain_of == "gradient" and self.cf != DENSE
        tally.gain += self.gains.get(self.cf, stats.gain) if fresh else stats.gain
        tally.moved_bytes += moved_bytes(stats.bytes_sent, stats.bytes_dense, self._world_size)
        if self.interval == "step":
            self._progress += 1
            if self._progress >= self.window_length:
                self._end_window(trainer)
        self.cf = self._choose()

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.interval == "epoch":
            self._progress += 1
            if self._progress >= self.window_length:
                self._end_window(trainer)
                self.cf = self._choose()
                self._hand_over(self.state)

    @property
    def window_length(self) -> int:
        """Steps (or epochs) of the current window: ``first_window`` for the first, ``window`` after."""
        return self.first_window if self.windows == 0 else self.window

    def _choose(self) -> float:
        """The factor to send next step: decided from values every rank holds identically."""
        if self.search == "model" and self.link is not None:
            return self._best_predicted()
        order = [self.settled] if self.settled is not None else [self.candidate, self.cf_min]
        for cf in order:
            if cf == DENSE or self.gains.get(cf, 0.0) >= self.epsilon:
                return cf
        return DENSE

    def _end_window(self, trainer: "pl.Trainer | None") -> None:
        self._progress = 0
        if not self._tally:
            return
        factors = sorted(self._tally)
        local = torch.tensor(
            [[self._tally[f].seconds, self._tally[f].comm_seconds] for f in factors], dtype=torch.float64
        )
        # Step times are this rank's own: the slowest rank sets the pace, and every rank must see the same value.
        slowest = trainer.strategy.reduce(local, reduce_op="max") if trainer is not None else local
        measured = {}
        for f, (seconds, comm_seconds) in zip(factors, slowest.tolist(), strict=True):
            tally = self._tally[f]
            samples = self._world_size * self._batch_size * tally.steps
            self.throughput[f] = samples / seconds * (tally.gain / tally.steps)
            measured[f] = (tally.steps, seconds, comm_seconds, tally.moved_bytes)
        if self.search == "model":
            self.link = fit_link(measured) or self.link
        self._tally.clear()
        self.windows += 1
        if self.search == "sequential":
            self._advance()
        self._check_plateau()

    def _advance(self) -> None:
        if self.settled is not None:
            return
        gain_min, gain_candidate = self.gains.get(self.cf_min), self.gains.get(self.candidate)
        if (
            self.candidate > self.cf_min
            and gain_min
            and gain_candidate is not None
            and abs(gain_min - gain_candidate) / gain_min <= self.omega
        ):
            self.cf_min = self.candidate
        self.scale = self._next_scale(self.scale)
        self.candidate = min(self.cf_min * self.scale, self.cf_max)

    def _check_plateau(self) -> None:
        ranked = sorted(self.throughput.items(), key=lambda item: item[1], reverse=True)
        if len(ranked) >= 2 and ranked[0][1] > 0 and (ranked[0][1] - ranked[1][1]) / ranked[0][1] <= self.omega:
            self.settled = min(ranked[0][0], ranked[1][0])  # the less aggressive of the two
        else:
            self.settled = None

    def predicted_throughput(self, cf: float, dense_bytes: float) -> float:
        """``Tc`` the link model predicts for ``cf`` (model search; ``nan`` before the first window)."""
        if self.link is None:
            return math.nan
        payload = dense_bytes if cf == DENSE else dense_bytes / cf
        moved = moved_bytes(payload, dense_bytes, self._world_size)
        seconds = self.link.other_seconds + self.link.per_step + moved * self.link.seconds_per_byte
        gain = 1.0 if cf == DENSE else self.gains.get(cf, 0.0)
        return self._world_size * self._batch_size / seconds * gain if seconds > 0 else math.inf

    def _best_predicted(self) -> float:
        eligible = [DENSE] + [cf for cf in self.ladder if self.gains.get(cf, 0.0) >= self.epsilon]
        return max(eligible, key=lambda cf: (self.predicted_throughput(cf, self._bytes_dense), -cf))

    @override
    def metrics(self, stats: StepStats) -> dict[str, float]:
        metrics = super().metrics(stats)
        metrics["gravac/cf_min"] = self.cf_min
        metrics["gravac/probe_cf"] = self.candidate
        metrics["gravac/settled"] = self.settled if self.settled is not None else 0.0
        metrics["gravac/compression_throughput"] = self.throughput.get(self.state.cf, 0.0)
        return metrics

    @override
    def state_dict(self) -> dict[str, Any]:
        """The whole search, and the current window's tallies.

        Lightning writes rank 0's callback state, so on resume every rank gets rank 0's partial-window step times:
        the only rank-local values here, which at the window's end only feed a MAX over ranks.
        """
        return {
            **super().state_dict(),
            "cf_min": self.cf_min,
            "candidate": self.candidate,
            "scale": self.scale,
            "settled": self.settled,
            "gains": dict(self.gains),
            "throughput": dict(self.throughput),
            "link": asdict(self.link) if self.link is not None else None,
            "windows": self.windows,
            "progress": self._progress,
            "steps": self._steps,
            "last_probe": self._last_probe,
            "tally": {f: asdict(t) for f, t in self._tally.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cf_min, self.candidate, self.scale = state_dict["cf_min"], state_dict["candidate"], state_dict["scale"]
        self.settled, self.windows, self._progress = (
            state_dict["settled"],
            state_dict["windows"],
            state_dict["progress"],
        )
        self.gains, self.throughput = dict(state_dict["gains"]), dict(state_dict["throughput"])
        self.link = _Link(**state_dict["link"]) if state_dict["link"] is not None else None
        self._tally = {f: _Tally(**t) for f, t in state_dict["tally"].items()}
        self._steps = state_dict.get("steps", 0)
        self._last_probe = state_dict.get("last_probe", self._steps)
        super().load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (
            f"GraVAC(cf_min={self.cf_min:g}, cf_max={self.cf_max:g}, epsilon={self.epsilon}, omega={self.omega}, "
            f"window={self.window}, policy={self.policy!r}, search={self.search!r}, probe_every={self.probe_every}, "
            f"first_window={self.first_window}, gain_of={self.gain_of!r})"
        )
