"""meProp: exact sparse backward, unified rows, training still converges."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gravac.meprop import MeProp, MePropLinear, apply_meprop
from lightning_gravac.zoo import TeacherRegression, teacher_dataset

from models import loader


def _layer_and_grads(unified: bool, k: int = 3):
    torch.manual_seed(0)
    dense = nn.Linear(8, 10)
    sparse = nn.Linear(8, 10)
    sparse.load_state_dict(dense.state_dict())
    assert apply_meprop(sparse, k=k, unified=unified) == [""]
    x = torch.randn(5, 8, requires_grad=True)
    c = torch.randn(5, 10)  # dL/dy for L = sum(c * y)
    (dense(x) * c).sum().backward()
    x_sparse = x.detach().clone().requires_grad_(True)
    out = sparse(x_sparse)
    assert torch.equal(out, dense(x).detach()), "the forward pass is unchanged"
    (out * c).sum().backward()
    return x.detach(), c, dense, sparse, x_sparse


def test_backward_keeps_the_top_k_output_gradient_entries_of_each_example():
    x, c, dense, sparse, x_sparse = _layer_and_grads(unified=False)
    keep = torch.zeros_like(c, dtype=torch.bool).scatter_(1, c.abs().topk(3, dim=1).indices, True)
    masked = torch.where(keep, c, 0)
    torch.testing.assert_close(sparse.weight.grad, masked.T @ x)
    torch.testing.assert_close(sparse.bias.grad, masked.sum(0))
    torch.testing.assert_close(x_sparse.grad, masked @ dense.weight.detach())
    assert not torch.allclose(sparse.weight.grad, dense.weight.grad)


def test_unified_backward_leaves_exactly_k_weight_gradient_rows_non_zero():
    x, c, dense, sparse, x_sparse = _layer_and_grads(unified=True)
    units = c.abs().sum(0).topk(3).indices
    masked = torch.zeros_like(c)
    masked[:, units] = c[:, units]
    torch.testing.assert_close(sparse.weight.grad, masked.T @ x)
    torch.testing.assert_close(x_sparse.grad, masked @ dense.weight.detach())
    assert int((sparse.weight.grad.abs().sum(1) > 0).sum()) == 3


def test_apply_meprop_keeps_parameters_and_checks_arguments():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))
    params = list(model.parameters())
    assert apply_meprop(model, ratio=0.5, exclude=("2",)) == ["0"]
    assert isinstance(model[0], MePropLinear) and model[0].k == 3 and type(model[2]) is nn.Linear
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="Give one of `k` and `ratio`"):
        apply_meprop(model)
    with pytest.raises(ValueError, match=r"`ratio` must be in \(0, 1\]"):
        apply_meprop(model, ratio=1.5)


def _fit(callbacks) -> float:
    pl.seed_everything(0)
    model = TeacherRegression(width=128, lr=0.05)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=6, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    trainer.fit(model, loader())
    data = teacher_dataset()
    with torch.no_grad():
        return nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]).item()


def test_training_with_meprop_still_converges():
    dense = _fit([])
    meprop = MeProp(ratio=0.25)
    sparse = _fit([meprop])
    assert meprop.layers == ["net.0", "net.2", "net.4"]  # the 1-unit output layer keeps its k = 1: whole
    # Within 30% of dense SGD's loss after 6 epochs, keeping a quarter of each hidden layer's output gradient.
    assert sparse < 1.3 * dense, f"meProp {sparse:.4f} against dense {dense:.4f}"


def test_embedding_bag_output_gradient_keeps_the_top_k_of_each_example():
    torch.manual_seed(0)
    dense, sparse = nn.EmbeddingBag(30, 8, mode="sum"), nn.EmbeddingBag(30, 8, mode="sum")
    sparse.load_state_dict(dense.state_dict())
    assert apply_meprop(sparse, k=2) == [""]
    bags, c = torch.randint(0, 30, (4, 5)), torch.randn(4, 8)
    (sparse(bags) * c).sum().backward()
    keep = torch.zeros_like(c, dtype=torch.bool).scatter_(1, c.abs().topk(2, dim=1).indices, True)
    (dense(bags) * torch.where(keep, c, 0)).sum().backward()  # the dense layer, fed the masked output gradient
    torch.testing.assert_close(sparse.weight.grad, dense.weight.grad)
    assert apply_meprop(sparse, k=3) == [""] and sparse._meprop_k == 3  # re-applied: one hook, the new k
