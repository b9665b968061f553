"""Compressor math, without a process group."""

import math
import warnings

import pytest
import torch

from lightning_gravac.adaptations import ErrorFeedback
from lightning_gravac.compressors import get_compressor, list_compressors, sparse_k, validate_cf
from lightning_gravac.compressors.base import Payload, sq_norm
from lightning_gravac.compressors.packing import Layout, pack_bits, unpack_bits
from lightning_gravac.compressors.select import above, distinct_indices, exact_topk, fill_to_k
from lightning_gravac.compressors.sparse import Sparsifier

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _grad(numel: int = 4096, dtype: torch.dtype = torch.float32, seed: int = 0, shape=None) -> torch.Tensor:
    g = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return g.view(shape) if shape else g


#: Factors each method can reach on a [256, 300] fp32 matrix (its target, where the method fixes its own).
REACHABLE = {
    "adaq": [10, 100],
    "bf16": [2],
    "dgc": [10, 100],
    "efsignsgd": [32],
    "fp16": [2],
    "int4": [8],  # 4.25 bits an entry at 128-entry blocks: 7.5x
    "int8": [4],
    "natural": [4],  # a byte an entry
    "none": [1],
    "onebit": [25.6],  # 256 bits and 2 fp32 means a column of 256 fp32 entries
    "powersgd": [10, 35],
    "qsgd": [4, 5, 8, 10],
    "randomk": [10, 100],
    "redsync": [10, 100],
    "sidco": [10, 100],
    "signsgd": [32],
    "terngrad": [16],
    "threshold": [10, 100],
    "topk": [10, 100],
}


def _fresh(name: str):
    # DGC's warm-up keeps a quarter of the entries in epoch 0; past it, it keeps what cf asks.
    return get_compressor(name, warmup_epochs=0) if name == "dgc" else get_compressor(name)


def test_reachable_table_covers_every_registered_compressor():
    assert sorted(REACHABLE) == list_compressors()


@pytest.mark.parametrize("name", list_compressors())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
class TestEveryCompressor:
    def test_round_trip_shape_and_dtype(self, name, dtype):
        c = get_compressor(name)
        g = _grad(dtype=dtype, shape=(64, 64))
        out = c.decompress(c.compress(g, cf=10, key="w", step=3))
        assert out.shape == g.shape and out.dtype == g.dtype

    def test_the_header_norm_is_the_energy_of_what_is_decoded(self, name, dtype):
        # Closed forms (signs, counts, the packed codes' integer energies, P^T P * Q^T Q) against the decoded payload,
        # on a shape that pads (QSGD's buckets, the packed bytes), in every dtype (a 16-bit payload decodes with one
        # more rounding, which a closed form must see or leave to the decode).
        c = _fresh(name)
        for cf in REACHABLE[name]:
            payload = c.compress(_grad(64 * 33, dtype, seed=3, shape=(64, 33)) * 3, cf=cf, key="w", step=1)
            expected = float(sq_norm(c.decompress(payload)))
            assert float(c.sent_sq_norm(payload)) == pytest.approx(expected, rel=1e-5)

    def test_payload_size_depends_on_numel_and_cf_only(self, name, dtype):
        c = get_compressor(name)
        a = c.compress(_grad(1000, dtype, seed=1), cf=20, key="a", step=0)
        b = c.compress(_grad(1000, dtype, seed=2) * 1e3, cf=20, key="b", step=7)
        assert [t.shape for t in a.wire] == [t.shape for t in b.wire]
        assert [t.dtype for t in a.wire] == [t.dtype for t in b.wire]

    def test_achieved_cf_within_ten_percent_of_a_reachable_target(self, name, dtype):
        g = _grad(256 * 300, shape=(256, 300))  # fp32: the factors are stated for fp32 values
        for cf in REACHABLE[name]:
            c = _fresh(name)
            achieved = c.achieved_cf(c.compress(g, cf=cf, key="w"))
            assert achieved == pytest.approx(cf, rel=0.1), f"asked {cf}, achieved {achieved:.2f}"

    def test_error_feedback_residual_is_input_minus_decoded(self, name, dtype):
        c, memory = _fresh(name), ErrorFeedback()
        if c.owns_feedback:
            pytest.skip("keeps its own residual (DGC's v): tests/test_dgc.py")
        for step in range(3):
            g = _grad(dtype=dtype, seed=step, shape=(32, 128))
            memory.compensate_("w", g)
            error_fed = g.clone()
            payload = c.compress(g, cf=20, key="w", step=step)
            residual = memory.residual_of(c, g, payload)
            memory.set("w", residual)
            decoded = c.decompress(payload)
            assert torch.equal(g, error_fed), "residual_of must not modify its input"
            assert torch.equal(residual, error_fed - decoded)
            if isinstance(c, Sparsifier) or name in ("randomk", "none"):
                # Sparsifiers zero what they sent: residual + decoded is the input with no rounding at all.
                assert torch.equal(residual + decoded, error_fed)

    def test_deterministic(self, name, dtype):
        g = _grad(dtype=dtype)
        a = get_compressor(name).compress(g, cf=10, key="w", step=5)
        b = get_compressor(name).compress(g.clone(), cf=10, key="w", step=5)
        assert all(torch.equal(x, y) for x, y in zip(a.wire, b.wire, strict=True))


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


