"""Helpers for Trainer-level tests, top-level so that spawned ranks can import them."""

import atexit
import itertools
import multiprocessing
import os
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gravac import Controller, GraVAC, StepStats
from lightning_gravac.adaptations import MomentumCorrection
from lightning_gravac.compressors.base import Compressor
from lightning_gravac.zoo import TeacherRegression, teacher_dataset


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


class SimulatedLink(GraVAC):
    """GraVAC whose step time is modelled, not measured: 10 ms of compute plus the bytes at 10 Mbit/s.

    Makes the throughput-driven decisions (plateau, model search) deterministic, so runs can be compared: the link
    probe, the step and the compression are modelled. The paper's sequential search unless ``search`` is given.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("search", "sequential")
        super().__init__(**kwargs)

    def step_seconds(self, stats: StepStats) -> float:
        return 0.01 + stats.bytes_sent * 8 / 10e6

    def compress_seconds(self, stats: StepStats) -> float:
        return 0.0

    def measure_link(self, trainer: pl.Trainer) -> tuple[float, float]:
        return 0.0, 8 / 10e6

    def measure_half(self, trainer: pl.Trainer) -> tuple[float, float]:
        return 8 / 10e6, 0.0  # an fp16 byte costs an fp32 one's; the casts nothing

    def measure_compression(self, trainer: pl.Trainer) -> float:
        return 0.0

    def measure_round(self, trainer: pl.Trainer, method: Compressor) -> float:
        return 0.0


class StopAfter(Callback):
    """Stop a fit after ``steps`` optimizer steps. With a large ``max_steps`` it gives a short test run a long budget:
    GraVAC's factors are bounded by the run's length (``trainer.estimated_stepping_batches``)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


