"""The default's choice between sending every step and local steps: rounds of ``H`` inner steps with nothing sent,
then the parameter change averaged in block codes with error feedback (``lightning_gravac.adaptations.local_steps``):
2-bit (``int2``: each entry ``-m``, 0 or ``m`` of its block's largest) where the budget allows rounds of 32 (at least
224 steps), 4-bit (``int4``) below, whichever method the default sends every step (QSGD, or Top-K on a model that is
mostly embedding tables; what Top-K still owed at the switch goes into the first local step). What a round rounds away
is carried into the next, and the fit's last round goes with it in ``int8``. QSGD's 4 bits are unbiased but noisier
than the change itself (a relative error of 1.25 on a Gaussian vector): on a regression with SGD momentum they kept the
rounds at 2.3x the loss of the same rounds sent whole, ``int4`` at 1.1x and ``int2`` at 0.55x. Over three seeds at
1,000 steps ``int2``'s rounds kept dense's held-out metric as ``int4``'s did, in half their bytes; at 120 steps
``int2`` missed the mlp by 1.06% on a seed where ``int4`` kept it (-0.11%): with a handful of rounds what a coarse code
rounds away is not averaged out (BENCHMARKS.md).

Local steps are chosen, after the fit's first step or at a window's end, when the cost model predicts that they save at
least a tenth of the every-step choice's step (:data:`~.cost.MIN_SAVING`) and the run's budget holds enough rounds.
``H`` is the shortest round whose communication adds at most a tenth of a step's computation a step
(:data:`WITHIN_LIMIT`: the run then computes 90% of its time), else the longest allowed; chosen again, once, from the
computation the first round's inner steps measure. The bounds are ``H <= 64`` and at least 7 rounds in the budget, so
``H <= 16`` up to a 223-step budget. Rounds of up to 16 kept dense's held-out metric at a 120-step budget on all five
SGD tasks of the matrix (fewer rounds are not measured); rounds of 16, 32 and 64 kept it at 1,000 steps on the mean of
three seeds on three tasks, where rounds of 16 at 100 Mbit/s cost up to twice their steps' computation
(BENCHMARKS.md). Only where nothing of the optimizer lives in the hook and the optimizer does not scale each
coordinate (SGD): Adam-like inner steps lost 2% of dense's held-out loss at ``H = 8``."""

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_info

from lightning_gravac.adaptations.local_steps import LocalSteps, OuterUpdate
from lightning_gravac.callbacks.gravac.checkpoint import Checkpointed, checkpointed
from lightning_gravac.callbacks.gravac.cost import CostModel, Link, moved_bytes, saves_enough
from lightning_gravac.callbacks.gravac.ladder import Budget
from lightning_gravac.compressors.base import Compressor, get_compressor
from lightning_gravac.compressors.blockwise import Int2, Int4
from lightning_gravac.state import CompressionState

#: Round lengths the default picks from, shortest first (32 and 64 only where the budget holds 7 of them: 224 and
#: 448 steps).
LENGTHS = (4, 8, 16, 32, 64)
#: The fewest rounds the budget must hold at the round length picked.
MIN_ROUNDS = 7
#: The share of a step's computation a round's communication may add a step.
WITHIN_LIMIT = 0.1
#: The outer update's code and factor where the budget allows rounds of 32 (:data:`LONG_BUDGET`): 2-bit block codes
#: from fp32, with error feedback.
OUTER_METHOD, OUTER_CF = Int2.name, Int2.fixed_cf
#: The outer update's code and factor on a shorter budget: 4-bit block codes.
SHORT_METHOD, SHORT_CF = Int4.name, Int4.fixed_cf
#: Each outer code's factor, by name.
CODE_CF = {OUTER_METHOD: OUTER_CF, SHORT_METHOD: SHORT_CF}
#: The fewest steps a budget takes for the rounds' 2-bit code: 7 rounds of 32.
LONG_BUDGET = MIN_ROUNDS * LENGTHS[3]


def outer_code(steps_left: float) -> tuple[str, float]:
    """The rounds' code and factor where ``steps_left`` steps of the budget are left (:data:`LONG_BUDGET`)."""
    return (OUTER_METHOD, OUTER_CF) if steps_left >= LONG_BUDGET else (SHORT_METHOD, SHORT_CF)


def round_seconds(link: Link, cost: CostModel, work: float, cf: float = OUTER_CF) -> float:
    """A round's communication by the cost model: one message and the payload of the whole model at ``cf``, gathered,
    and ``work``, the seconds of the round's own work (:attr:`Rounds.work_seconds`). An upper bound where embedding
    tables go by the rows a round changed (their mask a small all-reduce more)."""
    dense = cost.model_bytes or cost.dense_bytes
    per_message = link.per_step / max(1, cost.buckets)
    return per_message + moved_bytes(dense / cf, dense, cost.world_size) * link.seconds_per_byte + work


