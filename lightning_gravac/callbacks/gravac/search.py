"""GraVAC's decision rules: the paper's sequential search and the default's cost model, behind one interface.

A rule holds no state of its own: it reads and writes the controller's carried state (:class:`GraVACState`:
``cf_min``, ``candidate``, ``gains``, ``gain_sums``, ``link``, ...), so both rules checkpoint alike.
"""

from typing import TYPE_CHECKING, Any, Literal

from lightning_gravac.callbacks.gravac.cost import DENSE, Measured
from lightning_gravac.callbacks.gravac.ladder import next_scale, within_budget
from lightning_gravac.callbacks.gravac.prediction import (
    best_predicted,
    first_window_choice,
    fit_step_model,
    predicted_seconds,
)

if TYPE_CHECKING:
    from lightning_gravac.callbacks.gravac.controller import GraVAC

Search = Literal["sequential", "model"]
Interval = Literal["step", "epoch"]

#: What the arguments left at ``None`` mean, per search. ``"sequential"`` is the paper's GraVAC; ``"model"`` is the
#: default (``docs/algorithms.md`` has each departure and the measurement behind it).
SEARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "sequential": {"epsilon": 0.7, "window": 500, "probe_every": 1, "gain_of": "error_fed", "gain_power": 1.0,
                   "link_probe": False, "probe_backoff": 1, "fp16_rung": False},
    "model": {"epsilon": 0.02, "window": 50, "probe_every": 25, "gain_of": "gradient", "gain_power": 1 / 3,
              "link_probe": True, "probe_backoff": 8, "fp16_rung": False},
}  # fmt: skip


class SearchRule:
    """One of GraVAC's decision rules: which factors the hook probes, how their gains are smoothed, what to send next
    and what a window's end changes. A rule holds no state of its own: it reads and writes the controller's, so both
    rules checkpoint alike and a subclass of :class:`GraVAC` reaches every value it decides from."""

    #: Whether the rule predicts a step's cost from a measured link (and so measures it at fit start).
    models_cost = False

    def first_window(self, window: int) -> int:
        """The first window's length when the user leaves it unset."""
        return window

    def probe_cfs(self, c: "GraVAC") -> tuple[float, ...]:
        raise NotImplementedError

    def smooth(self, c: "GraVAC", cf: float, gain: float, weight: float) -> None:
        """Take a probe of the gain at ``cf`` that weighs ``weight`` into ``c.search_state.gains``."""
        raise NotImplementedError

    def choose(self, c: "GraVAC") -> float:
        """The factor to send next step, from values every rank holds identically."""
        raise NotImplementedError

    def end_window(self, c: "GraVAC", measured: Measured, slowest: list[list[float]], factors: list[float]) -> None:
        """What a window's end changes, given its steps by factor (``(steps, seconds, comm seconds, moved bytes)``,
        the slowest rank's) once ``c.search_state.windows`` counts it."""
        raise NotImplementedError

    def gains_can_matter(self, c: "GraVAC") -> bool:
        """Whether measuring gains could change the choice."""
        return True


class Sequential(SearchRule):
    """The paper's search: the gains at ``cf_min`` and a candidate each step; the candidate if its gain reaches
    ``epsilon``, else ``cf_min`` if that does, else dense; each window promotes and advances the candidate."""

    def probe_cfs(self, c: "GraVAC") -> tuple[float, ...]:
        s = c.search_state
        factors = {s.cf_min, s.candidate}
        if s.settled is not None and s.settled != DENSE:
            factors.add(s.settled)
        return tuple(sorted(factors))

    def smooth(self, c: "GraVAC", cf: float, gain: float, weight: float) -> None:
        # The paper's EWMA, started at the first value.
        gains = c.search_state.gains
        gains[cf] = gain if cf not in gains else (1 - weight) * gains[cf] + weight * gain

    def choose(self, c: "GraVAC") -> float:
        s = c.search_state
        order = [s.settled] if s.settled is not None else [s.candidate, s.cf_min]
        for cf in order:
            if cf == DENSE or s.gains.get(cf, 0.0) >= c.epsilon:
                return cf
        return DENSE

    def end_window(self, c: "GraVAC", measured: Measured, slowest: list[list[float]], factors: list[float]) -> None:
        s = c.search_state
        if s.settled is not None:
            return
        gain_min, gain_candidate = s.gains.get(s.cf_min), s.gains.get(s.candidate)
        if (
            s.candidate > s.cf_min
            and gain_min
            and gain_candidate is not None
            and abs(gain_min - gain_candidate) / gain_min <= c.omega
        ):
            s.cf_min = s.candidate
        s.scale = next_scale(s.scale, c.policy)
        s.candidate = min(s.cf_min * s.scale, c.cf_max)


class Model(SearchRule):
    """The default: the factor of highest predicted compression throughput, by a cost model of the step fitted to a
    link measured at fit start and to the steps sent; the gains of every factor of the ladder, bias-corrected."""

    models_cost = True

    def first_window(self, window: int) -> int:
        return min(window, 3)

    def probe_cfs(self, c: "GraVAC") -> tuple[float, ...]:
        return c.ladder

    def smooth(self, c: "GraVAC", cf: float, gain: float, weight: float) -> None:
        # Bias-corrected: the weights of the probes so far, normalised.
        s = c.search_state
        total, mass = s.gain_sums.get(cf, (0.0, 0.0))
        total, mass = (1 - weight) * total + weight * gain, (1 - weight) * mass + weight
        s.gain_sums[cf] = (total, mass)
        s.gains[cf] = total / mass

    def choose(self, c: "GraVAC") -> float:
        gains = c.search_state.gains
        if c.search_state.link is not None:
            return best_predicted(c)
        if c.probed is not None:
            # The first window, on a measured link, while the gains are being measured: the first steps of training
            # are its most sensitive, so dense or the mildest eligible factor, whichever the link justifies.
            eligible = [cf for cf in c.ladder if gains.get(cf, 1.0) >= c.epsilon and within_budget(c, cf)]
            return first_window_choice(c, min(eligible, default=DENSE))
        return SEARCHES["sequential"].choose(c)  # no link measured: the paper's rule until the first fit

    def end_window(self, c: "GraVAC", measured: Measured, slowest: list[list[float]], factors: list[float]) -> None:
        s = c.search_state
        s.link = fit_step_model(c, measured, slowest) or s.link

    def gains_can_matter(self, c: "GraVAC") -> bool:
        link = c.search_state.link
        if link is None:
            return True
        dense = predicted_seconds(c, link, DENSE, c.bytes_dense)
        return any(predicted_seconds(c, link, cf, c.bytes_dense) < dense for cf in c.ladder)


#: GraVAC's decision rules by the name ``search`` takes.
SEARCHES: dict[str, SearchRule] = {"sequential": Sequential(), "model": Model()}
