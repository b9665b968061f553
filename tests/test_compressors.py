"""Compressor math, without a process group: the contract every registered method keeps, the factors' accounting and
checks, the payloads' layout and the squared norm."""

import math
import warnings

import pytest
import torch
from compressor_inputs import DTYPES, _grad

from lightning_gravac.adaptations import ErrorFeedback
from lightning_gravac.compressors import get_compressor, list_compressors, sparse_k, validate_cf
from lightning_gravac.compressors.base import Payload, sq_norm
from lightning_gravac.compressors.packing import Layout
from lightning_gravac.compressors.sparse import Sparsifier

#: Factors each method can reach on a [256, 300] fp32 matrix (its target, where the method fixes its own).
REACHABLE = {
    "adaq": [10, 100],
    "bf16": [2],
    "dgc": [10, 100],
    "efsignsgd": [32],
    "fp16": [2],
    "int2": [14.2],  # 2.25 bits an entry at 128-entry blocks: 14.2x (its nominal 16 is 2 bits from 32)
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
