"""Gradient compressors: one method per module, each registered by name."""

from lightning_gravac.compressors.adaq import AdaQ
from lightning_gravac.compressors.base import (
    Compressor,
    Pattern,
    Payload,
    get_compressor,
    list_compressors,
    register_compressor,
    sparse_k,
    validate_cf,
)
from lightning_gravac.compressors.blockwise import BlockCode, Int2, Int4, Int8
from lightning_gravac.compressors.cast import BF16, FP16
from lightning_gravac.compressors.dgc import DGC
from lightning_gravac.compressors.efsignsgd import EFSignSGD
from lightning_gravac.compressors.natural import Natural
from lightning_gravac.compressors.none import NoCompression
from lightning_gravac.compressors.onebit import OneBit
from lightning_gravac.compressors.powersgd import PowerSGD
from lightning_gravac.compressors.qsgd import QSGD
from lightning_gravac.compressors.randomk import RandomK
from lightning_gravac.compressors.redsync import RedSync
from lightning_gravac.compressors.rounds import MultiRound, Rounds
from lightning_gravac.compressors.sidco import SIDCo
from lightning_gravac.compressors.signsgd import SignSGD
from lightning_gravac.compressors.terngrad import TernGrad
from lightning_gravac.compressors.threshold import Threshold
from lightning_gravac.compressors.topk import TopK

__all__ = [
    "BF16",
    "DGC",
    "FP16",
    "QSGD",
    "AdaQ",
    "BlockCode",
    "Compressor",
    "EFSignSGD",
    "Int2",
    "Int4",
    "Int8",
    "MultiRound",
    "Natural",
    "NoCompression",
    "OneBit",
    "Pattern",
    "Payload",
    "PowerSGD",
    "RandomK",
    "RedSync",
    "Rounds",
    "SIDCo",
    "SignSGD",
    "TernGrad",
    "Threshold",
    "TopK",
    "get_compressor",
    "list_compressors",
    "register_compressor",
    "sparse_k",
    "validate_cf",
]
