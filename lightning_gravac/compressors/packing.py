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
