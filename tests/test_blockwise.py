"""The block codes (``int8``, ``int4``, ``int2``): what their rounding must hold, without a process group (the hook's
tests run them on two ranks, ``tests/test_hook.py``)."""

import math

import pytest
import torch

from lightning_gravac.adaptations import ErrorFeedback
from lightning_gravac.compressors import get_compressor

CODES = {"int8": 127, "int4": 7, "int2": 1}


def _heavy(numel: int, seed: int) -> torch.Tensor:
    """Student-t values of 2 degrees of freedom (a gradient's outliers) times a spread that varies by five orders."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(2.0).sample((numel,))
    return (t * torch.logspace(-3, 2, numel)[torch.randperm(numel, generator=generator)]).float()


def _blocks(x: torch.Tensor, size: int) -> list[torch.Tensor]:
    return list(x.reshape(-1).split(size))


@pytest.mark.parametrize("name", CODES)
@pytest.mark.parametrize("block_size", [128, 100, 7])
def test_every_entry_is_its_nearest_level_within_half_a_step(name, block_size):
    x = _heavy(10_007, 1)
    method = get_compressor(name, block_size=block_size)
    decoded = method.decompress(method.compress(x, method.fixed_cf))
    s = CODES[name]
    for block, got in zip(_blocks(x, block_size), _blocks(decoded, block_size), strict=True):
        step = block.abs().max().double() / s
        error = (block.double() - got.double()).abs()
        assert error.max() <= step / 2 * (1 + 1e-5), "an entry is off by more than half a level"
        levels = got.double() / step
        assert (levels - levels.round()).abs().max() < 1e-3 and levels.abs().max() <= s + 1e-3, "not on a level"


@pytest.mark.parametrize("name", CODES)
def test_ties_round_away_from_zero_and_the_largest_entry_is_the_top_level(name):
    s = CODES[name]
    tie_up = 1.5 / s if s > 1 else 0.0  # a tie between levels 1 and 2 (int2 has no level 2)
    block = torch.tensor([1.0, 0.5 / s, -0.5 / s, tie_up, -1.0, 0.0, -0.0, 0.25 / s])
    decoded = get_compressor(name, block_size=8).decompress(get_compressor(name, block_size=8).compress(block, 4))
    step = torch.tensor(1.0) / s
    expected = torch.tensor([s, 1, -1, 2 if s > 1 else 0, -s, 0, 0, 0]) * step
    torch.testing.assert_close(decoded, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", CODES)
def test_a_block_of_zeros_decodes_to_exact_zeros(name):
    x = _heavy(1000, 2)
    x[128:256] = 0.0
    x[130] = -0.0
    method = get_compressor(name)
    decoded = method.decompress(method.compress(x, method.fixed_cf))
    assert torch.equal(decoded[128:256], torch.zeros(128)) and not decoded[128:256].signbit().any()
    zeros = torch.zeros(300)
    assert torch.equal(method.decompress(method.compress(zeros, method.fixed_cf)), zeros)
    assert method.sent_sq_norm(method.compress(zeros, method.fixed_cf)) == 0


@pytest.mark.parametrize("name", CODES)
def test_a_non_finite_entry_makes_its_block_decode_non_finite(name):
    # The hook skips a step whose decoded sum is not finite: a NaN or an infinity must not be rounded away.
    for bad in (math.nan, math.inf):
        x = _heavy(512, 3)
        x[300] = bad
        decoded = get_compressor(name).decompress(get_compressor(name).compress(x, 8))
        assert not decoded[256:384].isfinite().all() and decoded[:256].isfinite().all()


@pytest.mark.parametrize("name", CODES)
def test_error_feedback_carries_the_whole_rounding_error_into_the_next_step(name):
    # With residuals, what was sent over T steps is what was asked for minus the last residual, within fp32 rounding
    # of the sums; without, the rounding of every step adds up.
    method, memory = get_compressor(name), ErrorFeedback()
    gradients = [_heavy(4096, 10 + t) * 1e-3 + 1e-4 for t in range(50)]  # a small common drift under the noise
    sent_ef, sent_plain = torch.zeros(4096, dtype=torch.float64), torch.zeros(4096, dtype=torch.float64)
    for t, g in enumerate(gradients):
        fed = g.clone()
        memory.compensate_("w", fed)
        payload = method.compress(fed, method.fixed_cf, key="w", step=t)
        memory.set("w", memory.residual_of(method, fed, payload))
        sent_ef += method.decompress(payload).double()
        sent_plain += method.decompress(method.compress(g, method.fixed_cf)).double()
    asked = torch.stack(gradients).double().sum(0)
    residual = memory.get("w").double()
    torch.testing.assert_close(sent_ef + residual, asked, rtol=0, atol=1e-5 * asked.abs().max().item())
    # The residual stays within one step's rounding (half a level of a block), never accumulating.
    assert residual.abs().max() <= max(g.abs().max() for g in gradients) / CODES[name]
    assert (sent_ef - asked).norm() < (sent_plain - asked).norm()


def test_four_bits_err_far_less_than_qsgd_at_the_same_bytes():
    # QSGD's 4 bits round each entry stochastically against its bucket's norm: on a Gaussian vector the error is
    # larger than the vector. The block code rounds against the block's largest entry: about a tenth of it.
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    block, qsgd = get_compressor("int4"), get_compressor("qsgd")
    block_error = (block.decompress(block.compress(x, 8)) - x).norm() / x.norm()
    qsgd_error = (qsgd.decompress(qsgd.compress(x, 8, key="w")) - x).norm() / x.norm()
    assert block_error < 0.15 and qsgd_error > 1.0


def test_block_size_must_be_a_whole_number():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="block_size"):
            get_compressor("int4", block_size=bad)


@pytest.mark.parametrize("name", CODES)
@pytest.mark.parametrize("numel", [10_007, 300_003])  # one thread, and chunks on threads; a short last group of 8
def test_coding_into_the_residual_in_one_pass_gives_the_separate_steps_bits(name, numel):
    x = _heavy(numel, 5)
    x[:128] = 0.0
    method = get_compressor(name)
    fused = x.clone()
    payload = method.compress_residual_(fused, method.fixed_cf)
    if payload is None:
        pytest.skip("the compiled kernels are not available here")
    separate = method.compress(x, method.fixed_cf)
    assert all(torch.equal(a, b) for a, b in zip(payload.wire, separate.wire, strict=True))
    assert torch.equal(fused, x - method.decompress(separate))
