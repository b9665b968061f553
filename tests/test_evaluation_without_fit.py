"""``trainer.validate``, ``test`` and ``predict`` without a ``fit`` first, under every configuration of the strategy,
through Lightning's Trainer on two gloo ranks: each runs as under stock ``DDPStrategy`` and gives its results. Outside
fit Lightning sets up no optimizer and wraps no DDP model: nothing is sent, so nothing of the strategy may ask for
one."""

from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy

from lightning_gravac import GraVAC, GraVACStrategy, LocalSteps, Static
from lightning_gravac.launch import run_distributed

from models import Tiny, tiny_loader, trainer_kwargs

pytestmark = pytest.mark.distributed

#: name -> (strategy, callbacks) for each configuration run as stock DDP's.
CONFIGURATIONS: dict[str, Callable[[], tuple[Any, list[pl.Callback]]]] = {
    "stock": lambda: (DDPStrategy(), []),
    "default": lambda: (GraVACStrategy(), []),
    "lossless": lambda: (GraVACStrategy("none"), []),
    "topk": lambda: (GraVACStrategy("topk"), [Static(cf=4)]),
    "gravac": lambda: (GraVACStrategy("topk"), [GraVAC()]),
    "model-averaging": lambda: (GraVACStrategy(model_averaging_period=2), []),
    "local-steps": lambda: (GraVACStrategy(local_steps=8), []),
    "local-steps-overlap": lambda: (GraVACStrategy(local_steps=LocalSteps(every=8, overlap=True)), []),
    "local-steps-topk": lambda: (GraVACStrategy("topk", local_steps=4), [Static(cf=1)]),
    "local-steps-no-guard": lambda: (GraVACStrategy(local_steps=LocalSteps(every=4, guard=None)), []),
}


def _evaluated(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, make in CONFIGURATIONS.items():
        results: dict[str, Any] = {}
        for stage in ("validate", "test", "predict"):
            strategy, callbacks = make()
            pl.seed_everything(0)
            trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, **trainer_kwargs(2))
            if stage == "predict":
                results[stage] = torch.cat(trainer.predict(Tiny(), tiny_loader(16)))
            else:
                results[stage] = getattr(trainer, stage)(Tiny(), tiny_loader(16), verbose=False)
        out[name] = results
    # Validated first, then fitted by the same trainer: the fit still runs its rounds.
    strategy, _ = CONFIGURATIONS["local-steps"]()
    pl.seed_everything(0)
    trainer = pl.Trainer(strategy=strategy, max_steps=8, **trainer_kwargs(2))
    model = Tiny()
    trainer.validate(model, tiny_loader(16), verbose=False)
    trainer.fit(model, tiny_loader())
    out["validated-then-fitted"] = {"rounds": strategy.outer.rounds, "steps": trainer.global_step}
    return out


def test_validate_test_and_predict_without_fit_run_as_under_stock_ddp():
    ranks = run_distributed(_evaluated, timeout=300)
    for rank in ranks:
        stock = rank["stock"]
        for name in CONFIGURATIONS:
            assert rank[name]["validate"] == stock["validate"], name
            assert rank[name]["test"] == stock["test"], name
            assert torch.equal(rank[name]["predict"], stock["predict"]), name
        assert rank["validated-then-fitted"] == {"rounds": 1, "steps": 8}
