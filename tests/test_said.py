"""What a run says at fit start reads in one line: the factors named as what they are, a loopback not taken for a
network, the link's speed with the spread of the timings it is the best of."""

import logging
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
import torch
from lightning_utilities.core import rank_zero

from lightning_gravac import GraVAC, GraVACStrategy
from lightning_gravac.callbacks.gravac.ladder import Ladder
from lightning_gravac.callbacks.gravac.link_timer import LinkTimer, loopback_note
from lightning_gravac.launch import run_distributed
from lightning_gravac.state import ring_share
from lightning_gravac.zoo import TeacherRegression

from models import loader, trainer_kwargs


def test_the_factors_said_at_fit_start_say_what_a_factor_is(caplog):
    ladder = Ladder.between(10.0, 1000.0, "exponential", {"cf_min": True, "cf_max": True})
    with caplog.at_level("INFO"):
        assert ladder.fit_bounds((3.97, 15.5), largest=1 << 20, method="qsgd")
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("GraVAC: the factors it chooses among when it compresses: cf 3.97, 7.94, 15.5 (")
    assert "a factor is dense bytes over bytes sent; 'qsgd' sends from 3.97 to 15.5" in said


def test_a_link_within_one_machine_is_said_to_be_a_loopback():
    note = loopback_note(SimpleNamespace(num_nodes=1))
    assert "a loopback, not a network" in note and "load" in note
    assert loopback_note(SimpleNamespace(num_nodes=2)) == ""


#: Each rank's three timings of an all-reduce, as multiples of a 100 Mbit/s link's: each rank's best is the link's.
SCRIPTED_RUNS = ((1.0, 1.2, 1.1), (1.05, 1.0, 1.3))


class ScriptedTimer(LinkTimer):
    """The link timer on a scripted 100 Mbit/s link of 100 us a message: its timings are :data:`SCRIPTED_RUNS`'s, its
    reductions over the ranks real."""

    def timed(self, nbytes: int, dtype: torch.dtype) -> float:
        self.nbytes = nbytes
        return super().timed(nbytes, dtype)

    def runs_of_three(self, work: Callable[[], object]) -> list[float]:
        moved = ring_share(self.world_size) * self.nbytes
        return [1e-4 + moved * 8 / 100e6 * f for f in SCRIPTED_RUNS[torch.distributed.get_rank()]]


class OnScriptedTimer(GraVAC):
    def _link_timer(self, trainer: pl.Trainer) -> LinkTimer:
        if self._timer is None:
            self._timer = ScriptedTimer(
                trainer, None, lambda v: self._all_reduce(trainer, v, torch.distributed.ReduceOp.MAX)
            )
        return self._timer


def _said_at_fit_start(rank: int, world_size: int) -> list[str]:
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    rank_zero.log.addHandler(handler)  # where rank_zero_info writes (Lightning's logger, once it is imported)
    trainer = pl.Trainer(strategy=GraVACStrategy("qsgd"), callbacks=[OnScriptedTimer()], max_steps=1,
                         **trainer_kwargs(world_size))  # fmt: skip
    trainer.fit(TeacherRegression(), loader())
    return [line for line in said if "link measured at fit start" in line]


@pytest.mark.distributed
def test_the_link_is_said_with_the_spread_of_the_timings_it_is_the_best_of():
    said, nothing = run_distributed(_said_at_fit_start, timeout=300)
    assert nothing == []  # rank 0 says it
    # Each run is the slowest rank's (1.05, 1.2 and 1.3 times the link's time): 95, 83 and 77 Mbit/s.
    (line,) = said
    assert "100 us a message, 100 Mbit/s, the best of 3 timings that ranged 77-95" in line, line
