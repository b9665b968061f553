"""Static says at fit start, once, when its factor is expected to end the run behind dense training, and what keeps
dense's result instead; never for a method that sends every entry every step."""

import math
import warnings

import pytest
import pytorch_lightning as pl
import torch

from lightning_gravac import GraVACStrategy, Static, get_compressor
from lightning_gravac.adaptations import MomentumCorrection
from lightning_gravac.adaptations.momentum import SGDMomentum
from lightning_gravac.callbacks.static import MIN_SHARE, share_of_dense
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo import TeacherRegression

from models import loader, trainer_kwargs


def _momentum(masking: bool, momentum: float = 0.9) -> MomentumCorrection:
    part = MomentumCorrection(masking=masking)
    part.settings["w"] = SGDMomentum(momentum)
    return part


@pytest.mark.parametrize(
    ("cf", "steps", "masking", "behind"),
    [
        (10, 96, True, True),  # the README's old example: 1.87x dense's loss at 96 steps
        (10, 96, False, True),  # +19%: each entry still waits 20 of the 96 steps
        (10, 240, False, False),
        (100, 96, True, True),  # an entry waits 200 steps, longer than the run
        (100, 20_000, True, False),
        (1, 96, True, False),  # dense
    ],
    ids=str,
)
def test_top_k_share_of_dense_progress(cf, steps, masking, behind):
    share = share_of_dense(get_compressor("topk"), _momentum(masking), cf, torch.float32, steps)
    assert 0.0 <= share <= 1.0
    assert (share < MIN_SHARE) is behind


def test_masking_costs_the_share_it_keeps_of_momentum_and_an_unknown_length_nothing():
    topk = get_compressor("topk")
    masked, free = (share_of_dense(topk, _momentum(m), 10, torch.float32, 96) for m in (True, False))
    assert masked < free == pytest.approx(1 - 20 / 96)
    assert share_of_dense(topk, _momentum(True), 10, torch.float32, math.inf) == 1.0


@pytest.mark.parametrize("name", ["int8", "int4", "qsgd", "fp16", "powersgd"])
def test_a_method_that_sends_every_entry_every_step_keeps_the_whole_share(name):
    assert share_of_dense(get_compressor(name), _momentum(True), 8, torch.float32, 10) == 1.0


class _StopAfterTwo(pl.Callback):
    """Ends the fit after two steps, whatever length it was asked for (which is what Static reads)."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        trainer.should_stop = trainer.global_step >= 2


def _fit_said(rank, world_size, runs):
    said = {}
    for name, method, cf, steps in runs:
        pl.seed_everything(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = pl.Trainer(strategy=GraVACStrategy(method), callbacks=[Static(cf=cf), _StopAfterTwo()],
                                 max_steps=steps, **trainer_kwargs(world_size))  # fmt: skip
            trainer.fit(TeacherRegression(lr=0.05, momentum=0.9), loader(n=1024))
        said[name] = [str(w.message) for w in caught if "Static:" in str(w.message)]
    return said


@pytest.mark.distributed
def test_static_says_once_at_fit_start_when_its_factor_ends_behind_dense():
    runs = [("short", "topk", 10, 12), ("long", "topk", 2, 400_000), ("int8", "int8", 3.9, 12)]
    r0, r1 = run_distributed(_fit_said, runs=runs, timeout=300)
    (said,) = r0["short"]
    assert "'topk' at cf 10 is expected to end behind dense" in said
    assert "longer than the run's 12" in said and "GraVACStrategy('int8')" in said
    assert r0["int8"] == [] and r1["short"] == []  # rank 0 says it
    # A long run at a mild factor: the wait is nothing, but masking keeps 23% of momentum's step at cf 2.
    (long,) = r0["long"]
    assert "masking keeps 23%" in long and long.endswith("or `momentum_masking=False`.")
