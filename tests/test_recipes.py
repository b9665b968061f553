"""Every recipe parses; the quickstart runs as a user runs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_gravac.cli import QUICKSTART, RECIPES, cli_main, resolve_recipe

from conftest import LAUNCHER_VARIABLES

ROOT = Path(__file__).resolve().parent.parent
ALL_RECIPES = sorted(RECIPES.rglob("*.yaml"))


def test_there_are_recipes():
    assert QUICKSTART in ALL_RECIPES


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_with_lightning_cli(recipe, tmp_path):
    resolved = tmp_path / recipe.name
    resolved.write_text(yaml.safe_dump(resolve_recipe(recipe, ["trainer.logger=false"])))
    cli = cli_main(["--config", str(resolved)], run=False)
    assert type(cli.trainer.strategy).__name__ == "GraVACStrategy"


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


@pytest.mark.distributed
def test_quickstart_runs_two_steps_and_prints_the_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES} | {"OMP_NUM_THREADS": "1"}
    overrides = ["trainer.max_steps=2", "trainer.log_every_n_steps=1", f"trainer.logger.init_args.save_dir={tmp_path}"]
    cmd = [sys.executable, "recipes/run.py", *overrides]
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "traffic saved" in done.stdout
    (plot,) = tmp_path.rglob("gravac.png")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "the plot is not a PNG"
    assert list(tmp_path.rglob("metrics.csv")), "the CSV logger wrote nothing"
    header = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()[0]
    assert "gravac/bytes_sent" in header and "gravac/cf" in header
