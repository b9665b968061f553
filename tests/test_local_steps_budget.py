"""The run's budget and the default's rounds of local steps, through Lightning's Trainer on two gloo ranks: the steps
left when the first round ends, counted from Lightning's global step (a round's end one step however much it sends),
so a budget that holds the fewest rounds allowed at a length exactly is given that length; and the rounds' code, 2-bit
where the budget allows rounds of 32, 4-bit below."""

from typing import Any

import pytest

from lightning_gravac import GraVAC, GraVACStrategy
from lightning_gravac.callbacks.gravac.rounds import LONG_BUDGET, MIN_ROUNDS
from lightning_gravac.launch import run_distributed


def _lengths_by_budget(rank: int, world_size: int, budgets: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    from local_steps_runs import SlowBeforeTheSwitch, _fit

    from lightning_gravac.strategies import default_controller

    default_controller._default_controller = lambda method, alone: SlowBeforeTheSwitch(1e6)
    out = {}
    for budget in budgets:
        strategy = GraVACStrategy()
        _fit(strategy, budget)
        rounds = next(c for c in strategy.lightning_module.trainer.callbacks if isinstance(c, GraVAC)).rounds
        out[budget] = {"every": rounds.every, "start": rounds.start, "rounds": strategy.outer.rounds,
                       "step": strategy.compression_state.step, "code": strategy.outer.compressor.name,
                       "cf": strategy.outer.cf, "sent": strategy.outer.sent_cf}  # fmt: skip
    return out


@pytest.mark.distributed
def test_the_first_rounds_end_counts_the_steps_left_as_lightning_does():
    # Local steps from step 1 in rounds of 4, chosen again at the first round's end (step 5) from a measured 10 ms a
    # step: rounds of 8 where they keep the fit's rounds at MIN_ROUNDS (the first and six more), rounds of 4 else.
    first_end, longer = 5, 8
    fits = first_end + longer * (MIN_ROUNDS - 1)
    ranks = run_distributed(_lengths_by_budget, timeout=300, budgets=(fits - 1, fits))
    assert ranks[0] == ranks[1]  # every rank decides alike
    short, exact = ranks[0][fits - 1], ranks[0][fits]
    assert (exact["every"], exact["start"], exact["rounds"]) == (longer, 1, MIN_ROUNDS)
    assert (short["every"], short["start"]) == (4, 1), "one step short of six more rounds of 8: the rounds stay at 4"
    assert (short["step"], exact["step"]) == (fits - 1, fits)  # the step count is the global step


@pytest.mark.distributed
def test_the_rounds_code_follows_the_budget():
    # 224 steps (7 rounds of 32) and more left at the switch (after step 1): int2 at its factor, the fit's last round
    # in int8; one step fewer: int4.
    ranks = run_distributed(_lengths_by_budget, timeout=300, budgets=(LONG_BUDGET, LONG_BUDGET + 1))
    assert ranks[0] == ranks[1]  # every rank decides alike
    short, long = ranks[0][LONG_BUDGET], ranks[0][LONG_BUDGET + 1]
    assert short["start"] == long["start"] == 1
    assert (short["code"], short["cf"], long["code"], long["cf"]) == ("int4", 8.0, "int2", 16.0)
    assert short["sent"] == long["sent"] == 4.0, "the last round goes in int8"
    assert short["every"] and long["every"], "both budgets take rounds"


def test_the_rounds_code_is_checkpointed_and_an_older_checkpoint_resumes_in_int4():
    from lightning_gravac.callbacks.gravac.rounds import Rounds

    saved = Rounds(every=32, start=1, code="int2").state_dict()
    restored = Rounds()
    restored.load_state_dict(saved)
    assert (restored.code, restored.cf) == ("int2", 16.0)
    older = {k: v for k, v in saved.items() if k != "code"}  # a checkpoint of the version before the code was kept
    restored.load_state_dict(older)
    assert (restored.code, restored.cf, restored.every) == ("int4", 8.0, 32)
