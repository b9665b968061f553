"""lightning-gravac: compressed, adaptive gradient communication for PyTorch Lightning DDP."""

from pytorch_lightning.strategies import StrategyRegistry

from lightning_gravac.callbacks import Accordion, Controller, DivergenceGuard, GraVAC, RunSummary, Static
from lightning_gravac.compressors import Compressor, ErrorFeedback, Payload, get_compressor, list_compressors
from lightning_gravac.strategies import CompressionState, GraVACStrategy, StepStats

if "gravac" not in StrategyRegistry:
    GraVACStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"

__all__ = [
    "Accordion",
    "CompressionState",
    "Compressor",
    "Controller",
    "DivergenceGuard",
    "ErrorFeedback",
    "GraVAC",
    "GraVACStrategy",
    "Payload",
    "RunSummary",
    "Static",
    "StepStats",
    "get_compressor",
    "list_compressors",
]
