"""Compiled CPU kernels for selection and quantization, built on first use by the system's C compiler, with eager
fallback.

On CPU compression is bound by memory traffic, and eager PyTorch reads the gradient more often than the work needs: a
block's peak takes two row reductions (``amax``, ``amin``), the entries above a threshold a full ``hardshrink`` plus
``nonzero``, a packed code a gradient-sized temporary per shift. The kernels do each in one read, on all of torch's
threads, with the same results bit for bit (``tests/test_kernels.py`` checks them against the eager path): block peaks
and scans (the sparsifiers; of ``-x`` without a negated copy, and both signs' peaks in one read, for AdaQ), the sparse
decode (``index_add_``'s sums, prefetching the positions), error feedback's sum, DGC's momentum and velocity update,
sign packing, decoding and the majority vote, counter-based draws, QSGD's, TernGrad's and the block codes' codes and
their decode, the codes' exact integer energy (the statistics header), 1-bit SGD's column sums (in float64, a single
column in float32 lanes of 32 entries first: close to the eager float32 sums, not equal) and decode, natural
compression's bytes and decode, and the 16-bit casts with both header norms in the same pass. Not bit for bit by design:
the float64 norms found beside a pass (error feedback's ``||x||^2``: summed exactly per entry, where the eager path sums
fp32 chunk norms), TernGrad's standard deviation and extremes in one read (the deviation in float64, accurate where the
eager fp32 ``std`` is not), and PowerSGD's three products with the gradient, ``M Q``, ``M^T P`` and ``M += alpha P
Q^T``, at ranks up to 32 where the CPU has AVX-512 (BLAS is slow on these tall-skinny products on some CPUs; these sum
in another order, to about BLAS's accuracy).

The package: this module wraps each kernel in a function of tensors; ``library.py`` builds, caches and loads the shared
library, with one table of the C functions' ctypes signatures; the C files hold a family of kernels each, named for it
(``sparse.c``, ``feedback.c``, ``signs.c``, ``quantize.c``, ``onebit.c``, ``casts.c``, ``natural.c``, ``lowrank.c``),
and ``common.h`` what several share (the block sizes, when to wake threads, the counter-based draws, the norms' lanes).
They are compiled together into one library: one build, one cache entry and one load, and a family reads on its own.

Why not ``torch.utils.cpp_extension``: it compiles against torch's headers, which takes about a minute on two cores
and needs ninja, on every fresh machine and for every torch version. These kernels touch raw float arrays only, so
plain C, built by ``cc`` in seconds and loaded with ``ctypes`` (which releases the GIL during the call), serves.
``LIGHTNING_GRAVAC_NATIVE=0`` turns the kernels off; a machine without a compiler, or a failed build, falls back to
eager PyTorch and logs why once.
"""

import ctypes
import functools

import torch
from torch import Tensor

from lightning_gravac.compressors.kernels import library

#: The 16-bit types :func:`half_sq` takes.
HALVES = (torch.float16, torch.bfloat16)
#: Entries a block; common.h's BLOCK.
BLOCK = 32
#: Entries a block of the float64 norms found beside a pass (one scratch slot each); common.h's SQ_BLOCK.
SQ_BLOCK = 1024


def available() -> bool:
    """Whether the compiled kernels are loaded (building them on the first call)."""
    return library.load() is not None


def reset() -> None:
    """Forget the loaded library: the next call builds or loads it again, reading ``CC``, ``LIGHTNING_GRAVAC_CACHE``
    and ``LIGHTNING_GRAVAC_NATIVE`` anew (for tests that change them)."""
    library.load.cache_clear()
    skinny_available.cache_clear()