@pytest.mark.parametrize(
    ("cf", "dtype", "index_bytes", "k"),
    [
        (100, torch.float32, 4, 50),  # value + int32 index = 2 fp32 elements: cf 100 keeps numel / 200
        (100, torch.float32, 0, 100),  # no indices sent (Random-K): numel / 100
        (100, torch.float16, 4, 34),  # 2 + 4 bytes an entry: ceil(10000 * 2 / 600)
        (1e9, torch.float32, 4, 1),  # at least one entry
    ],
)
def test_sparse_k_accounting(cf, dtype, index_bytes, k):
    assert sparse_k(10_000, cf, dtype, index_bytes) == k


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


def test_none_is_identity():
    g = _grad(dtype=torch.bfloat16)
    c = get_compressor("none")
    assert torch.equal(c.decompress(c.compress(g, cf=1)), g)


def test_unknown_compressor_lists_known_names():
    with pytest.raises(ValueError, match=r"Unknown compressor 'zip'\. Known compressors: .*randomk.*topk"):
        get_compressor("zip")


@pytest.mark.parametrize("cf", [0.5, 0, -3, float("nan"), float("inf"), "10", True])
def test_cf_must_be_a_finite_number_at_least_one(cf):
    with pytest.raises(ValueError, match=r"`cf` must be a finite number >= 1"):
        validate_cf(cf)


def test_layout_packs_mixed_dtypes_aligned_and_unpacks_every_rank():
    topk = get_compressor("topk")
    payloads = [
        topk.compress(_grad(333, torch.float16, seed=1), cf=7),
        topk.compress(_grad(100, torch.float32, seed=2), cf=3),
        Payload((torch.arange(5, dtype=torch.uint8),), torch.Size([5]), torch.uint8),
    ]
    layout = Layout.of(payloads, header_numel=2)
    assert layout.nbytes % 8 == 0
    assert all(s.offset % torch.empty((), dtype=s.dtype).element_size() == 0 for s in layout.slots)
    header = torch.tensor([1.5, 2.5], dtype=torch.float64)
    rows = torch.stack([layout.pack(payloads, header), layout.pack(payloads, 2 * header)])
    headers, stacked = layout.unpack(rows, payloads)
    assert torch.equal(headers, torch.tensor([[1.5, 2.5], [3.0, 5.0]], dtype=torch.float64))
    for local, both in zip(payloads, stacked, strict=True):
        for w, s in zip(local.wire, both.wire, strict=True):
            assert s.shape == (2, *w.shape) and torch.equal(s[0], w) and torch.equal(s[1], w)


# --- method-specific properties ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1001])
def test_bit_packing_round_trips_in_the_fewest_bytes(bits, numel):
    codes = torch.randint(0, 2**bits, (numel,), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(numel * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, numel), codes)


def test_bit_packing_is_most_significant_first():
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 1]), 1).tolist() == [0b10110001]
    assert pack_bits(torch.tensor([3, 0, 2, 1]), 2).tolist() == [0b11001001]


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


def test_qsgd_is_unbiased():
    # Each entry's level is a two-point draw around s|v|/||v||, spread at most 1 level: its decoded value has
    # standard deviation at most ||v_bucket|| / (2 s). The mean of n draws is within 6 of those / sqrt(n).
    c, g, n = get_compressor("qsgd"), _grad(1024), 3000
    s = c.levels_for(10, torch.float32)
    mean = sum(c.decompress(c.compress(g, cf=10, step=t)) for t in range(n)) / n
    bound = 6 * g.view(2, 512).norm(dim=1).repeat_interleave(512) / (2 * s * math.sqrt(n))
    assert s == 3 and torch.all((mean - g).abs() <= bound)
    assert not torch.allclose(c.decompress(c.compress(g, cf=10, step=0)), g, atol=0.05), "it must quantize"


