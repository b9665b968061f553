"""Every recipe and its quick variant parse; the quickstart and every quick variant run as a user runs them."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_gravac.cli import (
    QUICKSTART,
    cli_main,
    find_recipe,
    fit_to_machine,
    list_recipes,
    quick_variant,
    resolve_recipe,
)

from conftest import LAUNCHER_VARIABLES
from wandb_offline import history

ROOT = Path(__file__).resolve().parent.parent
ALL_RECIPES = list_recipes()


def test_there_are_recipes():
    assert QUICKSTART in ALL_RECIPES


@pytest.mark.parametrize("quick", [False, True], ids=["recipe", "quick"])
@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_recipe_parses_with_lightning_cli(recipe, quick, tmp_path):
    resolved = tmp_path / f"{recipe}.yaml"
    overrides = [f"trainer.logger.init_args.save_dir={tmp_path}", f"quick={str(quick).lower()}"]
    resolved.write_text(yaml.safe_dump(resolve_recipe(recipe, overrides)))
    cli = cli_main(["--config", str(resolved)], run=False)
    assert type(cli.trainer.strategy).__name__ == "GraVACStrategy"
    assert type(cli.trainer.logger).__name__ == "WandbLogger"
    head = find_recipe(recipe).read_text().splitlines()[:4]
    assert all(line.startswith("#") for line in head), "a recipe begins with a comment giving the command"
    assert any("python -m lightning_gravac" in line for line in head) and any("=" in line for line in head[1:])


def test_recipes_are_found_by_name_by_path_and_by_the_old_repository_path(tmp_path):
    assert QUICKSTART in ALL_RECIPES and {"resnet101_cifar10", "vgg16_cifar100", "lstm_ptb"} <= set(ALL_RECIPES)
    text = find_recipe("quickstart").read_text()
    assert find_recipe("recipes/quickstart.yaml").read_text() == find_recipe("quickstart.yaml").read_text() == text
    mine = tmp_path / "mine.yaml"
    mine.write_text("trainer:\n  max_steps: 3\n")
    assert resolve_recipe(mine) == {"trainer": {"max_steps": 3}}
    with pytest.raises(FileNotFoundError, match=r"No recipe 'quickstrat': not a file, and not a packaged recipe"):
        find_recipe("quickstrat")


def test_the_module_lists_its_recipes_and_explains_its_commands(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}

    def module(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "lightning_gravac", *args]
        return subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True)

    listed = module("recipes")
    assert listed.returncode == 0, listed.stderr
    names, _, note = listed.stdout.partition("\n\n")
    assert [line.split()[0] for line in names.splitlines()] == ALL_RECIPES and "quick=true" in note
    usage = module("run")
    assert usage.returncode != 0 and "quickstart [dotted.key=value ...]" in usage.stderr
    # A typo and a recipe that does not exist answer with the tool's usage, not LightningCLI's or a traceback.
    typo, missing = module("recipe"), module("run", "quickstrat")
    assert typo.returncode != 0 and "unknown command 'recipe'" in typo.stderr and "recipes " in typo.stderr
    assert missing.returncode != 0 and "No recipe 'quickstrat'" in missing.stderr and "Traceback" not in missing.stderr
    # Help and the list answer without loading torch or Lightning (seconds of CPU): the package defers both.
    for args in (["--help"], ["recipes"]):
        timed = subprocess.run([sys.executable, "-X", "importtime", "-m", "lightning_gravac", *args], check=True,
                               cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip
        loaded = {line.split("|")[-1].strip().split(".")[0] for line in timed.stderr.splitlines() if "|" in line}
        assert not loaded & {"torch", "pytorch_lightning", "lightning"}, args
    helped = module("--help")
    assert "trainer.max_steps=5" in helped.stdout  # an override example


def _run(args: list[str], timeout: int, cwd: Path, module: bool = False) -> subprocess.CompletedProcess:
    # As a user runs it: a fresh interpreter, no launcher variables, no W&B key (so offline), one thread a rank; in a
    # directory of the test's own, where Lightning and the recipe write what they write by default.
    drop = {*LAUNCHER_VARIABLES, "WANDB_API_KEY", "WANDB_MODE"}
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1", "NETRC": "/nonexistent"}
    entry = ["-m", "lightning_gravac"] if module else [str(ROOT / "recipes" / "run.py")]
    cmd = [sys.executable, *entry, *args]
    return subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_quickstart_runs_prints_the_summary_plots_and_logs_to_wandb_offline(tmp_path):
    # As from an installed package: `python -m lightning_gravac quickstart`, in a directory of the user's.
    args = ["quickstart", "trainer.max_steps=4", "trainer.log_every_n_steps=1"]
    done = _run([*args, f"trainer.logger.init_args.save_dir={tmp_path}"], 240, module=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "traffic saved" in done.stdout
    assert "logging offline" in done.stderr and "wandb sync" in done.stderr
    # Quiet: no advertisement of Lightning's logging service, no deprecation inside Lightning twice (once a rank), no
    # W&B lines repeating the offline one, no question whether validating nothing was meant; Lightning's own stay.
    assert "litlogger" not in done.stderr and "is deprecated" not in done.stderr, done.stderr[-3000:]
    assert "wandb:" not in done.stderr and "Total length" not in done.stderr, done.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=4` reached." in done.stderr and "Trainable params" in done.stderr
    # Into a pipe: no progress bar's redraws, no colour codes (W&B's exit hook wrote them), no tables of W&B's.
    for out in (done.stdout, done.stderr):
        assert "\x1b" not in out and "\r" not in out and "Run history" not in out, out[-3000:]
    (plot,) = tmp_path.rglob("gravac.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "the plot is not a PNG"
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    rows = [r for r in history(run_dir) if "gravac/cf" in r]
    assert len(rows) == 4, "a row of gravac/* metrics a step"
    assert all(r["gravac/bytes_sent"] < r["gravac/bytes_dense"] for r in rows)
    assert {"gravac/gain", "gravac/achieved_cf", "train_loss"} <= set().union(*map(set, history(run_dir)))


@pytest.mark.parametrize(
    ("args", "module", "said"),
    [
        (["quickstart", "trainer.strategy.init_args.compressor=tpok"], True,
         "lightning_gravac: GraVACStrategy: Unknown compressor 'tpok'. Known compressors: "),
        (["quickstart", "trainer.callbacks[0].init_args.epsilon=0"], False,
         "lightning_gravac: GraVAC: `epsilon` must be in (0, 1], got 0.0"),
    ],
    ids=["compressor-by-module", "epsilon-by-run.py"],
)  # fmt: skip
def test_an_argument_a_class_refuses_is_said_in_one_line_without_the_parsers_traceback(args, module, said, tmp_path):
    done = _run(args, 120, cwd=tmp_path, module=module)
    assert done.returncode == 1, done.stderr[-3000:]
    refused = [line for line in done.stderr.splitlines() if line.startswith("lightning_gravac: ")]
    assert len(refused) == 1 and refused[0].startswith(said), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Namespace(" not in done.stderr and "Union" not in done.stderr
    assert list(tmp_path.iterdir()) == [], "a run that never logged left a W&B folder"


def test_every_recipe_has_a_quick_variant_with_validation_and_the_users_overrides_win():
    # A key the trainer, model or data do not take is refused by LightningCLI (test_recipe_parses_with_lightning_cli).
    for recipe in ALL_RECIPES:
        assert quick_variant(recipe), recipe
        quick = resolve_recipe(recipe, ["quick=true"])
        trainer = quick["trainer"]
        assert 10 <= trainer["max_steps"] <= 50 and trainer["val_check_interval"] <= trainer["max_steps"], recipe
        assert quick["data"]["init_args"].get("synthetic", True), recipe
        find_recipe(recipe).read_text().index(f"{recipe} quick=true")  # the recipe says how to run it
    mine = resolve_recipe("lstm_ptb", ["quick=true", "trainer.max_steps=12"])
    assert mine["trainer"]["max_steps"] == 12 and mine["model"]["init_args"]["hidden"] == 200
    assert resolve_recipe("lstm_ptb", ["quick=false"]) == resolve_recipe("lstm_ptb")
    with pytest.raises(ValueError, match=r"`quick` is true or false, got 'yes please'"):
        resolve_recipe("lstm_ptb", ["quick=yes please"])


def test_a_recipe_of_ones_own_takes_a_quick_variant_beside_it(tmp_path):
    (tmp_path / "mine.yaml").write_text("trainer:\n  max_steps: 3000\n")
    with pytest.raises(FileNotFoundError, match=r"No quick variant of .*mine.yaml.*quick/mine.yaml beside it"):
        resolve_recipe(tmp_path / "mine.yaml", ["quick=true"])
    (tmp_path / "quick").mkdir()
    (tmp_path / "quick" / "mine.yaml").write_text("trainer.max_steps: 30\n")
    assert resolve_recipe(tmp_path / "mine.yaml", ["quick=true"]) == {"trainer": {"max_steps": 30}}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_a_recipes_quick_variant_validates_to_a_finite_metric_on_two_cpu_processes(recipe, tmp_path):
    done = _run([recipe, "quick=true", f"trainer.logger.init_args.save_dir={tmp_path}"], 900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (monitor,) = [line.split() for line in done.stdout.splitlines() if line.startswith("val_")]
    assert math.isfinite(float(monitor[1])), done.stdout[-3000:]
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    assert any(monitor[0] in row for row in history(run_dir)), "the validation metric reached the logger"


MODEL_RECIPES = [r for r in ALL_RECIPES if r != QUICKSTART]  # run from the checkout, by `recipes/run.py NAME`


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("recipe", MODEL_RECIPES)
def test_recipe_trains_two_steps_on_synthetic_data_with_two_cpu_ranks(recipe, tmp_path):
    overrides = [
        "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=2", "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "data.init_args.synthetic=true",
        f"trainer.logger.init_args.save_dir={tmp_path}",
    ]  # fmt: skip
    if "cifar" in recipe:
        overrides.append("data.init_args.num_workers=0")
    done = _run([recipe, *overrides], 420, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "traffic saved" in done.stdout
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    assert sum("gravac/bytes_sent" in r for r in history(run_dir)) >= 1


def test_a_recipe_is_fitted_to_the_machine(capsys):
    """``devices: auto`` without a GPU would start one process, with nothing to communicate: two CPU processes
    instead; workers beyond this process's CPUs are capped; no progress bar where the output is not a terminal. An
    explicit device count and progress bar are kept."""
    import torch

    config = resolve_recipe("vgg16_cifar100", ["data.init_args.num_workers=4096"])
    fit_to_machine(config)
    if not torch.cuda.is_available():
        assert (config["trainer"]["accelerator"], config["trainer"]["devices"]) == ("cpu", 2)
    assert 1 <= config["data"]["init_args"]["num_workers"] < 4096
    said = capsys.readouterr().err
    assert "4096 data loader workers asked" in said
    # Under pytest the output is not a terminal: no progress bar, unless asked for.
    assert config["trainer"]["enable_progress_bar"] is False
    kept = resolve_recipe("vgg16_cifar100", ["trainer.devices=3", "data.init_args.num_workers=1"])
    kept["trainer"]["enable_progress_bar"] = True
    fit_to_machine(kept)
    assert kept["trainer"]["devices"] == 3 and kept["data"]["init_args"]["num_workers"] == 1
    assert kept["trainer"]["enable_progress_bar"] is True


def _rows(table: str) -> dict[str, str]:
    """A summary table's rows, name to value (the two are apart by two spaces or more)."""
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in table.splitlines() if "  " in line.strip())


