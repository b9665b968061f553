"""Accordion: light compression in critical regimes, heavy elsewhere (Agarwal et al., MLSys 2021)."""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_gravac._validation import choice, fraction, whole
from lightning_gravac.adaptations import OuterUpdate
from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.compressors.base import validate_cf
from lightning_gravac.state import DENSE, CompressionState, Factors, StepStats


class Accordion(Controller):
    """Per-layer factors from critical-regime detection: compress lightly while a layer's gradient changes fast.

    Over each interval it sums every layer's gradient. At the interval's end, a layer whose accumulated-gradient
    norm changed by ``eta`` or more, relatively (``| ||A_prev|| - ||A_now|| | / ||A_prev|| >= eta``), is *critical*
    and gets ``low_cf``; the others get ``high_cf``. The first interval is critical (training starts light), and when
    the learning rate drops every layer goes back to ``low_cf`` until the next check. 1-D parameters (biases, norms)
    are never compressed. The gradients summed are the ones the optimizer applies, after the all-reduce, which are
    bitwise identical on every rank: every rank makes the same per-layer decisions without a collective. Under fully
    sharded training each rank holds a shard of each sum: its norm is taken whole (a collective a parameter a window,
    over the ranks that shard it), and a checkpoint saves the sums whole.

    ``cf`` is a ratio of bytes: Top-K that keeps 99% of the entries costs more than dense, so the "light" setting is
    ``low_cf=1`` (dense) or a small factor; ``high_cf`` is the authors' heavy setting (10x for CIFAR-10 Top-K).

    Args:
        low_cf: factor of critical layers.
        high_cf: factor of the other layers.
        eta: relative change of the accumulated-gradient norm that makes a layer critical, in (0, 1].
        window: interval length, in ``interval`` units (the authors check every 10 epochs).
        interval: ``"epoch"`` or ``"step"``.

    Raises:
        ValueError: for a factor below 1, ``low_cf > high_cf``, ``eta`` outside (0, 1], a window below 1 or an
            unknown interval.
    """

    def __init__(
        self,
        low_cf: float = 1.0,
        high_cf: float = 10.0,
        eta: float = 0.5,
        window: int = 10,
        interval: Literal["epoch", "step"] = "epoch",
    ) -> None:
        low_cf, high_cf = validate_cf(low_cf, "low_cf"), validate_cf(high_cf, "high_cf")
        if low_cf > high_cf:
            raise ValueError(f"`low_cf` ({low_cf:g}) must not exceed `high_cf` ({high_cf:g}).")
        super().__init__(cf=low_cf)
        self.low_cf, self.high_cf = low_cf, high_cf
        self.eta = fraction(eta, "eta")
        self.window = whole(window, "window")
        self.interval = choice(interval, "interval", ("epoch", "step"))
        self.compressible: list[str] = []  # parameters with ndim > 1
        self.previous_norms: dict[str, float] = {}
        self.lr_dropped = False
        self._sums: dict[str, Tensor] = {}
        self._progress = 0
        self._last_lr: float | None = None

    @property
    @override
    def max_cf(self) -> tuple[str, float]:
        return "high_cf", self.high_cf

    @property
    def layer_cf(self) -> Mapping[str, float]:
        """Every layer's factor, by name: the decision's own (:attr:`decided`); a layer not in it goes at ``low_cf``."""
        return self.decided.param_cf

    @layer_cf.setter
    def layer_cf(self, layer_cf: Mapping[str, float]) -> None:
        # A new mapping each time, never written in place: the hook reads the one it was handed until the next.
        self.decided = replace(self.decided, param_cf=dict(layer_cf))

    @override
    def decide(self, state: CompressionState) -> Factors:
        return replace(super().decide(state), param_cf=self.layer_cf)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_fit_start(trainer, pl_module)
        if not self.layer_cf:  # a fresh run: the first interval is critical, 1-D parameters are never compressed
            self.layer_cf = {n: DENSE if p.ndim <= 1 else self.low_cf for n, p in pl_module.named_parameters()}
            self.compressible = [n for n, p in pl_module.named_parameters() if p.ndim > 1]
        self._sums = {name: s.to(pl_module.device) for name, s in self._sums.items()}  # restored on the CPU
        self.apply(self.state)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        # Learning rates are the same on every rank, so this decision is too.
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
        if lr is not None and self._last_lr is not None and lr < self._last_lr:
            self.lr_dropped = True
            self.layer_cf = {**self.layer_cf, **dict.fromkeys(self.compressible, self.low_cf)}
            self.apply(self.state)
        self._last_lr = lr

    @override
    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Optimizer
    ) -> None:
        with torch.no_grad():
            for name, p in pl_module.named_parameters():
                if p.grad is None or p.ndim <= 1:
                    continue
                if name in self._sums:
                    # A sum restored whole under sharding (a checkpoint's) is laid out as its gradient first.
                    self._sums[name] = _laid_out(self._sums[name], p.grad)
                    self._sums[name].add_(p.grad)
                else:
                    self._sums[name] = p.grad.detach().clone()

    @override
    def observe(self, stats: StepStats, trainer: "pl.Trainer | None") -> None:
        if self.interval == "step":
            self._tick()

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.interval == "epoch":
            self._tick()
            self.apply(self.state)

    def _tick(self) -> None:
        self._progress += 1
        if self._progress >= self.window:
            norms = {name: _norm(s) for name, s in self._sums.items()}
            self.check(norms)
            self._sums.clear()
            self._progress = 0

    def check(self, norms: dict[str, float]) -> None:
        """Decide every layer's factor from the norms of its gradient summed over the interval that just ended."""
        layer_cf = dict(self.layer_cf)
        for name, norm in norms.items():
            previous = self.previous_norms.get(name)
            if self.lr_dropped or previous is None or previous == 0:
                critical = True  # the first interval, and the one after a learning-rate drop, start light
            else:
                critical = abs(previous - norm) / previous >= self.eta
            layer_cf[name] = self.low_cf if critical else self.high_cf
        self.layer_cf = layer_cf
        self.previous_norms = dict(norms)
        self.lr_dropped = False

    @property
    def critical_fraction(self) -> float:
        """The fraction of compressible layers that are critical (at ``low_cf``) now."""
        if not self.compressible:
            return 1.0
        return sum(self.layer_cf.get(n, self.low_cf) == self.low_cf for n in self.compressible) / len(self.compressible)

    @override
    def metrics(self, stats: StepStats) -> dict[str, float]:
        metrics = super().metrics(stats)
        if not self.state.carry.get(OuterUpdate):  # under local steps the base's are the rounds' factors
            metrics["gravac/cf"] = stats.achieved_cf  # factors differ by layer: report what the step achieved
        metrics["gravac/critical"] = self.critical_fraction
        return metrics

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "layer_cf": dict(self.layer_cf),
            "compressible": list(self.compressible),
            "previous_norms": dict(self.previous_norms),
            "lr_dropped": self.lr_dropped,
            "progress": self._progress,
            "last_lr": self._last_lr,
            "sums": {name: _whole(s).detach().cpu().clone() for name, s in self._sums.items()},
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.layer_cf, self.previous_norms = dict(state_dict["layer_cf"]), dict(state_dict["previous_norms"])
        self.compressible = list(state_dict["compressible"])
        self.lr_dropped, self._progress, self._last_lr = (
            state_dict["lr_dropped"],
            state_dict["progress"],
            state_dict["last_lr"],
        )
        self._sums = {name: s.clone() for name, s in state_dict["sums"].items()}
        super().load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (
            f"Accordion(low_cf={self.low_cf:g}, high_cf={self.high_cf:g}, eta={self.eta}, window={self.window}, "
            f"interval={self.interval!r})"
        )


def _whole(summed: Tensor) -> Tensor:
    """A summed gradient whole: a sharded one's shards gathered (a collective every rank makes when saving)."""
    return summed.full_tensor() if isinstance(summed, DTensor) else summed


def _laid_out(summed: Tensor, grad: Tensor) -> Tensor:
    """``summed`` laid out as ``grad`` is: a whole sum (restored) against a sharded gradient becomes its shard, cut on
    this rank; otherwise ``summed`` itself."""
    if isinstance(grad, DTensor) and not isinstance(summed, DTensor):
        return distribute_tensor(summed.to(grad.device), grad.device_mesh, grad.placements, src_data_rank=None)
    return summed


def _norm(summed: Tensor) -> float:
    """The L2 norm of a summed gradient, whole: of a sharded one (FSDP2's DTensor) over every rank's shard, so that
    every rank decides from the same value (a collective, which every rank reaches in the same order)."""
    norm = torch.linalg.vector_norm(summed, dtype=torch.float64)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
