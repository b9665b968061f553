"""The exchange of local steps' rounds: each rank's change over a round, written into one flat tensor a dtype, error-fed
for a biased method, compressed and averaged over the ranks, and the mean decoded back, one tensor a parameter.

A whole change (``cf`` 1, a method that sends its input as it is, or a round sent whole) is all-reduced in place; a
compressed one is all-gathered as each rank's payload and the mean decoded into a tensor of its own. With error
feedback the fit's last round goes with its residual in 8-bit block codes (:data:`FINAL_METHOD`), what they leave
(at most half a level, 1/254 of each block's largest entry) dropped: a quarter of its bytes sent whole. Once packed, the
change (where no residual holds it) and its codes are let go, so that neither sits beside the collective's buffers nor
the mean, and the heap's freed pages go back to the system before the mean is allocated. An embedding table
whose rows a round left unchanged on every rank is sent by the rows some rank changed (which rows: one small MAX
all-reduce of a byte a row), the rest of its change exactly zero on every rank; one under weight decay goes whole.
With overlap the exchange stays in flight through the next round; a checkpoint lands it (the same bits as landing it at
the round's end), so the run that saved goes on as the run that did not.
"""

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gravac.compressors.base import Compressor, Payload, get_compressor
from lightning_gravac.compressors.blockwise import Int8
from lightning_gravac.compressors.packing import Layout
from lightning_gravac.staged import Staged
from lightning_gravac.tables import ByRows, RowTables, row_mask, set_rows

#: The code of the fit's last round under error feedback, and its factor: 8-bit blocks from fp32.
FINAL_METHOD, FINAL_CF = Int8.name, Int8.fixed_cf


