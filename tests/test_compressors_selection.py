"""The sparsifiers' selection, without a process group: Top-K, Random-K and the threshold methods, and the scans,
draws and fills they choose their entries with."""

import math

import pytest
import torch
from compressor_inputs import DTYPES, _grad

from lightning_gravac.compressors import get_compressor, sparse_k
from lightning_gravac.compressors.select import above, distinct_indices, exact_topk, fill_to_k


@pytest.mark.parametrize("cf", [2, 10, 100, 1000])
def test_topk_keeps_exactly_the_largest_magnitudes(cf):
    g = _grad(10_000) * torch.linspace(0.1, 3, 10_000)  # distinct magnitudes, no ties
    c = get_compressor("topk")
    payload = c.compress(g, cf=cf)
    values, indices = payload.wire
    k = math.ceil(10_000 * 4 / (cf * 8))
    assert indices.dtype == torch.int32 and values.numel() == k
    expected = torch.argsort(g.abs(), descending=True)[:k]
    assert set(indices.tolist()) == set(expected.tolist())
    assert torch.equal(values, g[indices.long()])
    decoded = c.decompress(payload)
    assert torch.count_nonzero(decoded) == k and torch.equal(decoded[expected], g[expected])


def test_randomk_indices_agree_for_same_seed_step_key_and_differ_otherwise():
    a, b = get_compressor("randomk", seed=3), get_compressor("randomk", seed=3)
    g1, g2 = _grad(seed=1), _grad(seed=2)  # different data, as on two ranks
    idx = lambda c, g, **kw: c.compress(g, cf=10, **kw).derived[0]  # noqa: E731
    assert torch.equal(idx(a, g1, key="w", step=4), idx(b, g2, key="w", step=4))
    assert not torch.equal(idx(a, g1, key="w", step=4), idx(a, g1, key="w", step=5))
    assert not torch.equal(idx(a, g1, key="w", step=4), idx(a, g1, key="v", step=4))
    assert not torch.equal(idx(a, g1, key="w", step=4), idx(get_compressor("randomk", seed=4), g1, key="w", step=4))
    assert idx(a, g1, key="w", step=4).unique().numel() == 410  # without replacement


def test_unbiased_randomk_is_unbiased():
    # Mean of n draws: each entry is kept with probability p = k/numel and scaled by 1/p, so its sample mean has
    # standard deviation |g_i| sqrt((1-p)/(p n)). Bound the worst entry at 6 of those.
    c = get_compressor("randomk", unbiased=True)
    g, n = _grad(1000), 4000
    mean = sum(c.decompress(c.compress(g, cf=4, step=s)) for s in range(n)) / n
    p = 250 / 1000
    std = g.abs() * math.sqrt((1 - p) / (p * n))
    assert torch.all((mean - g).abs() <= 6 * std + 1e-6)
    assert not c.biased and get_compressor("randomk").biased


def test_fill_to_k_takes_the_top_of_many_candidates_and_pads_few():
    values = torch.tensor([5.0, -1.0, -4.0, 3.0, 0.5, 2.0])
    out = torch.empty(6)

    def pick(threshold: float, k: int) -> list[int]:
        return fill_to_k(values, above(values, threshold, out), k).tolist()

    assert sorted(pick(1.5, 2)) == [0, 2]
    assert pick(4.5, 3) == [0, 1, 2]  # the one candidate, then the first entries left out, in index order
    assert len(pick(1.5, 4)) == 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [3, 7, 8, 1001, 100_003])
def test_above_finds_every_entry_whose_magnitude_exceeds_the_threshold(numel, dtype):
    values = (torch.rand(numel, generator=torch.Generator().manual_seed(numel)) * 2 - 1).to(dtype)
    for threshold in (0.0, 0.5, 0.999, 2.0):
        found = above(values, threshold, torch.empty_like(values))
        assert torch.equal(found, (values.abs() > threshold).nonzero().view(-1))
    offset = values[1:]  # not 8-byte aligned: the plain scan
    assert torch.equal(above(offset, 0.5, torch.empty_like(offset)), (offset.abs() > 0.5).nonzero().view(-1))


def test_above_by_blocks_is_the_plain_scan_signed_and_with_nan():
    # Sparse survivors (the block path: few blocks of 32 hold one), a tail past the last whole block, NaN entries.
    torch.manual_seed(0)
    values = torch.distributions.StudentT(3.0).sample((70_001,))
    values[[5, 40_000, 70_000]] = float("nan")
    out = torch.empty_like(values)
    for threshold in (8.0, 30.0):
        plain = (values.abs() > threshold) | values.isnan()
        assert torch.equal(above(values, threshold, out), plain.nonzero().view(-1))
        assert torch.equal(above(values, threshold, out, signed=True), (values > threshold).nonzero().view(-1))


def test_a_lowered_threshold_admits_k_entries_from_the_block_peaks_alone():
    from lightning_gravac.compressors.select import Blocks

    torch.manual_seed(2)
    values = torch.distributions.StudentT(3.0).sample((64_000,))  # 2,000 blocks of 32
    blocks = Blocks(values, signed=False)
    for k in (1, 300, 2000):
        threshold = blocks.lowered(float(values.abs().max()), k, 0.7)
        passed = int((values.abs() > threshold).sum())
        peaks = values.abs().view(-1, 32).amax(1)
        assert passed >= k and int((peaks > threshold).sum()) == k  # just below the k-th largest peak
    assert blocks.lowered(1.0, 2001, 0.7) == pytest.approx(0.7)  # more than one a block: the plain factor


