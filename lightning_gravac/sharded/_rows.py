"""A block code's payload as one row of bytes, its scales first, and back: what the sharded collectives exchange.

A row is padded to whole fp32s, so that in a buffer of rows every row's scales start aligned and are read in place.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gravac.compressors.base import Payload
from lightning_gravac.compressors.blockwise import BlockCode

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


def exact_tail(row: Tensor, start: int) -> Tensor:
    """The fp32 entries sent exact after the codes of a row (or of each row of rows), from byte ``start`` (a whole
    number of fp32s: ``row_layout``'s padded length), in place."""
    return row[..., start:].view(torch.float32)


def coded(code: BlockCode, chunk: Tensor, error_feedback: bool) -> Payload:
    """``chunk`` (fp32) in ``code``; with ``error_feedback``, ``chunk`` becomes what coding dropped, in place (in the
    encode's own pass where the compiled kernel can)."""
    payload = code.compress_residual_(chunk, code.fixed_cf or 1.0) if error_feedback else None
    if payload is None:
        payload = code.compress(chunk, code.fixed_cf or 1.0)
        if error_feedback:
            code.residual_(chunk, payload)
    return payload


def all_gather_payload(payload: Payload, group: dist.ProcessGroup) -> Tensor:
    """Every rank of ``group``'s payload (each of ``payload``'s layout), as rows of bytes in rank order."""
    row = torch.zeros(row_layout(payload)[2], dtype=torch.uint8, device=payload.wire[0].device)
    write_row(row, payload)
    rows = torch.empty(group.size() * row.numel(), dtype=torch.uint8, device=row.device)
    dist.all_gather_single(rows, row, group=group)  # flat: gloo takes no rows
    return rows.view(group.size(), -1)
