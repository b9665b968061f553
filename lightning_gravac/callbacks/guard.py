"""A guard against divergence the user did not ask for: a compressed step whose gradient norm explodes."""

import statistics
from collections import deque
from typing import Any

from lightning_gravac._validation import whole
from lightning_gravac.state import StepStats


class DivergenceGuard:
    """Sends dense for a while when a compressed step's gradient norm explodes against its recent history.

    Every step with a statistics header (compressed, or probed) brings ``sqrt(sum_ranks ||g||^2)``, the norm of what
    was compressed, identical on every rank. When a step that compressed has a norm above ``ratio`` times the median
    of the last ``history`` such norms (once ``min_history`` are known), the controller is overridden: every factor
    is 1 for ``cooldown`` steps, its own decisions frozen (it observes nothing meanwhile), and each later trigger
    doubles the cooldown. When it triggers, the residuals, the method's own accumulation (DGC's) and the SGD momentum
    moved into the hook are dropped: they hold the accumulation that exploded, and sending them dense would apply it.
    Every rank decides the same, from values that crossed the network. It catches a spike; a slow blow-up (weights
    growing over tens of steps, each step's norm within ``ratio`` of the recent median) it catches late or not at all.

    Args:
        ratio: how many times the recent median norm counts as an explosion.
        history: how many recent norms the median is taken over.
        min_history: norms needed before the guard can trigger.
        cooldown: dense steps after the first trigger.
    """

    def __init__(self, ratio: float = 10.0, history: int = 50, min_history: int = 10, cooldown: int = 100) -> None:
        if not ratio > 1:
            raise ValueError(f"`ratio` must be > 1, got {ratio!r}.")
        self.ratio = ratio
        self.history = whole(history, "history")
        self.min_history = whole(min_history, "min_history")
        self.cooldown = whole(cooldown, "cooldown")
        self.norms: deque[float] = deque(maxlen=self.history)
        self.holding = 0  # dense steps still to send
        self.triggers = 0

    def check(self, stats: StepStats) -> bool:
        """Take a finite step's statistics; whether the guard triggers now."""
        if self.holding:
            self.holding -= 1
            return False
        if stats.sq_norm <= 0:  # plain dense all-reduce: no header, nothing measured
            return False
        norm = stats.sq_norm**0.5
        compressed = stats.bytes_sent < stats.bytes_dense
        exploded = (
            compressed and len(self.norms) >= self.min_history and norm > self.ratio * statistics.median(self.norms)
        )
        if exploded:
            self.holding = self.cooldown * 2**self.triggers
            self.triggers += 1
            return True
        self.norms.append(norm)
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"norms": list(self.norms), "holding": self.holding, "triggers": self.triggers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms = deque(state["norms"], maxlen=self.history)
        self.holding, self.triggers = state["holding"], state["triggers"]

    def __repr__(self) -> str:
        return (
            f"DivergenceGuard(ratio={self.ratio}, history={self.history}, min_history={self.min_history}, "
            f"cooldown={self.cooldown})"
        )
