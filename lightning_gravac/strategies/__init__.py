"""The strategy, its comm hook and the state they share."""

from lightning_gravac.state import CompressionState, StepStats
from lightning_gravac.strategies.gravac import GraVACStrategy
from lightning_gravac.strategies.hook import gravac_hook

__all__ = ["CompressionState", "GraVACStrategy", "StepStats", "gravac_hook"]