class Snapshot(Callback):
    """Records the controller's state, the step counter and this rank's residuals: at the end of epoch ``at_epoch``
    (as the checkpoint then written holds them), or at train start (as a resumed run begins)."""

    def __init__(self, at_epoch: int | None = None) -> None:
        self.at_epoch = at_epoch
        self.taken: dict[str, Any] | None = None

    def _take(self, trainer: pl.Trainer) -> None:
        controller = next(c for c in trainer.callbacks if isinstance(c, GraVAC))  # type: ignore[attr-defined]
        state = trainer.strategy.compression_state  # type: ignore[attr-defined]
        self.taken = {
            "controller": controller.state_dict(),
            "step": state.step,
            "residuals": state.carry.residuals.state_dict(),
            "compressor": state.compressor.state_dict(),
            "momentum": state.carry.get(MomentumCorrection).state_dict(),
        }

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_epoch is None:
            self._take(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_epoch == trainer.current_epoch:
            self._take(trainer)


class FaultyRegression(TeacherRegression):
    """The teacher task, with one fault on one rank at one step: a NaN or Inf loss, an exit or a stall."""

    def __init__(
        self, fault: str = "nan", at_step: int = 5, on_rank: int = 1, stall_s: float = 600, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.fault, self.at_step, self.on_rank, self.stall_s = fault, at_step, on_rank, stall_s

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.at_step and self.global_rank == self.on_rank:
            if self.fault == "exit":
                os._exit(0)
            if self.fault == "stall":  # for `stall_s`, then gone (a test need not wait for it to be killed)
                time.sleep(self.stall_s)
                os._exit(0)
            return loss * float(self.fault)  # "nan" or "inf": every gradient of this rank is non-finite
        return loss


class UnusedAndFrozen(TeacherRegression):
    """The teacher task with a frozen layer and a layer that never takes part in the loss."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.frozen(x) * 0 + x)


class SparseBag(pl.LightningModule):
    """A sum of ``nn.EmbeddingBag(256, 16, sparse=True)`` rows under a ``Linear(16, 1)``: one sparse gradient beside
    dense ones. SGD with momentum 0.9, the embedding in a group of its own (``one_group``: with the head). Batches of 8
    bags of 5 token ids, a random regression target."""

    def __init__(self, one_group: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(256, 16, mode="sum", sparse=True)
        self.head = nn.Linear(16, 1)
        self.one_group = one_group

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, y = batch
        return nn.functional.mse_loss(self.head(self.bag(tokens)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.one_group:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        groups = [{"params": self.bag.parameters()}, {"params": self.head.parameters()}]
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def bag_loader(n: int = 256) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (n, 5), generator=g)
    return DataLoader(TensorDataset(tokens, torch.randn(n, 1, generator=g)), batch_size=8)


class ExitCleanly(Callback):
    """For Trainers that spawn their ranks: end each spawned worker with ``os._exit(0)`` at interpreter exit.

    A spawned gloo worker sometimes aborts during interpreter finalization after a clean run, and the spawn launcher
    then reports a failure the code under test did not cause. Lightning hands rank 0's results to the parent (a
    synchronous pipe write) before the worker returns, so exiting first loses nothing. Registered last, the handler
    runs before every other exit handler.
    """

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Only in a spawned worker: in the process that runs pytest it would turn every exit status into 0.
        if multiprocessing.parent_process() is not None:
            atexit.register(os._exit, 0)


class MLP(pl.LightningModule):
    """A plain MLP on the teacher's data (``n_in`` inputs, one output), SGD; ``sizes`` are every layer's width."""

    def __init__(self, sizes: tuple[int, ...] = (16, 64, 64), lr: float = 0.05, momentum: float = 0.0) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(sizes[-1], 1))
        self.lr, self.momentum = lr, momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Cycling(Controller):
    """A controller that changes the factor every ``every`` steps, through ``factors`` in turn (1 among them: the
    dense path between compressed ones), as an adaptive controller may."""

    def __init__(self, factors: tuple[float, ...] = (4, 1, 16, 8), every: int = 2) -> None:
        super().__init__(cf=factors[0])
        self.factors, self.every, self._seen = factors, every, 0

    def observe(self, stats: StepStats, trainer: pl.Trainer) -> None:
        self._seen += 1
        self.cf = self.factors[(self._seen // self.every) % len(self.factors)]

    @property
    def max_cf(self) -> tuple[str, float]:
        return "factors", max(self.factors)


class Tiny(pl.LightningModule):
    """A ``Linear(32, 2)`` on random data, as small as Lightning's own test model: 66 parameters, the largest
    gradient 64 entries. Logs its loss in every stage; ``fail_in`` names a stage whose step raises ``Failure``."""

    def __init__(self, fail_in: str = "", optimizer: str = "sgd") -> None:
        super().__init__()
        self.layer = nn.Linear(32, 2)
        self.fail_in, self.optimizer = fail_in, optimizer
        self.seen: list[tuple[int, int]] = []  # (epoch, dataset index) of every sample this rank trained on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def _loss(self, batch: Any, stage: str) -> torch.Tensor:
        if self.fail_in == stage:
            raise Failure(f"{stage} failed on rank {self.global_rank}")
        index, x = batch
        if stage == "train":
            self.seen += [(self.current_epoch, i) for i in index.tolist()]
        return self(x).square().mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch, "train")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch, "validate"), sync_dist=True)
        self.log("val_rank", float(self.global_rank), rank_zero_only=False)  # each rank its own, not reduced

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch, "test"), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.fail_in == "predict":
            raise Failure(f"predict failed on rank {self.global_rank}")
        return self(batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Failure(Exception):
    """What :class:`Tiny` raises in the stage it is told to fail in."""


class Indexed(torch.utils.data.Dataset):
    """``n`` random 32-vectors with their index, so a test can tell which rank saw which sample."""

    def __init__(self, n: int = 64) -> None:
        self.x = torch.randn(n, 32, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, self.x[i]


def tiny_loader(n: int = 64, batch_size: int = 4) -> DataLoader:
    return DataLoader(Indexed(n), batch_size=batch_size)


class OneWeight(Tiny):
    """A model of a single parameter: ``y = w x[:, 0]``, the smallest a strategy may meet."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x[:, :1])


class FrozenBackbone(Tiny):
    """A frozen ``Linear(32, 4)`` under a trainable ``Linear(4, 2)``: the largest tensor (128 entries) takes no
    gradient, the largest gradient has 8 entries."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(32, 4).requires_grad_(False)
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.backbone(x))


class CompiledMLP(MLP):
    """:class:`MLP` whose network is ``torch.compile``-d in ``configure_model``, as Lightning's docs show."""

    def configure_model(self) -> None:
        self.net = torch.compile(self.net)


class Regression(pl.LightningModule):
    """16 -> 64 -> 32 -> 4, SGD with the given momentum settings."""

    def __init__(self, lr: float = 0.05, **sgd: float | bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
        self.lr, self.sgd = lr, sgd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, **self.sgd)


def regression_data(n: int, seed: int) -> TensorDataset:
    """A random tanh teacher (always the same one) on ``n`` inputs drawn with ``seed``."""
    teacher = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(16, 32, generator=teacher) / 4, torch.randn(32, 4, generator=teacher) / 32**0.5
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, torch.tanh(x @ w1) @ w2)


