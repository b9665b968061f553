"""Helpers shared by the methods that select or draw at random: seeded generators, sampling, thresholds, fill to k.

The selection path is written for large gradients on CPU as much as on GPU: one fused pass over the tensor per
threshold tried, no full-size temporaries beyond the caller's scratch buffer (fresh 100 MB allocations cost more in
page faults than the arithmetic), no sort or ``topk`` over the whole tensor (``torch.topk`` of 25M entries takes
half a second on a CPU core), and ``index_select`` instead of advanced indexing.
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


def above(values: Tensor, threshold: float, out: Tensor) -> Tensor:
    """Sorted int64 indices of the flat ``values`` whose magnitude exceeds ``threshold`` (``>= 0``).

    One fused pass, ``hardshrink`` into the caller's scratch ``out`` (same size and dtype): entries at or below the
    threshold become 0, the rest keep their value, so no ``|x|`` and no bool mask is materialized. The result is then
    scanned 8 bytes at a time (int64 words) and only the words holding a survivor are expanded: about twice as fast
    as ``nonzero`` on a CPU when few survive. NaN entries survive (they fail every comparison).
    """
    torch.hardshrink(values, threshold, out=out)
    return nonzero_words(out)


def nonzero_words(flat: Tensor) -> Tensor:
    """Sorted int64 indices of the non-zero entries of the flat ``flat``, scanning whole 8-byte words first.

    Bit patterns are compared, so ``-0.0`` counts as non-zero (``hardshrink`` never produces it).
    """
    per_word = 8 // flat.element_size()
    n = flat.numel()
    whole = n - n % per_word
    if per_word < 2 or whole == 0 or flat.data_ptr() % 8:
        return flat.nonzero().view(-1)
    words = flat[:whole].view(torch.int64).nonzero().view(-1)
    lanes = flat[:whole].view(-1, per_word).index_select(0, words)
    inner = lanes.view(_bits_of(flat.dtype)).nonzero()
    found = words.index_select(0, inner[:, 0]).mul_(per_word).add_(inner[:, 1])
    if whole < n:
        found = torch.cat([found, flat[whole:].nonzero().view(-1).add_(whole)])
    return found


def _bits_of(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of ``dtype``'s width: its bit patterns, for exact zero tests."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]


def fill_to_k(values: Tensor, candidates: Tensor, k: int, out: Tensor) -> Tensor:
    """Exactly ``k`` distinct indices of the flat ``values``: the ``k`` of largest magnitude among ``candidates`` when
    there are at least ``k``, else every candidate and the first entries that are not one, in index order.

    ``out`` must be what :func:`above` left (zero exactly off the candidates). Padding sends the padded entries' true
    values, so nothing is lost (error feedback zeroes exactly what was sent); they are just not the next largest.
    That keeps payloads at their fixed size without a ``topk`` over the whole tensor.
    """
    found = candidates.numel()
    if found >= k:
        if found == k:
            return candidates
        magnitude = values.index_select(0, candidates).abs_()
        return candidates.index_select(0, torch.topk(magnitude, k, sorted=False).indices)
    # The first k - found entries that are not candidates lie within the first k entries: scan those alone.
    rest = (out[:k].view(_bits_of(out.dtype)) == 0).nonzero().view(-1)[: k - found]
    return torch.cat([candidates, rest])


def exact_topk(
    values: Tensor, k: int, out: Tensor, generator: torch.Generator, sample_ratio: float = 0.01, signed: bool = False
) -> Tensor:
    """Indices of the ``k`` entries of the flat ``values`` of largest magnitude (largest value with ``signed``):
    exact, without a ``topk`` over the whole tensor.

    A uniform sample estimates a threshold a little below the ``k``-th largest; if at least ``k`` entries pass it,
    the top ``k`` among them is the top ``k`` of the whole (ties broken as ``topk`` breaks them). Otherwise a lower
    quantile of the sample is tried; a tensor with fewer than ``k`` non-zeros (a sparse gradient) sends them all and
    pads with zeros. The sample decides only how much work is done, never which entries win. Small
    selections or ones of a quarter or more, and signed ones whose threshold is not positive, go straight to
    ``torch.topk``. ``out`` is
    a scratch of ``values``' size and dtype.
    """
    n = values.numel()
    samples = math.ceil(sample_ratio * n)
    if k * 4 >= n or samples < 1024:
        return _topk(values, k, signed)
    drawn = sample(values, samples, generator)
    drawn = drawn.float() if signed else drawn.abs().float()
    # Expected passes in the sample: k/n of it; aim 20% and 3 standard deviations (of a binomial count) higher.
    expected = samples * k / n
    rank = math.ceil(1.2 * expected + 3 * math.sqrt(expected)) + 1
    for _ in range(4):
        rank = min(samples, rank)
        threshold = float(torch.topk(drawn, rank, sorted=False).values.min())
        if signed and threshold <= 0:
            break
        candidates = above(values, threshold, out)
        if signed:
            candidates = candidates[values.index_select(0, candidates) > 0]
        elif threshold <= 0 and candidates.numel() < k:  # fewer non-zeros than k: all of them, then zeros
            return fill_to_k(values, candidates, k, out)
        if candidates.numel() >= k:
            chosen = values.index_select(0, candidates)
            chosen = chosen if signed else chosen.abs_()
            return candidates.index_select(0, torch.topk(chosen, k, sorted=False).indices)
        if rank == samples:
            break
        rank *= 4
    return _topk(values, k, signed)


def _topk(values: Tensor, k: int, signed: bool) -> Tensor:
    return torch.topk(values if signed else values.abs(), k, sorted=False).indices


class Scratch:
    """Flat buffers reused from call to call, one per ``(dtype, device)``, grown to the largest request.

    Compressors take their gradient-sized temporaries from it: a fresh allocation each call costs page faults on
    CPU. Views are valid until the next request of the same dtype and slot, so nothing returned may keep one. Not
    pickled (a spawned strategy starts with none).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device, int], Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> Tensor:
        """A flat tensor of ``numel`` entries, contents undefined; ``slot`` tells apart buffers needed together."""
        buffer = self._buffers.get((dtype, device, slot))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(dtype, device, slot)] = buffer
        return buffer[:numel]

    def like(self, flat: Tensor, slot: int = 0) -> Tensor:
        """A reused flat buffer of ``flat``'s size, dtype and device."""
        return self.get(flat.numel(), flat.dtype, flat.device, slot)

    def __getstate__(self) -> dict[str, object]:
        return {"_buffers": {}}
