"""Compression controllers: Lightning callbacks that set the factor."""

from lightning_gravac.callbacks.accordion import Accordion
from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.callbacks.gravac import GraVAC
from lightning_gravac.callbacks.guard import DivergenceGuard
from lightning_gravac.callbacks.static import Static
from lightning_gravac.callbacks.summary import RunSummary

__all__ = ["Accordion", "Controller", "DivergenceGuard", "GraVAC", "RunSummary", "Static"]
