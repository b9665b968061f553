"""What GraVAC sends for an Adam-like optimizer or clipped gradients: dense, whole in fp16 or a near-exact code while
it holds, and what it says of it (:class:`Hold`, the part that decides it).

An optimizer that divides each coordinate by a running second moment (Adam, AdamW, RMSprop, Adagrad) is upset by
error-fed sparse or coarsely quantized gradients, not by a 16-bit cast or a block code that errs by a fraction of each
block's range. So GraVAC holds such an optimizer, left as the user configured it, at whichever of dense, fp16 and the
method's block code (``adam="gradient"``, the default) the link makes fastest: all the run, or (``adam="moment"``, 1-bit
Adam's scheme, named by the user) until Adam's second moment is frozen and its first moment is sent compressed.
"""

from dataclasses import dataclass
from typing import Literal

from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gravac.callbacks.gravac.cost import DENSE, CostModel, saves_enough
from lightning_gravac.compressors.base import Compressor
from lightning_gravac.state import HALF

#: What GraVAC does for an Adam-like optimizer and a lossy method (the ``adam`` argument).
AdamPolicy = Literal["gradient", "moment", "fp16", "dense", "compress"]
#: The policies that hold dense or fp16 (and, with ``"gradient"``, a near-exact code).
HOLDING = ("gradient", "fp16", "moment")
#: The fewest steps a budget takes for clipped gradients to go in a code (fp16 or the block code) rather than dense: a
#: clipped LSTM language model (plain SGD at lr 20, clip 0.25) kept dense's held-out loss in ``int8`` at 1,000 steps
#: over three paired seeds (-0.11%) and lost 4.5% at 120 steps, where an fp16 cast lost 2.9% on a seed too.
CLIPPED_CODE_BUDGET = 1000


@dataclass(kw_only=True)
class Hold:
    """Whether GraVAC holds the steps at dense, fp16 or a block code for the optimizer or the clipping, and at which.

    Attributes:
        policy: what GraVAC does for an Adam-like optimizer and a lossy method (the ``adam`` argument).
        clipped: the trainer clips the gradients and the method is a block code: each step dense, fp16 or the code
            (set at fit start).
        exact: clipped, on a budget under :data:`CLIPPED_CODE_BUDGET`: each step dense (set at fit start).
        said: what the hold sends was said where it was decided (the zero-argument default's line at setup).
    """

    policy: AdamPolicy = "gradient"
    clipped: bool = False
    exact: bool = False
    said: bool = False

    def fit(self, clips: bool, method: Compressor, budget_steps: float) -> None:
        """At fit start: clipping (``clips``) reacts to a block code's error as Adam does, so it holds the code too;
        on a budget of ``budget_steps`` under :data:`CLIPPED_CODE_BUDGET`, dense (:attr:`exact`)."""
        self.clipped = clips and method.near_exact
        self.exact = self.clipped and budget_steps < CLIPPED_CODE_BUDGET

    @property
    def moves_moments(self) -> bool:
        """Whether Adam's moments move into the hook after a warm-up (``adam="moment"``)."""
        return self.policy == "moment"

    def holds(self, adaptive: bool, moved: bool) -> bool:
        """Whether the next step is held: an ``adaptive`` (Adam-like) optimizer, a lossy method and a holding policy,
        all the run or until the moments have ``moved`` (``adam="moment"``); or clipped gradients."""
        return (adaptive and self.policy != "compress" and not moved) or self.clipped

    def rung(
        self, asked: bool, adaptive: bool, method: Compressor, fp32: bool, cf_min: float, models_cost: bool
    ) -> bool:
        """Whether the fp16 rung can be sent (:func:`rung_allowed`): on for the hold of an ``adaptive`` optimizer or of
        clipping where the search models a step's cost, else as ``asked``."""
        held = ((adaptive and self.policy in HOLDING) or self.clipped) and models_cost
        return rung_allowed(asked, held, method, fp32, cf_min)

    def factor(
        self, holding: bool, moved: bool, method: Compressor | None, rungs: tuple[float, ...], cost: CostModel
    ) -> float | None:
        """The factor the hold sends next step (:func:`held_factor`), ``None`` when the search decides; clipped
        gradients are held as ``adam="gradient"`` holds an Adam-like optimizer."""
        if holding and self.exact:
            return DENSE
        policy = "gradient" if self.clipped else self.policy
        fixed_cf, near_exact = (method.fixed_cf, method.near_exact) if method is not None else (None, False)
        return held_factor(holding, moved, policy, fixed_cf, rungs, cost, near_exact)

    def say(self, method: Compressor, rows: bool, rungs: tuple[float, ...], models_cost: bool, fp16_rung: bool,
            moments_move: bool) -> None:  # fmt: skip
        """Say on rank 0 what the hold sends (``rows``: tables by rows), once a fit: unless the moments move after the
        warm-up (``moments_move``), said where that was decided."""
        if self.exact:
            rank_zero_info(
                f"GraVAC: the trainer clips the gradients' norm and the budget is under {CLIPPED_CODE_BUDGET} steps: "
                "each step's gradient is sent dense, as stock DDP sends it (a coded step's error moved a clipped run's "
                "result at short budgets)."
            )
        elif self.clipped or (self.policy == "gradient" and method.near_exact):
            rank_zero_info(code_note(method.name, bool(rungs), self.clipped))
        elif not (moments_move or self.said):
            rank_zero_warn(hold_warning(self.policy, rungs, method.name, rows, models_cost, fp16_rung))


