"""The default's first steps: nothing more aggressive than the link justifies, and a run near the edge of stability
trains as under stock DDP."""

import math

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from lightning_gravac import GraVACStrategy, RunSummary
from lightning_gravac.launch import run_distributed

from models import LinkOf, OneCycleRegression, one_cycle_loader, trainer_kwargs, weights

STEPS = 40


def _one_cycle(rank, world_size):
    out = {}
    for name, bits_per_second in [("stock", None), ("fast", 10e9), ("slow", 10e6)]:
        pl.seed_everything(0)
        model, summary = OneCycleRegression(steps=STEPS), RunSummary()
        if bits_per_second is None:
            strategy, callbacks = DDPStrategy(), []
        else:  # what the zero-argument default sends under plain SGD on a dense model, on a scripted link
            strategy, callbacks = GraVACStrategy("qsgd"), [LinkOf(bits_per_second), summary]
        trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, max_steps=STEPS, **trainer_kwargs(world_size))
        trainer.fit(model, one_cycle_loader())
        cfs = [row["gravac/cf"] for row in summary.history]
        out[name] = {"losses": model.losses, "weights": weights(model), "cfs": cfs}
        if bits_per_second is not None:
            out[name]["mildest"] = trainer.strategy.compression_state.compressor.factor_range(torch.float32)[0]
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_run_near_the_edge_of_stability_trains_as_stock_and_the_first_window_stays_mild():
    r0, r1 = run_distributed(_one_cycle, timeout=600)
    stock, fast, slow = r0["stock"], r0["fast"], r0["slow"]
    assert all(math.isfinite(loss) for loss in stock["losses"]), "stock DDP itself diverged: not the scenario"
    # A fast link: a dense step costs far less than 20 ms more than a compressed one and compression would save less
    # than a tenth of a step, so the whole run goes dense: stock DDP's run, bit for bit (its loss spikes and recovers;
    # the same run whose first three steps went as 2-bit QSGD ended NaN).
    assert fast["cfs"] == [1.0] * STEPS
    assert fast["losses"] == stock["losses"]
    assert all(torch.equal(w, stock["weights"][k]) for k, w in fast["weights"].items())
    # A slow link (10 Mbit/s): the first window (3 steps) sends the mildest factor, 8-bit QSGD, and nothing more
    # aggressive; its decisions afterwards are the cost model's.
    assert slow["cfs"][:3] == [slow["mildest"]] * 3
    assert slow["mildest"] == pytest.approx(3.969, abs=1e-3)
    # Every decision alike on both ranks.
    for name in ("fast", "slow"):
        assert r1[name]["cfs"] == r0[name]["cfs"]
