"""The quantizing, sign, low-rank and cast methods' own properties, without a process group: bit packing, unbiased
draws, what each sends, and how the ranks' payloads add up."""

import math

import pytest
import torch
from compressor_inputs import _grad

from lightning_gravac.compressors import get_compressor
from lightning_gravac.compressors.packing import pack_bits, unpack_bits


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
