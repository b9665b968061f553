"""The compiled kernels' build and loading (the signature table, the fall back to eager PyTorch), and the error
feedback's, the sparse decode's and the 16-bit casts' kernels against the eager path they replace: bit for bit."""

import ctypes
import math
import re
import shlex
import shutil
import sysconfig
from pathlib import Path

import kernel_inputs
import pytest
import torch
from kernel_inputs import _awkward, _student, needs_kernels

from lightning_gravac.adaptations.residuals import ErrorFeedback, encode
from lightning_gravac.compressors import get_compressor, kernels
from lightning_gravac.compressors.base import sq_norm
from lightning_gravac.compressors.kernels import library
from lightning_gravac.compressors.select import Blocks

#: The fixtures these tests share with the other kernels' tests (``kernel_inputs.py``), found by pytest by these names.
eager, threads = kernel_inputs.eager, kernel_inputs.threads


_COMPILER = shlex.split(sysconfig.get_config_var("CC") or "cc")[0]


@pytest.fixture
def fresh_library():
    """The kernels' loader starts over, and again after the test: builds and environment are re-read."""
    kernels.reset()
    yield
    kernels.reset()


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
