"""meProp: sparsified back-propagation through linear layers (Sun et al., ICML 2017).

In a linear layer ``y = x W^T + b`` the backward pass keeps only the ``k`` largest-magnitude entries of the output
gradient ``dL/dy`` of each example (or, *unified*, the same ``k`` output units for the whole batch, chosen by their
summed magnitude) and propagates those alone: ``dL/dx`` and ``dL/dW`` are computed from the sparse output gradient,
so in the unified form only ``k`` rows of the weight gradient are non-zero. The forward pass is unchanged.
It saves computation in the backward pass, not communication; combined with a sparsifier it makes the weight
gradients sparser still.
"""

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning import Callback
from torch import Tensor, nn
from typing_extensions import override


class _SparseBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, k: int, unified: bool) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.k, ctx.unified, ctx.has_bias = k, unified, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0])
        inputs = x.reshape(-1, weight.shape[1])
        if ctx.unified:
            units = torch.topk(g.abs().sum(0), ctx.k, sorted=False).indices
            kept = g.index_select(1, units)  # [batch, k]
            grad_weight = torch.zeros_like(weight).index_copy_(0, units, kept.T @ inputs)
            grad_x = kept @ weight.index_select(0, units)
            grad_bias = torch.zeros(weight.shape[0], dtype=g.dtype, device=g.device).index_copy_(0, units, kept.sum(0))
        else:
            top = torch.topk(g.abs(), ctx.k, dim=1, sorted=False).indices
            sparse = torch.zeros_like(g).scatter_(1, top, g.gather(1, top))
            grad_weight, grad_x, grad_bias = sparse.T @ inputs, sparse @ weight, sparse.sum(0)
        return grad_x.view_as(x), grad_weight, grad_bias if ctx.has_bias else None, None, None


class MePropLinear(nn.Linear):
    """An ``nn.Linear`` whose backward keeps the top ``k`` output-gradient entries (see the module's docstring).

    Made by :func:`apply_meprop` from an existing ``nn.Linear`` (same parameters); ``k`` at least the layer's width
    leaves it dense. In evaluation (no gradient) it is a plain linear layer.
    """

    k: int
    unified: bool

    def forward(self, x: Tensor) -> Tensor:
        if self.k >= self.out_features or not torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        return _SparseBackward.apply(x, self.weight, self.bias, self.k, self.unified)


def _keep_top_k_per_row(k: int):  # type: ignore[no-untyped-def]
    def hook(grad: Tensor) -> Tensor:
        top = torch.topk(grad.abs(), k, dim=-1, sorted=False).indices
        return torch.zeros_like(grad).scatter_(-1, top, grad.gather(-1, top))

    return hook


def _sparsify_bag_gradient(module: nn.Module, args: Any, output: Tensor) -> None:
    k: int = getattr(module, "_meprop_k")  # noqa: B009 - set by apply_meprop, not a declared attribute
    if torch.is_grad_enabled() and output.requires_grad and k < output.shape[-1]:
        output.register_hook(_keep_top_k_per_row(k))


def apply_meprop(
    module: nn.Module, k: int | None = None, ratio: float | None = None, unified: bool = False, exclude: tuple = ()
) -> list[str]:
    """Turn every ``nn.Linear`` in ``module`` (but those named in ``exclude``) into a :class:`MePropLinear`, in place;
    an ``nn.EmbeddingBag`` (a linear layer of word counts) gets the same per-example sparsification of its output
    gradient through a hook (not in the unified form).

    The layers keep their parameters (the class of the module object changes), so this works before or after DDP
    has wrapped the model. Give ``k`` (entries kept per example) or ``ratio`` (of each layer's width, at least 1).
    Returns the names of the layers changed.
    """
    if (k is None) == (ratio is None):
        raise ValueError(f"Give one of `k` and `ratio`, got k={k!r}, ratio={ratio!r}.")
    if k is not None and k < 1:
        raise ValueError(f"`k` must be >= 1, got {k!r}.")
    if ratio is not None and not 0 < ratio <= 1:
        raise ValueError(f"`ratio` must be in (0, 1], got {ratio!r}.")
    changed = []
    for name, layer in module.named_modules():
        if name in exclude:
            continue
        if isinstance(layer, nn.Linear):
            layer.__class__ = MePropLinear
            assert isinstance(layer, MePropLinear)
            layer.k = k if k is not None else max(1, round(ratio * layer.out_features))  # type: ignore[operator]
            layer.unified = unified
            changed.append(name)
        elif isinstance(layer, nn.EmbeddingBag) and not unified:
            # A linear layer of the bag's word counts: its output gradient is sparsified per example the same way
            # (a gradient hook on the output), so each bag's words get k of the embedding's columns.
            kept = k if k is not None else max(1, round(ratio * layer.embedding_dim))  # type: ignore[operator]
            setattr(layer, "_meprop_k", kept)  # noqa: B010 - a plain attribute on a stock module
            if not hasattr(layer, "_meprop_handle"):
                setattr(layer, "_meprop_handle", layer.register_forward_hook(_sparsify_bag_gradient))  # noqa: B010
            changed.append(name)
    return changed


class MeProp(Callback):
    """Applies meProp to the model's linear layers when fitting starts (a recipe flag: add this callback).

    Args:
        ratio: share of each layer's output-gradient entries kept per example.
        k: a fixed number kept instead of ``ratio``.
        unified: the same ``k`` output units for the whole batch (only ``k`` weight-gradient rows non-zero).
        exclude: names of linear layers to leave dense (e.g. the output layer).
    """

    def __init__(
        self, ratio: float | None = 0.1, k: int | None = None, unified: bool = False, exclude: tuple = ()
    ) -> None:
        self.ratio, self.k, self.unified, self.exclude = (None if k is not None else ratio), k, unified, tuple(exclude)
        self.layers: list[str] = []

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # After `configure_model`, so models that build their layers from the data are covered too.
        self.layers = apply_meprop(pl_module, self.k, self.ratio, self.unified, self.exclude)
