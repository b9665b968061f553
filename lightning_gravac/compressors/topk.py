"""Top-K sparsification: keep the k entries of largest magnitude."""

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Payload, register_compressor, sparse_k, sq_norm
from lightning_gravac.compressors.select import exact_topk, seeded_generator
from lightning_gravac.compressors.sparse import Sparsifier


@register_compressor
class TopK(Sparsifier):
    """Keep the ``k`` largest-magnitude entries, sending their values and int32 indices.

    ``k`` is chosen so that values plus indices cost ``1/cf`` of the dense bytes (see
    :func:`~lightning_gravac.compressors.base.sparse_k`): with fp32 gradients ``cf=100`` keeps 0.5% of the entries.
    Biased, so error feedback is on by default.

    Example::

        >>> import torch
        >>> from lightning_gravac.compressors import get_compressor
        >>> c = get_compressor("topk")
        >>> g = torch.tensor([0.1, -3.0, 0.2, 2.0])
        >>> c.decompress(c.compress(g, cf=2)).tolist()
        [0.0, -3.0, 0.0, 0.0]
    """

    name = "topk"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def _top(self, flat: Tensor, k: int, key: str, step: int) -> Tensor:
        # Exact, by a sampled threshold and a top-k over the few entries that pass it (select.exact_topk); the
        # sample only decides how much work that takes, never which entries win.
        return exact_topk(flat, k, self.scratch.like(flat), seeded_generator(self.seed, step, key))

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        flat = tensor.reshape(-1)
        return self.kept(tensor, self._top(flat, sparse_k(flat.numel(), cf, flat.dtype), key, step))

    def compress_and_probe(
        self, tensor: Tensor, cf: float, probe_cfs: Sequence[float], *, key: str = "", step: int = 0
    ) -> tuple[Payload, Tensor]:
        """Multi-level Top-K: one selection at the least aggressive of all the factors, then nested ones.

        The top ``k`` of any more aggressive factor lies inside the top ``K`` of a less aggressive one, so each level
        is selected from the previous level's entries alone (a top-k over ``K`` values, not over the tensor), and
        every probe's ``||C(g)||^2`` is the squared norm of its level's values.
        """
        flat = tensor.reshape(-1)
        ks = [sparse_k(flat.numel(), c, flat.dtype) for c in (cf, *probe_cfs)]
        levels: dict[int, tuple[Tensor, Tensor]] = {}
        indices: Tensor | None = None
        values: Tensor | None = None
        for k in sorted(set(ks), reverse=True):
            if indices is None or values is None:
                indices = self._top(flat, k, key, step)
                values = flat.index_select(0, indices)
            else:
                chosen = torch.topk(values.abs(), k, sorted=False).indices
                indices, values = indices.index_select(0, chosen), values.index_select(0, chosen)
            levels[k] = (indices, values)
        kept_indices, kept_values = levels[ks[0]]
        payload = Payload((kept_values, kept_indices.to(torch.int32)), tensor.shape, tensor.dtype)
        norms = [sq_norm(levels[k][1]) for k in ks[1:]]
        probes = torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=flat.device)
        return payload, probes

    def probe(self, tensor: Tensor, cfs: Sequence[float], *, key: str = "", step: int = 0) -> Tensor:
        if not cfs:
            return torch.zeros(0, dtype=torch.float64, device=tensor.device)
        return self.compress_and_probe(tensor, min(cfs), cfs, key=key, step=step)[1]

    def __repr__(self) -> str:
        return f"TopK(seed={self.seed})"
