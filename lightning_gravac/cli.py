"""The command line: LightningCLI over any LightningModule and DataModule, with recipes resolved by omegaconf."""

import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml
from omegaconf import OmegaConf

from lightning_gravac.missing_data import MissingData

if sys.version_info >= (3, 11):
    from importlib.resources.abc import Traversable
else:  # its home before 3.11 (and gone from there in later versions)
    from importlib.abc import Traversable
if TYPE_CHECKING:
    from pytorch_lightning.cli import LightningCLI

#: The recipes shipped inside the package (package data), so that an installed wheel runs them from any directory.
RECIPES: Traversable = resources.files("lightning_gravac") / "recipes"
QUICKSTART = "quickstart"
#: The override that runs a recipe's quick variant, and the folder beside the recipes that holds their overrides.
QUICK = "quick"


def list_recipes() -> list[str]:
    """The names of the packaged recipes."""
    return sorted(p.name.removesuffix(".yaml") for p in RECIPES.iterdir() if p.name.endswith(".yaml"))


def find_recipe(recipe: str | Path) -> Traversable:
    """A recipe file: an existing path, or the name of a packaged recipe (``quickstart``, ``lstm_ptb.yaml``, or the
    ``recipes/<name>.yaml`` of older instructions)."""
    if Path(recipe).is_file():
        return Path(recipe)
    name = Path(recipe).name.removesuffix(".yaml")
    if name not in list_recipes():
        raise FileNotFoundError(
            f"No recipe {str(recipe)!r}: not a file, and not a packaged recipe ({', '.join(list_recipes())})."
        )
    return RECIPES / f"{name}.yaml"


class RefusedArgument(ValueError):
    """A class of this package refused an argument the configuration gave it: its own one-line message, with the
    class's name, in place of the argument parser's traceback around it."""


class _Instantiator:
    """Builds the classes a configuration names (a jsonargparse instantiator), keeping the first error a class of this
    package raises: jsonargparse folds it into an error of its own, where a bad compressor's name is line 62 of 64."""

    def __init__(self) -> None:
        self.refused: RefusedArgument | None = None

    def __call__(self, class_type: type, *args: Any, **kwargs: Any) -> Any:
        try:
            return class_type(*args, **kwargs)
        except Exception as error:
            if self.refused is None and class_type.__module__.partition(".")[0] == __package__:
                said = str(error).removeprefix(f"{class_type.__name__}: ")  # a message that names its class already
                self.refused = RefusedArgument(f"{class_type.__name__}: {said}")
            raise


def _no_advertisement(record: logging.LogRecord) -> bool:
    """Lightning's tip to install its cloud logger, at every Trainer: not about the run."""
    return "try installing [litlogger]" not in record.getMessage()


