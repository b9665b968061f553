"""GraVAC's factors: the ladder from ``cf_min`` to ``cf_max`` by the policy, fitted to the method's reach and the
model at setup, and to the run's budget at fit start."""

import math
from typing import TYPE_CHECKING, Literal

from lightning_utilities.core.rank_zero import rank_zero_info

from lightning_gravac.callbacks.gravac.cost import DENSE
from lightning_gravac.state import HALF

if TYPE_CHECKING:
    from lightning_gravac.callbacks.gravac.controller import GraVAC

Policy = Literal["exponential", "geometric"]

#: The factors GraVAC searches between by default (each capped at the size of the model's largest gradient).
DEFAULT_CF_MIN, DEFAULT_CF_MAX = 10.0, 1000.0


def next_scale(scale: float, policy: Policy) -> float:
    """The policy: exponential squares the scale (2, 4, 16, 256, ...), geometric doubles it."""
    return scale * scale if policy == "exponential" else 2 * scale


def ladder(cf_min: float, cf_max: float, policy: Policy) -> tuple[float, ...]:
    """``cf_min``, then ``cf_min`` times each scale of ``policy`` from 2, up to ``cf_max``, which ends it."""
    factors, scale = [cf_min], 2.0
    while factors[-1] < cf_max:
        factors.append(min(cf_min * scale, cf_max))
        scale = next_scale(scale, policy)
    return tuple(factors)


def fit_bounds(c: "GraVAC", largest: int) -> None:
    """Fit ``c``'s default bounds (those not passed) to the method's reach (:meth:`Compressor.factor_range`, once the
    strategy's method is known: QSGD's 2- to 8-bit codes), else 10 and 1000, capped at ``largest``, the size of the
    model's largest gradient. Said when they change."""
    s, state = c.search_state, c.compression_state
    reach = state.compressor.factor_range(c.grad_dtype) if state is not None else None
    cf_min, cf_max = reach if reach is not None else (DEFAULT_CF_MIN, DEFAULT_CF_MAX)
    cf_max = min(cf_max, float(largest)) if c.default_bounds["cf_max"] else c.cf_max
    cf_min = min(cf_min, cf_max) if c.default_bounds["cf_min"] else s.cf_min
    if (cf_min, cf_max) == (s.cf_min, c.cf_max):
        return
    s.cf_min, c.cf_max, c.ladder = cf_min, cf_max, ladder(cf_min, cf_max, c.policy)
    s.candidate = min(max(s.candidate, cf_min), cf_max)
    if c.cf not in (DENSE, HALF):  # dense or fp16 (a resumed run's factor) stay what they are
        c.cf = min(max(c.cf, cf_min), cf_max)
    why = f"{c.state.compressor.name!r} sends from {reach[0]:.3g} to {reach[1]:.3g}" if reach else ""
    if largest in (cf_max, cf_min):
        why += ("; " if why else "") + f"the model's largest gradient has {largest} entries"
    rank_zero_info(f"GraVAC: factors {', '.join(f'{f:.3g}' for f in c.ladder)} ({why or 'the defaults'}).")


def within_budget(c: "GraVAC", cf: float) -> bool:
    """Whether an entry sent at ``cf`` waits no longer than the run's steps (``c.budget_steps``) on average; true for
    methods that send every entry each step (quantizers, casts, low rank). The same on every rank."""
    state = c.compression_state
    if not c.budget or state is None or cf in (DENSE, *c.rungs):
        return True
    wait = state.compressor.masked_wait(cf, c.grad_dtype)
    return wait is None or wait <= c.budget_steps


def fit_to_budget(c: "GraVAC") -> None:
    """Replace the rungs of ``c``'s ladder that the budget leaves out by the most aggressive factor it admits (whole,
    at least ``cf_min``), so that the search can send the edge: a method's wait is proportional to its factor."""
    state = c.compression_state
    per_cf = state.compressor.masked_wait(1.0, c.grad_dtype) if state is not None else None
    if per_cf is None or not math.isfinite(c.budget_steps):
        return
    kept = [cf for cf in c.ladder if within_budget(c, cf)]
    edge = float(math.floor(c.budget_steps / per_cf))
    if len(kept) == len(c.ladder):
        return
    left_out = [f"{cf:g}" for cf in c.ladder if cf not in kept]
    if edge >= c.search_state.cf_min and (not kept or edge > kept[-1]):
        kept.append(edge)
    c.ladder = tuple(kept)
    rank_zero_info(
        f"GraVAC: a run of {c.budget_steps:.0f} steps: cf {', '.join(left_out)} left out (an entry would wait longer "
        f"than the run to be sent); factors {', '.join(f'{f:g}' for f in c.ladder) or 'none'}."
    )