def test_the_run_summary_weighs_the_factors_by_bytes_and_says_when_more_was_sent():
    from lightning_gravac import RunSummary

    def step(cf: float, sent: float) -> dict[str, float]:
        return {"gravac/cf": cf, "gravac/bytes_sent": sent, "gravac/bytes_dense": 1000.0, "train_loss": 0.5}

    summary = RunSummary()
    summary.history = [step(10.0, 100.0), step(1000.0, 1.0)]  # as asked: 101 bytes of 2000
    table = summary.table(1.0)
    rows = _rows(table)
    # Named as what it is: not the mean of 10 and 1000; and the time is the training's.
    assert rows["traffic saved"] == "19.8x" and rows["cf asked, harmonic mean"] == "19.8"
    assert rows["training time"] == "1.0 s" and "wall time" not in table
    assert "sent more on some steps" not in table
    summary.history = [step(100.0, 250.0)] + [step(100.0, 10.0)] * 3  # a warm-up step sent 25x what was asked
    assert "sent more on some steps" in summary.table(1.0)


def test_the_run_summary_says_a_metric_never_logged_was_not_measured_and_plots_what_it_has(tmp_path):
    from lightning_gravac import RunSummary

    summary = RunSummary(monitor="val_ppl")
    steps = [
        {"step": 1.0 + i, "gravac/cf": 10.0, "gravac/bytes_sent": 10.0, "gravac/bytes_dense": 100.0} for i in range(3)
    ]
    summary.history, summary.logged = steps, ["loss"]
    table = summary.table(1.0)
    rows = _rows(table)
    assert rows["val_ppl"] == "not measured" and "nan" not in table
    assert "No metric named 'val_ppl' was logged (logged: loss)" in table
    summary.save_plot(tmp_path / "gravac.png")
    assert summary.plotted == ["cf"]
    # Measured on some steps, or only when training ended (a validation after the last step): its last value.
    summary.history = [*steps[:2], {**steps[2], "val_ppl": 120.0}]
    assert "not measured" not in summary.table(1.0) and "120" in summary.table(1.0)
    summary.save_plot(tmp_path / "gravac.png")
    assert summary.plotted == ["cf", "val_ppl"]
    summary.history, summary.final = steps, 95.0
    assert {line[:14].strip(): line[14:].strip() for line in summary.table(1.0).splitlines()}["val_ppl"] == "95"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("offline", ["download", "files"])
def test_a_recipe_without_its_data_ends_with_one_line_on_rank_zero(offline, tmp_path):
    # No network (a proxy at a closed port refuses every download at once), or no files and no download.
    overrides = [
        "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=1", "data.init_args.num_workers=0",
        f"data.init_args.root={tmp_path / 'cifar10'}", f"trainer.logger.init_args.save_dir={tmp_path}",
        f"data.init_args.download={'true' if offline == 'download' else 'false'}",
    ]  # fmt: skip
    proxy = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    with pytest.MonkeyPatch.context() as env:
        for name, value in proxy.items():
            env.setenv(name, value)
            env.setenv(name.lower(), value)
        done = _run(["run", "resnet101_cifar10", *overrides], 300, module=True, cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "synthetic" in line]
    expected = "could not download" if offline == "download" else "cifar-10-batches-py/data_batch_1"
    assert len(said) == 1 and said[0].startswith("lightning_gravac: cifar10: ") and expected in said[0], said
    assert "data.init_args.synthetic=true" in said[0] or "synthetic: true" in said[0]
    # The other rank exits quietly: no traceback and no broken connection from either process.
    assert "Traceback" not in done.stderr and "Connection closed" not in done.stderr, done.stderr[-3000:]
