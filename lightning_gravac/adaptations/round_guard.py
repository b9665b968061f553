"""The guard of local steps' rounds: it undoes a round that diverged, holds the steps after it synchronous, and stops
a run that cannot go on.

A round whose ranks' mean training loss (over the round's inner steps that stepped) is above ``ratio`` times the
lowest of the rounds before it, or whose averaged change is not finite, is undone by its owner
(:class:`~lightning_gravac.adaptations.local_steps.OuterUpdate`); the next ``cooldown`` steps (doubled at each further
undo) are synchronous. A run stops with :class:`LocalStepsDiverged` where going on would only freeze it: when two
round ends in a row (a hold's step ends one) moved nothing, no rank having taken a finite step since the last or the
ranks' averaged change not finite (the parameters sit where every batch's gradient overflows, or every round's
change does: the weights would never move again), or when the guard would undo a round for the ``MOST_UNDOS + 1``-th
time. Each is decided from what every rank shares (the all-reduce of the rounds' losses, the averaged change), so
every rank raises at the same step and none waits in a collective.
"""

import math
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor

#: Rounds the guard undoes in a fit before a further divergence stops it: after three holds (of 100, 200 and 400
#: steps by default) the rounds have not kept from diverging, and the run would spend itself in undos.
MOST_UNDOS = 3

_WHAT_TO_TRY = (
    "Try a smaller learning rate, shorter rounds (`local_steps=4`), or every step synchronous "
    "(`GraVACStrategy(local_steps=None)`)."
)


class LocalStepsDiverged(RuntimeError):
    """Local steps cannot go on: raised on every rank at the same step, ending the fit as an error in a step does."""


