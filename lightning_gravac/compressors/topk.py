"""Top-K sparsification: keep the k entries of largest magnitude."""

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Payload, register_compressor, sparse_k


@register_compressor
class TopK(Compressor):
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
    nesting = "exact"

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        flat = tensor.reshape(-1)
        k = sparse_k(flat.numel(), cf, flat.dtype)
        # sorted=False: the order of the selection is irrelevant and sorting it costs O(k log k).
        _, indices = torch.topk(flat.abs(), k, sorted=False)
        return Payload((flat[indices], indices.to(torch.int32)), tensor.shape, tensor.dtype)

    def compress_and_probe(
        self, tensor: Tensor, cf: float, probe_cfs: Sequence[float], *, key: str = "", step: int = 0
    ) -> tuple[Payload, Tensor]:
        """Multi-level Top-K: one selection, sorted by magnitude, at the least aggressive of all the factors.

        The top ``k`` of any more aggressive factor is a prefix of it, so the payload at ``cf`` is a slice and
        every probe's ``||C(g)||^2`` is a prefix sum of squares: one top-k and one sort of its ``k`` values, instead
        of one top-k a factor.
        """
        flat = tensor.reshape(-1)
        ks = [sparse_k(flat.numel(), c, flat.dtype) for c in (cf, *probe_cfs)]
        _, indices = torch.topk(flat.abs(), max(ks), sorted=True)
        values = flat[indices]
        prefix_sq = values.double().square().cumsum(0)
        k = ks[0]
        payload = Payload((values[:k], indices[:k].to(torch.int32)), tensor.shape, tensor.dtype)
        return payload, prefix_sq[torch.tensor(ks[1:], device=prefix_sq.device, dtype=torch.long) - 1]

    def probe(self, tensor: Tensor, cfs: Sequence[float], *, key: str = "", step: int = 0) -> Tensor:
        if not cfs:
            return torch.zeros(0, dtype=torch.float64, device=tensor.device)
        return self.compress_and_probe(tensor, min(cfs), cfs, key=key, step=step)[1]

    def decompress(self, payload: Payload) -> Tensor:
        values, indices = payload.wire
        out = torch.zeros(payload.shape.numel(), dtype=payload.dtype, device=values.device)
        out.index_put_((indices.long(),), values)
        return out.view(payload.shape)

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        # One index_add_ over every rank's entries; duplicates add up, in rank order on CPU.
        values, indices = stacked.wire
        out.index_add_(0, indices.reshape(-1), values.reshape(-1), alpha=scale)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        # g - decoded is g with the sent entries zeroed: exact, and no dense temporary.
        tensor.view(-1).index_fill_(0, payload.wire[1].long(), 0)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        return payload.wire[0].double().square().sum()
