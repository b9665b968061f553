"""What the compiled kernels' tests share: selection forced onto eager PyTorch, the thread counts they run on,
heavy-tailed inputs with the values a kernel can get wrong, and the mark of tests that need the kernels built."""

import pytest
import torch

from lightning_gravac.compressors import kernels


@pytest.fixture
def eager(monkeypatch):
    """Within the test, selection runs on eager PyTorch whatever the kernels' state."""

    def use() -> None:
        monkeypatch.setattr(kernels, "usable", lambda values, dtypes=None: False)

    return use


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


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels did not build here")