def test_natural_compression_is_unbiased_within_its_variance_bound_and_exact_on_powers_of_two():
    # Each entry is a two-point draw between the powers of two around it: variance at most |t|^2 / 8, so the mean of
    # n draws is within 6 |t| / sqrt(8 n) of t.
    c, g, n = get_compressor("natural"), _grad(1024), 3000
    mean = sum(c.decompress(c.compress(g, cf=4, key="w", step=t)) for t in range(n)) / n
    assert torch.all((mean - g).abs() <= 6 * g.abs() / math.sqrt(8 * n))
    one = c.decompress(c.compress(g, cf=4, key="w", step=0))
    magnitude = one[one != 0].abs()
    assert torch.equal(magnitude, torch.exp2(torch.log2(magnitude).round())), "every value sent is a power of two"
    assert torch.equal(one.sign(), g.sign())
    # Powers of two are sent as they are, down to 2^-126 of the largest (here 8 = 2^3); below, as 0 (of either sign:
    # a negative one was sent as the sign with code 0, which is NaN's byte, and poisoned the step).
    exact = torch.tensor([0.0, 1.0, -0.5, 2.0**-20, 8.0, -(2.0**-123), 2.0**-124, -(2.0**-124), -1e-45])
    sent = torch.tensor([0.0, 1.0, -0.5, 2.0**-20, 8.0, -(2.0**-123), 0.0, 0.0, 0.0])
    assert torch.equal(c.decompress(c.compress(exact, cf=4, key="p")), sent)
    (codes, top) = c.compress(g, cf=4).wire
    assert codes.dtype == torch.uint8 and codes.numel() == g.numel() and top.numel() == 1
    # Zeros of either sign stay 0; NaN and Inf decode as NaN, never as a finite power of two; an all-zero tensor.
    odd = torch.tensor([0.0, -0.0, -3.0, math.nan, math.inf, -math.inf])
    decoded = c.decompress(c.compress(odd, cf=4, key="o"))
    assert decoded[:2].tolist() == [0.0, 0.0] and decoded[2] in (-2.0, -4.0) and decoded[3:].isnan().all()
    assert torch.equal(c.decompress(c.compress(torch.zeros(8), cf=4)), torch.zeros(8))
    # Rounding up never overflows the input's dtype: fp16 entries near its largest round down instead.
    big = torch.tensor([60000.0, -65504.0, 40000.0], dtype=torch.float16)
    assert all(torch.isfinite(c.decompress(c.compress(big, cf=4, step=t))).all() for t in range(50))


def test_qsgd_packs_sign_and_level_in_the_fewest_bits():
    g = _grad(1000)
    for cf, levels, bits in [(10, 3, 3), (5, 31, 6), (4, 127, 8), (16, 1, 2)]:
        c = get_compressor("qsgd")
        packed, norms = c.compress(g, cf=cf).wire
        assert c.levels_for(cf, torch.float32) == levels
        assert packed.numel() == math.ceil(1000 * bits / 8) and norms.numel() == 2
    assert get_compressor("qsgd", levels=5).compress(g, cf=10).wire[0].numel() == math.ceil(1000 * 4 / 8)


def test_terngrad_is_unbiased_and_ternary():
    # Uniform entries: none is beyond 2.5 standard deviations, so clipping leaves them as they are. An entry is
    # s sign(g) with probability |g|/s, else 0: standard deviation sqrt(s|g| - g^2) <= sqrt(s|g|).
    c, n = get_compressor("terngrad"), 3000
    g = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 2 - 1
    draws = [c.decompress(c.compress(g, cf=16, step=t)) for t in range(n)]
    scale = g.abs().max()
    assert all(set(d.unique().tolist()) <= {-scale.item(), 0.0, scale.item()} for d in draws[:10])
    mean = sum(draws) / n
    assert torch.all((mean - g).abs() <= 6 * torch.sqrt(scale * g.abs() / n) + 1e-6)


def test_terngrad_clips_outliers_to_two_and_a_half_std():
    g = _grad(10_000)
    g[0] = 100.0
    decoded = get_compressor("terngrad").decompress(get_compressor("terngrad").compress(g, cf=16))
    assert decoded.abs().max() <= 2.5 * g.std() + 1e-5


def test_stochastic_quantizers_draw_independently_per_rank():
    g = _grad(4096)
    for name in ("qsgd", "terngrad"):
        a, b = get_compressor(name), get_compressor(name)
        b.setup(world_size=2, rank=1)
        assert not torch.equal(
            a.compress(g, cf=10, key="w", step=1).wire[0], b.compress(g, cf=10, key="w", step=1).wire[0]
        )


