"""lightning-gravac: compressed, adaptive gradient communication for PyTorch Lightning DDP."""

import importlib
import itertools
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_gravac.adaptations import ErrorFeedback, LocalSteps, LocalStepsDiverged
    from lightning_gravac.callbacks import Accordion, Controller, DivergenceGuard, GraVAC, RunSummary, Static
    from lightning_gravac.compressors import Compressor, Payload, get_compressor, list_compressors
    from lightning_gravac.sharded import GraVACModelParallelStrategy
    from lightning_gravac.strategies import CompressionState, GraVACStrategy, StepStats

__version__ = "0.1.0"

#: The public names, by the module that defines them: imported on first use (PEP 562).
_HOMES = {
    "lightning_gravac.callbacks": ("Accordion", "Controller", "DivergenceGuard", "GraVAC", "RunSummary", "Static"),
    "lightning_gravac.compressors": ("Compressor", "Payload", "get_compressor", "list_compressors"),
    "lightning_gravac.adaptations": ("ErrorFeedback", "LocalSteps", "LocalStepsDiverged"),
    "lightning_gravac.strategies": ("CompressionState", "GraVACStrategy", "StepStats"),
    "lightning_gravac.sharded": ("GraVACModelParallelStrategy",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "Accordion",
    "CompressionState",
    "Compressor",
    "Controller",
    "DivergenceGuard",
    "ErrorFeedback",
    "GraVAC",
    "GraVACModelParallelStrategy",
    "GraVACStrategy",
    "LocalSteps",
    "LocalStepsDiverged",
    "Payload",
    "RunSummary",
    "Static",
    "StepStats",
    "get_compressor",
    "list_compressors",
    "register_strategies",
]


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def register_strategies() -> None:
    """Register ``"gravac"`` (and its variants) and ``"gravac_model_parallel"`` in Lightning's strategy registry,
    once."""
    from pytorch_lightning.strategies import StrategyRegistry  # noqa: PLC0415 - on use: see the end of this file

    from lightning_gravac.sharded import GraVACModelParallelStrategy  # noqa: PLC0415
    from lightning_gravac.strategies import GraVACStrategy  # noqa: PLC0415

    if "gravac" not in StrategyRegistry:
        GraVACStrategy.register_strategies(StrategyRegistry)
    if GraVACModelParallelStrategy.strategy_name not in StrategyRegistry:
        GraVACModelParallelStrategy.register_strategies(StrategyRegistry)


def _run_as_command() -> bool:
    """Whether this process is ``python -m lightning_gravac ...``."""
    argv = getattr(sys, "orig_argv", [])
    return any(flag == "-m" and module == __name__ for flag, module in itertools.pairwise(argv))


# Importing the package registers `Trainer(strategy="gravac")`, which needs torch and Lightning (seconds of CPU). The
# command line runs this file first: its help and recipe list need neither, and it registers when it trains.
if not _run_as_command():
    register_strategies()
