"""Helpers shared by the methods that select or draw at random: seeded generators, sampling, thresholds, fill to k.

The selection path is written for large gradients on CPU as much as on GPU: the tensor is read, never written,
to find what lies above a threshold (the peaks of 32-entry blocks, then only the blocks holding a survivor), further
thresholds are tried on the peaks alone, no full-size temporaries beyond the caller's scratch buffer (fresh 100 MB
allocations cost more in page faults than the arithmetic), no sort or ``topk`` over the whole tensor (``torch.topk``
of 25M entries takes half a second on a CPU core), and ``index_select`` instead of advanced indexing.
"""

import math
import zlib

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels


def seeded_generator(seed: int, step: int, key: str, rank: int = 0) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step, key, rank)``.

    A dedicated generator, never the global one: the global RNG differs between ranks and belongs to the user.
    Methods whose draws must agree across ranks (Random-K's indices) pass ``rank=0`` everywhere; methods whose draws
    should be independent per rank (stochastic rounding) pass their rank.
    """
    return torch.Generator(device="cpu").manual_seed(stream_key(seed, step, key, rank))


def stream_key(seed: int, step: int, key: str, rank: int = 0) -> int:
    """A 63-bit number mixed from ``(seed, step, key, rank)``: a generator's seed, or a counter-based stream."""
    return (((seed * 1_000_003 + step) * 4_294_967_311 + zlib.crc32(key.encode())) * 65_537 + rank) % (1 << 63)


#: How many times :meth:`Blocks.above_lowering` lowers a threshold too high, and by what factor when the tensor has
#: fewer than ``k`` blocks (the selection is exact either way: these only bound the work).
LOWERINGS, LOWERING_FACTOR = 3, 0.7

#: Entries a run in :func:`sample`.
_RUN = 32


def sample(values: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """About ``count`` entries of the flat ``values``, in runs of 32 contiguous entries whose starts are drawn
    uniformly with replacement: a cluster sample, unbiased for any statistic of the entries' distribution, and a
    gather of a few hundred contiguous runs costs a small part of what as many scattered entries cost (each of
    those is a cache miss). Tensors shorter than a run give all their entries."""
    n = values.numel()
    if n <= _RUN:
        return values.reshape(-1)
    starts = torch.randint(n - _RUN + 1, (max(1, count // _RUN),), generator=generator)
    return values.reshape(-1).unfold(0, _RUN, 1).index_select(0, starts.to(values.device)).view(-1)


def distinct_indices(numel: int, k: int, generator: torch.Generator) -> Tensor:
    """``k`` distinct indices in ``[0, numel)``, a uniformly random subset, sorted (int64, on the CPU).

    The first ``k`` distinct values of a stream of uniform draws form a uniform random ``k``-subset; drawing exactly
    the shortfall each round never overshoots, and rounds shrink geometrically. Costs ``O(k log k)``, where
    ``randperm(numel)[:k]`` costs ``O(numel)`` (a second for 25M entries).
    """
    if k * 2 > numel:  # dense: a permutation is as cheap, and the draws would collide often
        return torch.randperm(numel, generator=generator)[:k].sort().values
    # int32 draws sort faster than int64, and a stable sort then unique_consecutive beats unique on a CPU.
    dtype = torch.int32 if numel < 2**31 else torch.int64
    chosen = torch.randint(numel, (k,), generator=generator, dtype=dtype)
    chosen = chosen.sort(stable=True).values.unique_consecutive()
    while chosen.numel() < k:
        more = torch.randint(numel, (k - chosen.numel(),), generator=generator, dtype=dtype)
        chosen = torch.cat([chosen, more]).sort(stable=True).values.unique_consecutive()
    return chosen.long()


#: Entries a block in :class:`Blocks`. torch's CPU row reductions are vectorized from 32 entries a row on (16 is
#: four times slower), and few blocks hold a survivor when about 1% of the entries pass. The compiled kernels use it.
_BLOCK = kernels.BLOCK


class Blocks:
    """A flat tensor seen as blocks of 32 entries with each block's peak: its largest magnitude (largest value when
    ``signed``), from one read of the tensor that writes 1/32 of it: a compiled kernel for fp32 on CPU
    (:mod:`~lightning_gravac.compressors.kernels`), two vectorized row reductions otherwise.

    Which blocks hold an entry above a threshold is then a question about the peaks alone, so thresholds can be
    tried again and again without another pass over the tensor, and only the blocks that hold a survivor are copied
    and scanned. A block holding a NaN has a NaN peak and is scanned. ``negated`` (compiled kernels only) is the
    signed selection of ``-values``, read from ``values`` without a negated copy.
    """

    def __init__(self, values: Tensor, signed: bool, peak: Tensor | None = None, negated: bool = False) -> None:
        values = values if values.is_contiguous() else values.contiguous()  # blocks are rows of a view
        self.values, self.signed, self.negated = values, signed or negated, negated
        self.whole = values.numel() - values.numel() % _BLOCK
        self.rows = values[: self.whole].view(-1, _BLOCK)
        self.native = kernels.usable(values)
        if negated and not self.native:
            raise ValueError("a negated selection reads -x through the compiled kernels, which do not take this tensor")
        if peak is not None:  # computed along with the values (DGC's accumulation, both of AdaQ's tails)
            self.peak = peak
        elif self.native:
            self.peak = kernels.block_peaks(values, self.rows.shape[0], signed, negated)
        else:
            peak = torch.amax(self.rows, 1)
            self.peak = peak if signed else torch.maximum(peak, torch.amin(self.rows, 1).neg_())

    def above(self, threshold: float, out: Tensor) -> Tensor:
        """Sorted indices of the entries above ``threshold``; ``out`` is a scratch of the tensor's size and dtype."""
        n = self.values.numel()
        if self.native:
            found = kernels.scan(self.values, self.peak, threshold, self.signed, out, self.negated)
        else:
            # A NaN peak is hot: its block is scanned, and only the NaN itself is judged by the entry test.
            hot = torch.le(self.peak, threshold).logical_not_()
            rows = hot.nonzero().view(-1)
            if rows.numel() * 4 > hot.numel():  # a quarter of the blocks or more: one pass over all is cheaper
                return _survivors(self.values, threshold, out[:n], self.signed)
            lanes = torch.index_select(self.rows, 0, rows, out=out[: rows.numel() * _BLOCK].view(-1, _BLOCK))
            inner = _survivors(lanes.view(-1), threshold, lanes.view(-1), self.signed)
            found = rows.index_select(0, inner.div(_BLOCK, rounding_mode="floor")).mul_(_BLOCK)
            found.add_(inner.remainder(_BLOCK))
        if self.whole < n:
            rest = self.values[self.whole :]
            if self.negated:
                tail = torch.lt(rest, -threshold).nonzero().view(-1)
            else:
                tail = _survivors(rest, threshold, out[self.whole : n], self.signed)
            found = torch.cat([found, tail.add_(self.whole)])
        return found

    def count(self, threshold: float) -> int:
        """Blocks holding an entry above ``threshold``: at least one and at most 32 entries each."""
        return int(torch.count_nonzero(self.peak > threshold))

    def lowered(self, threshold: float, k: int, factor: float) -> float:
        """For a ``threshold`` that fewer than ``k`` entries exceed, a lower one that about ``k`` do: just below the
        ``k``-th largest block peak (so at least ``k`` do, and little more when few blocks hold two), or ``threshold *
        factor`` when there are fewer than ``k`` blocks. Costs a selection among the peaks, not a pass over the
        tensor."""
        if k > self.peak.numel():
            return threshold * factor
        kth = kth_largest(self.peak.float(), k)
        return float(torch.nextafter(kth, kth.new_zeros(())))

    def above_lowering(self, threshold: float, k: int, out: Tensor) -> tuple[Tensor, float]:
        """The entries above ``threshold``, lowered (:meth:`lowered`) up to :data:`LOWERINGS` times while fewer than
        ``k`` pass and it is positive; returns them and the threshold that gave them. One lowering almost always
        suffices (just below the ``k``-th block peak, at least ``k`` pass); the factor only serves tensors of fewer
        than ``k`` blocks. Callers decide what a tensor still short gets (every non-zero, or the exact top ``k``)."""
        candidates = self.above(threshold, out)
        for _ in range(LOWERINGS):
            if candidates.numel() >= k or threshold <= 0:  # enough, or a sparse tensor: every non-zero passed
                break
            threshold = self.lowered(threshold, k, LOWERING_FACTOR)
            candidates = self.above(threshold, out)
        return candidates, threshold

    def topk(self, k: int, out: Tensor, generator: torch.Generator, sample_ratio: float = 0.01) -> Tensor:
        """The exact top ``k`` (see :func:`exact_topk`): a sample estimates a threshold a little below the ``k``-th
        largest; if at least ``k`` entries pass it, the top ``k`` among them is the top ``k`` of the whole (ties
        broken as ``topk`` breaks them). Otherwise a lower quantile of the sample is tried, from the block peaks
        alone (no new pass over the tensor); a tensor with fewer than ``k`` non-zeros (a sparse gradient) sends them
        all and pads. The sample decides only how much work is done, never which entries win. A signed selection
        whose threshold is not positive, or one still short after four tries, takes ``torch.topk``.
        """
        found = self.from_threshold(k, out, generator, sample_ratio)
        return found if found is not None else _topk(self.values, k, self.signed)

    def from_threshold(
        self, k: int, out: Tensor, generator: torch.Generator, sample_ratio: float, exclude: Tensor | None = None
    ) -> Tensor | None:
        """:meth:`topk` without its fallback: ``None`` where it would take ``torch.topk``. ``exclude`` (signed and
        negated selections only) names positions that may not be chosen."""
        if exclude is not None and not self.signed:
            raise ValueError("excluding positions needs a signed selection (a magnitude's test is not the value's)")
        values, n = self.values, self.values.numel()
        drawn = sample(values, math.ceil(sample_ratio * n), generator)
        drawn = drawn.neg() if self.negated else drawn.float() if self.signed else drawn.abs().float()
        # An excluded position is a candidate only where its value passes the threshold (AdaQ's largest entries
        # reaching the negatives; a NaN never does): tested on the excluded values alone.
        excluded = None
        if exclude is not None:
            excluded = values.index_select(0, exclude)
            excluded = excluded.neg() if self.negated else excluded
        samples = drawn.numel()
        rank = margin_rank(samples, k, n)
        for _ in range(4):
            rank = min(samples, rank)
            threshold = float(torch.topk(drawn, rank, sorted=False).values.min())
            if self.signed and threshold <= 0:
                break
            candidates = self.above(threshold, out)
            if exclude is not None and excluded is not None and bool(torch.gt(excluded, threshold).any()):
                candidates = candidates[torch.isin(candidates, exclude, invert=True)]
            if threshold <= 0 and candidates.numel() < k:  # fewer non-zeros than k: all of them, then zeros
                return fill_to_k(values, candidates, k)
            if candidates.numel() >= k:
                return _top_among(values, candidates, k, self.signed, self.negated)
            if rank == samples:
                break
            rank *= 4
        return None


def kth_largest(values: Tensor, k: int) -> Tensor:
    """The ``k``-th largest of the flat ``values`` (NaN counting as largest, as ``kthvalue`` orders), exactly.

    ``kthvalue`` over every block peak of a large bucket costs more than the selection it serves. A strided
    sample's ``margin_rank``-th largest is, almost surely, no larger than the answer; the ``k``-th largest of the
    few values at or above it is the answer, and ``kthvalue`` of the whole is the fallback when the bound misses.
    The sample decides the work, not the result.
    """
    n = values.numel()
    drawn = values[:: max(1, n // 8192)]
    if drawn.numel() * 4 > n:  # short: the sample saves nothing
        return torch.kthvalue(values, n - k + 1).values
    rank = min(drawn.numel(), margin_rank(drawn.numel(), k, n))
    bound = torch.kthvalue(drawn, drawn.numel() - rank + 1).values
    pool = values[torch.lt(values, bound).logical_not_()]  # NaN stays in the pool, as it is among the largest
    if pool.numel() >= k:
        return torch.kthvalue(pool, pool.numel() - k + 1).values
    return torch.kthvalue(values, n - k + 1).values


def above(values: Tensor, threshold: float, out: Tensor, signed: bool = False) -> Tensor:
    """Sorted int64 indices of the flat ``values`` whose magnitude (value, with ``signed``) exceeds ``threshold``.

    The tensor is read twice and never written (block peaks, then the blocks that hold a survivor, copied into the
    caller's scratch ``out`` of ``values``' size and dtype); see :class:`Blocks`. Without ``signed``, NaN entries
    survive (they fail every comparison).
    """
    if values.numel() < 64 * _BLOCK:
        return _survivors(values, threshold, out[: values.numel()], signed)
    return Blocks(values, signed).above(threshold, out)


def _survivors(values: Tensor, threshold: float, out: Tensor, signed: bool) -> Tensor:
    """:func:`above` in one pass: ``hardshrink`` into ``out`` (may be ``values`` itself), then the word scan."""
    torch.hardshrink(values, threshold, out=out)
    found = nonzero_words(out)
    return found[values.index_select(0, found) > 0] if signed else found


def nonzero_words(flat: Tensor) -> Tensor:
    """Sorted int64 indices of the non-zero entries of the flat ``flat``, scanning whole 8-byte words first:
    about twice as fast as ``nonzero`` on a CPU when few entries are non-zero.

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


def fill_to_k(values: Tensor, candidates: Tensor, k: int) -> Tensor:
    """Exactly ``k`` distinct indices of the flat ``values``: the ``k`` of largest magnitude among ``candidates``
    (sorted and distinct, as :func:`above` returns them) when there are at least ``k``, else every candidate and the
    first entries that are not one, in index order.

    Padding sends the padded entries' true values, so nothing is lost (error feedback zeroes exactly what was sent);
    they are just not the next largest. That keeps payloads at their fixed size without a ``topk`` over the whole
    tensor.
    """
    found = candidates.numel()
    if found >= k:
        return _top_among(values, candidates, k, signed=False)
    # The first k - found entries that are not candidates lie within the first k entries: scan those alone.
    free = torch.ones(k, dtype=torch.bool, device=values.device)
    free.index_fill_(0, candidates[: int(torch.searchsorted(candidates, k))], False)
    return torch.cat([candidates, free.nonzero().view(-1)[: k - found]])


def _top_among(values: Tensor, candidates: Tensor, k: int, signed: bool, negated: bool = False) -> Tensor:
    """The ``k`` of ``candidates`` (at least ``k`` indices into the flat ``values``) of largest magnitude (value;
    value of ``-values`` when ``negated``)."""
    if candidates.numel() == k:
        return candidates
    chosen = values.index_select(0, candidates)
    chosen = chosen.neg_() if negated else chosen if signed else chosen.abs_()
    return candidates.index_select(0, torch.topk(chosen, k, sorted=False).indices)


def margin_rank(samples: int, k: int, n: int) -> int:
    """The rank in a sample of ``samples`` of ``n`` entries whose value a little more than ``k`` entries exceed: the
    expected count ``samples * k / n`` plus 20% and 3 standard deviations of a binomial count, so that falling short
    of ``k`` is rare while the candidates stay few."""
    expected = samples * k / n
    return math.ceil(1.2 * expected + 3 * math.sqrt(expected)) + 1


def exact_topk(
    values: Tensor,
    k: int,
    out: Tensor,
    generator: torch.Generator,
    sample_ratio: float = 0.01,
    signed: bool = False,
    peak: Tensor | None = None,
) -> Tensor:
    """Indices of the ``k`` entries of the flat ``values`` of largest magnitude (largest value with ``signed``):
    exact, without a ``topk`` over the whole tensor (see :meth:`Blocks.topk`). Small selections or ones of a
    quarter or more go straight to ``torch.topk``. ``out`` is a scratch of ``values``' size and dtype; ``peak``,
    the block peaks when the caller has them (:func:`signed_extremes`).
    """
    if not through_blocks(values.numel(), k, sample_ratio):
        return _topk(values, k, signed)
    return Blocks(values, signed, peak).topk(k, out, generator, sample_ratio)


def through_blocks(n: int, k: int, sample_ratio: float) -> bool:
    """Whether a selection of ``k`` of ``n`` entries goes through :class:`Blocks`: a sample large enough to place a
    threshold and fewer than a quarter of the entries kept (else ``torch.topk`` is as cheap)."""
    return k * 4 < n and sample_ratio * n >= 1024


def signed_extremes(values: Tensor, k: int, sample_ratio: float = 0.01) -> tuple[Tensor | None, Tensor | None]:
    """The signed block peaks of the flat ``values`` and of ``-values`` from one read (the compiled kernel), for
    selections of ``k`` from both tails (:func:`exact_topk` signed, :func:`exact_lowest`); ``(None, None)`` where
    those would not read the peaks (see :func:`exact_topk`) or the kernels do not take ``values``."""
    if not through_blocks(values.numel(), k, sample_ratio) or not kernels.usable(values):
        return None, None
    return kernels.block_extremes(values, values.numel() // _BLOCK)


def exact_lowest(
    values: Tensor,
    k: int,
    out: Tensor,
    generator: torch.Generator,
    exclude: Tensor,
    sample_ratio: float = 0.01,
    peak: Tensor | None = None,
) -> Tensor | None:
    """Indices of the ``k`` smallest entries of the flat fp32 ``values`` outside the positions ``exclude``, read
    from ``values`` by the compiled kernels without a negated copy: always the exact set; and, when every excluded
    value is at least every other value (AdaQ's top group), what :func:`exact_topk` with ``signed`` gives on a copy
    of ``-values`` whose ``exclude`` positions are ``-inf``, in the same order (the same draws, candidates and
    ``topk`` among them; otherwise the draws see ``-x`` where the copy holds ``-inf``, so a threshold, and with it
    the order or the choice among ties, may differ). ``None`` where this path cannot decide cheaply (no kernels, a
    small tensor or selection, fewer than about ``k`` negative entries, or still short after four thresholds): the
    caller then makes the copy. ``peak``: the block peaks of ``-values`` when the caller has them
    (:func:`signed_extremes`).
    """
    if not through_blocks(values.numel(), k, sample_ratio) or not kernels.usable(values):
        return None
    return Blocks(values, True, peak, negated=True).from_threshold(k, out, generator, sample_ratio, exclude)


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
