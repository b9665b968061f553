"""The compiled kernels of the quantizing methods (signs, one-bit, QSGD, the block codes, TernGrad, natural compression)
and of their counter-based draws against the eager path they replace: the same codes, decodes and energies."""

import math

import kernel_inputs
import pytest
import torch
from kernel_inputs import _awkward, _student, needs_kernels

from lightning_gravac.compressors import get_compressor, kernels

#: The fixtures these tests share with the other kernels' tests (``kernel_inputs.py``), found by pytest by these names.
eager, threads = kernel_inputs.eager, kernel_inputs.threads


@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000, 300_001])
def test_sign_kernels_are_the_eager_packing_decoding_and_vote_bit_for_bit(numel, threads):
    from lightning_gravac.compressors.packing import pack_bits, unpack_bits

    g = _awkward(max(numel, 17_000))[:numel] if numel > 16_031 else _student(numel, 1)
    if numel >= 8:
        g[3] = -0.0  # sets the bit (-0.0 >= 0), as a NaN does not
        g[5] = float("nan")
    bits = kernels.pack_signs(g)
    assert torch.equal(bits, pack_bits(g >= 0, 1))
    # Adding +-step: what the eager decode (+1/-1 times the step) adds, for a step whose product with +-1 is exact.
    out = torch.randn(numel)
    start = out.clone()
    kernels.add_signs_(out, bits, 0.375, -0.375)
    assert torch.equal(out, start + (unpack_bits(bits, 1, numel).float() * 2 - 1) * 0.375)
    # The vote of three ranks' bits (one a copy, so no ties; then two ranks, with ties: sign 0).
    others = [pack_bits(torch.randn(numel) >= 0, 1) for _ in range(2)]
    for rows in (torch.stack([bits, *others]), torch.stack([bits, others[0]])):
        out = start.clone()
        kernels.vote_(out, rows, 1 / 3)
        votes = torch.stack([unpack_bits(r, 1, numel).float() * 2 - 1 for r in rows]).sum(0)
        assert torch.equal(out, start.clone().add_(votes.sign(), alpha=1 / 3))


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd"])
def test_sign_methods_give_the_same_bits_with_and_without_the_kernels(name, eager, threads):
    method = get_compressor(name)
    g = _awkward(50_001)
    g[torch.isnan(g)] = 1.0  # a non-finite scale would make every value NaN: compare finite ones
    g[torch.isinf(g)] = -3.0
    rows = torch.stack([method.compress(g, 32).wire[0], method.compress(-g.flip(0), 32).wire[0]])
    payload = method.compress(g, 32)
    stacked = payload.with_wire([rows, *(torch.stack([w, w * 2]) for w in payload.wire[1:])])
    (fast, *fast_decoded), (slow, *slow_decoded) = _decoded_both_ways(method, g, payload, stacked, eager)
    assert all(torch.equal(a, b) for a, b in zip(fast.wire, slow.wire, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fast_decoded, slow_decoded, strict=True))


def _decoded_both_ways(method, g, payload, stacked, eager):
    """With the kernels, then on eager PyTorch: ``method``'s payload of ``g``, ``payload`` decoded, ``stacked`` (two
    ranks) aggregated into a ramp, and the residual of ``g`` after ``payload``."""
    got = []
    for use_kernels in (True, False):
        if not use_kernels:
            eager()
        out = torch.linspace(-1, 1, g.numel())
        method.aggregate_(out, stacked, 1 / 3)
        residual = g.clone()
        method.residual_(residual, payload)
        got.append((method.compress(g, 32), method.decompress(payload), out, residual))
    return got


def test_counter_based_draws_are_the_eager_hash_and_uniform(threads):
    from lightning_gravac.compressors.uniform import uniforms

    for stream in (0, 1, 2**62 + 12345, 2**63 - 1):
        fast, slow = kernels.uniforms(stream, 100_003), uniforms(stream, 100_003)
        assert torch.equal(fast, slow)
    draws = uniforms(7, 1_000_000)
    assert draws.min() >= 0 and draws.max() < 1
    counts = torch.histc(draws, bins=20, min=0, max=1)
    assert (counts - 50_000).abs().max() < 1000  # about 4.5 standard deviations of a bin's count
    assert not torch.equal(uniforms(7, 1000), uniforms(8, 1000)), "streams must differ"


