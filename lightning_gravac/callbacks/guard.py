"""A guard against divergence the user did not ask for: a compressed step whose gradient norm explodes, or a training
loss that climbs while compressing."""

import statistics
from collections import deque
from typing import Any

from lightning_gravac._validation import whole
from lightning_gravac.state import StepStats


class DivergenceGuard:
    """Sends dense for a while when a compressed step's gradient norm explodes against its recent history, or when the
    training loss, while compressing, climbs well above the lowest it has been.

    Every step with a statistics header (compressed, or probed) brings ``sqrt(sum_ranks ||g||^2)``, the norm of what
    was compressed, identical on every rank. When a step that compressed has a norm above ``ratio`` times the median
    of the last ``history`` such norms (once ``min_history`` are known), the controller is overridden: every factor
    is 1 for ``cooldown`` steps, its own decisions frozen (it observes nothing meanwhile), and each later trigger
    doubles the cooldown. When it triggers, the residuals, the method's own accumulation (DGC's) and the SGD momentum
    moved into the hook are dropped: they hold the accumulation that exploded, and sending them dense would apply it.
    Every rank decides the same, from values that crossed the network.

    The norm catches a spike; a slow blow-up it does not (weights growing over tens of steps, each step's norm within
    ``ratio`` of the recent median). For that the loss: on every compressed step the controller all-reduces the ranks'
    mean training loss (8 bytes; dense steps, probed or not, pay nothing), and the guard triggers when the median of the
    last ``min_history`` losses exceeds ``loss_ratio`` times the lowest such median seen while compressing since the
    last trigger (each hold starts the loss history afresh). The loss test catches a slow blow-up early enough for the
    dense steps to rescue the run, where the norm test alone fires a few steps before the loss overflows. Why 4x
    and not 2x: small batches' losses are heavy-tailed, so a few hard batches in a row (which dense sees too) can lift
    the median past twice its lowest with nothing diverging. A loss that legitimately climbs 4x (a schedule restart, a
    new data phase) costs one cooldown of dense steps, never correctness; ``loss_ratio=None`` turns the loss test off.
    The runs behind these choices are in ``docs/algorithms.md`` (Static and the divergence guard).

    Args:
        ratio: how many times the recent median norm counts as an explosion.
        history: how many recent norms the median is taken over.
        min_history: norms needed before the guard can trigger.
        cooldown: dense steps after the first trigger.
        loss_ratio: how many times the lowest recent median loss counts as a blow-up (``None``: the loss is not
            watched). Losses must be positive (a loss that can go negative is not watched: the test is skipped).
    """

    def __init__(
        self,
        ratio: float = 10.0,
        history: int = 50,
        min_history: int = 10,
        cooldown: int = 100,
        loss_ratio: float | None = 4.0,
    ) -> None:
        if not ratio > 1:
            raise ValueError(f"`ratio` must be > 1, got {ratio!r}.")
        if loss_ratio is not None and not loss_ratio > 1:
            raise ValueError(f"`loss_ratio` must be > 1 or None, got {loss_ratio!r}.")
        self.ratio, self.loss_ratio = ratio, loss_ratio
        self.history = whole(history, "history")
        self.min_history = whole(min_history, "min_history")
        self.cooldown = whole(cooldown, "cooldown")
        self.norms: deque[float] = deque(maxlen=self.history)
        self.losses: deque[float] = deque(maxlen=self.min_history)  # the ranks' mean loss, compressed steps only
        self.lowest: float | None = None  # the lowest median of `losses` seen
        self.holding = 0  # dense steps still to send
        self.triggers = 0

    @property
    def watches_loss(self) -> bool:
        """Whether :meth:`check` wants the ranks' mean loss (on compressed steps)."""
        return self.loss_ratio is not None

    def check(self, stats: StepStats, loss: float | None = None) -> bool:
        """Take a finite step's statistics and, on compressed steps, the ranks' mean training loss (the same on
        every rank; ``None``: not known); whether the guard triggers now."""
        if self.holding:
            self.holding -= 1
            return False
        if stats.sq_norm <= 0:  # plain dense all-reduce: no header, nothing measured
            return False
        norm = stats.sq_norm**0.5
        compressed = stats.compressed
        exploded = (
            compressed and len(self.norms) >= self.min_history and norm > self.ratio * statistics.median(self.norms)
        )
        if exploded or (compressed and self._climbed(loss)):
            self.holding = self.cooldown * 2**self.triggers
            self.triggers += 1
            # Judged afresh after the hold, against the lowest median seen from then on: a loss that rose for a reason
            # (a schedule restart, a new data phase) and stays up would otherwise trigger again at every release.
            self.losses.clear()
            self.lowest = None
            return True
        self.norms.append(norm)
        return False

    def restart(self) -> None:
        """Forget the recent gradient norms: what the steps send changed meaning (Adam's moved direction after its
        warm-up), so its norms are not comparable with the gradients' before."""
        self.norms.clear()

    def _climbed(self, loss: float | None) -> bool:
        """Whether the recent median loss, with ``loss`` in it, has climbed past ``loss_ratio`` x the lowest."""
        if self.loss_ratio is None or loss is None or not loss > 0:  # NaN, or a loss that may be negative
            return False
        self.losses.append(loss)
        if len(self.losses) < self.min_history:
            return False
        median = statistics.median(self.losses)
        if self.lowest is None or median < self.lowest:
            self.lowest = median
        return median > self.loss_ratio * self.lowest

    def state_dict(self) -> dict[str, Any]:
        return {
            "norms": list(self.norms),
            "holding": self.holding,
            "triggers": self.triggers,
            "losses": list(self.losses),
            "lowest": self.lowest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms = deque(state["norms"], maxlen=self.history)
        self.holding, self.triggers = state["holding"], state["triggers"]
        self.losses = deque(state.get("losses", ()), maxlen=self.min_history)  # absent in older checkpoints
        self.lowest = state.get("lowest")

    def __repr__(self) -> str:
        return (
            f"DivergenceGuard(ratio={self.ratio}, history={self.history}, min_history={self.min_history}, "
            f"cooldown={self.cooldown}, loss_ratio={self.loss_ratio})"
        )