class LinkOf(GraVAC):
    """The default controller (model search) on a scripted link of ``bits_per_second``: the fit-start timing, a step's
    seconds (``compute`` plus the bytes sent) and compression (free) are modelled: its decisions are deterministic.
    ``rounds_timed`` counts the times a round's own work was asked to be timed."""

    def __init__(self, bits_per_second: float, compute: float = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.per_byte, self.compute = 8 / bits_per_second, compute
        self.rounds_timed = 0

    def step_seconds(self, stats: StepStats) -> float:
        return self.compute + stats.bytes_sent * self.per_byte

    def compress_seconds(self, stats: StepStats) -> float:
        return 0.0

    def measure_link(self, trainer: pl.Trainer) -> tuple[float, float]:
        return 0.0, self.per_byte

    def measure_half(self, trainer: pl.Trainer) -> tuple[float, float]:
        return self.per_byte, 0.0

    def measure_compression(self, trainer: pl.Trainer) -> float:
        return 0.0

    def measure_round(self, trainer: pl.Trainer, method: Compressor) -> float:
        self.rounds_timed += 1
        return 0.0


class OneCycleRegression(pl.LightningModule):
    """A ReLU MLP regressing targets of scale ``scale`` with SGD (weight decay 1e-4) under ``OneCycleLR`` up to
    ``max_lr``, its momentum cycled 0.85-0.95: a run near the edge of stability, where users' schedules live."""

    def __init__(self, max_lr: float = 0.085, steps: int = 40, width: int = 256) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
        )
        self.max_lr, self.steps = max_lr, steps
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.max_lr / 25, momentum=0.9, weight_decay=1e-4)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.max_lr, total_steps=self.steps, base_momentum=0.85, max_momentum=0.95
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def one_cycle_loader(scale: float = 10.0, batch_size: int = 32) -> DataLoader:
    """The teacher's targets scaled and shifted by ``scale``, for :class:`OneCycleRegression`."""
    x, y = teacher_dataset(4096).tensors
    return DataLoader(TensorDataset(x, scale * y + scale), batch_size=batch_size, shuffle=True)


def clusters(n: int = 4096, n_in: int = 32, classes: int = 8, seed: int = 0) -> TensorDataset:
    """``n`` points of ``classes`` overlapping Gaussian clusters in ``n_in`` dimensions, and their cluster."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, n_in, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centers[labels] + 1.5 * torch.randn(n, n_in, generator=g), labels)


class ClusterClassifier(pl.LightningModule):
    """A ReLU MLP (two hidden layers of 256) classifying :func:`clusters`, plain SGD at ``lr``."""

    def __init__(self, lr: float = 0.05, n_in: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(n_in, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, classes)
        )
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)