def _quantized_both_ways(method, g, cf, other, eager):
    """``method``'s packed codes, wire, decoded sum of two ranks (``g`` and ``other``), one rank's payload decoded and
    its energy, with the compiled kernels and then on eager PyTorch."""
    got = []
    for use_kernels in (True, False):
        if not use_kernels:
            eager()
        payload = method.compress(g, cf, key="w", step=3)
        second = method.compress(other, cf, key="w", step=4)
        stacked = payload.with_wire([torch.stack([a, b]) for a, b in zip(payload.wire, second.wire, strict=True)])
        out = torch.linspace(-1, 1, g.numel())
        method.aggregate_(out, stacked, 1 / 3)
        got.append((*payload.wire, out, method.decompress(payload), method.sent_sq_norm(payload)))
    return got


@pytest.mark.parametrize("bucket_size", [96, 100])  # whole groups of 8 codes a bucket, and groups cut by buckets
@pytest.mark.parametrize("levels", [1, 3, 7, 15, 31, 63, 127])  # every code width, 2 to 8 bits
def test_qsgd_kernel_packs_and_decodes_the_eager_bits(levels, bucket_size, eager, threads):
    g = _student(50_003, 2)
    g[:bucket_size] = 0.0  # a zero bucket: its norm is clamped, every level 0
    g[200] = -0.0
    method = get_compressor("qsgd", levels=levels, bucket_size=bucket_size)
    got = _quantized_both_ways(method, g, 10, -g.flip(0), eager)
    for fast, slow in zip(*got, strict=True):
        _same(fast, slow)
    for *_, decoded, _ in got:  # level 0 (code s), not -s times a step of 0 (-0.0): s / tiny is inf from s = 4
        assert not decoded[:bucket_size].signbit().any()


@pytest.mark.parametrize("bucket_size", [512, 96, 200_000])  # 200_000: fewer buckets than threads
def test_qsgd_kernel_on_threads_with_nan_and_inf_buckets_packs_the_eager_bits(bucket_size, eager, threads):
    # Above the kernels' multi-thread threshold (chunks of groups cut by bucket edges), with a bucket holding an inf
    # (its scale 0, inf * 0 a NaN level, sent as 0) and one holding a NaN (every level NaN, sent as 0).
    g = _student(300_003, 6)
    g[1000], g[5000] = math.inf, math.nan
    method = get_compressor("qsgd", levels=7, bucket_size=bucket_size)
    for fast, slow in zip(*_quantized_both_ways(method, g, 10, g.flip(0), eager), strict=True):
        if fast.dtype == torch.float64 and fast.dim() == 0:  # the energy: NaN both ways
            assert math.isnan(fast) == math.isnan(slow)
        else:
            assert torch.equal(fast.nan_to_num(), slow.nan_to_num())


@pytest.mark.parametrize("block_size", [96, 100, 200_000])  # whole groups of 8 codes, cut groups, fewer than threads
@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_block_code_kernel_packs_and_decodes_the_eager_bits(name, block_size, eager, threads):
    # Above the multi-thread threshold, with a block of zeros (scale 0: every code the zero level), a negative zero, a
    # block holding an inf and one holding a NaN (sent non-finite both ways), and ties at half a level.
    g = _student(300_003, 7)
    g[:block_size] = 0.0
    g[block_size + 3] = -0.0
    g[250_000], g[280_000] = math.inf, math.nan
    method = get_compressor(name, block_size=block_size)
    for fast, slow in zip(*_quantized_both_ways(method, g, method.fixed_cf, -g.flip(0), eager), strict=True):
        if fast.dtype == torch.float64 and fast.dim() == 0:  # the energy: NaN both ways
            assert math.isnan(fast) == math.isnan(slow)
        else:
            assert torch.equal(fast.nan_to_num(), slow.nan_to_num())
    for *_, decoded, _ in _quantized_both_ways(method, g, method.fixed_cf, g, eager):
        assert torch.equal(decoded[:block_size], torch.zeros(block_size)) and not decoded[:block_size].signbit().any()


