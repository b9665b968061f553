"""Helpers shared by the methods that select or draw at random: seeded generators, sampling, fill to ``k``."""

import zlib

import torch
from torch import Tensor


def seeded_generator(seed: int, step: int, key: str, rank: int = 0) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step, key, rank)``.

    A dedicated generator, never the global one: the global RNG differs between ranks and belongs to the user.
    Methods whose draws must agree across ranks (Random-K's indices) pass ``rank=0`` everywhere; methods whose draws
    should be independent per rank (stochastic rounding) pass their rank.
    """
    mixed = (((seed * 1_000_003 + step) * 4_294_967_311 + zlib.crc32(key.encode())) * 65_537 + rank) % (1 << 63)
    return torch.Generator(device="cpu").manual_seed(mixed)


def sample(values: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """``count`` entries of the flat ``values`` drawn uniformly with replacement (cheap: no permutation)."""
    picks = torch.randint(values.numel(), (count,), generator=generator)
    return values[picks.to(values.device)]


def fill_to_k(magnitude: Tensor, mask: Tensor, k: int) -> Tensor:
    """Exactly ``k`` distinct indices of the flat ``magnitude``, chosen from those ``mask`` admits.

    Threshold methods estimate a cut and may admit more or fewer than ``k`` entries. With more, the exact top ``k``
    among them is taken, so a threshold below the true ``k``-th magnitude gives exact Top-K at the price of a top-k
    over the candidates only. With fewer, every candidate is kept and the payload is padded with the first entries
    the mask left out, in index order: their true values are sent, so nothing is lost (error feedback zeroes
    exactly what was sent), but they are not the next largest. That keeps payloads at the fixed size without a
    full top-k over the tensor.
    """
    candidates = mask.nonzero().view(-1)
    found = candidates.numel()
    if found >= k:
        if found == k:
            return candidates
        return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]
    rest = (~mask).nonzero().view(-1)[: k - found]
    return torch.cat([candidates, rest])
