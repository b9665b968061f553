"""The gradients the compressors' tests compress, and the dtypes they run in."""

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _grad(numel: int = 4096, dtype: torch.dtype = torch.float32, seed: int = 0, shape=None) -> torch.Tensor:
    g = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return g.view(shape) if shape else g