class OuterExchange:
    """Averages the ranks' changes at a round's end (see the module's docstring).

    State: this rank's error feedback residual, the averaging in flight (with overlap) and, in a checkpoint, its mean
    landed, the same on every rank; both by parameter name. The bytes this fit's exchanges put into the collectives.
    """

    def __init__(self) -> None:
        self.compressor: Compressor | None = None
        self.cf = 1.0
        self.error_feedback = False
        self.residual = Staged()  # what compression left out of each change, added into the next (biased methods)
        self.landed = Staged()  # with overlap: the averaging in flight, landed for a checkpoint
        self.bytes_sent = 0  # this fit's outer updates, as each rank put them into the collectives
        self.sent_cf = 1.0  # the factor the last change went at: 1 sent whole
        #: Told of each outer update's bytes and whether they were gathered (the strategy records them as a step's).
        self.sent: Callable[[int, bool], None] = _unrecorded
        #: The embedding tables a compressed round sends by the rows some rank changed (the strategy's, found when DDP
        #: wraps the model; ``GraVACStrategy(embedding_rows=False)`` sends them whole).
        self.tables = RowTables(enabled=False)
        self._params: dict[str, nn.Parameter] = {}
        self._optimizer: torch.optim.Optimizer | None = None
        self._in_flight: list[_Averaging] = []
        self._formed: Tensor | None = None  # the change :meth:`change` formed, until :meth:`send` takes it

    def configure(self, compressor: Compressor, cf: float, error_feedback: bool) -> None:
        """Send each change with ``compressor`` at factor ``cf``, error-fed when ``error_feedback``."""
        self.compressor, self.cf, self.error_feedback = compressor, cf, error_feedback

    def take_from(self, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        """The parameters whose changes are sent, by name, and the inner optimizer (its weight decay)."""
        self._params, self._optimizer = params, optimizer

    @property
    def compresses(self) -> bool:
        """Whether a change goes in the method's code (at :attr:`cf`) unless sent whole: not at a factor of 1, nor
        with a method that sends its input as it is."""
        return self.cf > 1 and not (self.compressor is not None and self.compressor.passthrough)

    @property
    def in_flight(self) -> bool:
        """Whether a round's averaging waits to be taken (sent with overlap, or landed by a checkpoint)."""
        return bool(self._in_flight or self.landed.kept)

    def change(self, names: list[str], starts: dict[str, Tensor]) -> Tensor:
        """This rank's change of ``names`` since ``starts`` (``start - x``), written once, into one flat tensor: what
        an all-reduce sums, what the method compresses and, with error feedback, the new residual, in place. Held
        here until :meth:`send` (a caller that reads it lets it go first: sent compressed, nothing else keeps it)."""
        like = [self._params[n] for n in names]
        delta = torch.empty(sum(p.numel() for p in like), dtype=like[0].dtype, device=like[0].device)
        for name, part, p in zip(names, split_like(delta, like), like, strict=True):
            torch.sub(starts[name], p, out=part)
        self._formed = delta
        return delta

    def send(self, names: list[str], whole: bool, step: int, final: bool = False) -> None:
        """Start averaging the change of ``names`` :meth:`change` formed (error-fed first for a biased method, the new
        residuals kept): an all-reduce of the whole change, or an all-gather of the compressed one, its draws seeded
        by ``step`` (the rounds ended). ``whole``: sent uncompressed, the residual with it. ``final``: the fit's last
        round, which under error feedback goes with the residual in :data:`FINAL_METHOD`, nothing kept owed. A
        compressed change no residual holds is let go once packed: the collective's buffers and the mean's tensor
        never sit beside it."""
        assert self.compressor is not None and self._formed is not None
        delta, self._formed = self._formed, None
        like = [self._params[n] for n in names]
        parts = split_like(delta, like)
        if self.error_feedback:
            for n, part in zip(names, parts, strict=True):
                residual = self.residual.kept.pop(n, None)  # added in: this round's residual replaces it
                if residual is not None:
                    part.add_(residual)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if whole or not self.compresses:
            self.sent_cf = 1.0
            for n in names:
                self.residual.kept.pop(n, None)
            self._record(delta.numel() * delta.element_size(), gathered=False)
            handle = dist.all_reduce(delta, async_op=True) if world > 1 else None
            self._in_flight.append(_Averaging(names, like, world, handle, delta))
            return
        owed = self.error_feedback and not final  # the last round's code leaves nothing owed: its error is dropped
        code, cf = (self._final_code(), FINAL_CF) if final and self.error_feedback else (self.compressor, self.cf)
        self.sent_cf = cf
        rows = self._changed_rows(names, parts, world)
        selected = torch.cat(rows.select(parts)) if rows.chosen else delta
        # Error-fed, the change becomes its residual in place (all of it in the rows no rank changed): in the encode's
        # own pass where the code can (the block codes), else decoded and subtracted.
        payload = code.compress_residual_(selected, cf, key="outer", step=step) if owed else None
        if payload is None:
            payload = code.compress(selected, cf, key="outer", step=step)
            if owed:
                code.residual_(selected, payload)
        layout = Layout.of([payload])
        packed = layout.pack([payload])
        if owed:
            if rows.chosen:
                rows.place(selected, parts)
            for n, rest in zip(names, parts, strict=True):
                self.residual.kept[n] = rest
        # Packed, the codes go, and the change where no residual holds it: reading every rank's back needs the
        # payload's layout alone, and the mean gets a tensor of its own once the collective's buffers are gone.
        payload = payload.with_wire([w.new_empty(0) for w in payload.wire])
        kept = delta if owed else None
        del delta, parts, selected
        gathered = torch.empty(world * layout.nbytes, dtype=torch.uint8, device=packed.device)
        self._record(layout.nbytes, gathered=True)
        handle = dist.all_gather_single(gathered, packed, async_op=True) if world > 1 else None
        if handle is None:
            gathered.copy_(packed)
        self._in_flight.append(_Averaging(names, like, world, handle, kept, gathered, layout, payload, rows, code))

    def _final_code(self) -> Compressor:
        """The last round's code: the method itself where it is :data:`FINAL_METHOD`, else a new one (stateless)."""
        assert self.compressor is not None
        return self.compressor if self.compressor.name == FINAL_METHOD else get_compressor(FINAL_METHOD)

    def take(self) -> dict[str, Tensor]:
        """The ranks' mean changes of what :meth:`send` sent since the last take (waited for), or those a checkpoint
        landed, by name; nothing is left in flight."""
        averaged = dict(self.landed.kept) or {
            n: a for ex in self._in_flight for n, a in zip(ex.names, self._land(ex), strict=True)
        }
        self._in_flight = []
        self.landed.load({})  # let go, not kept as spares: nothing is landed into them again until a checkpoint
        return averaged

    def reset(self) -> None:
        """Drop the residual (let go, not kept as spares: its tensors are views of one change)."""
        self.residual.load({})

    def state_dict(self) -> dict[str, Tensor]:
        """The residual and, in flight, the averaged change (landed now: the same bits as at the round's end)."""
        if self._in_flight:
            with torch.no_grad():
                averaged = self.take()  # before `landed`: taking it replaces `landed.kept` with a new dict
                self.landed.kept.update(averaged)
        return {
            f"{prefix}/{name}": tensor.detach().clone()
            for prefix, staged in (("residual", self.residual), ("landed", self.landed))
            for name, tensor in staged.kept.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        for prefix, staged in (("residual", self.residual), ("landed", self.landed)):
            staged.load({key[len(prefix) + 1 :]: t for key, t in state.items() if key.startswith(f"{prefix}/")})

    def _record(self, nbytes: int, gathered: bool) -> None:
        self.bytes_sent += nbytes
        self.sent(nbytes, gathered)

    def _changed_rows(self, names: list[str], parts: list[Tensor], world: int) -> ByRows:
        """Which rows of the tables among ``names`` (their changes ``parts``) some rank changed: a MAX all-reduce of a
        byte a row, the same on every rank. A table none of whose rows stayed unchanged goes whole; so does one under
        weight decay, which moves every row each step."""
        positions = [i for i, n in enumerate(names) if n in self.tables.rows and self._undecayed(n)]
        if not positions:
            return ByRows()
        rows = [self.tables.rows[names[i]] for i in positions]
        mask = row_mask([parts[i] for i in positions], rows)
        self._record(mask.numel(), gathered=False)
        if world > 1:
            dist.all_reduce(mask, op=dist.ReduceOp.MAX)
        # One host sync a table a round (on CUDA): how many rows go decides the payload's size.
        changed = zip(positions, set_rows(mask, rows), strict=True)
        by_rows = ByRows({i: idx for i, idx in changed if idx.numel() < parts[i].shape[0]})
        return by_rows if by_rows.numel(parts) else ByRows()  # nothing changed anywhere: the method gets something

    def _undecayed(self, name: str) -> bool:
        """Whether the inner optimizer leaves parameter ``name`` without weight decay (the same on every rank)."""
        p = self._params[name]
        groups = self._optimizer.param_groups if self._optimizer is not None else []
        return all(not g.get("weight_decay") for g in groups if any(q is p for q in g["params"]))

    def _land(self, averaging: "_Averaging") -> list[Tensor]:
        """Wait for ``averaging`` and decode the ranks' mean change, one tensor a parameter (a whole change averaged
        in its own tensor; a compressed one decoded into a tensor of its own)."""
        if averaging.handle is not None:
            averaging.handle.wait()
            averaging.handle = None  # the collective's own buffers go before the mean is written
        world, like = averaging.world, averaging.like
        if averaging.payload is None:
            assert averaging.buffer is not None
            return split_like(averaging.buffer.div_(world), like)
        assert averaging.code is not None and averaging.layout is not None and averaging.gathered is not None
        assert averaging.rows is not None
        _, (stacked,) = averaging.layout.unpack(
            averaging.gathered.view(world, averaging.layout.nbytes), [averaging.payload]
        )
        rows, first = averaging.rows, like[0]
        if first.device.type == "cpu":
            _trim_heap()
        mean = torch.empty(rows.numel(like), dtype=first.dtype, device=first.device)
        averaging.code.decode_(mean, stacked, 1.0 / world)
        if not rows.chosen:
            return split_like(mean, like)
        out = torch.zeros(sum(p.numel() for p in like), dtype=first.dtype, device=first.device)  # zero in the rows
        rows.place(mean, split_like(out, like))  # no rank changed
        return split_like(out, like)


def split_like(flat: Tensor, like: list[Tensor] | list[nn.Parameter]) -> list[Tensor]:
    """``flat`` cut into views shaped as ``like``."""
    out, offset = [], 0
    for p in like:
        out.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, ``None`` where the C library has none (macOS, musl) or cannot be opened by name
    (Windows, where ``CDLL(None)`` is refused)."""
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):
        return None


def _trim_heap() -> None:
    """Hand the pages the heap holds free back to the system. A round's codes, their packed copy and the collective's
    own buffers are each a few MiB: after the first round, glibc serves such sizes from its heap, where freed they stay
    resident; the mean's parameter-sized tensor, allocated after them, would add to them at the round's peak."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _unrecorded(nbytes: int, gathered: bool) -> None:
    """Bytes not recorded anywhere (before the strategy's setup)."""


@dataclass
class _Averaging:
    """One flat tensor's averaging in flight: its names and shapes, the collective's handle, the change summed in
    place when sent whole (compressed, the residual's tensor where error feedback holds one) and, compressed, the
    gathered payloads, the layout to read them by and the code that wrote them."""

    names: list[str]
    like: list[nn.Parameter]
    world: int
    handle: Any
    buffer: Tensor | None
    gathered: Tensor | None = None
    layout: Layout | None = None
    payload: Payload | None = None
    rows: ByRows | None = None
    code: Compressor | None = None
