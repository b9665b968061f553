"""Compressor math, without a process group."""

import math

import pytest
import torch

from lightning_gravac.compressors import ErrorFeedback, get_compressor, list_compressors, sparse_k, validate_cf
from lightning_gravac.compressors.base import Payload
from lightning_gravac.compressors.packing import Layout

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _grad(numel: int = 4096, dtype: torch.dtype = torch.float32, seed: int = 0, shape=None) -> torch.Tensor:
    g = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return g.view(shape) if shape else g


@pytest.mark.parametrize("name", list_compressors())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
class TestEveryCompressor:
    def test_round_trip_shape_and_dtype(self, name, dtype):
        c = get_compressor(name)
        g = _grad(dtype=dtype, shape=(64, 64))
        out = c.decompress(c.compress(g, cf=10, key="w", step=3))
        assert out.shape == g.shape and out.dtype == g.dtype

    def test_payload_size_depends_on_numel_and_cf_only(self, name, dtype):
        c = get_compressor(name)
        a = c.compress(_grad(1000, dtype, seed=1), cf=20, key="a", step=0)
        b = c.compress(_grad(1000, dtype, seed=2) * 1e3, cf=20, key="b", step=7)
        assert [t.shape for t in a.wire] == [t.shape for t in b.wire]
        assert [t.dtype for t in a.wire] == [t.dtype for t in b.wire]

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


@pytest.mark.parametrize("name", ["topk", "randomk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_feedback_residual_plus_decoded_is_input_exactly(name, dtype):
    c, memory = get_compressor(name), ErrorFeedback()
    for step in range(3):
        g = _grad(dtype=dtype, seed=step, shape=(32, 128))
        memory.compensate_("w", g)
        error_fed = g.clone()
        payload = c.compress(g, cf=50, key="w", step=step)
        residual = memory.update("w", c, g, payload)
        assert torch.equal(g, error_fed), "update must not modify its input"
        assert torch.equal(residual + c.decompress(payload), error_fed)


def test_randomk_indices_agree_for_same_seed_step_key_and_differ_otherwise():
    a, b = get_compressor("randomk", seed=3), get_compressor("randomk", seed=3)
    g1, g2 = _grad(seed=1), _grad(seed=2)  # different data, as on two ranks
    idx = lambda c, g, **kw: c.compress(g, cf=10, **kw).local[0]  # noqa: E731
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
