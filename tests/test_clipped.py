"""A trainer that clips gradients under SGD: the default sends 8-bit block codes with error feedback every step, held
against dense and fp16 by the link, and takes no local steps; on a budget under ``CLIPPED_CODE_BUDGET`` steps, dense."""

import pytest
import pytorch_lightning as pl

from lightning_gravac import GraVACStrategy, RunSummary
from lightning_gravac.callbacks.gravac.hold import CLIPPED_CODE_BUDGET
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo import TeacherRegression

from models import LinkOf, loader, trainer_kwargs


def _clipped(rank, world_size, bits_per_second, clip, steps=CLIPPED_CODE_BUDGET):
    from lightning_gravac.strategies import default_controller

    # The zero-argument default, its controller's link scripted.
    default_controller._default_controller = lambda method, alone: LinkOf(bits_per_second)
    pl.seed_everything(0)
    summary, strategy = RunSummary(), GraVACStrategy()
    trainer = pl.Trainer(strategy=strategy, callbacks=[summary], max_steps=steps, gradient_clip_val=clip,
                         **trainer_kwargs(world_size))  # fmt: skip
    trainer.fit(TeacherRegression(width=64), loader())
    return strategy.compressor.name, [r["gravac/cf"] for r in summary.history], strategy.outer.config is not None


@pytest.mark.distributed
def test_clipped_sgd_sends_block_codes_every_step_and_no_rounds():
    # A slow link: without clipping the default sends QSGD and switches to local steps; clipped, int8 every step.
    for method, cfs, rounds in run_distributed(_clipped, bits_per_second=1e6, clip=0.25, timeout=300):
        assert (method, set(cfs), rounds) == ("int8", {4.0}, False), (method, cfs)
    unclipped = run_distributed(_clipped, bits_per_second=1e6, clip=None, steps=40, timeout=300)
    assert all(method == "qsgd" and rounds for method, _, rounds in unclipped)
    # A budget one step short: every step dense, however slow the link.
    for method, cfs, rounds in run_distributed(_clipped, bits_per_second=1e6, clip=0.25, steps=CLIPPED_CODE_BUDGET - 1,
                                               timeout=300):  # fmt: skip
        assert (method, set(cfs), rounds) == ("int8", {1.0}, False), (method, cfs)
    # A fast link: dense once the first window has measured a step's computation.
    for method, cfs, _ in run_distributed(_clipped, bits_per_second=1e11, clip=0.25, steps=40, timeout=300):
        assert method == "int8" and set(cfs[3:]) == {1.0}, cfs
