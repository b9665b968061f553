"""The unified ``lightning`` package: the same training through ``lightning.pytorch`` and ``pytorch_lightning``."""

import importlib

import pytest
import torch

from lightning_gravac.launch import run_distributed

from models import loader, trainer_kwargs, weights

pytest.importorskip("lightning")


def _train(rank, world_size, flavour, controller):
    """Top-K through ``flavour``'s Trainer (``lightning.pytorch`` or ``pytorch_lightning``), 12 steps, 2 ranks."""
    pl = importlib.import_module(flavour)
    gravac = importlib.import_module(
        "lightning_gravac.lightning" if flavour == "lightning.pytorch" else "lightning_gravac"
    )
    zoo = importlib.import_module(f"{gravac.__name__}.zoo")
    pl.seed_everything(0)
    model = zoo.TeacherRegression(width=64, lr=0.05, momentum=0.9)
    summary = gravac.RunSummary()
    callbacks = [summary] if controller == "default" else [gravac.Static(cf=4), summary]
    trainer = pl.Trainer(strategy=gravac.GraVACStrategy("topk"), callbacks=callbacks, max_steps=12,
                         **trainer_kwargs(world_size))  # fmt: skip
    trainer.fit(model, loader())
    return {
        "weights": weights(model),
        "cf": [r["gravac/cf"] for r in summary.history],
        "metrics": sorted(k for k in trainer.callback_metrics if k.startswith("gravac/")),
        "trainer": type(trainer).__module__,
        "strategy": type(trainer.strategy).__module__,
    }


@pytest.mark.distributed
def test_both_packages_train_alike_bit_for_bit():
    unified = run_distributed(_train, flavour="lightning.pytorch", controller="static", timeout=300)
    classic = run_distributed(_train, flavour="pytorch_lightning", controller="static", timeout=300)
    assert unified[0]["trainer"].startswith("lightning.pytorch")
    assert unified[0]["strategy"] == "lightning_gravac.lightning.strategies.gravac"
    assert classic[0]["strategy"] == "lightning_gravac.strategies.gravac"
    for a, b in zip(unified, classic, strict=True):
        assert a["cf"] == b["cf"] == [4.0] * 12
        assert a["metrics"] == b["metrics"] and "gravac/bytes_sent" in a["metrics"]
        for name, tensor in a["weights"].items():
            assert torch.equal(tensor, b["weights"][name]), f"{name} differs between the two packages"
    for name, tensor in unified[0]["weights"].items():
        assert torch.equal(tensor, unified[1]["weights"][name]), f"{name} differs between ranks"


@pytest.mark.distributed
def test_the_default_controller_and_the_registry_name_under_lightning():
    ranks = run_distributed(_train, flavour="lightning.pytorch", controller="default", timeout=300)
    assert ranks[0]["cf"] == ranks[1]["cf"] and len(ranks[0]["cf"]) == 12
    import lightning.pytorch as lpl

    import lightning_gravac.lightning  # noqa: F401  (registers "gravac" in lightning.pytorch's registry)

    assert "gravac" in lpl.strategies.StrategyRegistry


def test_a_lightning_facing_module_is_read_for_lightning_and_a_shared_one_is_not():
    from lightning_gravac.lightning import rewrite

    source = (
        "import pytorch_lightning as pl\nfrom lightning_fabric.utilities import rank_zero_only\n"
        "from lightning_gravac.callbacks.controller import Controller\n"
        "from lightning_gravac.state import StepStats\nfrom lightning_gravac import GraVAC\n"
    )
    assert rewrite(source) == (
        "import lightning.pytorch as pl\nfrom lightning.fabric.utilities import rank_zero_only\n"
        "from lightning_gravac.lightning.callbacks.controller import Controller\n"
        "from lightning_gravac.state import StepStats\nfrom lightning_gravac.lightning import GraVAC\n"
    )
    import lightning_gravac
    import lightning_gravac.lightning as unified

    # The compressors and the hook's state are shared: one class each, whichever package a user trains with.
    assert unified.get_compressor is lightning_gravac.get_compressor
    assert unified.CompressionState is lightning_gravac.CompressionState
    assert unified.GraVACStrategy is not lightning_gravac.GraVACStrategy
    # A shared module asked for under the unified name is the shared module itself, not a second copy.
    from lightning_gravac.lightning import compressors

    assert compressors is lightning_gravac.compressors
    assert rewrite("lightning_gravac.callbacks.gravac.GraVAC") == "lightning_gravac.lightning.callbacks.gravac.GraVAC"


def test_every_module_that_reaches_lightning_is_read_for_lightning(tmp_path, monkeypatch):
    """The list is found from the sources: a module naming ``pytorch_lightning``, or importing one that does, is read
    for ``lightning``; a module that touches neither is shared."""
    import lightning.pytorch as lpl

    import lightning_gravac.lightning as unified
    from lightning_gravac.lightning.zoo import TabularClassifier

    assert issubclass(TabularClassifier, lpl.LightningModule)  # a zoo model of its own module
    assert {"callbacks.gravac", "strategies.gravac", "zoo.tabular", "callbacks"} <= unified.LIGHTNING_FACING
    assert not {"compressors.topk", "state", "strategies.hook", "cli"} & unified.LIGHTNING_FACING

    # A new module: one that imports Lightning, one that imports it only through a facing module, one with neither.
    package = tmp_path / "lightning_gravac"
    (package / "extra").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "extra" / "__init__.py").write_text("from lightning_gravac.extra.direct import A\n")
    (package / "extra" / "direct.py").write_text("import pytorch_lightning as pl\nA = pl.Callback\n")
    (package / "extra" / "through.py").write_text("from lightning_gravac.extra import A\n")
    (package / "extra" / "plain.py").write_text("import torch\n")
    monkeypatch.setattr(unified, "_ROOT", package)
    assert unified.lightning_facing() == {"extra", "extra.direct", "extra.through"}
