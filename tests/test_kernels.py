"""The compiled selection kernels against the eager path they replace: the same peaks and indices, bit for bit."""

import ctypes
import math
import re
import shlex
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from lightning_gravac.adaptations.residuals import ErrorFeedback, encode
from lightning_gravac.compressors import get_compressor, kernels
from lightning_gravac.compressors.base import sq_norm
from lightning_gravac.compressors.kernels import library
from lightning_gravac.compressors.select import Blocks, exact_lowest, exact_topk, seeded_generator

_COMPILER = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]


@pytest.fixture
def eager(monkeypatch):
    """Within the test, selection runs on eager PyTorch whatever the kernels' state."""

    def use() -> None:
        monkeypatch.setattr(kernels, "usable", lambda values, dtypes=None: False)

    return use


@pytest.fixture
def fresh_library():
    """The kernels' loader starts over, and again after the test: builds and environment are re-read."""
    kernels.reset()
    yield
    kernels.reset()


@pytest.fixture(params=[1, 2, 3], ids=lambda t: f"threads{t}")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _awkward(numel: int, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed values with what a kernel can get wrong: NaN, infinities, negative zeros, a block of ties, and a
    block whose only large entry is its last."""
    g = _student(numel, seed)
    g[100] = float("nan")
    g[5000:5032] = 2.5
    g[7001] = float("inf")
    g[9000] = float("-inf")
    g[12000:12032] = -0.0
    g[16031] = -40.0
    return g


def _student(numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(numel, generator=generator)
    chi = torch.randn(numel, 3, generator=generator).square().sum(1)
    return normal / (chi / 3).sqrt()


@pytest.mark.skipif(shutil.which(_COMPILER) is None, reason=f"no C compiler ({_COMPILER})")
def test_the_kernels_build_where_there_is_a_compiler():
    assert kernels.available()
    assert kernels.usable(torch.zeros(64)) and not kernels.usable(torch.zeros(64, dtype=torch.float16))


# The ctypes type of each scalar type in the kernels' C prototypes.
_C_SCALARS = {
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}


def _declarable(parameter: str) -> set[type]:
    """The ctypes types the table may give a C parameter: an address for a pointer (or ctypes' pointer for a
    ``double *`` it fills in), else the scalar's own."""
    words = parameter.replace("*", " * ").split()
    if "*" in words:
        return {ctypes.c_void_p, ctypes.POINTER(ctypes.c_double)} if "double" in words else {ctypes.c_void_p}
    return {_C_SCALARS[words[-2]]}


def test_the_signature_table_declares_every_c_function_as_its_file_does():
    """A function left out of the table, or declared otherwise, is called with the wrong types without an error (a
    double result read as ctypes' default int is garbage)."""
    prototypes = {
        name: (result, [p for p in parameters.split(",") if p.strip() not in ("", "void")])
        for path in Path(kernels.__file__).parent.glob("*.c")
        for result, name, parameters in re.findall(r"^(\w+) (lg_\w+)\(([^)]*)\)", path.read_text(), re.MULTILINE)
    }
    assert set(prototypes) == set(library.SIGNATURES)
    for name, (result, parameters) in prototypes.items():
        argtypes, restype = library.SIGNATURES[name]
        assert restype is (None if result == "void" else _C_SCALARS[result]), name
        assert len(argtypes) == len(parameters), name
        assert all(t in _declarable(p) for t, p in zip(argtypes, parameters, strict=True)), name


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels did not build here")


@needs_kernels
@pytest.mark.parametrize("signed", [False, True], ids=["magnitude", "signed"])
@pytest.mark.parametrize("numel", [32 * 5000, 32 * 5000 + 7, 200_003])
def test_block_peaks_equal_the_eager_reductions(numel, signed, threads, eager):
    g = _awkward(numel)
    native = Blocks(g, signed)
    eager()
    reference = Blocks(g, signed)
    assert native.native and not reference.native
    torch.testing.assert_close(native.peak, reference.peak, rtol=0, atol=0, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("signed", [False, True], ids=["magnitude", "signed"])
def test_scan_finds_the_same_entries_as_the_eager_scan(signed, threads, eager):
    g = _awkward(200_003, seed=1)
    thresholds = [0.0, 2.5, float(g.abs().nan_to_num(0).quantile(0.99)), 3.0, 1e6, float("inf")]
    scratch = torch.empty_like(g)
    native = Blocks(g, signed)
    found = [native.above(t, scratch) for t in thresholds]
    eager()
    reference = Blocks(g, signed)
    for threshold, indices in zip(thresholds, found, strict=True):
        expected = reference.above(threshold, scratch)
        assert torch.equal(indices, expected), threshold
    # And what the scan means, independently of either path:
    test = g > 3.0 if signed else ~(g.abs() <= 3.0)
    assert torch.equal(found[3], test.nonzero().view(-1))


@needs_kernels
@pytest.mark.parametrize("numel", [32 * 5000, 200_003])
def test_the_negated_peaks_and_scan_are_the_signed_ones_of_the_negation(numel, threads):
    g = _awkward(numel, seed=4)
    g[20000:20032] = torch.tensor([0.0, -0.0] * 16)  # signed zeros: -(+0) is -0
    g[30000:30032] = -0.0
    blocks = numel // 32
    peaks = kernels.block_peaks(g, blocks, signed=True, negated=True)
    torch.testing.assert_close(peaks, kernels.block_peaks(-g, blocks, signed=True), rtol=0, atol=0, equal_nan=True)
    high, low = kernels.block_extremes(g, blocks)  # both from one read
    torch.testing.assert_close(high, kernels.block_peaks(g, blocks, signed=True), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(low, peaks, rtol=0, atol=0, equal_nan=True)
    scratch = torch.empty_like(g)
    for threshold in [0.0, 2.5, 3.0, 40.0, 1e6, float("inf")]:
        found = kernels.scan(g, peaks, threshold, True, scratch, negated=True)
        whole = g[: blocks * 32]
        assert torch.equal(found, torch.lt(whole, -threshold).nonzero().view(-1)), threshold


def _lowest_from_a_negated_copy(g: torch.Tensor, k: int, exclude: torch.Tensor) -> torch.Tensor:
    negated = g.neg()
    negated.index_fill_(0, exclude, -math.inf)
    return exact_topk(negated, k, torch.empty_like(g), seeded_generator(1, 0, "w"), signed=True)


@needs_kernels
@pytest.mark.parametrize("shift", [0.0, 1.5], ids=["centred", "mostly-positive"])
@pytest.mark.parametrize("numel", [300_000, 300_007])
def test_the_lowest_entries_without_a_negated_copy_are_the_copys_selection(numel, shift, threads):
    g = _student(numel, seed=6).add_(shift)
    g[1000:1032] = -2.5  # ties
    g[77] = float("nan")
    top = exact_topk(g, numel // 200, torch.empty_like(g), seeded_generator(0, 0, "w"), signed=True)
    for k in (numel // 200, numel // 50):
        fast = exact_lowest(g, k, torch.empty_like(g), seeded_generator(1, 0, "w"), exclude=top)
        assert fast is not None
        assert torch.equal(fast, _lowest_from_a_negated_copy(g, k, top))
        assert not torch.isin(fast, top).any()
        assert torch.equal(g[fast].sort().values, g[~torch.isin(torch.arange(numel), top)].sort().values[:k])


@needs_kernels
def test_the_lowest_entries_leave_out_a_group_that_reaches_the_negatives(monkeypatch):
    # Fewer positives than the top group: its smallest members are negative and candidates of the bottom's scan.
    g = -_student(300_000, seed=7).abs()
    g[:500] = 1.0
    top = exact_topk(g, 3000, torch.empty_like(g), seeded_generator(0, 0, "w"), signed=True)
    assert (g[top] < 0).any()
    # The scan's threshold comes from the draws: exclusion must hold whichever the group's values are.
    fast = exact_lowest(g, 3000, torch.empty_like(g), seeded_generator(1, 0, "w"), exclude=top)
    assert fast is not None and not torch.isin(fast, top).any()
    assert torch.equal(fast, _lowest_from_a_negated_copy(g, 3000, top))
    # Excluded positions among the most negative entries (a NaN among them): the filter leaves them out, and the set
    # is the copy's (the draws see their values where the copy holds -inf, so the order may differ).
    g = _student(300_000, seed=9)
    exclude = torch.topk(g, 500, largest=False).indices[::2].contiguous()
    g[exclude[7]] = float("nan")
    fast = exact_lowest(g, 3000, torch.empty_like(g), seeded_generator(1, 0, "w"), exclude=exclude)
    assert fast is not None and not torch.isin(fast, exclude).any()
    assert torch.equal(fast.sort().values, _lowest_from_a_negated_copy(g, 3000, exclude).sort().values)
    kept = torch.ones(300_000, dtype=torch.bool)
    kept[exclude] = False
    assert torch.equal(g[fast].sort().values, g[kept].sort().values[:3000])
    # Without the kernels there is no negated read: the caller's copy decides, and Blocks refuses the mode.
    monkeypatch.setattr(kernels, "usable", lambda values, dtypes=None: False)
    assert exact_lowest(g, 3000, torch.empty_like(g), seeded_generator(1, 0, "w"), exclude=exclude) is None
    with pytest.raises(ValueError, match="negated selection"):
        Blocks(g, signed=True, negated=True)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="signed selection"):  # |x| > t says nothing about an excluded x's sign
        Blocks(g, signed=False).from_threshold(3000, torch.empty_like(g), seeded_generator(1, 0, "w"), 0.01, exclude)
    # Too few negatives for the draws' threshold: the caller's copy decides.
    few = _student(300_000, seed=8).abs()
    few[:10] = -1.0
    assert exact_lowest(few, 3000, torch.empty_like(few), seeded_generator(1, 0, "w"), exclude=top) is None


@needs_kernels
@pytest.mark.parametrize("numel", [200_003, 20_001])
def test_error_feedback_sums_and_finds_the_norm_in_one_pass(numel, threads):
    g, residual = _awkward(200_003, seed=9)[:numel].nan_to_num(posinf=7.0, neginf=-7.0), _student(numel, seed=10)
    memory = ErrorFeedback()
    first, sq = memory.error_fed_sq("w", g)  # no residual yet: a copy
    assert torch.equal(first, g) and first.data_ptr() != g.data_ptr()
    exact = g.double().square().sum()  # each fp32 square exact in float64
    assert float(sq) == pytest.approx(float(exact), rel=1e-12)
    assert float(sq) == pytest.approx(float(sq_norm(g)), rel=1e-6)  # the eager path's chunked fp32 norms
    memory.set("w", residual)
    fed, sq = memory.error_fed_sq("w", g)
    assert torch.equal(fed, g + residual)  # fp32's own sum, bit for bit
    assert float(sq) == pytest.approx(float(fed.double().square().sum()), rel=1e-12)
    torch.set_num_threads(1)
    assert float(memory.error_fed_sq("w", g)[1]) == float(sq)  # the thread count does not change it
    assert math.isnan(float(memory.error_fed_sq("w", torch.full_like(g, math.nan))[1]))


@needs_kernels
@pytest.mark.parametrize("name", ["topk", "adaq", "randomk", "efsignsgd", "onebit", "powersgd", "natural"])
def test_the_error_fed_norm_is_the_basis_the_eager_path_finds(name, eager):
    g = _student(300_000, seed=11)
    g = g.view(600, 500) if name in ("onebit", "powersgd") else g
    memory = ErrorFeedback()
    memory.set("w", _student(300_000, seed=12).view_as(g))
    fast = encode(get_compressor(name), g, 100, key="w", residual_mode="recycle", memory=memory)
    fed = g + _student(300_000, seed=12).view_as(g)
    assert float(fast.basis) == pytest.approx(float(fed.double().square().sum()), rel=1e-12)  # the kernel's, exact
    memory.set("w", _student(300_000, seed=12).view_as(g))
    eager()
    slow = encode(get_compressor(name), g, 100, key="w", residual_mode="recycle", memory=memory)
    assert float(fast.basis) == pytest.approx(float(slow.basis), rel=1e-6)
    assert torch.equal(fast.residual, slow.residual) or name in ("natural", "onebit", "powersgd")


@needs_kernels
def test_the_sparse_decode_adds_as_index_add_does():
    out = _student(200_000, seed=13)
    positions = torch.randint(0, 200_000, (3, 5_000), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    positions[1, :100] = positions[0, :100]  # two ranks' entries at one position: both added, in order
    values = _student(15_000, seed=14).view(3, 5_000)
    expected = out.clone().index_add_(0, positions.view(-1).long(), values.view(-1), alpha=1 / 3)
    kernels.scatter_add_(out, positions.view(-1), values.view(-1), scale=1 / 3)
    assert torch.equal(out, expected)
    constant = torch.tensor(0.1)
    expected = out.clone().index_add_(0, positions[2].long(), constant.expand(5_000))
    kernels.scatter_add_(out, positions[2].contiguous(), None, constant=float(constant))
    assert torch.equal(out, expected)
    # A position out of range (a corrupt payload) is refused before anything is written.
    for bad in (200_000, -1):
        wrong = positions[0].clone()
        wrong[-1] = bad
        with pytest.raises(IndexError, match="outside the tensor"):
            kernels.scatter_add_(out, wrong, values[0].contiguous())
        assert torch.equal(out, expected)
    with pytest.raises(IndexError, match="positions for"):  # fewer values than positions
        kernels.scatter_add_(out, positions[0].contiguous(), values[0, :-1].contiguous())


@needs_kernels
@pytest.mark.parametrize("name", ["topk", "dgc", "redsync", "sidco", "threshold", "adaq"])
@pytest.mark.parametrize("cf", [10, 100])
def test_compressors_send_the_same_payload_with_and_without_the_kernels(name, cf, eager):
    g = _student(300_000, seed=2)
    options = {"warmup_epochs": 0} if name == "dgc" else {}
    native = get_compressor(name, **options).compress(g, cf, key="w", step=3)
    eager()
    reference = get_compressor(name, **options).compress(g, cf, key="w", step=3)
    for sent, expected in zip(native.wire, reference.wire, strict=True):
        assert torch.equal(sent, expected)


def test_without_a_compiler_selection_falls_back_to_eager(monkeypatch, tmp_path, fresh_library):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LIGHTNING_GRAVAC_CACHE", str(tmp_path / "cache"))
    assert not kernels.available()
    g = _student(100_000, seed=3)
    blocks = Blocks(g, signed=False)
    assert not blocks.native
    assert torch.equal(blocks.above(3.0, torch.empty_like(g)), (g.abs() > 3.0).nonzero().view(-1))


def test_a_compiler_error_falls_back_to_eager(monkeypatch, tmp_path, fresh_library):
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'error: no' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    monkeypatch.setenv("LIGHTNING_GRAVAC_CACHE", str(tmp_path / "cache"))
    assert not kernels.available()
    assert not list((tmp_path / "cache").glob("*.so"))  # no partial library left behind


def test_the_environment_turns_the_kernels_off(monkeypatch, fresh_library):
    monkeypatch.setenv("LIGHTNING_GRAVAC_NATIVE", "0")
    assert not kernels.available() and not Blocks(torch.ones(4096), signed=False).native


def _dgc_run(options: dict, steps: int = 3) -> tuple[list[tuple[torch.Tensor, ...]], dict, torch.Tensor]:
    dgc = get_compressor("dgc", warmup_epochs=0, **options)
    payloads, basis = [], None
    for step in range(steps):
        g = _student(300_007, seed=10 + step)  # a tail of 7: neither a whole block nor whole vectors
        payload = dgc.compress(g, 50, key="w", step=step)
        payloads.append(payload.wire)
        basis = payload.basis
        dgc.commit(["w"])
    return payloads, dgc.state_dict(), basis


@needs_kernels
@pytest.mark.parametrize(
    "options",
    [{"clip_norm": None}, {"clip_norm": 50.0}, {"momentum_correction": False, "clip_norm": None}],
    ids=["momentum", "clipped", "no-correction"],
)
def test_dgc_accumulates_the_same_bits_with_and_without_the_kernel(options, threads, eager):
    payloads, state, basis = _dgc_run(options)
    eager()
    expected_payloads, expected_state, expected_basis = _dgc_run(options)
    for wire, expected in zip(payloads, expected_payloads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(wire, expected, strict=True))
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(state[key], expected_state[key]) for key in state)
    # The kernel sums the squared norm in its own order: equal to within fp32 rounding.
    torch.testing.assert_close(basis, expected_basis, rtol=1e-6, atol=0)


@needs_kernels
def test_accumulate_writes_the_same_bits_aligned_and_unaligned(threads):
    # Aligned outputs take the streaming stores, outputs one float off a 32-byte boundary the plain ones; the squared
    # norm is summed in the same order at every thread count (compared against one thread).
    n = 300_007
    g, u_old, v_old = (_student(n, seed) for seed in (1, 2, 3))
    results = []
    for offset in (0, 1):
        u, v = (torch.empty(n + 8)[offset : offset + n] for _ in range(2))
        assert (u.data_ptr() % 32 == 0) == (offset == 0)
        peaks, sq = kernels.accumulate(g, 0.5, u_old, 0.9, u, v_old, v)
        results.append((u, v, peaks, sq))
    (u, v, peaks, sq), (u1, v1, peaks1, sq1) = results
    assert torch.equal(u, u1) and torch.equal(v, v1) and torch.equal(peaks, peaks1) and sq == sq1
    assert torch.equal(u, torch.add(g * 0.5, u_old, alpha=0.9)) and torch.equal(v, v_old + u)
    torch.set_num_threads(1)
    assert kernels.accumulate(g, 0.5, u_old, 0.9, torch.empty(n), v_old, torch.empty(n))[1] == sq


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
@pytest.mark.parametrize("name", ["int8", "int4"])
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


skinny = pytest.mark.skipif(not kernels.skinny_available(), reason="no AVX-512 product kernel here")


@skinny
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("shape", [(300, 700), (1031, 517), (5, 3), (4, 16), (600, 500)])  # rows cut by 4; 300k
def test_powersgds_products_are_the_float64_products_to_blas_accuracy_on_any_thread_count(shape, side, threads):
    from lightning_gravac.compressors.powersgd import left_factor, right_factor

    rows, cols = shape
    generator = torch.Generator().manual_seed(rows)
    matrix = torch.randn(rows, cols, generator=generator)
    # P = M Q (Q: [cols, r]) and Q = M^T P (P: [rows, r]), each by its kernel, against float64.
    kernel, factor, inner = (
        (kernels.skinny_mq, left_factor, cols) if side == "left" else (kernels.skinny_mtp, right_factor, rows)
    )
    operand = matrix if side == "left" else matrix.T
    for rank in (1, 2, 7, 8, 9, 16, 17, 25, 32):
        other = torch.randn(inner, rank, generator=generator)
        got, exact = kernel(matrix, other), operand.double() @ other.double()
        assert got.shape == exact.shape and got.is_contiguous()
        assert float((got - exact).abs().max() / exact.abs().max()) < 2e-6, (shape, rank)
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # each output one thread's, summed in a fixed order: the same bits
        try:
            assert torch.equal(kernel(matrix, other), got)
        finally:
            torch.set_num_threads(before)
    other = torch.randn(inner, 25, generator=generator)
    assert torch.allclose(factor(matrix, other), operand @ other, rtol=1e-4, atol=1e-4)  # what PowerSGD calls


@skinny
@pytest.mark.parametrize("shape", [(300, 700), (1031, 517), (5, 3), (4, 16), (600, 500)])
def test_powersgds_decode_adds_alpha_p_q_t_to_blas_accuracy_on_any_thread_count(shape, threads):
    from lightning_gravac.compressors.powersgd import add_product_, average_product_

    rows, cols = shape
    generator = torch.Generator().manual_seed(rows + cols)
    given = torch.randn(rows, cols, generator=generator)
    for rank in (1, 2, 7, 16, 17, 25, 32):
        p, q = torch.randn(rows, rank, generator=generator), torch.randn(cols, rank, generator=generator)
        for alpha in (-1.0, 0.5, 1 / 3):
            got = given.clone()
            kernels.skinny_add_pqt_(got, p, q, alpha)
            exact = given.double() + alpha * (p.double() @ q.double().T)
            assert float((got - exact).abs().max() / exact.abs().max()) < 2e-6, (shape, rank, alpha)
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                again = given.clone()
                kernels.skinny_add_pqt_(again, p, q, alpha)
                assert torch.equal(again, got)
            finally:
                torch.set_num_threads(before)
    p, q = torch.randn(rows, 25, generator=generator), torch.randn(cols, 25, generator=generator)
    wide = given.clone()
    add_product_(wide, p, q, -1.0)  # what PowerSGD's residual and decode call
    assert torch.allclose(wide, given - p @ q.T, rtol=1e-4, atol=1e-4)
    fallback = given.double()
    add_product_(fallback, p.double(), q.double(), -1.0)  # float64: torch's addmm_
    assert torch.equal(fallback, given.double().addmm_(p.double(), q.double().T, alpha=-1.0))
    with pytest.raises(RuntimeError):  # factors of different ranks (a corrupt payload): addmm_'s error, no read past Q
        add_product_(given.clone(), torch.randn(rows, 3), torch.randn(cols, 2), 1.0)
    # The hook's average of the summed factors, P Q^T / N, written over whatever the bucket held.
    for ranks in (1, 2, 3):
        averaged = torch.full((rows, cols), math.nan)
        average_product_(averaged, p, q, ranks)
        exact = (p.double() @ q.double().T) / ranks
        assert float((averaged - exact).abs().max() / exact.abs().max()) < 2e-6, ranks
        again = torch.full((rows, cols), math.nan)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            average_product_(again, p, q, ranks)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(again, averaged)
    wide = torch.empty(rows, cols, dtype=torch.float64)
    average_product_(wide, p.double(), q.double(), 3)  # float64: torch's mm, then div_
    assert torch.equal(wide, (p.double() @ q.double().T).div_(3))


def test_powersgds_left_product_falls_back_to_torch_where_the_kernel_does_not_apply():
    from lightning_gravac.compressors.powersgd import left_factor

    matrix = torch.randn(40, 30)
    for q in (torch.randn(30, 33), torch.randn(30, 5, dtype=torch.float64), torch.randn(5, 30).T):
        assert not kernels.skinny_usable(matrix if q.dtype == torch.float32 else matrix.double(), q)
        m = matrix.to(q.dtype)
        assert torch.equal(left_factor(m, q), m @ q)  # past the rank, another dtype, a transposed view: torch's
    assert not kernels.skinny_usable(matrix, torch.randn(31, 5))  # mismatched shapes: torch's (which raises)
    with pytest.raises(RuntimeError):
        left_factor(matrix, torch.randn(31, 5))


def test_powersgds_right_product_falls_back_to_torch_where_the_kernel_does_not_apply():
    from lightning_gravac.compressors.powersgd import right_factor

    matrix = torch.randn(40, 30)
    for p in (torch.randn(40, 33), torch.randn(40, 5, dtype=torch.float64), torch.randn(5, 40).T, torch.randn(40, 1)):
        m = matrix.to(p.dtype)
        assert torch.equal(right_factor(m, p), (p.T @ m).T.contiguous())  # past the rank, fp64, a view, rank 1
    assert not kernels.skinny_usable(matrix, torch.randn(30, 5), transposed=True)  # mismatched shapes
    with pytest.raises(RuntimeError):
        right_factor(matrix, torch.randn(30, 5))


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_energy_of_16_bit_values_widens_every_value_exactly(dtype, threads):
    # Every 16-bit pattern (normal, subnormal, zero, inf; NaN aside), in blocks that cut the pattern list.
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = every[torch.isfinite(every.float())]
    for values in (finite, finite[:1000], finite[:7], finite.flip(0)[:3001]):
        expected = values.double().square().sum()
        assert float(kernels.half_sq(values.contiguous())) == pytest.approx(float(expected), rel=1e-6)
    # The widening itself, exactly: one value at a time (squared in float64: exact).
    for value in (finite[0], finite[len(finite) // 2], finite[-1], finite[100], finite[20000]):
        one = value.reshape(1).contiguous()
        assert float(kernels.half_sq(one)) == float(value.double()) ** 2
    infinite = torch.tensor([1.0, float("inf")], dtype=dtype)
    assert math.isinf(float(kernels.half_sq(infinite)))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_cast_kernel_rounds_as_torch_and_finds_both_norms(dtype, threads):
    # Every exponent and sign of fp32 (random bit patterns: overflow to inf, subnormal results, ties) and the edges
    # of the 16-bit range; a length that leaves a tail after the blocks of 8 and of 1024.
    patterns = torch.randint(-(2**31), 2**31 - 1, (300_007,), generator=torch.Generator().manual_seed(0))
    info = torch.finfo(dtype)
    edges = [info.max, -info.max, info.max * 1.001, info.tiny, info.tiny * info.eps, info.tiny * info.eps / 2, 65520.0]
    x = torch.cat([patterns.to(torch.int32).view(torch.float32), torch.tensor(edges), torch.randn(20_001)])
    x = torch.cat([x, torch.tensor([math.nan, math.inf, -math.inf, -0.0])])
    out = torch.empty(x.numel(), dtype=dtype)
    kernels.cast_half(x, out)
    expected = x.to(dtype)
    nan = expected.isnan()
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16)) and out[nan].isnan().all()
    # The norms, on the entries whose 16-bit value is finite: the input's against torch in float64, what is sent
    # exactly as the 16-bit norm kernel sums it (the same blocks and lanes); neither depends on the thread count.
    keep = x[expected.isfinite() & x.isfinite()].contiguous()
    wire = torch.empty(keep.numel(), dtype=dtype)
    given, sent = kernels.cast_half(keep, wire)
    assert float(given) == pytest.approx(float(keep.double().square().sum()), rel=1e-12)
    assert float(sent) == float(kernels.half_sq(wire))
    torch.set_num_threads(1)
    assert [float(given), float(sent)] == [float(v) for v in kernels.cast_half(keep, torch.empty_like(wire))]


@needs_kernels
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_the_casts_send_the_same_payload_and_header_with_and_without_the_kernel(name, eager):
    g = _student(100_003, seed=5)
    method = get_compressor(name)
    fast = encode(method, g, 2, key="w", out=torch.empty(g.numel(), dtype=method.wire_dtype))
    eager()
    slow = encode(method, g, 2, key="w")
    assert torch.equal(fast.payload.wire[0], slow.payload.wire[0])
    assert float(fast.basis) == pytest.approx(float(slow.basis), rel=1e-6)  # sq_norm: fp32 chunks, then float64
    assert float(method.sent_sq_norm(fast.payload)) == pytest.approx(float(method.sent_sq_norm(slow.payload)), rel=1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_portable_16_bit_conversion_rounds_as_torch(dtype):
    # The path CPUs without F16C take (this one has it, so cast_half never runs it on whole groups of 8).
    patterns = torch.randint(-(2**31), 2**31 - 1, (300_007,), generator=torch.Generator().manual_seed(1))
    x = torch.cat([patterns.to(torch.int32).view(torch.float32), torch.randn(10_000), torch.tensor([-0.0, math.inf])])
    out = torch.empty(x.numel(), dtype=dtype)
    kernels.half_bits(x, out)
    expected = x.to(dtype)
    nan = expected.isnan()
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16)) and out[nan].isnan().all()