def cli_main(args: Sequence[str] | None = None, run: bool = True, recipe: str | None = None) -> "LightningCLI":
    """``python -m lightning_gravac fit --config recipe.yaml``: the LightningCLI, models and data by class path.

    With ``recipe`` (its name), a configuration the parser rejects (a key Lightning's ``fit`` does not take, a value of
    the wrong type) ends the run with the parser's message, not the usage of LightningCLI's flags, which a recipe's
    ``dotted.key=value`` overrides never wrote.

    Raises:
        RefusedArgument: when a class of this package refuses an argument of the configuration.
    """
    # Imported here, not at the top: `--help` and `recipes` answer without torch and Lightning (seconds of CPU).
    from pytorch_lightning.cli import LightningArgumentParser, LightningCLI  # noqa: PLC0415

    from lightning_gravac import register_strategies  # noqa: PLC0415

    instantiator = _Instantiator()

    class CLI(LightningCLI):
        def before_instantiate_classes(self) -> None:
            # After Lightning's own instantiators (models and data modules), which stay first for their classes.
            self.parser.add_instantiator(instantiator, object)

    class RecipeParser(LightningArgumentParser):
        def error(self, message: str, ex: Exception | None = None) -> NoReturn:
            # Where the parser would exit (not in the inner parsers it tries a union's types with), a SystemExit as
            # its own: nothing between here and the command catches it.
            if not self.exit_on_error:
                super().error(message, ex)
            raise SystemExit(_unparsed(recipe or "", message))

    register_strategies()  # the "gravac" names, for a recipe that asks for the strategy by name
    logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(_no_advertisement)
    with warnings.catch_warnings():
        # LightningCLI warns whenever `args` is given, in case a script meant its own command line; here it is meant:
        # the resolved recipe, or the arguments after `python -m lightning_gravac`.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        # Lightning's own call of an API newer torch deprecates, once a rank: nothing a run's user can change.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        # An empty list of validation loaders is how a recipe's data module says it holds nothing out (the teacher's at
        # `val_n=0`): Lightning skips validation and asks whether that was meant. An empty loader is still said.
        warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")
        try:
            cli = CLI(
                subclass_mode_model=True,
                subclass_mode_data=True,
                save_config_kwargs={"overwrite": True},
                parser_class=RecipeParser if recipe is not None else LightningArgumentParser,
                args=list(args) if args is not None else None,
                run=run,
            )
            _finish_wandb()
            return cli
        except Exception as error:
            refused = instantiator.refused
            # The parser's error quotes the refusal it stopped on; one it recovered from (another type of a union
            # that fitted) is not the cause.
            if refused is None or str(refused).partition(": ")[2] not in str(error):
                raise
            raise refused from None


def _unparsed(recipe: str, message: str) -> str:
    """The parser's ``message`` on a recipe, as this tool says it: the key the user wrote, not LightningCLI's option."""
    unknown = re.fullmatch(r"Subcommand '\w+' does not accept option '(.+)'", message.strip())
    # A class's argument that its signature lacks: jsonargparse says it inside each type of the key's union.
    pattern = r"Parser key \"(.+?)\":.*class_path '([\w.]+)':\s+Option '(\w+)' is not accepted"
    refused = re.search(pattern, message, re.S)
    if unknown:
        said = f"no key {unknown[1]!r} (check its spelling)"
    elif refused:
        key, path, option = refused.groups()
        said = f"{path.rpartition('.')[2]} takes no argument {option!r} (under {key!r}; check its spelling)"
    else:
        said = message.strip()
    return f"lightning_gravac: {recipe}: {said}\nThe keys and their types: python -m lightning_gravac fit --help"


def _finish_wandb() -> None:
    """End the W&B run a command started, if any, before the interpreter's exit: W&B's own exit hook says where the run
    is in colour codes whether or not the output is a terminal, where its ``finish`` writes them to a terminal only.
    (Lightning's logger leaves the run open on purpose, for a script that logs after ``fit``; a command ends here.)"""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def resolve_recipe(recipe: str | Path, overrides: Sequence[str] = ()) -> dict:
    """Load a recipe yaml (a path or a packaged recipe's name) with omegaconf, apply ``dotted.key=value`` overrides
    and resolve interpolations.

    A key may index a list (``trainer.callbacks[0].init_args.omega=0.5``); a value is read as yaml (``1e-3``,
    ``[1, 2]``, ``null``, ``{class_path: ..., init_args: {...}}``, which replaces the node whole). ``quick=true``
    applies the recipe's quick variant (:func:`quick_variant`) before the other overrides.

    Raises:
        ValueError: for an override that is not ``dotted.key=value``, or a ``quick`` that is not true or false.
    """
    config = OmegaConf.create(find_recipe(recipe).read_text())
    pairs = [_override(override) for override in overrides]
    quick = [value for key, value in pairs if key == QUICK]
    if quick and not isinstance(quick[-1], bool):
        raise ValueError(f"`{QUICK}` is true or false, got {quick[-1]!r}.")
    pairs = [*(quick_variant(recipe) if quick and quick[-1] else []), *((k, v) for k, v in pairs if k != QUICK)]
    for key, parsed in pairs:
        # `update` walks list indices, which a merge of `OmegaConf.from_dotlist` cannot. A mapping replaces the node
        # (`trainer.logger={class_path: ..., init_args: ...}` swaps the logger, none of the old arguments stay).
        OmegaConf.update(config, key, parsed, merge=not isinstance(parsed, dict))
    resolved = OmegaConf.to_container(config, resolve=True)
    assert isinstance(resolved, dict)
    return resolved


