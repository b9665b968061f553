"""PowerSGD's compiled product kernels against float64 products, to BLAS's accuracy and the same bits on any thread
count, and the fall back to torch where they do not apply."""

import math

import kernel_inputs
import pytest
import torch

from lightning_gravac.compressors import kernels

#: The fixture these tests share with the other kernels' tests (``kernel_inputs.py``), found by pytest by this name.
threads = kernel_inputs.threads


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