@pytest.mark.parametrize("clip_std", [2.5, None])
def test_terngrad_kernel_packs_and_decodes_the_eager_bits(clip_std, eager, threads):
    g = _student(50_003, 3)
    g[7] = -0.0
    method = get_compressor("terngrad", clip_std=clip_std)
    for fast, slow in zip(*_quantized_both_ways(method, g, 16, g * 2, eager), strict=True):
        _same(fast, slow)


@needs_kernels
@pytest.mark.parametrize("offset", [0.0, 1e4])  # a mean far above the spread: the deviations must not cancel
def test_terngrad_statistics_in_one_read_are_the_float64_deviation_and_the_exact_extremes(offset, threads):
    g = _student(300_007, 5) + offset  # above the kernels' multi-thread threshold, a short last block
    deviation, low, high = kernels.moments(g)
    assert deviation == pytest.approx(float(g.double().std()), rel=1e-12)
    assert (low, high) == (float(g.min()), float(g.max()))
    torch.set_num_threads(1)  # blocks combined in their order: the same bits on one thread
    assert kernels.moments(g) == (deviation, low, high)
    if not offset:  # on a gradient-like tensor the fp32 rounding agrees with torch's std (the TernGrad kernel test
        # compares codes with the eager path's bit for bit and relies on it: should torch's std change, that test says)
        assert torch.tensor(deviation, dtype=torch.float32) == g.std()
    for special, at in [(math.nan, 200_000), (math.nan, 4096), (math.inf, 200_000)]:  # (4096: a block's first)
        h = g.clone()
        h[at] = special
        deviation, low, high = kernels.moments(h)
        assert math.isnan(deviation)
        assert (math.isnan(low), math.isnan(high)) == (math.isnan(special),) * 2
        assert math.isnan(special) or high == math.inf
    # Blocks shorter than the 16 lanes, two entries, exactly one and two whole blocks.
    for n in (2, 15, 17, 4096, 8192, 8195):
        h = g[:n]
        assert kernels.moments(h)[0] == pytest.approx(float(h.double().std()), rel=1e-12), n
        assert kernels.moments(h)[1:] == (float(h.min()), float(h.max())), n
    with pytest.raises(ValueError, match="at least 2"):
        kernels.moments(g[:1])


