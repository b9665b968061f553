"""Compression controllers: Lightning callbacks that set the factor."""

from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.callbacks.static import Static

__all__ = ["Controller", "Static"]
