"""torch.compile inside a LightningModule, with GraVACStrategy at cf 1 and at cf 100."""

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from lightning_gravac import GraVACStrategy, Static
from lightning_gravac.launch import run_distributed

from models import CompiledMLP, loader, trainer_kwargs, weights


def _compiled(rank, world_size):
    out = {}
    for name, strategy, controllers in [
        ("stock", DDPStrategy(), []),
        ("cf1", GraVACStrategy("topk"), [Static(cf=1)]),
        ("cf100", GraVACStrategy("topk"), [Static(cf=100)]),
    ]:
        pl.seed_everything(0)
        model = CompiledMLP()
        trainer = pl.Trainer(strategy=strategy, callbacks=controllers, max_steps=5, **trainer_kwargs(world_size))
        trainer.fit(model, loader())
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gravac/")}
        out[name] = {"weights": weights(model), "metrics": metrics}
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_compiled_model_trains_as_stock_ddp_at_cf1_and_compresses_at_cf100():
    ranks = run_distributed(_compiled, timeout=400)
    for r in ranks:
        for name, w in r["stock"]["weights"].items():
            assert torch.equal(w, r["cf1"]["weights"][name]), name
        assert r["cf100"]["metrics"]["gravac/cf"] == 100
        assert r["cf100"]["metrics"]["gravac/bytes_sent"] < r["cf100"]["metrics"]["gravac/bytes_dense"] / 50
    for name, w in ranks[0]["cf100"]["weights"].items():
        assert torch.equal(w, ranks[1]["cf100"]["weights"][name]), name
    first = next(iter(ranks[0]["stock"]["weights"]))  # the compiled module's keys: net._orig_mod.0.weight, ...
    assert not torch.equal(ranks[0]["cf100"]["weights"][first], ranks[0]["stock"]["weights"][first])