class RoundGuard:
    """What local steps' guard decides and keeps (see the module's docstring).

    State, the same on every rank: the synchronous steps still to take, the rounds undone, the lowest round's mean loss
    and the round ends in a row that moved nothing; this rank's round so far: its finite losses' sum and
    count, and the steps it took.
    """

    def __init__(self) -> None:
        self.ratio: float | None = None  # ``LocalSteps.guard``; ``None``: no round undone
        self.cooldown = 1
        self.holding = 0  # synchronous steps still to take after a round was undone
        self.triggers = 0  # rounds undone
        self.lowest: float | None = None  # the lowest round's mean loss since the rounds began or last went on
        self.stalled = 0  # round ends in a row that moved nothing
        self._moved: bool | None = None  # whether the round ending moved anything (``None``: it had no steps)
        self._round = torch.zeros(3, dtype=torch.float64)  # this rank's round: finite losses' sum and count, steps

    def configure(self, ratio: float | None, cooldown: int) -> None:
        """Undo a round above ``ratio`` times the lowest (``None``: none), holding ``cooldown`` steps after it."""
        self.ratio, self.cooldown = ratio, cooldown

    def to(self, device: torch.device) -> None:
        """Keep this rank's round on ``device`` (the parameters')."""
        self._round = self._round.to(device)

    def stepped(self, loss: Tensor | None) -> None:
        """This rank took a step whose closure returned ``loss`` (``None`` under manual optimization): counted, and
        its loss where finite (no host sync)."""
        one = torch.ones((), dtype=self._round.dtype, device=self._round.device)
        if loss is None:
            self._round[2] += one
            return
        value = loss.detach().reshape(()).to(self._round)
        finite = torch.isfinite(value)
        self._round += torch.stack([torch.where(finite, value, 0.0), finite.to(value), one])

    def close(self, steps: int, synchronous: bool) -> float | None:
        """A round of ``steps`` inner steps ends (a hold's one step: ``synchronous``); every rank calls it (one
        all-reduce of three numbers). The ranks' mean training loss over the round's steps that stepped; ``None`` when
        none had a finite loss, in a hold, or without the guard."""
        totals = self._round.clone()
        self._round.zero_()
        if dist.is_initialized():
            dist.all_reduce(totals)
        total, count, taken = totals.tolist()
        self._moved = taken > 0 if steps > 0 else None
        if self.ratio is None or synchronous or not count:
            return None
        return total / count

    def lost(self) -> None:
        """Without the guard, the ranks' averaged change was not finite: every rank goes on from the round's start."""
        self._moved = False
        rank_zero_warn("Local steps: the averaged change was not finite; every rank goes on from the anchor.")

    def ended(self) -> None:
        """The round closed by :meth:`close` has ended; every rank calls it.

        Raises:
            LocalStepsDiverged: the second round end in a row that moved nothing.
        """
        if self._moved is not None:
            self.stalled = 0 if self._moved else self.stalled + 1
        self._moved = None
        if self.stalled >= 2:
            after = " after the guard undid a round" if self.triggers else ""
            raise LocalStepsDiverged(
                "Local steps cannot go on: its last two rounds moved nothing (no rank took a finite step, or the "
                f"ranks' averaged change was not finite){after}, so the parameters would stay where they are for the "
                "rest of the fit. " + _WHAT_TO_TRY
            )

    def diverged(self, loss: float | None) -> bool:
        """Whether the round's mean ``loss`` is above the guard's ratio of the lowest before it (a loss that is not
        positive is not compared); the lowest is kept."""
        if self.ratio is None or loss is None:
            return False
        if not math.isfinite(loss) or (self.lowest is not None and self.lowest > 0 and loss > self.ratio * self.lowest):
            return True
        self.lowest = loss if self.lowest is None else min(self.lowest, loss)
        return False

    def undo(self, loss: float | None, step: int) -> None:
        """The round ending at ``step`` is undone (its mean ``loss``; ``None``: its averaged change was not finite):
        the next steps are held synchronous (``cooldown``, doubled each time), and said.

        Raises:
            LocalStepsDiverged: when the guard has undone ``MOST_UNDOS`` rounds already.
        """
        why = (
            "its averaged change was not finite"
            if loss is None
            else f"the ranks' mean training loss {loss:.4g} is above {self.ratio:g}x the lowest round's"
        )
        if self.triggers >= MOST_UNDOS:
            raise LocalStepsDiverged(
                f"Local steps cannot go on: the round ending at step {step} diverged ({why}), after the guard had "
                f"undone {self.triggers} rounds and held the steps after each synchronous. " + _WHAT_TO_TRY
            )
        self.holding = self.cooldown * 2**self.triggers
        self.triggers += 1
        self.lowest = None
        rank_zero_warn(
            f"Local steps diverged: the round ending at step {step} is undone ({why}). Every rank is back at the "
            f"round's start; the next {self.holding} steps average each step's change whole, then the rounds go on. "
            "Where local steps are asked for, `LocalSteps(guard=None)` turns this off."
        )

    def hold(self) -> bool:
        """Whether this step is one of a hold's synchronous steps (counted)."""
        if not self.holding:
            return False
        self.holding -= 1
        return True

    def state_dict(self) -> dict[str, Tensor]:
        """The guard's state as tensors, every value finite (no lowest yet: no entry, the same on every rank)."""
        state = {
            "holding": torch.tensor(self.holding),
            "triggers": torch.tensor(self.triggers),
            "stalled": torch.tensor(self.stalled),
            "loss": self._round[:2].clone(),
            "stepped": self._round[2].clone(),
        }
        if self.lowest is not None:
            state["lowest"] = torch.tensor(self.lowest, dtype=torch.float64)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (also one that saved no lowest as NaN)."""
        self.holding = int(state["holding"]) if "holding" in state else 0
        self.triggers = int(state["triggers"]) if "triggers" in state else 0
        self.stalled = int(state["stalled"]) if "stalled" in state else 0
        lowest = float(state["lowest"]) if "lowest" in state else math.nan
        self.lowest = None if math.isnan(lowest) else lowest
        if "loss" in state:
            loss = state["loss"].to(self._round)
            # A checkpoint without the steps taken counted only those with a finite loss.
            stepped = state["stepped"].to(self._round) if "stepped" in state else loss[1]
            self._round = torch.cat([loss, stepped.reshape(1)])
