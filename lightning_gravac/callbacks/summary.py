"""A summary of a run's communication, printed at the end of training."""

import time
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning import Callback
from pytorch_lightning.utilities import rank_zero_only
from typing_extensions import override


class RunSummary(Callback):
    """Collects the ``gravac/*`` metrics of every step and prints a table when training ends (rank 0).

    The table: steps, final value of ``monitor``, bytes sent against dense DDP's, the mean compression factor and
    the wall time. :attr:`history` keeps one row a step for plots and tests.

    Args:
        monitor: the logged metric to report (default ``train_loss``).
    """

    def __init__(self, monitor: str = "train_loss") -> None:
        self.monitor = monitor
        self.history: list[dict[str, float]] = []
        self._start = 0.0

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        metrics = trainer.callback_metrics
        if "gravac/cf" in metrics:
            row = {k: float(v) for k, v in metrics.items() if k.startswith("gravac/") or k == self.monitor}
            self.history.append({"step": float(trainer.global_step), **row})

    def table(self, wall_s: float) -> str:
        """The summary as text."""
        if not self.history:
            return "RunSummary: no compressed step was recorded."
        sent = sum(r["gravac/bytes_sent"] for r in self.history)
        dense = sum(r["gravac/bytes_dense"] for r in self.history)
        rows = [
            ("steps", f"{len(self.history)}"),
            (self.monitor, f"{self.history[-1].get(self.monitor, float('nan')):.4g}"),
            ("bytes sent", f"{sent / 2**20:.2f} MiB"),
            ("bytes dense DDP", f"{dense / 2**20:.2f} MiB"),
            ("traffic saved", f"{dense / sent:.1f}x"),
            ("mean cf", f"{sum(r['gravac/cf'] for r in self.history) / len(self.history):.1f}"),
            ("final cf", f"{self.history[-1]['gravac/cf']:g}"),
            ("wall time", f"{wall_s:.1f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        line = "-" * (width + 24)
        return "\n".join([line, *(f"{k:<{width}}  {v:>20}" for k, v in rows), line])

    @override
    @rank_zero_only
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        print(self.table(time.perf_counter() - self._start))
