"""Helpers for Trainer-level tests, top-level so that spawned ranks can import them."""

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_gravac.zoo import teacher_dataset


def loader(n: int = 2048, n_in: int = 16, batch_size: int = 32) -> DataLoader:
    return DataLoader(teacher_dataset(n, n_in), batch_size=batch_size, shuffle=True)


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
        log_every_n_steps=1,
    )
    kwargs.update(overrides)
    return kwargs


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
