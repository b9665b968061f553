"""Embedding tables whose steps touch few of their rows: which they are, and which the hook sends by their rows.

An embedding table's gradient is zero outside the rows its batch looked up. On a step sent dense or in fp16 the hook
sends such a table by the rows some rank touched (``communicators.RowsReduced``): the same sum as a dense all-reduce,
in a fraction of the bytes. A table whose steps touch most of its rows is sent whole, and checked again later. A round
of local steps sends a table's change by the rows some rank changed the same way (``adaptations.OuterUpdate``): which
rows, :func:`row_mask` reduced by MAX over the ranks and read by :func:`set_rows`; what goes, :class:`ByRows`.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

#: A table is sent by its rows while the rows some rank touched are at most this share of it; above, whole.
ROWS_SHARE = 0.5
#: Steps a table is sent whole, without asking which rows were touched, after a step that touched more than that.
WHOLE_FOR = 100
#: The share of the trainable parameters above which a model counts as mostly embedding tables.
EMBEDDING_SHARE = 0.5


def untied_tables(module: nn.Module, dense_only: bool = False) -> list[nn.Parameter]:
    """The weights of ``module``'s embedding tables (``nn.Embedding``, ``nn.EmbeddingBag``) that no other layer
    shares (a table tied to an output layer gets a dense gradient); with ``dense_only``, of those whose gradient is
    dense (``sparse=False``: a sparse one already crosses the network as its rows)."""
    embeddings = (nn.Embedding, nn.EmbeddingBag)
    tables = {
        id(p): p
        for m in module.modules()
        if isinstance(m, embeddings) and not (dense_only and m.sparse)
        for p in m.parameters(False)
        if p.dim() == 2
    }
    tied = {id(p) for m in module.modules() if not isinstance(m, embeddings) for p in m.parameters(False)}
    return [p for i, p in tables.items() if i not in tied]


def embedding_share(module: nn.Module) -> float:
    """The share of ``module``'s trainable parameters' entries held by embedding tables that no other layer shares (a
    table tied to an output layer gets a dense gradient)."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    own = sum(p.numel() for p in untied_tables(module) if p.requires_grad)
    return own / trainable if trainable else 0.0


@dataclass
class RowTables:
    """The tables the hook may send by their rows (parameter name -> rows), and until which step one is sent whole.

    Every entry follows from the module and from the union of touched rows, which every rank receives alike: the
    same on every rank. Which way a table is sent changes neither the sum nor what is kept (a half step of a bucket
    with tables keeps no rounding either way), so none of it is checkpointed.
    """

    enabled: bool = True
    rows: dict[str, int] = field(default_factory=dict)
    whole_until: dict[str, int] = field(default_factory=dict)

    def find(self, module: nn.Module, world_size: int) -> None:
        """Name ``module``'s dense-gradient, untied, trainable, contiguous tables (when enabled, and when there are
        other ranks to send to: alone, a step sends nothing)."""
        names = {id(p): name for name, p in module.named_parameters()}
        tables = untied_tables(module, dense_only=True) if self.enabled and world_size > 1 else []
        self.rows = {
            names[id(p)]: p.shape[0]
            for p in tables
            if p.requires_grad and p.is_contiguous() and p.shape[0] > 0 and id(p) in names
        }
        self.whole_until = {}

    def holds_table(self, names: list[str]) -> bool:
        """Whether any of ``names`` is a table the hook may send by its rows."""
        return any(name in self.rows for name in names)

    def in_bucket(self, names: list[str], step: int) -> list[int]:
        """The positions in ``names`` of the tables to send by their rows at ``step``."""
        if not self.rows:
            return []
        return [i for i, name in enumerate(names) if name in self.rows and self.whole_until.get(name, -1) <= step]

    def observe(self, name: str, touched: int, step: int) -> bool:
        """Whether table ``name`` goes by its rows this step, ``touched`` rows of it touched on some rank; a table
        that goes whole is not asked again for :data:`WHOLE_FOR` steps."""
        if touched <= ROWS_SHARE * self.rows[name]:
            return True
        self.whole_until[name] = step + WHOLE_FOR
        return False


def row_mask(tables: Sequence[Tensor], rows: Sequence[int]) -> Tensor:
    """A byte a row of each of ``tables`` (``rows[k]`` rows in ``tables[k]``): 1 where the row holds an entry that is
    not zero. Reduced by MAX over the ranks, it marks the rows some rank touched."""
    return torch.cat([t.reshape(n, -1).ne(0).any(1) for t, n in zip(tables, rows, strict=True)]).to(torch.uint8)


def set_rows(mask: Tensor, rows: Sequence[int]) -> list[Tensor]:
    """The indices of the rows set in ``mask`` (laid out as :func:`row_mask` lays it out), one tensor a table. How
    many there are is read on the host: one sync with a CUDA device a table."""
    out, offset = [], 0
    for n in rows:
        out.append(mask[offset : offset + n].nonzero().view(-1))
        offset += n
    return out


class ByRows:
    """Tensors sent entry by entry, but for the tables in ``chosen`` (a tensor's position -> the indices of the rows
    that go), only those rows."""

    def __init__(self, chosen: dict[int, Tensor] | None = None) -> None:
        self.chosen = chosen or {}

    def numel(self, parts: Sequence[Tensor]) -> int:
        """The entries of ``parts`` that go."""
        return sum(
            self.chosen[i].numel() * (p.numel() // p.shape[0]) if i in self.chosen else p.numel()
            for i, p in enumerate(parts)
        )

    def select(self, parts: Sequence[Tensor]) -> list[Tensor]:
        """The entries of each of ``parts`` that go, flat, in order."""
        return [
            p.reshape(p.shape[0], -1).index_select(0, self.chosen[i]).reshape(-1) if i in self.chosen else p.reshape(-1)
            for i, p in enumerate(parts)
        ]

    def place(self, sent: Tensor, parts: Sequence[Tensor]) -> None:
        """``sent`` (flat, in :meth:`select`'s order) written into ``parts``, cast to each one's dtype: a table's
        chosen rows (its other rows left as they are), every other part whole."""
        at = 0
        for i, p in enumerate(parts):
            rows = self.chosen.get(i)
            if rows is None:
                p.copy_(sent[at : at + p.numel()].view_as(p))
                at += p.numel()
            else:
                width = p.numel() // p.shape[0]
                values = sent[at : at + rows.numel() * width].view(-1, width)
                p.view(p.shape[0], width).index_copy_(0, rows, values.to(p.dtype))
                at += rows.numel() * width


def sparse_parameters(module: nn.Module) -> set[int]:
    """The ids of ``module``'s parameters whose gradients are sparse, found as DDP finds them: of an embedding with
    ``sparse=True``."""
    embeddings = (nn.Embedding, nn.EmbeddingBag)
    return {id(p) for m in module.modules() if isinstance(m, embeddings) and m.sparse for p in m.parameters()}