def test_selection_reads_strided_tensors():
    torch.manual_seed(1)
    values = torch.distributions.StudentT(3.0).sample((200_000,))[::2]  # a 1-D view with stride 2
    out = torch.empty(values.numel())
    assert torch.equal(above(values, 10.0, out), (values.abs() > 10.0).nonzero().view(-1))
    got = exact_topk(values, 500, out, torch.Generator().manual_seed(0))
    assert torch.equal(got.sort().values, torch.topk(values.abs(), 500).indices.sort().values)


def test_fill_to_k_pads_around_candidates_in_index_order():
    values = torch.zeros(10)
    values[[1, 7]] = 1.0
    assert fill_to_k(values, torch.tensor([1, 7]), 5).tolist() == [1, 7, 0, 2, 3]


@pytest.mark.parametrize("k", [1, 10, 500, 5000, 60_000])
def test_exact_topk_by_sampled_threshold_is_exact(k):
    torch.manual_seed(k)
    values = torch.distributions.StudentT(3.0).sample((100_000,))
    out = torch.empty_like(values)
    for seed in range(3):
        got = exact_topk(values, k, out, torch.Generator().manual_seed(seed))
        assert torch.equal(got.sort().values, torch.topk(values.abs(), k).indices.sort().values)
        signed = exact_topk(values, k, out, torch.Generator().manual_seed(seed), signed=True)
        assert torch.equal(signed.sort().values, torch.topk(values, k).indices.sort().values)


def test_distinct_indices_are_distinct_uniform_and_reproducible():
    draws = [distinct_indices(1000, 100, torch.Generator().manual_seed(s)) for s in range(400)]
    assert all(d.unique().numel() == 100 and d.min() >= 0 and d.max() < 1000 for d in draws)
    assert torch.equal(draws[0], distinct_indices(1000, 100, torch.Generator().manual_seed(0)))
    # Each index is chosen with probability 0.1: 40 times in 400 draws, standard deviation 6.
    counts = torch.bincount(torch.cat(draws), minlength=1000)
    assert counts.min() > 40 - 6 * 6 and counts.max() < 40 + 6 * 6


@pytest.mark.parametrize("name", ["redsync", "sidco", "threshold"])
@pytest.mark.parametrize("cf", [10, 100, 1000])
def test_threshold_methods_keep_exactly_k_distinct_entries_close_to_topk(name, cf):
    # Heavy-tailed like real gradients: Student-t with 3 degrees of freedom.
    torch.manual_seed(cf)
    g = torch.distributions.StudentT(3.0).sample((50_000,)).float()
    c, topk = get_compressor(name), get_compressor("topk")
    values, indices = c.compress(g, cf=cf, key="w").wire
    k = sparse_k(g.numel(), cf, g.dtype)
    assert values.numel() == k and indices.unique().numel() == k
    assert torch.equal(values, g[indices.long()])
    best = topk.compress(g, cf=cf).wire[0].double().square().sum()
    # The kept energy against exact Top-K's: the threshold estimate costs at most a little of it.
    assert values.double().square().sum() >= 0.9 * best


def test_redsync_search_ends_below_the_kth_magnitude_on_gaussian_gradients():
    # Light tails: the bisection between mean and max stops at a threshold passing at least k (on the sample, so on
    # the tensor give or take its error) and at most a few k (the search's 0.2 resolution); the exact top k of those
    # candidates is then the exact Top-K.
    g = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0))
    for k in (1000, 10_000):
        thr = get_compressor("redsync").threshold(g, k, key="w", step=0)
        assert k <= int((g.abs() > thr).sum()) <= 8 * k
        indices = get_compressor("redsync").compress(g, cf=4e6 / (8 * k) * 1.0000001, key="w").wire[1]
        assert set(indices.tolist()) == set(torch.topk(g.abs(), indices.numel()).indices.tolist())


def test_topk_of_fp16_and_bf16_keeps_their_dtype_and_the_largest():
    for dtype in (torch.float16, torch.bfloat16):
        g = (torch.arange(1, 401, dtype=torch.float32) * torch.tensor([1.0, -1.0]).repeat(200)).to(dtype)
        values, indices = get_compressor("topk").compress(g, cf=25).wire
        assert values.dtype == dtype and sorted(indices.tolist()) == list(range(400 - indices.numel(), 400))


@pytest.mark.parametrize("name", ["topk", "dgc", "redsync", "sidco", "threshold"])
def test_a_gradient_with_fewer_non_zeros_than_k_sends_them_all(name):
    # An embedding's gradient: a few rows touched, the rest exactly zero. k = 50,000 > 3,000 non-zeros.
    g = torch.zeros(1_000_000)
    g[torch.randperm(1_000_000, generator=torch.Generator().manual_seed(0))[:3000]] = torch.randn(3000)
    c = get_compressor(name, warmup_epochs=0, clip_norm=None) if name == "dgc" else get_compressor(name)
    values, indices = c.compress(g, cf=10, key="w").wire
    assert indices.numel() == sparse_k(1_000_000, 10, torch.float32) == indices.unique().numel()
    assert torch.count_nonzero(values) == 3000 and torch.equal(c.decompress(c.compress(g, cf=10, key="v")), g)


@pytest.mark.parametrize("k", [1, 37, 5_000, 60_000, 99_999])
def test_kth_largest_is_kthvalue_including_ties_and_nan(k):
    from lightning_gravac.compressors.select import kth_largest

    values = torch.randn(100_000, generator=torch.Generator().manual_seed(k)).abs()
    values[::7] = values[3]  # many ties
    values[11] = float("nan")
    expected = torch.kthvalue(values, values.numel() - k + 1).values
    torch.testing.assert_close(kth_largest(values, k), expected, rtol=0, atol=0, equal_nan=True)
