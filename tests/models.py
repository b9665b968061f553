"""Small learnable tasks for the tests, top-level so that spawned ranks can import them."""

import itertools
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TeacherRegression(pl.LightningModule):
    """An MLP that learns a fixed random teacher MLP: a task with a known, reachable minimum."""

    def __init__(self, width: int = 64, depth: int = 2, n_in: int = 16, lr: float = 0.05, momentum: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = []
        dims = [n_in] + [width] * depth
        for a, b in itertools.pairwise(dims):
            layers += [nn.Linear(a, b), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(dims[-1], 1))
        self.lr, self.momentum = lr, momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def teacher_data(n: int = 2048, n_in: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g)
    w1, w2 = torch.randn(n_in, 32, generator=g) / n_in**0.5, torch.randn(32, 1, generator=g) / 32**0.5
    y = torch.tanh(x @ w1) @ w2
    return TensorDataset(x, y)


def loader(n: int = 2048, n_in: int = 16, batch_size: int = 32) -> DataLoader:
    return DataLoader(teacher_data(n, n_in), batch_size=batch_size, shuffle=True)


class RecordMetrics(Callback):
    """Keeps every step's ``trainer.callback_metrics`` as floats."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def trainer_kwargs(world_size: int, **overrides: Any) -> dict[str, Any]:
    """Quiet, deterministic Trainer arguments for a CPU run on ``world_size`` ranks."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=world_size,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    kwargs.update(overrides)
    return kwargs


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
