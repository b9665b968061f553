"""Embedding tables whose steps touch few of their rows: which they are, and which the hook sends by their rows.

An embedding table's gradient is zero outside the rows its batch looked up. On a step sent dense or in fp16 the hook
sends such a table by the rows some rank touched (``communicators.RowsReduced``): the same sum as a dense all-reduce,
in a fraction of the bytes. A table whose steps touch most of its rows is sent whole, and checked again later.
"""

from dataclasses import dataclass, field

from torch import nn

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


def sparse_parameters(module: nn.Module) -> set[int]:
    """The ids of ``module``'s parameters whose gradients are sparse, found as DDP finds them: of an embedding with
    ``sparse=True``."""
    embeddings = (nn.Embedding, nn.EmbeddingBag)
    return {id(p) for m in module.modules() if isinstance(m, embeddings) and m.sparse for p in m.parameters()}
