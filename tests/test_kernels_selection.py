"""The compiled selection kernels against the eager path they replace: the same block peaks, scans, lowest entries and
payloads, and DGC's accumulation, bit for bit."""

import math

import kernel_inputs
import pytest
import torch
from kernel_inputs import _awkward, _student, needs_kernels

from lightning_gravac.compressors import get_compressor, kernels
from lightning_gravac.compressors.select import Blocks, exact_lowest, exact_topk, seeded_generator

#: The fixtures these tests share with the other kernels' tests (``kernel_inputs.py``), found by pytest by these names.
eager, threads = kernel_inputs.eager, kernel_inputs.threads


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
