"""The unified ``lightning`` package: the same training through ``lightning.pytorch`` and ``pytorch_lightning``."""

import importlib
import inspect
from pathlib import Path

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
    from lightning_gravac._mirror import Mirror

    rewrite = Mirror().rewrite
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
    # A name that only begins like the package is another name.
    assert rewrite("lightning_gravac_cache = pytorch_lightning_x") == "lightning_gravac_cache = pytorch_lightning_x"


def _package(root, modules):
    """A ``lightning_gravac`` package under ``root`` holding ``modules`` (path relative to it: source)."""
    package = root / "lightning_gravac"
    for path, source in {"__init__.py": "", **modules}.items():
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text(source)
    return package


def test_every_module_that_reaches_lightning_is_read_for_lightning(tmp_path):
    """The list is found from the sources: a module naming ``pytorch_lightning``, or importing one that does, is read
    for ``lightning``; a module that touches neither is shared."""
    import lightning.pytorch as lpl

    from lightning_gravac._mirror import Mirror
    from lightning_gravac.lightning.zoo import TabularClassifier

    assert issubclass(TabularClassifier, lpl.LightningModule)  # a zoo model of its own module
    facing = Mirror().facing
    assert {"callbacks.gravac", "strategies.gravac", "zoo.tabular", "callbacks"} <= facing
    assert not {"compressors.topk", "state", "strategies.hook", "cli"} & facing

    # A new module: one that imports Lightning, one that imports it only through a facing module, one with neither.
    package = _package(
        tmp_path,
        {
            "extra/__init__.py": "from lightning_gravac.extra.direct import A\n",
            "extra/direct.py": "import pytorch_lightning as pl\nA = pl.Callback\n",
            "extra/through.py": "from lightning_gravac.extra import A\n",
            "extra/plain.py": "import torch\n",
        },
    )
    assert Mirror(package).facing == {"extra", "extra.direct", "extra.through"}


def test_the_lightning_flavour_is_real_files_that_tracebacks_show():
    """Its modules are files on disk, each saying at its top what it is generated from, so a traceback, a debugger
    and coverage read the code that runs."""
    import traceback

    import lightning_gravac.lightning as unified
    from lightning_gravac._mirror import GENERATED

    source = Path(inspect.getsourcefile(unified.GraVACStrategy))
    assert source.is_file() and source.parts[-3:] == ("lightning", "strategies", "gravac.py")
    text = source.read_text()
    assert text.startswith(f"{GENERATED}lightning_gravac/strategies/gravac.py")
    assert "from lightning.pytorch" in text and "pytorch_lightning." not in text
    assert inspect.getsource(unified.GraVACStrategy) in text

    # An error raised inside the strategy: its traceback names that file, at lines that hold the code that ran.
    with pytest.raises(ValueError, match="compressor") as raised:
        unified.GraVACStrategy(compressor=42)
    frames = traceback.extract_tb(raised.tb)
    assert source in {Path(frame.filename) for frame in frames}
    for frame in frames:
        assert frame.line and frame.line in Path(frame.filename).read_text().splitlines()[frame.lineno - 1]


def test_the_generated_modules_are_up_to_date_with_their_sources():
    from lightning_gravac._mirror import Mirror

    stale = Mirror().stale()
    assert not stale, f"out of date with their sources: {stale}; run `python -m lightning_gravac._mirror`"


def test_the_mirror_writes_removes_and_leaves_alone(tmp_path):
    """Written from the sources; a generated module whose source is gone is removed, with its package if emptied;
    a file written by hand stays."""
    from lightning_gravac._mirror import MIRROR, Mirror

    package = _package(
        tmp_path,
        {
            "__init__.py": "from lightning_gravac.strategies.plugin import Plugin\n",
            "strategies/__init__.py": "",
            "strategies/plugin.py": "import pytorch_lightning as pl\nfrom lightning_gravac.math import f\n",
            "gone/__init__.py": "import lightning_fabric\n",
            "math.py": "def f(): ...\n",
            f"{MIRROR}/__init__.py": "from lightning_gravac.lightning._package import *\n",
        },
    )
    mirror = Mirror(package)
    into = package / MIRROR
    assert sorted(map(str, mirror.write())) == [
        "_package.py", "gone/__init__.py", "strategies/__init__.py", "strategies/plugin.py",
    ]  # fmt: skip
    assert (into / "strategies" / "plugin.py").read_text().splitlines()[2:] == [
        "import lightning.pytorch as pl",
        "from lightning_gravac.math import f",
    ]
    assert mirror.stale() == [] and mirror.write() == []

    (package / "gone" / "__init__.py").unlink()
    (package / "gone").rmdir()
    mirror = Mirror(package)
    assert mirror.stale() == [Path("gone/__init__.py")]
    mirror.write()
    assert not (into / "gone").exists()
    assert (into / "__init__.py").read_text() == "from lightning_gravac.lightning._package import *\n"


@pytest.mark.parametrize(
    ("trainer_of", "gravac_of", "right_of"),
    [
        ("lightning.pytorch", "lightning_gravac", "lightning_gravac.lightning"),
        ("pytorch_lightning", "lightning_gravac.lightning", "lightning_gravac"),
    ],
    ids=["lightning-trainer", "pytorch_lightning-trainer"],
)
def test_a_strategy_given_to_the_other_packages_trainer_names_the_right_import(trainer_of, gravac_of, right_of):
    trainer_pl, gravac, right = map(importlib.import_module, (trainer_of, gravac_of, right_of))
    expected = rf"^GraVACStrategy from `{gravac_of}` is built on .*`from {right_of} import GraVACStrategy`\.$"
    with pytest.raises(ValueError, match=expected) as raised:
        trainer_pl.Trainer(accelerator="cpu", devices=2, strategy=gravac.GraVACStrategy("topk"), logger=False)
    assert "\n" not in str(raised.value)
    # The right pair builds as before.
    trainer = trainer_pl.Trainer(accelerator="cpu", devices=2, strategy=right.GraVACStrategy("topk"), logger=False)
    assert type(trainer.strategy) is right.GraVACStrategy


def test_a_controller_of_the_other_package_is_refused_before_a_default_joins_it():
    import lightning.pytorch as lpl

    import lightning_gravac
    import lightning_gravac.lightning as unified
    from lightning_gravac.lightning.zoo import TeacherRegression

    trainer = lpl.Trainer(strategy=unified.GraVACStrategy("topk"), callbacks=[lightning_gravac.Static(cf=2)],
                          max_steps=1, **trainer_kwargs(1))  # fmt: skip
    expected = "^Static from `lightning_gravac` is built on `pytorch_lightning`, .*`from lightning_gravac.lightning"
    with pytest.raises(ValueError, match=expected):
        trainer.fit(TeacherRegression(width=8), loader(n=64))
