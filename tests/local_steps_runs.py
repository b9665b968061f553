"""What the local steps' tests run on two gloo ranks: regressions whose batches are drawn from (global step, rank),
a trace of each rank's parameters and losses, the fit through Lightning's Trainer, and a scripted link whose steps
before local steps are slower than its model predicts."""

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_gravac import GraVACStrategy

from models import LinkOf, loader, trainer_kwargs


class StepData(pl.LightningModule):
    """A regression whose batch is drawn from (global step, rank), not from the loader: a run resumed mid-epoch (where
    Lightning restarts the epoch's loader) sees the batches the uninterrupted run saw. SGD with momentum 0.9; ``nan_at``
    makes rank ``nan_rank``'s loss NaN at that step, ``blow_at`` rank 1's gradient 10^4 times larger (its parameters
    thrown far off)."""

    def __init__(self, nan_at: int = -1, blow_at: int = -1, nan_rank: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.nan_at, self.blow_at, self.nan_rank = nan_at, blow_at, nan_rank
        teacher = torch.Generator().manual_seed(7)
        self.register_buffer("w", torch.randn(16, 4, generator=teacher) / 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        x = torch.randn(32, 16, generator=g)
        loss = nn.functional.mse_loss(self.net(x), torch.tanh(x @ self.w))
        if self.global_step == self.nan_at and self.global_rank == self.nan_rank:
            loss = loss * float("nan")
        if self.global_step == self.blow_at and self.global_rank == 1:
            loss = loss * 1e4
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class BagStepData(pl.LightningModule):
    """A regression on bags of token ids, drawn from (global step, rank) like ``StepData``'s: an ``EmbeddingBag`` of
    512 x 16 under a ``Linear(16, 1)``, nearly all of the parameters in the table (the default sends Top-K). SGD at
    ``lr`` 0.3, plain as the matrix's embedding bag (``momentum``: SGD's)."""

    lr = 0.3

    def __init__(self, momentum: float = 0.0) -> None:
        super().__init__()
        self.momentum = momentum
        self.bag = nn.EmbeddingBag(512, 16, mode="sum")
        nn.init.normal_(self.bag.weight, std=0.01)
        self.head = nn.Linear(16, 1)
        teacher = torch.Generator().manual_seed(7)
        self.register_buffer("w", torch.randn(512, generator=teacher))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens)).squeeze(1)

    def batch_at(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 512, (32, 8), generator=torch.Generator().manual_seed(1000 * step + rank))
        return tokens, torch.tanh(self.w[tokens].sum(1) / 8**0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, target = self.batch_at(self.global_step, self.global_rank)
        loss = nn.functional.mse_loss(self(tokens), target)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Trace(pl.Callback):
    """This rank's parameters after every optimizer step, and the loss."""

    def __init__(self) -> None:
        self.after: list[torch.Tensor] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.after.append(torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()]))
        self.losses.append(float(outputs["loss"]))


def _fit(strategy: GraVACStrategy, steps: int, model: pl.LightningModule | None = None, **kwargs: Any) -> Trace:
    trace = Trace()
    pl.seed_everything(0)
    callbacks = [trace, *kwargs.pop("callbacks", [])]
    trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, max_steps=steps, **trainer_kwargs(2, **kwargs))
    trainer.fit(model or StepData(), loader(n=32768))  # 512 steps an epoch: no epoch ends a round here
    assert trainer.global_step == steps, "global_step counts inner steps"
    return trace


class SlowBeforeTheSwitch(LinkOf):
    """The scripted link, its steps before local steps 50 ms slower than the model predicts (a compressed step's
    overheads): the computation estimated from them is 6x the 10 ms an inner step then measures."""

    def step_seconds(self, stats: Any) -> float:
        return super().step_seconds(stats) + (0.0 if self.rounds.every else 0.05)