def test_onebit_reconstructs_each_column_to_its_means():
    g = _grad(64 * 48, shape=(64, 48))
    decoded = get_compressor("onebit").decompress(get_compressor("onebit").compress(g, cf=32))
    for j in range(48):
        column, out = g[:, j].double(), decoded[:, j].double()
        positive = column >= 0
        assert torch.allclose(out[positive], column[positive].mean().expand(int(positive.sum())), rtol=1e-6)
        assert torch.allclose(out[~positive], column[~positive].mean().expand(int((~positive).sum())), rtol=1e-6)
    assert torch.allclose(decoded.sum(0), g.sum(0), atol=1e-4), "column sums survive"


def test_onebit_sends_a_bit_an_entry_and_two_means_a_column():
    bits, means = get_compressor("onebit").compress(_grad(64 * 48, shape=(64, 48)), cf=32).wire
    assert bits.dtype == torch.uint8 and bits.numel() == 64 * 48 // 8 and means.shape == (2, 48)


def test_signsgd_majority_vote_and_efsignsgd_scale():
    c = get_compressor("signsgd", scaled=False)  # the published method
    ranks = [
        torch.tensor([1.0, -2.0, 3.0, -0.5]),
        torch.tensor([2.0, 1.0, -1.0, -0.1]),
        torch.tensor([-1.0, 3.0, 1.0, 4.0]),
    ]
    payloads = [c.compress(g, cf=32) for g in ranks]
    stacked = payloads[0].with_wire([torch.stack([p.wire[0] for p in payloads])])
    out = torch.zeros(4)
    c.aggregate_(out, stacked, scale=1 / 3)  # the hook averages: the vote must survive the 1/N
    assert out.tolist() == [1.0, 1.0, 1.0, -1.0]
    # The default scales the vote by the ranks' mean of their root-mean-square entries: sqrt(||g||^2 / 4) each.
    scaled = get_compressor("signsgd")
    payloads = [scaled.compress(g, cf=32) for g in ranks]
    rms = [(14.25 / 4) ** 0.5, (6.01 / 4) ** 0.5, (27.0 / 4) ** 0.5]
    assert [float(p.wire[1]) for p in payloads] == pytest.approx(rms)
    stacked = payloads[0].with_wire([torch.stack([p.wire[i] for p in payloads]) for i in range(2)])
    out = torch.zeros(4)
    scaled.aggregate_(out, stacked, scale=1 / 3)
    assert out.tolist() == pytest.approx([sum(rms) / 3, sum(rms) / 3, sum(rms) / 3, -sum(rms) / 3])
    assert scaled.decompress(payloads[0]).tolist() == pytest.approx([rms[0], -rms[0], rms[0], -rms[0]])
    assert float(scaled.sent_sq_norm(payloads[0])) == pytest.approx(14.25)  # as long as the rank's gradient
    assert not c.error_feedback_default and get_compressor("efsignsgd").error_feedback_default
    g = torch.tensor([1.0, -3.0, 0.5, -0.5])
    ef = get_compressor("efsignsgd")
    assert ef.decompress(ef.compress(g, cf=32)).tolist() == [1.25, -1.25, 1.25, -1.25]


def test_adaq_sends_positions_and_two_means():
    g = torch.tensor([0.1, 5.0, -4.0, 0.2, 3.0, -6.0, 0.0, -0.3])
    c = get_compressor("adaq")
    payload = c.compress(g, cf=8)  # 8 fp32 entries: 32 bytes / 8 = 4 bytes, one int32 position... at least 1 each
    decoded = c.decompress(get_compressor("adaq").compress(g, cf=2))  # 4 positions: 2 largest, 2 most negative
    assert decoded.tolist() == [0.0, 4.0, -5.0, 0.0, 4.0, -5.0, 0.0, 0.0]
    assert payload.wire[1].dtype == torch.int32 and payload.wire[0].numel() == 2


def test_powersgd_at_full_rank_reproduces_the_input():
    g = _grad(64 * 48, shape=(64, 48))
    c = get_compressor("powersgd", rank=48)
    assert torch.allclose(c.decompress(c.compress(g, cf=1, key="w")), g, atol=1e-4)
    low = get_compressor("powersgd")
    p, _ = low.compress(g, cf=8, key="w").wire
    assert p.shape == (64, low.rank_for(g.shape, 8)) and torch.allclose(p.T @ p, torch.eye(p.shape[1]), atol=1e-5)