def _natural_input(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Finite values over ``dtype``'s whole range (subnormals, the largest values, zeros of both signs) in ``dtype``."""
    info = torch.finfo(dtype)
    low, high = math.log10(info.smallest_normal * info.eps), math.log10(info.max) - 3  # Student's t reaches ~100
    g = _student(numel, seed) * torch.logspace(low, high, numel).roll(seed * 1000)
    g[::97] = 0.0
    g[5], g[11], g[13], g[17] = -0.0, info.smallest_normal * info.eps, -info.smallest_normal / 3, -info.max
    return g.to(dtype)


@needs_kernels
@pytest.mark.parametrize("special", ["finite", "nan", "inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_natural_kernel_codes_and_decodes_the_eager_bits(special, dtype, eager, threads):
    g = _natural_input(200_003, 4, dtype)  # above the kernels' threshold for more than one thread
    g[1000] = {"finite": 1.0, "nan": math.nan, "inf": -math.inf}[special]
    method = get_compressor("natural")
    for fast, slow in zip(*_quantized_both_ways(method, g, 4, g.flip(0) / 3, eager), strict=True):
        if fast.dtype == torch.float64 and fast.dim() == 0:  # the energy: summed in another order
            assert math.isnan(slow) if special != "finite" else float(fast) == pytest.approx(float(slow), rel=1e-12)
            assert math.isnan(fast) == math.isnan(slow)
        else:
            assert torch.equal(fast, slow) or (special != "finite" and torch.allclose(fast, slow, 0, 0, equal_nan=True))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_natural_rounds_every_exponent_and_the_top_by_the_same_draws(dtype, threads):
    """The kernel's largest exponent draws only where it can be reached: one that every entry but the largest rounds
    past, a tensor of subnormals only, one with no finite non-zero entry."""
    from lightning_gravac.compressors import natural

    info = torch.finfo(dtype)
    maxexp, smallest = math.floor(math.log2(info.max)), round(math.log2(info.smallest_normal * info.eps))
    cases = [
        _natural_input(20_011, 5, dtype).float(),
        torch.rand(4099) * 1e-39,  # subnormal fp32 only
        torch.tensor([0.0, -0.0, math.nan, math.inf] * 300),
        torch.full((300,), 1.999) * torch.tensor([1.0] * 299 + [2.0]),  # the largest field's entries round up or not
        # Over threads: one exponent field throughout, and only the last thread's entries (1.75) may round up.
        torch.cat([torch.full((150_000,), 1.75), torch.full((150_001,), 1.0)]).flip(0),
        _natural_input(300_007, 6, dtype).float(),
    ]
    for x in cases:
        for stream in (1, 2**62 + 7):
            codes, top, energy = kernels.natural_encode(x, maxexp, smallest, stream)
            slow_codes, slow_top = natural._encode(x, maxexp, stream)
            assert torch.equal(codes, slow_codes) and top == int(slow_top)
            slow_energy = natural._energy(torch.bincount(slow_codes, minlength=256), slow_top, smallest)
            assert torch.allclose(energy, slow_energy, rtol=1e-12, atol=0, equal_nan=True)


def _same(fast, slow):
    """Bit for bit, but for the decoded energy (a float64 scalar): the kernel sums the codes' squares exactly and
    weighs them once, the eager path decodes and sums the squares of the fp32 values."""
    if fast.dtype == torch.float64 and fast.dim() == 0:
        assert float(fast) == pytest.approx(float(slow), rel=1e-6)
    else:
        assert torch.equal(fast, slow)


@pytest.mark.parametrize("bits", range(1, 9))
def test_the_energy_of_packed_codes_is_the_eager_sum_of_squares_exactly(bits, threads):
    from lightning_gravac.compressors.packing import pack_bits

    numel, offset = 300_005, (1 << bits) // 2
    codes = torch.randint(0, 1 << bits, (numel,), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    squares = (codes - offset).square()
    for group in (1, 7, 8, 100, 512, numel):  # groups of one, cut by packs of 8, whole packs, one tensor-wide group
        expected = torch.nn.functional.pad(squares, (0, -numel % group)).view(-1, group).sum(1)
        assert torch.equal(kernels.codes_sq(packed, numel, bits, offset, group), expected), group


@pytest.mark.parametrize("shape", [(50_003,), (300, 170), (7, 3, 5, 5)])
def test_onebit_kernels_send_the_eager_bits_and_decode_them_bit_for_bit(shape, eager, threads):
    method = get_compressor("onebit")
    g = _student(math.prod(shape), 4).view(shape)
    g.view(-1)[:5] = torch.tensor([-0.0, 0.0, 1.0, -1.0, 0.0])
    fixed = method.compress(g, 32)  # one payload (the kernel's), decoded both ways below
    second = method.compress(-g.flip(0) * 2, 32)
    stacked = fixed.with_wire([torch.stack([a, b]) for a, b in zip(fixed.wire, second.wire, strict=True)])
    got = _decoded_both_ways(method, g, fixed, stacked, eager)
    (fast, *fast_decoded), (slow, *slow_decoded) = got
    assert torch.equal(fast.wire[0], slow.wire[0])  # the signs
    # The means: summed in float64 by the kernel, in float32 by torch.
    assert torch.allclose(fast.wire[1], slow.wire[1], rtol=1e-5, atol=1e-7)
    assert float(fast.sent) == pytest.approx(float(slow.sent), rel=1e-5)
    for a, b in zip(fast_decoded, slow_decoded, strict=True):  # decoding the same payloads: bit for bit
        assert torch.equal(a, b)