def choose_length(compute: float, every_step: float, round_s: float, steps_left: float) -> int | None:
    """The round length to run, or ``None`` to go on sending every step.

    Args:
        compute: a step's seconds without communication (the slowest rank's).
        every_step: the every-step choice's predicted seconds a step.
        round_s: a round's communication (:func:`round_seconds`); the fit's last round, sent in 8-bit block codes
            with what error feedback still owes, is counted as one too (a single round's difference over the run).
        steps_left: the steps left in the budget.
    """
    length = fitting_length(compute, round_s, steps_left)
    if length is None:
        return None
    return length if saves_enough(compute + round_s / length, every_step) else None


def fitting_length(compute: float, round_s: float, steps_left: float, done: int = 0) -> int | None:
    """The shortest round whose communication adds at most :data:`WITHIN_LIMIT` of ``compute`` a step, else the
    longest, among those that keep the fit's rounds (``done`` of them already) at :data:`MIN_ROUNDS` or more; ``None``
    when none does."""
    allowed = allowed_lengths(steps_left, done)
    if not allowed:
        return None
    fitting = [h for h in allowed if round_s / h <= WITHIN_LIMIT * compute]
    return fitting[0] if fitting else allowed[-1]


def allowed_lengths(steps_left: float, done: int = 0) -> list[int]:
    """The round lengths that keep the fit's rounds (``done`` of them already) at :data:`MIN_ROUNDS` or more."""
    return [h for h in LENGTHS if h * (MIN_ROUNDS - done) <= steps_left]


