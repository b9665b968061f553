"""Helpers shared by the methods that select or draw at random: seeded generators, sampling, thresholds, fill to k.

The selection path is written for large gradients on CPU as much as on GPU: no full-size temporaries beyond the
caller's scratch buffers (fresh 100 MB allocations cost more in page faults than the arithmetic), no full sort or
``topk`` over the whole tensor (``torch.topk`` of 25M entries takes half a second on a CPU core), and ``index_select``
instead of advanced indexing.
"""

import math
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
    return values.index_select(0, picks.to(values.device))


def distinct_indices(numel: int, k: int, generator: torch.Generator) -> Tensor:
    """``k`` distinct indices in ``[0, numel)``, a uniformly random subset, sorted (int64, on the CPU).

    The first ``k`` distinct values of a stream of uniform draws form a uniform random ``k``-subset; drawing exactly
    the shortfall each round never overshoots, and rounds shrink geometrically. Costs ``O(k log k)``, where
    ``randperm(numel)[:k]`` costs ``O(numel)`` (a second for 25M entries).
    """
    if k * 2 > numel:  # dense: a permutation is as cheap, and the draws would collide often
        return torch.randperm(numel, generator=generator)[:k].sort().values
    chosen = torch.randint(numel, (k,), generator=generator).unique()
    while chosen.numel() < k:
        more = torch.randint(numel, (k - chosen.numel(),), generator=generator)
        chosen = torch.cat([chosen, more]).unique()
    return chosen


def at_least(magnitude: Tensor, threshold: Tensor, mask: Tensor) -> Tensor:
    """Sorted int64 indices of the flat ``magnitude``'s entries at or above ``threshold``.

    ``mask`` is a caller-owned bool scratch of the same size. When few entries pass, the mask is scanned 8 entries at a
    time (as int64 words) and only the words holding one are expanded: about twice as fast as ``nonzero`` on CPU.
    """
    torch.ge(magnitude, threshold, out=mask)
    n = mask.numel()
    whole = n - n % 8
    if whole == 0:
        return mask.nonzero().view(-1)
    words = mask[:whole].view(torch.int64).nonzero().view(-1)
    inner = mask[:whole].view(-1, 8).index_select(0, words).nonzero()
    found = words.index_select(0, inner[:, 0]).mul_(8).add_(inner[:, 1])
    if whole < n:
        found = torch.cat([found, mask[whole:].nonzero().view(-1).add_(whole)])
    return found


def fill_to_k(magnitude: Tensor, candidates: Tensor, k: int, mask: Tensor) -> Tensor:
    """Exactly ``k`` distinct indices of the flat ``magnitude``: the exact top ``k`` among ``candidates`` when there
    are at least ``k``, else every candidate and the first entries that are not one, in index order.

    ``mask`` must hold ``True`` exactly at the candidates (as :func:`at_least` leaves it). Padding sends the padded
    entries' true values, so nothing is lost (error feedback zeroes exactly what was sent); they are just not the
    next largest. That keeps payloads at their fixed size without a ``topk`` over the whole tensor.
    """
    found = candidates.numel()
    if found >= k:
        if found == k:
            return candidates
        return candidates.index_select(0, torch.topk(magnitude.index_select(0, candidates), k, sorted=False).indices)
    rest = (~mask).nonzero().view(-1)[: k - found]
    return torch.cat([candidates, rest])


def exact_topk(
    magnitude: Tensor, k: int, mask: Tensor, generator: torch.Generator, sample_ratio: float = 0.01
) -> Tensor:
    """The indices of the ``k`` largest entries of the flat, non-negative ``magnitude``: exact, without a full ``topk``.

    A uniform sample estimates a threshold a little below the ``k``-th largest value; if at least ``k`` entries pass
    it, the top ``k`` among them is the top ``k`` of the whole (ties broken as ``topk`` breaks them). Otherwise the
    threshold is lowered and the pass repeated. Small or dense selections go straight to ``torch.topk``.
    """
    n = magnitude.numel()
    samples = math.ceil(sample_ratio * n)
    if k * 20 >= n or samples < 1024:
        return torch.topk(magnitude, k, sorted=False).indices
    drawn = sample(magnitude, samples, generator)
    # Expected passes in the sample: k/n of it; aim 20% and 3 standard deviations (of a binomial count) higher.
    expected = samples * k / n
    rank = min(samples, math.ceil(1.2 * expected + 3 * math.sqrt(expected)) + 1)
    threshold = torch.topk(drawn, rank, sorted=False).values.min()
    for _ in range(8):
        candidates = at_least(magnitude, threshold, mask)
        if candidates.numel() >= k:
            return fill_to_k(magnitude, candidates, k, mask)
        threshold = threshold * 0.5
    return torch.topk(magnitude, k, sorted=False).indices


class Scratch:
    """Flat buffers reused from call to call, one per ``(dtype, device)``, grown to the largest request.

    Compressors take their magnitude and mask temporaries from it: a gradient-sized allocation each call costs page
    faults on CPU. Views are valid until the next request of the same dtype, so nothing returned may keep one. Not
    pickled (a spawned strategy starts with none).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat tensor of ``numel`` entries, contents undefined."""
        buffer = self._buffers.get((dtype, device))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(dtype, device)] = buffer
        return buffer[:numel]

    def magnitude(self, flat: Tensor) -> Tensor:
        """``|flat|`` in a reused buffer."""
        return torch.abs(flat, out=self.get(flat.numel(), flat.dtype, flat.device))

    def mask(self, like: Tensor) -> Tensor:
        """A reused bool buffer of ``like``'s size."""
        return self.get(like.numel(), torch.bool, like.device)

    def __getstate__(self) -> dict[str, object]:
        return {"_buffers": {}}