def rung_allowed(asked: bool, held: bool, method: Compressor, fp32: bool, cf_min: float) -> bool:
    """Whether the fp16 rung can be sent: ``asked`` by the user, or ``held`` (the hold of an Adam-like optimizer,
    where it is the only factor besides 1); never with parameters not all in fp32 (``fp32``), a method with its own
    accumulation or one factor, or (unless held) a ladder from 2 or less (``cf_min``)."""
    # Held for Adam, a method of one factor (the moments' scaled signs) leaves fp16 a choice of its own.
    own_state = method.owns_feedback or method.near_lossless or (method.fixed_cf is not None and not held)
    return (asked or held) and fp32 and not own_state and (held or cf_min > HALF)


def held_factor(
    holding: bool,
    moved: bool,
    policy: AdamPolicy,
    fixed_cf: float | None,
    rungs: tuple[float, ...],
    cost: CostModel,
    near_exact: bool = False,
) -> float | None:
    """The factor to send next step when Adam decides it, ``None`` when the search does. While ``holding`` an
    Adam-like optimizer: under ``adam="gradient"`` with a ``near_exact`` method of one factor (a block code), dense,
    fp16 or that factor, as below; else fp16 if the rung can be sent (``rungs``) and the cost model predicts it saves
    a tenth of a dense step (before the first window ends, from the fit-start timing alone: the rest of the step is
    the same for both), else dense. Once Adam's moments have ``moved`` under a method of one factor (``fixed_cf``,
    scaled signs): dense, fp16 or that factor, whichever the cost model predicts fastest, a lossy one only where it
    saves a tenth of a step; that factor while the link is unknown. Nothing to search: what a step's code drops is
    carried by error feedback."""
    if holding and policy == "gradient" and near_exact and fixed_cf is not None:
        return _fastest(fixed_cf, rungs, cost)
    if holding:
        seconds = cost.seconds_by_factor(rungs)
        if policy == "dense" or not rungs or seconds is None:
            return DENSE
        return HALF if saves_enough(seconds(HALF), seconds(DENSE)) else DENSE
    if moved and fixed_cf is not None:
        return _fastest(fixed_cf, rungs, cost)
    return None


def _fastest(fixed_cf: float, rungs: tuple[float, ...], cost: CostModel) -> float:
    """Dense, a rung or ``fixed_cf``, whichever the cost model predicts fastest, a lossy one only where it saves a
    tenth of a dense step; ``fixed_cf`` while the link is unknown."""
    fixed, seconds = float(fixed_cf or DENSE), cost.seconds_by_factor(rungs)
    if seconds is None:
        return fixed
    lossy = [cf for cf in (*rungs, fixed) if saves_enough(seconds(cf), seconds(DENSE))]
    return min([DENSE, *lossy], key=lambda cf: (seconds(cf), cf))


def hold_warning(
    policy: AdamPolicy, rungs: tuple[float, ...], method: str, rows: bool, models_cost: bool, fp16_rung: bool
) -> str:
    """What an Adam-like optimizer gets from the hold: dense or fp16 by the link, or dense and why (``method``: the
    method's name; ``rows``: embedding tables are sent by the rows each step touched)."""
    if rungs and policy in HOLDING:
        sending = "sending each step dense or whole in fp16, whichever the measured link makes faster"
    else:
        sending = f"sending dense (factor 1): {_why_no_half(policy, method, models_cost, fp16_rung)}"
    if rows:
        sending += " (embedding tables by the rows each step touched: the same sum)"
    return (
        f"GraVAC: the optimizer scales each coordinate by a running second moment (Adam-like), which lossy "
        f"{method!r} gradients upset: {sending}. `GraVAC(adam='compress')` compresses anyway."
    )


def code_note(method: str, fp16_rung: bool, clipped: bool = False) -> str:
    """What an Adam-like optimizer, or a trainer that clips gradients (``clipped``), gets with a block code: the
    optimizer as configured, each step in whichever of dense, fp16 (where it can be sent) and the code the link makes
    fastest."""
    choices = "dense, whole in fp16 or" if fp16_rung else "dense or"
    why = (
        "the trainer clips the gradients' norm, which a coarser code's error would shorten"
        if clipped
        else "the optimizer scales each coordinate by a running second moment (Adam-like) and is left as configured"
    )
    return (
        f"GraVAC: {why}: each step's gradient is sent {choices} in {method!r} block codes with error feedback, "
        "whichever the measured link makes fastest."
    )


def _why_no_half(policy: AdamPolicy, method: str, models_cost: bool, fp16_rung: bool) -> str:
    """Why the hold cannot send fp16 (with no rung to send)."""
    if policy == "dense":
        return "asked with `adam='dense'`"
    if not models_cost:
        return "the sequential search has no cost model to weigh fp16 against dense"
    if not fp16_rung:
        return (
            f"fp16 cannot be sent here (parameters not in fp32, or {method!r} keeps an accumulation of its own or "
            "sends one fixed factor)"
        )
    return "the link was not measured (one rank, or `time_link=False`), so fp16 cannot be shown to pay"