def _override(override: str) -> tuple[str, Any]:
    """``dotted.key=value`` as the key and the value read as yaml."""
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise ValueError(f"An override is `dotted.key=value`, got {override!r}.")
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or "not yaml"
        raise ValueError(f"The value of {override!r} is read as yaml, and it is not: {problem}.") from None


def quick_variant(recipe: str | Path) -> list[tuple[str, Any]]:
    """The overrides of ``recipe``'s quick variant (``quick=true``): ``quick/<name>.yaml`` beside the recipe, a
    mapping of dotted keys to values that makes a run of a few dozen steps with validation, on synthetic data and a
    model small enough for a few minutes on two CPU cores.

    Raises:
        FileNotFoundError: when the recipe has none.
    """
    path = find_recipe(recipe)
    quick = (path.parent if isinstance(path, Path) else RECIPES) / QUICK / path.name
    if not quick.is_file():
        raise FileNotFoundError(f"No quick variant of {str(recipe)!r}: {QUICK}/{path.name} beside it gives one.")
    return list(yaml.safe_load(quick.read_text()).items())


def fit_to_machine(config: dict) -> None:
    """Fit a recipe's ``devices: auto``, data loader workers and progress bar to this machine, in place, and say so.

    Without a GPU, Lightning's ``devices: auto`` starts one CPU process, which has nothing to communicate: a recipe
    then starts two, so that it trains data-parallel as it would on GPUs. Workers are capped at the CPUs this process
    may use (the DataLoader warns above that). Where the output is not a terminal (a file, a pipe, a job's log), the
    progress bar, whose redraws are carriage returns and cursor codes there, is off unless the recipe or an override
    asks for it (``trainer.enable_progress_bar=true``).
    """
    trainer, data = config.get("trainer") or {}, (config.get("data") or {}).get("init_args") or {}
    if "enable_progress_bar" not in trainer and not sys.stderr.isatty():
        config["trainer"] = trainer
        trainer["enable_progress_bar"] = False  # not said: a line before a refused argument's would bury it
    if trainer.get("devices", "auto") == "auto" and trainer.get("accelerator", "auto") in ("auto", "cpu"):
        import torch  # noqa: PLC0415 - only when a recipe is run

        if not torch.cuda.is_available():
            trainer["accelerator"], trainer["devices"] = "cpu", 2
            _say("no GPU here, so the recipe runs 2 CPU processes (set trainer.devices to change)")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if isinstance(data.get("num_workers"), int) and data["num_workers"] > cpus:
        _say(f"{data['num_workers']} data loader workers asked, {cpus} CPUs here: using {cpus}")
        data["num_workers"] = cpus


def _say(message: str) -> None:
    """Once, from the process the user started (Lightning starts the other ranks with ``LOCAL_RANK`` set, and the
    first process of every other node with ``NODE_RANK``)."""
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
        print(f"lightning_gravac: {message}.", file=sys.stderr)


