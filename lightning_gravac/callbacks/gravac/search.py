"""GraVAC's decision rules: the paper's sequential search and the default's cost model, behind one interface.

A rule holds no state of its own: it reads the parts that hold it (the :class:`Ladder`, the probes' gains, the
:class:`CostModel`) and the window's end changes them, so both rules checkpoint alike.
"""

from typing import Any, Literal

from lightning_gravac.callbacks.gravac.cost import DENSE, CostModel
from lightning_gravac.callbacks.gravac.ladder import Ladder
from lightning_gravac.callbacks.gravac.prediction import Decision, best_predicted, first_window_choice
from lightning_gravac.callbacks.gravac.window import Closed

Search = Literal["sequential", "model"]

#: What the arguments left at ``None`` mean, per search. ``"sequential"`` is the paper's GraVAC; ``"model"`` is the
#: default (``docs/algorithms.md`` has each departure and the measurement behind it).
SEARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "sequential": {"epsilon": 0.7, "window": 500, "probe_every": 1, "gain_of": "error_fed", "gain_power": 1.0,
                   "time_link": False, "probe_backoff": 1, "fp16_rung": False},
    "model": {"epsilon": 0.02, "window": 50, "probe_every": 25, "gain_of": "gradient", "gain_power": 1 / 3,
              "time_link": True, "probe_backoff": 8, "fp16_rung": False},
}  # fmt: skip


class SearchRule:
    """One of GraVAC's decision rules: which factors the hook probes, how their gains are smoothed, what to send next
    and what a window's end changes. A rule holds no state of its own: the parts it is handed do, so both rules
    checkpoint alike."""

    #: Whether the rule predicts a step's cost from a measured link (and so measures it at fit start).
    models_cost = False
    #: Whether the gains are smoothed by a bias-corrected EWMA (else by the paper's, started at the first value).
    corrects_bias = False

    def first_window(self, window: int) -> int:
        """The first window's length when the user leaves it unset."""
        return window

    def probe_cfs(self, ladder: Ladder, settled: float | None) -> tuple[float, ...]:
        """The factors whose gain the hook measures on a probed step."""
        raise NotImplementedError

    def choose(self, d: Decision) -> float:
        """The factor to send next step, from values every rank holds identically."""
        raise NotImplementedError

    def end_window(
        self, closed: Closed, ladder: Ladder, gains: dict[float, float], cost: CostModel, settled: float | None,
        omega: float,
    ) -> None:  # fmt: skip
        """What a window's end changes (``closed``: its steps by factor, the slowest rank's), once the window counts
        it, before it settles again (``settled``: the factor it settled on at the last window's end)."""
        raise NotImplementedError

    def gains_can_matter(self, cost: CostModel, ladder: Ladder, rungs: tuple[float, ...]) -> bool:
        """Whether measuring gains could change the choice."""
        return True


class Sequential(SearchRule):
    """The paper's search: the gains at ``cf_min`` and a candidate each step; the candidate if its gain reaches
    ``epsilon``, else ``cf_min`` if that does, else dense; each window promotes and advances the candidate."""

    def probe_cfs(self, ladder: Ladder, settled: float | None) -> tuple[float, ...]:
        factors = {ladder.cf_min, ladder.candidate}
        if settled is not None and settled != DENSE:
            factors.add(settled)
        return tuple(sorted(factors))

    def choose(self, d: Decision) -> float:
        order = [d.settled] if d.settled is not None else [d.ladder.candidate, d.ladder.cf_min]
        for cf in order:
            if cf == DENSE or d.gains.get(cf, 0.0) >= d.epsilon:
                return cf
        return DENSE

    def end_window(
        self, closed: Closed, ladder: Ladder, gains: dict[float, float], cost: CostModel, settled: float | None,
        omega: float,
    ) -> None:  # fmt: skip
        if settled is not None:
            return
        gain_min, gain_candidate = gains.get(ladder.cf_min), gains.get(ladder.candidate)
        promote = (
            ladder.candidate > ladder.cf_min
            and gain_min
            and gain_candidate is not None
            and abs(gain_min - gain_candidate) / gain_min <= omega
        )
        ladder.advance(bool(promote))


class Model(SearchRule):
    """The default: the factor of highest predicted compression throughput, by a cost model of the step fitted to a
    link measured at fit start and to the steps sent; the gains of every factor of the ladder, bias-corrected."""

    models_cost = True
    corrects_bias = True

    def first_window(self, window: int) -> int:
        return min(window, 3)

    def probe_cfs(self, ladder: Ladder, settled: float | None) -> tuple[float, ...]:
        return ladder.factors

    def choose(self, d: Decision) -> float:
        if d.cost.link is not None:
            return best_predicted(d)
        if d.cost.timed is not None:
            # The first window, on a measured link, while the gains are being measured: the first steps of training
            # are its most sensitive, so dense or the mildest eligible factor, whichever the link justifies.
            eligible = [cf for cf in d.ladder.factors if d.gains.get(cf, 1.0) >= d.epsilon and d.admits(cf)]
            return first_window_choice(d.cost, min(eligible, default=DENSE), d.rungs)
        return SEARCHES["sequential"].choose(d)  # no link measured: the paper's rule until the first fit

    def end_window(
        self, closed: Closed, ladder: Ladder, gains: dict[float, float], cost: CostModel, settled: float | None,
        omega: float,
    ) -> None:  # fmt: skip
        cost.refit(closed.measured, closed.compress_seconds)

    def gains_can_matter(self, cost: CostModel, ladder: Ladder, rungs: tuple[float, ...]) -> bool:
        link = cost.link
        if link is None:
            return True
        dense = cost.seconds(link, DENSE, cost.bytes_dense, rungs)
        return any(cost.seconds(link, cf, cost.bytes_dense, rungs) < dense for cf in ladder.factors)


#: GraVAC's decision rules by the name ``search`` takes.
SEARCHES: dict[str, SearchRule] = {"sequential": Sequential(), "model": Model()}
