"""A block code's payload as one row of bytes, its scales first, and back: what the sharded collectives exchange.

A row is padded to whole fp32s, so that in a buffer of rows every row's scales start aligned and are read in place.
"""

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Payload

#: An fp32 scale's bytes.
SCALE_BYTES = 4


def row_layout(payload: Payload) -> tuple[int, int, int]:
    """Where ``payload``'s codes begin and end in its row, and the row's padded length, in bytes."""
    packed, peaks = payload.wire
    cut = peaks.numel() * SCALE_BYTES
    end = cut + packed.numel()
    return cut, end, end + -end % SCALE_BYTES


def write_row(row: Tensor, payload: Payload) -> None:
    """``payload``'s scales, then its codes, into ``row`` (``uint8``, :func:`row_layout`'s length)."""
    packed, peaks = payload.wire
    cut, end, _ = row_layout(payload)
    row[:cut].view(torch.float32).copy_(peaks)
    row[cut:end].copy_(packed)


def read_row(row: Tensor, like: Payload) -> Payload:
    """The payload another rank wrote as ``row``, with ``like``'s layout (this rank's payload of the same size)."""
    cut, end, _ = row_layout(like)
    return like.with_wire((row[cut:end], row[:cut].view(torch.float32)))