def test_powersgd_sends_vectors_dense_and_warm_starts_from_the_kept_q():
    c = get_compressor("powersgd")
    bias = _grad(10)
    assert torch.equal(c.decompress(c.compress(bias, cf=10)), bias)
    g = _grad(64 * 48, shape=(64, 48))
    first = c.compress(g, cf=8, key="w").wire[0]
    assert torch.equal(first, c.compress(g, cf=8, key="w").wire[0]), "compress alone keeps no state"
    c.keep("w", torch.ones(48, first.shape[1]))
    assert torch.equal(c.compress(g, cf=8, key="w").wire[0], first), "kept, not committed"
    c.commit(["w"])
    assert not torch.equal(c.compress(g, cf=8, key="w").wire[0], first)
    assert set(c.state_dict()) == {"q/w"}


def test_clamped_factors_are_warned_once():
    g = _grad(64 * 48, shape=(64, 48))
    with pytest.warns(
        UserWarning, match=r"terngrad: a compression factor of 77 is out of the method's reach; it sends at 15.9 "
    ):
        get_compressor("terngrad").compress(g, cf=77)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_compressor("terngrad").compress(g, cf=77)  # the same request again: no second warning
        get_compressor("terngrad").compress(g, cf=16.5)  # within 10%: no warning


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 1000, 1024, 5000, 1_000_003])
def test_sq_norm_is_accurate_without_a_float64_copy(dtype, numel):
    g = _grad(numel, dtype) * 3
    assert sq_norm(g).dtype == torch.float64
    assert sq_norm(g).item() == pytest.approx(g.double().square().sum().item(), rel=1e-6)
    assert math.isnan(sq_norm(torch.full((numel,), math.nan, dtype=dtype)).item())


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


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_casts_decode_add_and_keep_the_rounding_exactly_as_their_eager_definition(name):
    # Longer than one of the casts' chunks (2^18 entries), with a tail: the chunked passes must join up exactly.
    n = 3 * 2**18 + 12345
    method = get_compressor(name)
    g = torch.randn(n, generator=torch.Generator().manual_seed(0))
    payload = method.compress(g, 2)
    wire = payload.wire[0]
    for scale in (1.0, 0.5, 1 / 3):
        one_row = payload.with_wire([wire.unsqueeze(0)])
        out = torch.full((n,), float("nan"))  # decode_ overwrites: nothing of what was there survives
        method.decode_(out, one_row, scale)
        assert torch.equal(out, torch.zeros(n).add_(wire.float(), alpha=scale))
        rows = torch.stack([wire, -wire.flip(0), wire * 3])
        start = torch.randn(n, generator=torch.Generator().manual_seed(1))
        added = start.clone()
        method.aggregate_(added, payload.with_wire([rows]), scale)
        assert torch.equal(added, start.clone().add_(rows.float().sum(0), alpha=scale))
        decoded = start.clone()
        method.decode_(decoded, payload.with_wire([rows]), scale)
        assert torch.equal(decoded, torch.zeros(n).add_(rows.float().sum(0), alpha=scale))
    residual = g.clone()
    method.residual_(residual, payload)
    assert torch.equal(residual, g - wire.float())
    assert residual.abs().max() > 0 and residual.abs().max() <= g.abs().max() * 2**-7


def test_adaq_sums_ranks_as_their_decoded_payloads_add_in_rank_order():
    # Three ranks whose groups overlap across ranks (the same heavy entries): each position gets each rank's mean
    # times the scale, added in rank order.
    c = get_compressor("adaq")
    base = _grad(50_000)
    payloads = [c.compress(base + 0.01 * _grad(50_000, seed=rank), cf=20, step=rank) for rank in range(3)]
    stacked = payloads[0].with_wire([torch.stack([p.wire[i] for p in payloads]) for i in range(3)])
    out = torch.full((50_000,), 0.5)
    c.aggregate_(out, stacked, 1 / 3)
    expected = torch.full((50_000,), 0.5)
    for p in payloads:
        means, top, bottom = p.wire
        expected[bottom.long()] += (means[1] * (1 / 3)).float()
        expected[top.long()] += (means[0] * (1 / 3)).float()
    assert torch.equal(out, expected)
    assert torch.isin(payloads[0].wire[1], payloads[1].wire[1]).any()  # the ranks do share positions


@pytest.mark.parametrize(
    "g", [torch.zeros(1000), torch.ones(1000), torch.full((1000,), -2.0)], ids=["zero", "one", "neg"]
)
def test_adaq_groups_never_share_a_position_so_decoding_and_summing_ranks_agree(g):
    c = get_compressor("adaq")
    payload = c.compress(g, cf=10)
    _, top, bottom = payload.wire
    assert not torch.isin(bottom, top).any()
    out = torch.zeros(g.numel())
    c.aggregate_(out, payload.with_wire([w.unsqueeze(0) for w in payload.wire]), 1.0)
    assert torch.equal(out, c.decompress(payload))