def run_recipe(argv: Sequence[str]) -> None:
    """``recipes/run.py [recipe] [dotted.key=value ...]``: resolve the recipe (a yaml path or a packaged recipe's
    name; the quickstart when none is given), then fit it with the CLI."""
    paths = [a for a in argv if "=" not in a]
    if len(paths) > 1:
        raise SystemExit(
            f"lightning_gravac: {paths[1]!r} has no `=value`: after the recipe ({paths[0]!r}) each argument is an "
            "override, dotted.key=value (e.g. trainer.max_steps=5)"
        )
    recipe = paths[0] if paths else QUICKSTART
    try:
        config = resolve_recipe(recipe, [a for a in argv if "=" in a])
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"lightning_gravac: {error}".rstrip(".")) from None
    fit_to_machine(config)
    # LightningCLI reads files; the resolved recipe goes to one the other ranks can read too (Lightning
    # re-executes this command line for them, which resolves the same file again).
    stem = Path(recipe).name.removesuffix(".yaml")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=f"{stem}-", delete=False) as f:
        f.write(OmegaConf.to_yaml(config))
    try:
        cli_main(["fit", "--config", f.name], recipe=stem)
    finally:
        Path(f.name).unlink(missing_ok=True)


USAGE = """usage: python -m lightning_gravac COMMAND
  quickstart [dotted.key=value ...]        the quickstart recipe (2 CPU processes, synthetic data)
  run RECIPE [dotted.key=value ...]        a packaged recipe by name, or a recipe yaml by path
  recipes                                  list the packaged recipes
  fit|validate|test|predict ...            LightningCLI (e.g. fit --config my.yaml)

examples:
  python -m lightning_gravac quickstart trainer.max_steps=5
  python -m lightning_gravac run vgg16_cifar100 data.init_args.synthetic=true trainer.max_steps=100
  python -m lightning_gravac run lstm_ptb quick=true      (each recipe's quick variant: minutes on 2 CPU cores)
  python -m lightning_gravac run lstm_ptb 'trainer.callbacks[0].init_args.cf_max=100'"""


#: LightningCLI's subcommands, handed to it as they are.
CLI_COMMANDS = ("fit", "validate", "test", "predict")


def main(argv: Sequence[str]) -> None:
    """``python -m lightning_gravac``: the recipes, else the LightningCLI. A command that is neither (a typo) and a
    recipe that does not exist answer with this tool's usage, before Lightning is loaded. A data set that cannot be
    found or fetched, and an argument a class of this package refuses, end the run with one line on rank 0 and status 1
    on every rank, no traceback."""
    in_one_line(_dispatch, argv)


def in_one_line(command: Callable[[Sequence[str]], None], argv: Sequence[str]) -> None:
    """``command(argv)``, its missing data or refused argument said in one line on rank 0, then status 1."""
    try:
        command(argv)
    except (MissingData, RefusedArgument) as error:
        _say(str(error).rstrip("."))
        raise SystemExit(1) from None


def _dispatch(argv: Sequence[str]) -> None:
    command, rest = (argv[0], list(argv[1:])) if argv else ("", [])
    if command == "quickstart":
        run_recipe([QUICKSTART, *rest])
    elif command == "run":
        if not rest or "=" in rest[0]:
            names = ", ".join(list_recipes())
            raise SystemExit(f"run takes a recipe first: a packaged one ({names}) or a yaml's path.\n\n{USAGE}")
        try:
            find_recipe(rest[0])
        except FileNotFoundError as error:
            raise SystemExit(f"{error}\n\n{USAGE}") from None
        run_recipe(rest)
    elif command == "recipes":
        for name in list_recipes():
            print(f"{name:20s} {find_recipe(name).read_text().splitlines()[0].lstrip('# ')}")
        print(
            f"\nAdd {QUICK}=true for a recipe's quick variant: a few dozen steps with validation, a small model and "
            "synthetic data, a few minutes on 2 CPU cores."
        )
    elif command in ("", "-h", "--help"):
        print(USAGE)
    elif command in CLI_COMMANDS or command.startswith("-"):  # a subcommand, or LightningCLI's own flags first
        cli_main(argv)
    else:
        raise SystemExit(f"unknown command {command!r}\n\n{USAGE}")


if __name__ == "__main__":
    in_one_line(run_recipe, sys.argv[1:])