@dataclass(kw_only=True)
class Rounds(Checkpointed):
    """Whether and from when the default runs local steps.

    Attributes:
        allowed: the fit may switch (the zero-argument default under SGD, one optimizer, nothing of it in the hook).
        every: the round length chosen; 0 while every step is sent (checkpointed).
        start: the step from which local steps run (checkpointed).
        measured: the first round's inner steps have measured a step's computation and the length was chosen again
            from it (checkpointed).
        work_seconds: the seconds a round's own work takes beyond its bytes: the change formed, compressed, packed,
            every rank's decoded, the outer step and the parameters set (timed at fit start; checkpointed in local
            steps).
        inner: the first round's inner steps' seconds, this rank's (checkpointed in local steps).
        time_work: times a round's own work with a given outer code, every rank alike, while that is still to be
            timed this fit (set at fit start where the link was timed).
    """

    allowed: bool = False
    every: int = field(default=0, metadata=checkpointed(added=True))
    start: int = field(default=0, metadata=checkpointed(added=True))
    measured: bool = field(default=False, metadata=checkpointed(added=True))
    work_seconds: float = field(default=0.0, metadata=checkpointed(added=True))
    inner: list[float] = field(default_factory=list, metadata=checkpointed(added=True))  # this rank's
    code: str = field(default=SHORT_METHOD, metadata=checkpointed(added=True))  # the outer code, by the budget
    why: str = ""  # the prediction that chose them, said once
    _method: Compressor | None = field(default=None, repr=False)  # the outer code where it is not the every-step one
    time_work: Callable[[Compressor], float] | None = field(default=None, repr=False)

    @property
    def cf(self) -> float:
        """The outer code's factor."""
        return CODE_CF[self.code]

    def method(self, state: CompressionState) -> Compressor:
        """The outer update's code (:attr:`code`): the every-step method where it is that code, else one of its own
        for this rank."""
        if state.compressor.name == self.code:
            return state.compressor
        if self._method is None or self._method.name != self.code:
            self._method = get_compressor(self.code)
            rank = dist.get_rank(state.process_group) if dist.is_initialized() else 0
            self._method.setup(state.world_size, rank)
        return self._method

    def round_seconds(self, link: Link, cost: CostModel) -> float:
        """A round's communication (:func:`round_seconds`), its own work as timed at fit start, or where that did not
        run (a checkpoint of a version that did not time it), the every-step method's compression."""
        return round_seconds(link, cost, self.work_seconds or cost.compress_cost, self.cf)

    def consider(self, cost: CostModel, link: Link | None, every_step_cf: float, rungs: tuple[float, ...],
                 steps_done: int, budget: float) -> int | None:  # fmt: skip
        """After the fit's first step and at a window's end: the round length to switch to, from the cost model on
        ``link`` (``every_step_cf``: what the every-step rule would send next), or ``None``."""
        if not self.allowed or self.every or link is None or budget <= 0:
            return None
        every_step = cost.seconds(link, every_step_cf, cost.dense_bytes, rungs)
        round_s = self.round_seconds(link, cost)
        length = choose_length(link.other_seconds, every_step, round_s, budget - steps_done)
        if length is not None:
            local = link.other_seconds + round_s / length
            self.why = (
                f"a step's computation estimated at {link.other_seconds * 1e3:.1f} ms; predicted "
                f"{every_step * 1e3:.1f} ms a step sending every step (cf {every_step_cf:g}), {local * 1e3:.1f} ms "
                "with these rounds"
            )
        return length

    def switch(self, state: CompressionState | None, cost: CostModel, link: Link | None, every_step_cf: float,
               rungs: tuple[float, ...], budget: Budget) -> None:  # fmt: skip
        """Switch to local steps from the next step where :meth:`consider` says they pay on ``link`` within the run's
        ``budget``; the cost model then keeps ``link`` (the first round's measure is set against its estimate). Every
        rank calls this alike: a round's own work is timed (a collective) once, the first time rounds could pay whatever
        it takes, so a fit on a fast link does without. ``state``: ``None`` for a controller driven without a strategy,
        which never switches."""
        if not self.allowed or self.every or state is None:
            return
        steps, budget_steps = state.step, budget.steps
        self.code = outer_code(budget_steps - steps)[0]  # by the steps left: the rounds this switch can run
        if self.time_work is not None and self.could_pay(cost, link, every_step_cf, rungs, steps, budget_steps):
            self.work_seconds = self.time_work(self.method(state))
            self.time_work = None
        length = self.consider(cost, link, every_step_cf, rungs, steps, budget_steps)
        if length is not None:
            cost.link = link
            self.every, self.start = length, steps
            self.run(state, fresh=True)

    def could_pay(self, cost: CostModel, link: Link | None, every_step_cf: float, rungs: tuple[float, ...],
                  steps_done: int, budget: float) -> bool:  # fmt: skip
        """Whether :meth:`consider` could switch whatever a round's own work takes: whether the longest round the
        budget allows, its work taking no time, would save enough. Only then is that work worth timing."""
        if not self.allowed or self.every or link is None or budget <= 0:
            return False
        allowed = allowed_lengths(budget - steps_done)
        if not allowed:
            return False
        every_step = cost.seconds(link, every_step_cf, cost.dense_bytes, rungs)
        return saves_enough(link.other_seconds + round_seconds(link, cost, 0.0, self.cf) / allowed[-1], every_step)

    def first_round(self, seconds: float, first: bool, ended: bool, cost: CostModel, steps_left: float,
                    reduce: Callable[[float], float]) -> int | None:  # fmt: skip
        """After each local step of the first round (``seconds`` this one's; ``first``: the first local step;
        ``ended``: a round ended with it): at the round's end, the round length chosen again from what its inner steps
        measured, or ``None`` to keep it. The steps before the switch could only estimate a step's computation (their
        seconds less the communication the model predicts, which misses a compressed step's own overheads); an inner
        step sends nothing and measures it. The first local step (it may take what error feedback owed) and the
        round's last (it communicates) are left out. ``reduce``: the slowest rank's value, called on every rank
        alike."""
        if self.measured:
            return None
        if not ended:
            if not first:
                self.inner.append(seconds)
            return None
        self.measured = True
        if not self.inner or cost.link is None:  # a round cut short, or a checkpoint of a version that did not measure
            return None
        compute = reduce(statistics.median(self.inner))
        self.inner.clear()
        length = fitting_length(compute, self.round_seconds(cost.link, cost), steps_left, done=1)
        if length is None or length == self.every:
            return None
        rank_zero_info(
            f"GraVAC: local steps' rounds of {self.every} -> {length} steps: an inner step computes "
            f"{compute * 1e3:.1f} ms as measured, against {cost.link.other_seconds * 1e3:.1f} ms estimated before the "
            "switch."
        )
        return length

    def local_step(self, seconds: float, state: CompressionState, cost: CostModel, steps_left: float,
                   reduce: Callable[[float], float]) -> None:  # fmt: skip
        """After a local step of ``seconds``: at the first round's end, the round length chosen again from its inner
        steps (:meth:`first_round`) and the outer update given it, the same on every rank."""
        outer = state.carry.get(OuterUpdate)
        first, ended = state.step - self.start == 1, outer.since == 0
        length = self.first_round(seconds, first, ended, cost, steps_left, reduce)
        if length is not None:
            assert outer.config is not None and outer.compressor is not None
            outer.configure(replace(outer.config, every=length), outer.compressor, outer.error_feedback)
            self.every = length

    def run(self, state: CompressionState, fresh: bool) -> None:
        """Local steps from :attr:`start` on, rounds of :attr:`every`, said on rank 0 (``fresh``: from the next step,
        the round starting from the parameters as they are; else resumed, the round's state restored by the
        strategy)."""
        config, outer = LocalSteps(every=self.every, cf=self.cf), state.carry.get(OuterUpdate)
        method = self.method(state)
        if fresh:
            outer.start(config, method, method.error_feedback_default, state.step)
            rank_zero_info(
                f"GraVAC: local steps from step {state.step}: rounds of {self.every} steps, each round's parameter "
                f"change averaged in {method.name} block codes with error feedback ({self.why})."
            )
        else:
            outer.configure(config, method, method.error_feedback_default)
        state.config.local_sgd_from = self.start