def usable(values: Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether the kernels can take ``values``: a contiguous CPU tensor of one of ``dtypes`` (fp32 unless said) with
    int32-addressable entries."""
    return (
        values.device.type == "cpu"
        and values.dtype in dtypes
        and values.is_contiguous()
        and values.numel() < 2**31
        and available()
    )


#: sparse.c's mode of a signed selection of ``-values`` (read from ``values``, no negated copy).
NEGATED = 2


def _mode(signed: bool, negated: bool) -> int:
    return NEGATED if negated else int(signed)


def block_peaks(values: Tensor, blocks: int, signed: bool, negated: bool = False) -> Tensor:
    """The peaks of the first ``blocks`` 32-entry blocks of the flat ``values`` (see :func:`usable`); with
    ``negated``, the signed peaks of ``-values``."""
    lib = _loaded()
    peaks = torch.empty(blocks, dtype=torch.float32)
    lib.lg_block_peaks(values.data_ptr(), blocks, peaks.data_ptr(), _mode(signed, negated), torch.get_num_threads())
    return peaks


def block_extremes(values: Tensor, blocks: int) -> tuple[Tensor, Tensor]:
    """:func:`block_peaks` signed, and negated, in one read of the flat ``values`` (see :func:`usable`)."""
    high, low = torch.empty(blocks, dtype=torch.float32), torch.empty(blocks, dtype=torch.float32)
    _loaded().lg_block_extremes(values.data_ptr(), blocks, high.data_ptr(), low.data_ptr(), torch.get_num_threads())
    return high, low


def scan(values: Tensor, peaks: Tensor, threshold: float, signed: bool, out: Tensor, negated: bool = False) -> Tensor:
    """Sorted int64 indices of the entries above ``threshold`` (of ``-values`` above it with ``negated``) in the
    blocks that ``peaks`` covers; ``out`` is a contiguous 4-byte scratch of at least ``32 * len(peaks)`` entries
    (reinterpreted as int32)."""
    lib = _loaded()
    slots = out.view(torch.int32)
    count = lib.lg_scan(
        values.data_ptr(), peaks.numel(), peaks.data_ptr(), threshold, _mode(signed, negated), slots.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return slots[:count].long()


def accumulate(
    g: Tensor, scale: float, u_old: Tensor | None, momentum: float, u: Tensor | None, v_old: Tensor | None, v: Tensor
) -> tuple[Tensor, float]:
    """DGC's accumulation in one pass: ``a = g * scale``, ``u = u_old * momentum + a`` (a fused multiply-add, as
    torch's ``add`` with ``alpha``; ``a`` without ``u_old``), ``v = v_old + u`` (``u`` without ``v_old``; ``a`` for
    ``u`` without ``u``). Writes ``u`` and ``v`` and returns the block peaks of ``|v|`` and ``||v||^2``. Every tensor
    is flat, fp32, contiguous, on the CPU and of ``g``'s size; the optional ones may be ``None``."""
    lib = _loaded()
    n = g.numel()
    peaks = torch.empty(n // BLOCK, dtype=torch.float32)
    sq = lib.lg_accumulate(
        g.data_ptr(), scale, _pointer(u_old), momentum, _pointer(u), _pointer(v_old), v.data_ptr(), n,
        peaks.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return peaks, sq


def pack_signs(values: Tensor) -> Tensor:
    """The sign bits of the flat ``values`` (see :func:`usable`), 8 a byte, most significant first, set for
    ``>= 0``: what ``packing.pack_bits(values >= 0, 1)`` returns, in one read."""
    n = values.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    _loaded().lg_pack_signs(values.data_ptr(), n, out.data_ptr(), torch.get_num_threads())
    return out


def add_signs_(out: Tensor, bits: Tensor, positive: float, negative: float) -> None:
    """``out[i] += positive`` where bit ``i`` of the packed ``bits`` is set, else ``negative``; ``out`` is a flat fp32
    contiguous CPU tensor (see :func:`usable`), ``bits`` contiguous ``uint8`` holding ``out.numel()`` bits."""
    _loaded().lg_add_signs(bits.data_ptr(), out.numel(), positive, negative, out.data_ptr(), torch.get_num_threads())


def vote_(out: Tensor, rows: Tensor, alpha: float) -> None:
    """``out[i] += alpha * sign(votes)``: the majority vote of the packed sign bits of each row of ``rows``
    (``[ranks, bytes]`` ``uint8``, rows contiguous), ``votes`` the ranks with bit ``i`` set minus those without."""
    lib = _loaded()
    lib.lg_vote(
        rows.data_ptr(), rows.stride(0), rows.shape[0], out.numel(), alpha, out.data_ptr(), torch.get_num_threads()
    )


def uniforms(stream: int, numel: int) -> Tensor:
    """``numel`` draws of the counter-based generator's ``stream`` (see ``compressors/uniform.py``), fp32 in [0, 1)."""
    out = torch.empty(numel, dtype=torch.float32)
    _loaded().lg_uniforms(stream, numel, out.data_ptr(), torch.get_num_threads())
    return out


def qsgd_encode(values: Tensor, scales: Tensor, bucket: int, levels: int, bits: int, stream: int) -> Tensor:
    """QSGD's packed codes of the flat fp32 ``values`` in one pass: entry ``i`` of bucket ``b`` gets
    ``min(floor(|x| scales[b] + u_i), levels)`` with ``x``'s sign, plus ``levels``, in ``bits`` bits, ``u_i`` the
    stream's draw ``i``; ``scales`` (fp32) is ``levels / max(norm_b, tiny)`` per bucket. A NaN level (0 times a zero
    bucket's infinite scale, or a NaN entry) is 0, as the eager path's."""
    n = values.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8)
    _loaded().lg_qsgd_encode(
        values.data_ptr(), n, scales.data_ptr(), bucket, levels, bits, stream, out.data_ptr(), torch.get_num_threads()
    )
    return out


def block_encode(
    values: Tensor, scales: Tensor, block: int, levels: int, bits: int, steps: Tensor | None = None
) -> Tensor:
    """The block codes' packed codes of the flat fp32 ``values`` in one pass: entry ``i`` of block ``b`` gets
    ``min(floor(|x| scales[b] + 1/2), levels)`` (the nearest level) with ``x``'s sign, plus ``levels``, in ``bits``
    bits; ``scales`` (fp32) is ``levels / absmax_b`` per block, 0 for a block of zeros. The eager path's bits. With
    ``steps`` (fp32, decoding's step a block; ``block`` a multiple of 8), ``values`` becomes ``values - decoded`` in
    place in the same pass, the bits of :func:`codes_add_` with ``alpha=-1``."""
    n = values.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8)
    _loaded().lg_block_encode(
        values.data_ptr(), n, scales.data_ptr(), block, levels, bits, _pointer(steps), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def block_absmax(values: Tensor, block: int) -> Tensor:
    """The largest magnitude of each ``block``-entry block of the flat fp32 ``values`` (the last one short) in one read,
    NaN where a block holds a NaN: the eager ``maximum(amax, -amin)``'s values."""
    out = torch.empty(-(-values.numel() // block), dtype=torch.float32)
    _loaded().lg_block_absmax(values.data_ptr(), values.numel(), block, out.data_ptr(), torch.get_num_threads())
    return out


def moments(values: Tensor) -> tuple[float, float, float]:
    """The standard deviation (``n - 1`` in the denominator, float64) and the smallest and largest entry of the flat
    fp32 ``values`` (at least 2 entries) in one read; a NaN entry makes all three NaN. The same statistics as
    ``std()`` and ``aminmax()``; the deviation summed another way (float64, by blocks), so its fp32 rounding can differ
    from ``std()``'s in the last bit."""
    n = values.numel()
    if n < 2:
        raise ValueError(f"a standard deviation needs at least 2 entries, got {n}")
    scratch = torch.empty(4 * -(-n // 4096), dtype=torch.float64)
    out = (ctypes.c_double * 3)()
    _loaded().lg_moments(values.data_ptr(), n, scratch.data_ptr(), out, torch.get_num_threads())
    return out[0], out[1], out[2]


def terngrad_encode(values: Tensor, bound: float, scale: float, stream: int) -> Tensor:
    """TernGrad's packed 2-bit codes of the flat fp32 ``values`` in one pass: ``c`` the entry clipped to
    ``[-bound, bound]``, the code is ``1 + sign(c)`` where ``u_i scale < |c|``, else 1."""
    n = values.numel()
    out = torch.empty((n * 2 + 7) // 8, dtype=torch.uint8)
    _loaded().lg_terngrad_encode(values.data_ptr(), n, bound, scale, stream, out.data_ptr(), torch.get_num_threads())
    return out


def codes_add_(out: Tensor, packed: Tensor, bits: int, offset: int, steps: Tensor, group: int, alpha: float) -> None:
    """``out[i] += ((code_i - offset) * steps[i // group]) * alpha``, each product rounded to fp32 in that order, for
    the ``bits``-bit codes packed in ``packed`` (contiguous ``uint8``); ``steps`` is a contiguous fp32 tensor."""
    _loaded().lg_codes_add(
        packed.data_ptr(), out.numel(), bits, offset, steps.data_ptr(), group, alpha, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip


def codes_sq(packed: Tensor, numel: int, bits: int, offset: int, group: int) -> Tensor:
    """Per group of ``group`` entries, ``sum (code_i - offset)^2`` of the first ``numel`` ``bits``-bit codes packed in
    ``packed`` (contiguous ``uint8``), exact, as int64."""
    sums = torch.empty(-(-numel // group), dtype=torch.int64)
    _loaded().lg_codes_sq(packed.data_ptr(), numel, bits, offset, group, sums.data_ptr(), torch.get_num_threads())
    return sums


def onebit_sums(matrix: Tensor) -> Tensor:
    """Per column of the contiguous fp32 ``[rows, cols]`` ``matrix``: the count of entries ``>= 0``, their sum and the
    sum of all, as a float64 ``[3, cols]`` tensor (summed in float64, a single column in float32 lanes of 32 entries
    first, in an order the thread count does not change)."""
    rows, cols = matrix.shape
    scratch = torch.empty((-(-rows // 256)) * 3 * cols, dtype=torch.float64)
    out = torch.empty(3, cols, dtype=torch.float64)
    _loaded().lg_onebit_sums(
        matrix.data_ptr(), rows, cols, scratch.data_ptr(), out.data_ptr(), torch.get_num_threads()
    )  # fmt: skip
    return out


def onebit_add_(out: Tensor, bits: Tensor, means: Tensor, alpha: float) -> None:
    """``out[r, c] += (bit set ? means[0, c] : means[1, c]) * alpha`` (the product rounded to fp32 first) for the
    contiguous fp32 ``[rows, cols]`` ``out``, the sign bits ``bits`` of its entries in order and fp32 ``means``."""
    rows, cols = out.shape
    scaled = (means.float() * alpha).contiguous()  # fp32 products, as the kernel would round them
    _loaded().lg_onebit_add(
        bits.data_ptr(), rows, cols, scaled[0].data_ptr(), scaled[1].data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip


def add_sq(grad: Tensor, residual: Tensor | None, out: Tensor | None) -> Tensor:
    """``torch.add(grad, residual, out=out)`` (``out.copy_(grad)`` without a residual; nothing written without
    ``out``) for flat contiguous fp32 CPU tensors of one size, in one pass with ``||grad + residual||^2`` (float64,
    0-d; each square exact, summed in a fixed order: the same bits whether ``out`` is written or not)."""
    n = grad.numel()
    scratch = torch.empty(-(-n // SQ_BLOCK), dtype=torch.float64)
    total = _loaded().lg_add_sq(
        grad.data_ptr(), _pointer(residual), _pointer(out), n, scratch.data_ptr(), torch.get_num_threads()
    )
    return torch.tensor(total, dtype=torch.float64)


def scatter_add_(
    out: Tensor, positions: Tensor, values: Tensor | None, constant: float = 0.0, scale: float = 1.0
) -> None:
    """``out.index_add_(0, positions, values, alpha=scale)`` (``values`` ``None``: ``constant`` added at every
    position) for a flat contiguous fp32 CPU ``out``, contiguous int32 ``positions`` and contiguous fp32 ``values``
    of as many entries, with index_add_'s bits (the product rounded to fp32, then the sum; positions in order).
    Raises ``IndexError``, writing nothing, when a position is out of range or the counts differ."""
    if values is not None and values.numel() != positions.numel():
        raise IndexError(f"{positions.numel()} positions for {values.numel()} values in a sparse payload")
    done = _loaded().lg_scatter_add(
        out.data_ptr(), out.numel(), positions.data_ptr(), positions.numel(), _pointer(values), constant, scale
    )
    if not done:
        raise IndexError(f"a sparse payload's position is outside the tensor of {out.numel()} entries")


def half_sq(values: Tensor) -> Tensor:
    """``||values||^2`` (float64, 0-d) of a contiguous fp16 or bf16 CPU tensor (:func:`usable` with
    :data:`HALVES`), each value widened to fp32 exactly."""
    scratch = torch.empty(-(-values.numel() // SQ_BLOCK), dtype=torch.float64)
    total = _loaded().lg_half_sq(
        values.data_ptr(), values.numel(), int(values.dtype == torch.bfloat16), scratch.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return torch.tensor(total, dtype=torch.float64)


def natural_encode(values: Tensor, maxexp: int, smallest: int, stream: int) -> tuple[Tensor, int, Tensor]:
    """Natural compression's bytes of the flat fp32 ``values``, the largest rounded exponent ``top`` (0 when no entry
    is finite and non-zero) and the squared norm (float64, 0-d) of what the bytes decode to in a dtype whose smallest
    subnormal is ``2^smallest`` (NaN if an entry is not finite); the rounding drawn from ``stream``, exponents capped
    at ``maxexp``."""
    n, lib, threads = values.numel(), _loaded(), torch.get_num_threads()
    top = lib.lg_natural_top(values.data_ptr(), n, stream, maxexp, threads)
    top = 0 if top == -(2**31) else top
    out, scratch = torch.empty(n, dtype=torch.uint8), torch.empty(-(-n // 4096), dtype=torch.float64)
    energy = lib.lg_natural_encode(
        values.data_ptr(), n, stream, maxexp, top, smallest, out.data_ptr(), scratch.data_ptr(), threads
    )  # fmt: skip
    return out, top, torch.tensor(energy, dtype=torch.float64)


def natural_add_(out: Tensor, codes: Tensor, table: Tensor) -> None:
    """``out[i] += table[codes[i]]`` for the contiguous fp32 ``out``, its bytes ``codes`` and a 256-entry fp32
    ``table``."""
    _loaded().lg_natural_add(codes.data_ptr(), out.numel(), table.data_ptr(), out.data_ptr(), torch.get_num_threads())


def cast_half(values: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
    """``out.copy_(values)`` for the flat contiguous fp32 ``values`` and an fp16 or bf16 ``out`` (rounded as torch
    rounds; a NaN may come out with other payload bits), in one pass with ``||values||^2`` and ``||out||^2`` (each
    float64, 0-d)."""
    n = values.numel()
    scratch, sent = torch.empty(2 * -(-n // SQ_BLOCK), dtype=torch.float64), ctypes.c_double()
    given = _loaded().lg_cast_half(
        values.data_ptr(), n, int(out.dtype == torch.bfloat16), out.data_ptr(), scratch.data_ptr(),
        ctypes.byref(sent), torch.get_num_threads(),
    )  # fmt: skip
    return torch.tensor(given, dtype=torch.float64), torch.tensor(sent.value, dtype=torch.float64)


def half_bits(values: Tensor, out: Tensor) -> None:
    """``out.copy_(values)`` by the portable round-to-nearest-even conversions alone (no F16C), one thread: the path
    :func:`cast_half` takes on CPUs without F16C, exposed for its tests."""
    _loaded().lg_half_bits(values.data_ptr(), values.numel(), int(out.dtype == torch.bfloat16), out.data_ptr())


#: The largest rank PowerSGD's product kernel takes.
SKINNY_RANK = 32


def skinny_usable(matrix: Tensor, factor: Tensor, transposed: bool = False) -> bool:
    """Whether :func:`skinny_mq` takes ``matrix`` and a ``[cols, r]`` ``factor`` (with ``transposed``, whether
    :func:`skinny_mtp` takes it and a ``[rows, r]`` one, the product being with ``matrix.T``): both :func:`usable`,
    ``r <= SKINNY_RANK``, and kernels built for AVX-512 (elsewhere torch's matmul serves)."""
    return (
        matrix.dim() == 2
        and factor.dim() == 2
        and factor.shape[0] == matrix.shape[0 if transposed else 1]
        and 0 < factor.shape[1] <= SKINNY_RANK
        and usable(matrix)
        and usable(factor)
        and skinny_available()
    )


@functools.cache
def skinny_available() -> bool:
    """Whether the kernels were built for AVX-512, which :func:`skinny_mq` needs (asked once: the hook asks for every
    PowerSGD layer of every step)."""
    return available() and bool(_loaded().lg_skinny_available())


def skinny_mq(matrix: Tensor, q: Tensor) -> Tensor:
    """``matrix @ q`` for a contiguous fp32 ``[rows, cols]`` ``matrix`` and ``[cols, r]`` ``q`` (:func:`skinny_usable`),
    summed in blocks of 256 terms along each row, the same bits whatever the thread count."""
    rows, cols = matrix.shape
    out = torch.empty(rows, q.shape[1], dtype=torch.float32)
    done = _loaded().lg_skinny_mq(
        matrix.data_ptr(), rows, cols, q.data_ptr(), q.shape[1], out.data_ptr(), torch.get_num_threads()
    )
    assert done, "skinny_mq called where skinny_usable() is False"
    return out


def skinny_mtp(matrix: Tensor, p: Tensor) -> Tensor:
    """``matrix.T @ p`` for a contiguous fp32 ``[rows, cols]`` ``matrix`` and ``[rows, r]`` ``p``
    (``skinny_usable(matrix, p, transposed=True)``), summed in blocks of 256 terms down each column, the same bits
    whatever the thread count."""
    rows, cols = matrix.shape
    r = p.shape[1]
    out = torch.empty(cols, r, dtype=torch.float32)
    # The kernel's partial sums: rows of 16 or 32 floats, 64-byte aligned (16 spare floats to align the start).
    spare = torch.empty(cols * (32 if r > 16 else 16) + 16, dtype=torch.float32)
    partial = spare[(-spare.data_ptr() % 64) // 4 :]
    done = _loaded().lg_skinny_mtp(
        matrix.data_ptr(), rows, cols, p.data_ptr(), r, out.data_ptr(), partial.data_ptr(), torch.get_num_threads()
    )
    assert done, "skinny_mtp called where skinny_usable() is False"
    return out


def skinny_add_pqt_(out: Tensor, p: Tensor, q: Tensor, alpha: float, divisor: float | None = None) -> None:
    """``out.addmm_(p, q.T, alpha=alpha)`` for a contiguous fp32 ``[rows, cols]`` ``out``, ``[rows, r]`` ``p`` and
    ``[cols, r]`` ``q`` (:func:`skinny_usable` of ``out`` with ``q`` and with ``p`` transposed): each output's r terms
    summed from zero, then ``out + alpha * sum``; with a positive ``divisor``, ``torch.mm(p, q.T, out=out)
    .div_(divisor)`` instead (``out`` not read, ``alpha`` unused). The same bits whatever the thread count."""
    rows, cols = out.shape
    qt = q.T.contiguous()  # [r, cols]: each term's row of 16 columns in one load
    done = _loaded().lg_skinny_add_pqt(
        out.data_ptr(), rows, cols, p.data_ptr(), qt.data_ptr(), p.shape[1], alpha, divisor or 0.0,
        torch.get_num_threads(),
    )  # fmt: skip
    assert done, "skinny_add_pqt_ called where skinny_usable() is False"


def _loaded() -> ctypes.CDLL:
    lib = library.load()
    assert lib is not None, "a kernel called without the kernels: check usable() first"
    return lib


def _pointer(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
