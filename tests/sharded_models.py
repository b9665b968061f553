"""Helpers for the sharded strategy's tests, top-level so that spawned ranks can import them."""

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_gravac.zoo import teacher_dataset

from models import trainer_kwargs


class ShardedMLP(pl.LightningModule):
    """A three-layer MLP regressor under AdamW whose ``configure_model`` shards each layer and the whole with FSDP2.

    Widths that the world size does not divide (a bias of 1 entry, a layer of 30 rows) make FSDP pad its chunks.
    """

    def __init__(self, width: int = 30, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
        )

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def sharded_loader(n: int = 512, batch_size: int = 16) -> DataLoader:
    return DataLoader(teacher_dataset(n, 16), batch_size=batch_size, shuffle=False)


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (FSDP2's shards gathered), on every rank: a collective."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in module.named_parameters()
    }


class EveryStep(Callback):
    """The whole parameters after each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.steps.append(full_parameters(pl_module))


def sharded_kwargs(world_size: int, **overrides: Any) -> dict[str, Any]:
    """:func:`trainer_kwargs` for a sharded run; ``deterministic`` off (FSDP2's ops have no deterministic flag)."""
    return trainer_kwargs(world_size, **{"deterministic": False, **overrides})


def stock_strategy(world_size: int, **kwargs: Any) -> ModelParallelStrategy:
    """Lightning's own strategy, every rank in the data-parallel dimension."""
    return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1, **kwargs)
