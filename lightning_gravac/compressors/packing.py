"""Packing the wire tensors of several payloads into one byte buffer, and reading them back.

One buffer means one collective per bucket. Values keep their dtype and indices stay int32: the buffer is
``uint8`` and each tensor is a reinterpreting view into it. Views need offsets aligned to their element size,
so a float64 header comes first and the wire tensors follow in order of decreasing element size; the total is
padded to 8 bytes so that every row of a gathered ``[world_size, nbytes]`` buffer starts aligned too.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Payload

_ALIGN = 8


@dataclass(frozen=True)
class _Slot:
    payload: int
    wire: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


@dataclass(frozen=True)
class Layout:
    """Where each wire tensor of a list of payloads lies in a packed buffer.

    Attributes:
        header_numel: number of float64 values at the start of the buffer.
        nbytes: total size of the packed buffer, a multiple of 8.
    """

    header_numel: int
    nbytes: int
    slots: tuple[_Slot, ...]

    @classmethod
    def of(cls, payloads: Sequence[Payload], header_numel: int = 0) -> "Layout":
        """The layout of ``payloads`` behind a header of ``header_numel`` float64 values."""
        wires = [(i, j, t) for i, p in enumerate(payloads) for j, t in enumerate(p.wire)]
        # Stable sort by decreasing element size: every offset stays a multiple of the next element size.
        wires.sort(key=lambda item: -item[2].element_size())
        offset = header_numel * 8
        slots = []
        for i, j, t in wires:
            nbytes = t.numel() * t.element_size()
            slots.append(_Slot(i, j, offset, nbytes, t.dtype, t.shape))
            offset += nbytes
        return cls(header_numel, -(-offset // _ALIGN) * _ALIGN, tuple(slots))

    def pack(self, payloads: Sequence[Payload], header: Tensor | None = None) -> Tensor:
        """Copy ``header`` (float64) and the payloads' wire tensors into a new ``uint8`` buffer."""
        device = payloads[0].wire[0].device if payloads else header.device if header is not None else None
        out = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        if self.header_numel:
            assert header is not None and header.numel() == self.header_numel
            out[: self.header_numel * 8].copy_(header.to(torch.float64).reshape(-1).view(torch.uint8))
        for slot in self.slots:
            wire = payloads[slot.payload].wire[slot.wire]
            out[slot.offset : slot.offset + slot.nbytes].copy_(wire.contiguous().reshape(-1).view(torch.uint8))
        end = self.slots[-1].offset + self.slots[-1].nbytes if self.slots else self.header_numel * 8
        out[end:].zero_()
        return out

    def unpack(self, rows: Tensor, payloads: Sequence[Payload]) -> tuple[Tensor, list[Payload]]:
        """Read a gathered ``[world_size, nbytes]`` buffer back.

        Returns the headers as a ``[world_size, header_numel]`` float64 tensor and, for each local payload, a
        payload whose wire tensors hold every rank's, stacked along a leading rank dimension (views, no copy).
        """
        ranks = rows.shape[0]
        header = rows[:, : self.header_numel * 8].view(torch.float64)
        wires: list[list[Tensor | None]] = [[None] * len(p.wire) for p in payloads]
        for slot in self.slots:
            view = rows[:, slot.offset : slot.offset + slot.nbytes].view(slot.dtype)
            wires[slot.payload][slot.wire] = view.reshape(ranks, *slot.shape)
        stacked = [p.with_wire([t for t in w if t is not None]) for p, w in zip(payloads, wires, strict=True)]
        return header, stacked


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits take when packed."""
    return -(-numel * bits // 8)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack the flat integer ``codes`` (each in ``[0, 2**bits)``) into a ``uint8`` tensor, most significant first.

    Widths that divide 8 (1, 2, 4, 8) pack whole codes into each byte with shifts; other widths (3, 5, 6, 7) go
    through a bit matrix. The result has :func:`packed_nbytes` bytes, the last zero-padded.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"`bits` must be in [1, 8], got {bits}.")
    codes = codes.reshape(-1).to(torch.uint8)
    nbytes = packed_nbytes(codes.numel(), bits)
    if 8 % bits == 0:
        per_byte = 8 // bits
        padded = torch.zeros(nbytes * per_byte, dtype=torch.uint8, device=codes.device)
        padded[: codes.numel()] = codes
        groups = padded.view(nbytes, per_byte)
        out = groups[:, 0].clone()
        for j in range(1, per_byte):
            out.bitwise_left_shift_(bits).bitwise_or_(groups[:, j])
        return out
    shifts = torch.arange(bits - 1, -1, -1, dtype=torch.uint8, device=codes.device)
    bit_matrix = codes.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).reshape(-1)
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=codes.device)
    padded[: bit_matrix.numel()] = bit_matrix
    return _from_bits(padded.view(nbytes, 8))


def unpack_bits(packed: Tensor, bits: int, numel: int) -> Tensor:
    """The ``numel`` codes :func:`pack_bits` packed, as ``uint8``."""
    if 8 % bits == 0:
        per_byte = 8 // bits
        shifts = torch.arange((per_byte - 1) * bits, -1, -bits, dtype=torch.uint8, device=packed.device)
        mask = (1 << bits) - 1
        return packed.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(mask).reshape(-1)[:numel]
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bit_matrix = packed.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).reshape(-1)[: numel * bits]
    return _from_bits(bit_matrix.view(numel, bits))


def _from_bits(bit_matrix: Tensor) -> Tensor:
    """Rows of 0/1 ``uint8`` bits, most significant first, to one ``uint8`` each."""
    width = bit_matrix.shape[1]
    out = bit_matrix[:, 0].clone()
    for j in range(1, width):
        out.bitwise_left_shift_(1).bitwise_or_(bit_matrix[:, j])
    return out
