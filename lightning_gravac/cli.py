"""The command line: LightningCLI over any LightningModule and DataModule, with recipes resolved by omegaconf."""

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from pytorch_lightning.cli import LightningCLI

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
QUICKSTART = RECIPES / "quickstart.yaml"


def cli_main(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI:
    """``python -m lightning_gravac fit --config recipe.yaml``: the LightningCLI, models and data by class path."""
    import lightning_gravac  # noqa: F401 - registers the "gravac" strategy names

    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=list(args) if args is not None else None,
        run=run,
    )


def resolve_recipe(path: str | Path, overrides: Sequence[str] = ()) -> dict:
    """Load a recipe yaml with omegaconf, apply ``dotted.key=value`` overrides and resolve interpolations.

    A key may index a list (``trainer.callbacks[0].init_args.omega=0.5``); a value is read as yaml (``1e-3``,
    ``[1, 2]``, ``null``, ``{class_path: ..., init_args: {...}}``, which replaces the node whole).
    """
    config = OmegaConf.load(path)
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key:
            raise ValueError(f"An override is `dotted.key=value`, got {override!r}.")
        # `update` walks list indices, which a merge of `OmegaConf.from_dotlist` cannot. A mapping replaces the node
        # (`trainer.logger={class_path: ..., init_args: ...}` swaps the logger, none of the old arguments stay).
        parsed = yaml.safe_load(value)
        OmegaConf.update(config, key, parsed, merge=not isinstance(parsed, dict))
    resolved = OmegaConf.to_container(config, resolve=True)
    assert isinstance(resolved, dict)
    return resolved


def run_recipe(argv: Sequence[str]) -> None:
    """``recipes/run.py [recipe.yaml] [dotted.key=value ...]``: resolve the recipe, then fit it with the CLI."""
    paths = [a for a in argv if "=" not in a]
    if len(paths) > 1:
        raise SystemExit(f"usage: run.py [recipe.yaml] [dotted.key=value ...]; got several recipes: {paths}")
    recipe = Path(paths[0]) if paths else QUICKSTART
    config = resolve_recipe(recipe, [a for a in argv if "=" in a])
    # LightningCLI reads files; the resolved recipe goes to one the other ranks can read too (Lightning
    # re-executes this command line for them, which resolves the same file again).
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=f"{recipe.stem}-", delete=False) as f:
        f.write(OmegaConf.to_yaml(config))
    try:
        cli_main(["fit", "--config", f.name])
    finally:
        Path(f.name).unlink(missing_ok=True)


if __name__ == "__main__":
    run_recipe(sys.argv[1:])
