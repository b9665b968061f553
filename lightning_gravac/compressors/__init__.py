"""Gradient compressors: one method per module, each registered by name."""

from lightning_gravac.compressors.base import (
    Compressor,
    Payload,
    get_compressor,
    list_compressors,
    register_compressor,
    sparse_k,
    validate_cf,
)
from lightning_gravac.compressors.cast import BF16, FP16
from lightning_gravac.compressors.dgc import DGC
from lightning_gravac.compressors.memory import ErrorFeedback
from lightning_gravac.compressors.none import NoCompression
from lightning_gravac.compressors.randomk import RandomK
from lightning_gravac.compressors.topk import TopK

__all__ = [
    "BF16",
    "DGC",
    "FP16",
    "Compressor",
    "ErrorFeedback",
    "NoCompression",
    "Payload",
    "RandomK",
    "TopK",
    "get_compressor",
    "list_compressors",
    "register_compressor",
    "sparse_k",
    "validate_cf",
]
