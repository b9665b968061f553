"""Every recipe parses; the quickstart runs as a user runs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_gravac.cli import QUICKSTART, RECIPES, cli_main, resolve_recipe

from conftest import LAUNCHER_VARIABLES
from wandb_offline import history

ROOT = Path(__file__).resolve().parent.parent
ALL_RECIPES = sorted(RECIPES.rglob("*.yaml"))


def test_there_are_recipes():
    assert QUICKSTART in ALL_RECIPES


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_with_lightning_cli(recipe, tmp_path):
    resolved = tmp_path / recipe.name
    resolved.write_text(yaml.safe_dump(resolve_recipe(recipe, [f"trainer.logger.init_args.save_dir={tmp_path}"])))
    cli = cli_main(["--config", str(resolved)], run=False)
    assert type(cli.trainer.strategy).__name__ == "GraVACStrategy"
    assert type(cli.trainer.logger).__name__ == "WandbLogger"
    head = recipe.read_text().splitlines()[:4]
    assert all(line.startswith("#") for line in head), "a recipe begins with a comment giving the command"
    assert any("python recipes/run.py" in line for line in head) and any("=" in line for line in head[1:])


def test_a_mapping_override_replaces_the_node_whole():
    csv = "trainer.logger={class_path: pytorch_lightning.loggers.CSVLogger, init_args: {save_dir: runs}}"
    logger = resolve_recipe(QUICKSTART, [csv])["trainer"]["logger"]
    assert logger == {"class_path": "pytorch_lightning.loggers.CSVLogger", "init_args": {"save_dir": "runs"}}


def test_overrides_are_dotted_and_interpolations_resolve(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("steps: 7\ntrainer:\n  max_steps: ${steps}\n  devices: 2\n")
    assert resolve_recipe(recipe, ["steps=3"])["trainer"] == {"max_steps": 3, "devices": 2}


def test_overrides_reach_into_lists_and_read_yaml_values():
    resolved = resolve_recipe(QUICKSTART, ["trainer.callbacks[0].init_args.omega=0.5", "trainer.devices=[0, 1]"])
    assert resolved["trainer"]["callbacks"][0]["init_args"]["omega"] == 0.5
    assert resolved["trainer"]["devices"] == [0, 1]
    with pytest.raises(ValueError, match=r"An override is `dotted.key=value`, got 'trainer.max_steps'"):
        resolve_recipe(QUICKSTART, ["trainer.max_steps"])


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    # As a user runs it: a fresh interpreter, no launcher variables, no W&B key (so offline), one thread a rank.
    drop = {*LAUNCHER_VARIABLES, "WANDB_API_KEY", "WANDB_MODE"}
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1", "NETRC": "/nonexistent"}
    cmd = [sys.executable, "recipes/run.py", *args]
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
def test_quickstart_runs_prints_the_summary_plots_and_logs_to_wandb_offline(tmp_path):
    done = _run(
        ["trainer.max_steps=4", "trainer.log_every_n_steps=1", f"trainer.logger.init_args.save_dir={tmp_path}"], 240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "traffic saved" in done.stdout
    assert "logging offline" in done.stderr and "wandb sync" in done.stderr
    (plot,) = tmp_path.rglob("gravac.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "the plot is not a PNG"
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    rows = [r for r in history(run_dir) if "gravac/cf" in r]
    assert len(rows) == 4, "a row of gravac/* metrics a step"
    assert all(r["gravac/bytes_sent"] < r["gravac/bytes_dense"] for r in rows)
    assert {"gravac/gain", "gravac/achieved_cf", "train_loss"} <= set().union(*map(set, history(run_dir)))


MODEL_RECIPES = [r for r in ALL_RECIPES if r != QUICKSTART]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("recipe", MODEL_RECIPES, ids=lambda p: p.stem)
def test_recipe_trains_two_steps_on_synthetic_data_with_two_cpu_ranks(recipe, tmp_path):
    overrides = [
        "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=2", "trainer.limit_val_batches=1",
        "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "data.init_args.synthetic=true",
        f"trainer.logger.init_args.save_dir={tmp_path}",
    ]  # fmt: skip
    if "cifar" in recipe.stem:
        overrides.append("data.init_args.num_workers=0")
    done = _run([str(recipe), *overrides], 420)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "traffic saved" in done.stdout
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    assert sum("gravac/bytes_sent" in r for r in history(run_dir)) >= 1
