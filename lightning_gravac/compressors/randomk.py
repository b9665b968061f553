"""Random-K sparsification with indices every rank derives from a shared seed."""

import torch
from torch import Tensor

from lightning_gravac.compressors.base import Compressor, Pattern, Payload, register_compressor, sparse_k, sq_norm
from lightning_gravac.compressors.select import distinct_indices, seeded_generator


@register_compressor
class RandomK(Compressor):
    """Keep ``k`` entries chosen uniformly without replacement; only their values cross the network.

    The indices come from a generator seeded with ``(seed, step, key)``, so every rank picks the same ones:
    the payloads of all ranks share support, the hook sums them with an all-reduce, and no index is sent.
    ``cf=100`` therefore keeps 1% of the entries (no index bytes to pay for).

    Args:
        seed: base seed; must be the same on every rank.
        unbiased: scale the kept values by ``numel / k`` so that the decoded tensor is an unbiased estimate of
            the input. Use it without error feedback; with error feedback (the default) leave it off.
    """

    name = "randomk"
    communication = Pattern.SUM

    def __init__(self, seed: int = 0, unbiased: bool = False) -> None:
        self.seed = seed
        self.unbiased = unbiased
        self.biased = not unbiased

    random_sends = True

    def masked_wait(self, cf: float, dtype: torch.dtype) -> float | None:
        # No index is sent, so numel / k is cf; unbiased values are scaled, so no entry is sent exactly.
        return None if self.unbiased else cf

    def indices(self, numel: int, k: int, *, key: str, step: int, device: torch.device) -> Tensor:
        """The ``k`` indices this ``(seed, step, key)`` selects out of ``numel``; identical on every rank."""
        generator = seeded_generator(self.seed, step, key)  # no rank: every rank draws the same
        return distinct_indices(numel, k, generator).to(device)

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        flat = tensor.reshape(-1)
        k = sparse_k(flat.numel(), cf, flat.dtype, index_bytes=0)
        indices = self.indices(flat.numel(), k, key=key, step=step, device=flat.device)
        values = flat.index_select(0, indices)
        if self.unbiased:
            values = values * (flat.numel() / k)
        return Payload((values,), tensor.shape, tensor.dtype, derived=(indices,))

    def decompress(self, payload: Payload) -> Tensor:
        (values,), (indices,) = payload.wire, payload.derived
        out = torch.zeros(payload.shape.numel(), dtype=payload.dtype, device=values.device)
        out[indices] = values
        return out.view(payload.shape)

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        (values,), (indices,) = stacked.wire, stacked.derived
        out.index_add_(0, indices.repeat(values.shape[0]), values.reshape(-1), alpha=scale)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        if self.unbiased:
            super().residual_(tensor, payload)
        else:
            tensor.view(-1).index_fill_(0, payload.derived[0], 0)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        return sq_norm(payload.wire[0])

    def __repr__(self) -> str:
        return f"RandomK(seed={self.seed}, unbiased={self.unbiased})"
