"""Adam-like optimizers: the default holds dense, an explicit factor warns, and the user can ask to compress."""

import warnings

import pytest
import pytorch_lightning as pl
import torch

from lightning_gravac import GraVAC, GraVACStrategy, RunSummary, Static
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo import TeacherRegression

from models import loader, trainer_kwargs


class AdamW(TeacherRegression):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(rank, world_size, optimizer, controller, compressor):
    pl.seed_everything(0)
    model = AdamW(width=64) if optimizer == "adamw" else TeacherRegression(width=64, momentum=0.9)
    summary = RunSummary()
    callbacks = {"default": [], "compress": [GraVAC(adam="compress")], "static": [Static(cf=10)]}[controller]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(strategy=GraVACStrategy(compressor), callbacks=[*callbacks, summary], max_steps=8,
                             **trainer_kwargs(world_size))  # fmt: skip
        trainer.fit(model, loader())
    said = [str(w.message) for w in caught if "second moment" in str(w.message)]
    return {"cf": [r["gravac/cf"] for r in summary.history], "said": said}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("optimizer", "controller", "compressor", "dense", "warned"),
    [
        ("adamw", "default", "topk", True, True),  # held dense, and said so
        ("adamw", "compress", "topk", False, True),  # asked to compress: it does, with the warning
        ("adamw", "static", "topk", False, True),  # an explicit factor is kept, with the warning
        ("adamw", "default", "fp16", False, False),  # a cast is safe with Adam: held at its factor, no warning
        ("sgd", "default", "topk", False, False),  # SGD: the default compresses, nothing said
    ],
)
def test_adam_like_optimizers_get_dense_or_a_warning(optimizer, controller, compressor, dense, warned):
    ranks = run_distributed(_fit, optimizer=optimizer, controller=controller, compressor=compressor, timeout=120)
    for rank in ranks:
        assert len(rank["cf"]) == 8
        assert all(cf == 1.0 for cf in rank["cf"]) == dense, rank["cf"]
    assert bool(ranks[0]["said"]) == warned, ranks[0]["said"]
    assert ranks[0]["cf"] == ranks[1]["cf"]
