"""The recipes' optimizer: SGD with step decay of the learning rate, as a Lightning optimizer configuration."""

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def sgd_with_steps(
    parameters: Iterable[nn.Parameter],
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    milestones: list[int] | None = None,
    gamma: float = 0.1,
) -> Any:
    """SGD, and a ``MultiStepLR`` (``x gamma`` at each epoch in ``milestones``) when there are milestones."""
    optimizer = torch.optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if not milestones:
        return optimizer
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}
