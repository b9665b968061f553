"""The recipes' optimizer: SGD with step decay, and optionally Goyal et al.'s large-minibatch rule.

"Accurate, Large Minibatch SGD" (Goyal et al., 2017): scale the learning rate linearly with the global batch
(``lr x global_batch / reference_batch``) and warm it up, linearly per step, from the unscaled rate to the scaled one
over the first epochs. Both are one ``LambdaLR`` stepped every optimizer step, together with the step decay.
"""

import bisect
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def large_batch_factor(
    step: int, steps_per_epoch: int, scale: float, warmup_epochs: float, milestones: list[int], gamma: float
) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (from 0).

    During warm-up it rises linearly from 1 (the base rate) to ``scale``; then it is ``scale`` times ``gamma`` for
    each milestone epoch passed.
    """
    warmup_steps = warmup_epochs * steps_per_epoch
    if step < warmup_steps:
        return 1 + (scale - 1) * step / warmup_steps
    return scale * gamma ** bisect.bisect_right(milestones, step // steps_per_epoch)


def sgd_with_steps(
    parameters: Iterable[nn.Parameter],
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    milestones: list[int] | None = None,
    gamma: float = 0.1,
    *,
    global_batch: int | None = None,
    reference_batch: int = 256,
    warmup_epochs: float = 0.0,
    steps_per_epoch: int | None = None,
) -> Any:
    """SGD, with a ``MultiStepLR`` (``x gamma`` at each epoch in ``milestones``) when there are milestones.

    With ``global_batch`` (world size x per-rank batch x accumulation) the rate is also scaled by
    ``global_batch / reference_batch`` and warmed up over ``warmup_epochs`` (needs ``steps_per_epoch``): one
    ``LambdaLR`` stepped every optimizer step does all three.
    """
    optimizer = torch.optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if global_batch is not None:
        if not steps_per_epoch:
            raise ValueError("Large-minibatch scaling needs `steps_per_epoch` (optimizer steps in an epoch).")
        scale = global_batch / reference_batch
        steps, ms = steps_per_epoch, sorted(milestones or [])

        def factor(step: int) -> float:
            return large_batch_factor(step, steps, scale, warmup_epochs, ms, gamma)

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
    if not milestones:
        return optimizer
    decay = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones, gamma)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "epoch"}}


def trainer_batch_geometry(module: Any) -> tuple[int, int]:
    """``(global batch, optimizer steps per epoch)`` of the module's trainer and data module."""
    trainer = module.trainer
    per_rank = getattr(trainer.datamodule, "batch_size", None)
    if per_rank is None:
        raise ValueError("Large-minibatch scaling needs a data module with `batch_size`.")
    global_batch = per_rank * trainer.world_size * trainer.accumulate_grad_batches
    epochs = max(1, trainer.max_epochs or 1)
    steps = trainer.estimated_stepping_batches
    return global_batch, max(1, math.ceil(steps / epochs)) if math.isfinite(steps) else 1


def configure_sgd(module: Any) -> Any:
    """The zoo models' ``configure_optimizers``: :func:`sgd_with_steps` from their hyper-parameters.

    ``lr``: SGD learning rate; ``momentum``: SGD momentum; ``weight_decay``: L2 penalty; ``milestones``: epochs at
    which the rate is multiplied by ``gamma``. ``scale_lr``: large-minibatch training (Goyal et al.): ``lr`` is the
    rate for a global batch of ``reference_batch`` and is scaled by global batch / ``reference_batch``, warmed up
    linearly over ``warmup_epochs`` (Goyal et al. use 5).
    """
    h = module.hparams
    large: dict[str, Any] = {}
    if h["scale_lr"]:
        global_batch, steps_per_epoch = trainer_batch_geometry(module)
        large = dict(global_batch=global_batch, steps_per_epoch=steps_per_epoch,
                     reference_batch=h["reference_batch"], warmup_epochs=h["warmup_epochs"])  # fmt: skip
    return sgd_with_steps(
        module.parameters(), h["lr"], h["momentum"], h["weight_decay"], h["milestones"], h["gamma"], **large
    )
