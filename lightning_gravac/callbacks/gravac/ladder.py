"""GraVAC's factors (:class:`Ladder`): from ``cf_min`` to ``cf_max`` by the policy, fitted to the method's reach and
the model at setup and to the run's :class:`Budget` at fit start; the sequential search's candidate walks them."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from lightning_utilities.core.rank_zero import rank_zero_info

from lightning_gravac.callbacks.gravac.checkpoint import Checkpointed, checkpointed
from lightning_gravac.callbacks.gravac.cost import DENSE
from lightning_gravac.compressors.base import Compressor

Policy = Literal["exponential", "geometric"]

#: The factors GraVAC searches between by default (each capped at the size of the model's largest gradient).
DEFAULT_CF_MIN, DEFAULT_CF_MAX = 10.0, 1000.0


def next_scale(scale: float, policy: Policy) -> float:
    """The policy: exponential squares the scale (2, 4, 16, 256, ...), geometric doubles it."""
    return scale * scale if policy == "exponential" else 2 * scale


def ladder_factors(cf_min: float, cf_max: float, policy: Policy) -> tuple[float, ...]:
    """``cf_min``, then ``cf_min`` times each scale of ``policy`` from 2, up to ``cf_max``, which ends it."""
    factors, scale = [cf_min], 2.0
    while factors[-1] < cf_max:
        factors.append(min(cf_min * scale, cf_max))
        scale = next_scale(scale, policy)
    return tuple(factors)


@dataclass(kw_only=True)
class Ladder(Checkpointed):
    """The factors GraVAC searches, from ``cf_min`` to ``cf_max``, and the sequential search's walk along them.

    Attributes:
        cf_min: the least aggressive factor (the sequential search promotes its candidate to it).
        candidate: the sequential search's next factor, ``cf_min x scale`` capped at ``cf_max``.
        scale: the candidate's multiple of ``cf_min``, advanced by the policy at each window's end.
        cf_max: the most aggressive factor.
        policy: how the factors (and the candidate) advance, ``"exponential"`` or ``"geometric"``.
        default_bounds: which of ``cf_min`` and ``cf_max`` are defaults, fitted to the method and the model
            (:meth:`fit_bounds`), and which the user chose.
        factors: ``cf_min``, then ``cf_min`` times each scale of the policy, up to ``cf_max`` (:func:`ladder_factors`),
            less those the run's budget leaves out (:meth:`fit_to_budget`).
    """

    cf_min: float = field(metadata=checkpointed())
    candidate: float = field(metadata=checkpointed())
    scale: float = field(default=2.0, metadata=checkpointed())
    cf_max: float
    policy: Policy
    default_bounds: dict[str, bool]
    factors: tuple[float, ...]

    @classmethod
    def between(cls, cf_min: float, cf_max: float, policy: Policy, default_bounds: dict[str, bool]) -> "Ladder":
        """The factors from ``cf_min`` to ``cf_max`` by ``policy``, the candidate at ``2 cf_min``."""
        return cls(cf_min=cf_min, candidate=min(cf_min * 2.0, cf_max), cf_max=cf_max, policy=policy,
                   default_bounds=default_bounds, factors=ladder_factors(cf_min, cf_max, policy))  # fmt: skip

    def clamp(self, cf: float) -> float:
        """``cf`` within ``[cf_min, cf_max]``."""
        return min(max(cf, self.cf_min), self.cf_max)

    def fit_bounds(self, reach: tuple[float, float] | None, largest: int, method: str) -> bool:
        """Fit the default bounds (those not passed) to the method's reach (``reach``: that of ``method``, once the
        strategy's method is known: QSGD's 2- to 8-bit codes), else 10 and 1000, capped at ``largest``, the size of
        the model's largest gradient. Said when they change; returns whether they did."""
        cf_min, cf_max = reach if reach is not None else (DEFAULT_CF_MIN, DEFAULT_CF_MAX)
        cf_max = min(cf_max, float(largest)) if self.default_bounds["cf_max"] else self.cf_max
        cf_min = min(cf_min, cf_max) if self.default_bounds["cf_min"] else self.cf_min
        if (cf_min, cf_max) == (self.cf_min, self.cf_max):
            return False
        self.cf_min, self.cf_max, self.factors = cf_min, cf_max, ladder_factors(cf_min, cf_max, self.policy)
        self.candidate = self.clamp(self.candidate)
        why = f"{method!r} sends from {reach[0]:.3g} to {reach[1]:.3g}" if reach else ""
        if largest in (cf_max, cf_min):
            why += ("; " if why else "") + f"the model's largest gradient has {largest} entries"
        factors = ", ".join(f"{f:.3g}" for f in self.factors)
        rank_zero_info(
            f"GraVAC: the factors it chooses among when it compresses: cf {factors} (a factor is dense bytes over "
            f"bytes sent; {why or 'the defaults'})."
        )
        return True

    def fit_to_budget(self, admits: Callable[[float], bool], per_cf: float, budget_steps: float) -> None:
        """Replace the factors that a run of ``budget_steps`` leaves out (``admits``: whether an entry sent at a factor
        waits within it) by the most aggressive one it admits (whole, at least ``cf_min``), so that the search can send
        the edge: a method's wait is proportional to its factor, ``per_cf`` steps a unit of it. Said when it does."""
        kept = [cf for cf in self.factors if admits(cf)]
        edge = float(math.floor(budget_steps / per_cf))
        if len(kept) == len(self.factors):
            return
        left_out = [f"{cf:g}" for cf in self.factors if cf not in kept]
        if edge >= self.cf_min and (not kept or edge > kept[-1]):
            kept.append(edge)
        self.factors = tuple(kept)
        rank_zero_info(
            f"GraVAC: a run of {budget_steps:.0f} steps: cf {', '.join(left_out)} left out (an entry would wait longer "
            f"than the run to be sent); factors {', '.join(f'{f:g}' for f in self.factors) or 'none'}."
        )

    def advance(self, promote: bool) -> None:
        """The sequential search's step at a window's end: the candidate becomes ``cf_min`` if ``promote``; the scale
        advances by the policy, and the candidate with it."""
        if promote:
            self.cf_min = self.candidate
        self.scale = next_scale(self.scale, self.policy)
        self.candidate = min(self.cf_min * self.scale, self.cf_max)


@dataclass
class Budget:
    """The run's length, which bounds the factors (model search): an entry sent at a factor must not wait longer than
    the run's steps to be sent.

    Attributes:
        on: whether the budget leaves factors out.
        steps: the fit's steps (``trainer.estimated_stepping_batches``, set at fit start); ``inf`` when unknown.
    """

    on: bool
    steps: float = math.inf

    def admits(self, method: Compressor | None, cf: float, dtype: torch.dtype, rungs: tuple[float, ...]) -> bool:
        """Whether an entry that ``method`` sends at ``cf`` (gradients of ``dtype``) waits no longer than the run's
        steps on average; true for dense, the rungs (``rungs``) and methods that send every entry each step
        (quantizers, casts, low rank). The same on every rank."""
        if not self.on or method is None or cf in (DENSE, *rungs):
            return True
        wait = method.masked_wait(cf, dtype)
        return wait is None or wait <= self.steps

    def fit(self, ladder: Ladder, method: Compressor | None, dtype: torch.dtype, rungs: tuple[float, ...]) -> None:
        """Fit ``ladder`` to the run's steps (:meth:`Ladder.fit_to_budget`), where ``method``'s wait is known."""
        per_cf = method.masked_wait(1.0, dtype) if method is not None else None
        if per_cf is None or not math.isfinite(self.steps):
            return
        ladder.fit_to_budget(lambda cf: self.admits(method, cf, dtype, rungs), per_cf, self.steps)
