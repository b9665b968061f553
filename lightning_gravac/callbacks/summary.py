"""A summary of a run's communication, printed at the end of training."""

import math
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning import Callback
from pytorch_lightning.utilities import rank_zero_only
from pytorch_lightning.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_gravac.adaptations import OuterUpdate
from lightning_gravac.callbacks.controller import Controller, controllers_of


class RunSummary(Callback):
    """Collects the controller's ``gravac/*`` metrics of every step and prints a table when training ends (rank 0).

    The table: steps, last value of ``monitor`` ("not measured" when the module never logged it, with the names it
    did log, or that no validation ran where the module validates), bytes sent against dense DDP's, the harmonic mean
    of the compression factors asked for (what they would have saved; under local steps, the codes the rounds' changes
    went in, and a line says how many steps sent nothing) and the training time, from the first step to the end of
    training. :attr:`history` keeps one row a step for plots and tests. Its place among the callbacks does not matter:
    a step is collected once the controller has seen it.

    With ``plot`` it also saves ``gravac.png`` in the trainer's log directory: the factor, the gain, the compression
    throughput (when the controller reports one: GraVAC) and the monitored metric over steps, each where it was
    measured.

    Args:
        monitor: the logged metric to report (default ``train_loss``).
        plot: save the PNG plot at the end of training (rank 0; needs matplotlib).
    """

    def __init__(self, monitor: str = "train_loss", plot: bool = True) -> None:
        self.monitor, self.plot = monitor, plot
        self.plot_path: Path | None = None
        self.history: list[dict[str, float]] = []
        self._start = 0.0
        self._controller: Controller | None = None
        self._seen = 0
        #: The names of the metrics the module logged, said when ``monitor`` is not among them, and ``monitor``'s value
        #: when training ended (a validation after the last step included).
        self.logged: list[str] = []
        self.final: float | None = None
        #: The series the last plot holds: those measured at least once.
        self.plotted: list[str] = []
        #: Whether the fit ran local steps (by its end): the table says what their factors count.
        self.local_steps = False
        #: Whether a validation ran during the fit (not the sanity check), and, for a module that validates when none
        #: did, the training batches between validations (``None`` where none or not said): what the table says when
        #: ``monitor`` was never logged.
        self.validated = False
        self.validates_every: float | None = None

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._start = time.perf_counter()
        self._controller = next(iter(controllers_of(trainer)), None)
        self._seen = self._controller.metrics_step if self._controller is not None else 0

    def _collect(self, trainer: "pl.Trainer") -> None:
        # Called before and after every batch, so that a controller placed after this callback is read too.
        controller = self._controller
        if controller is None or controller.metrics_step == self._seen:
            return
        self._seen = controller.metrics_step
        row = {"step": float(controller.metrics_step), **controller.last_metrics}
        if self.monitor in trainer.callback_metrics:
            row[self.monitor] = float(trainer.callback_metrics[self.monitor])
        self.history.append(row)

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        self._collect(trainer)

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        self._collect(trainer)

    def table(self, wall_s: float) -> str:
        """The summary as text."""
        if not self.history:
            return "RunSummary: no compressed step was recorded."
        measured = [r[self.monitor] for r in self.history if self.monitor in r]
        last = self.final if self.final is not None else next(reversed(measured), None)
        sent = sum(r["gravac/bytes_sent"] for r in self.history)
        dense = sum(r["gravac/bytes_dense"] for r in self.history)
        asked = len(self.history) / sum(1 / r["gravac/cf"] for r in self.history)
        rows = [
            ("steps", f"{len(self.history)}"),
            (self.monitor, "not measured" if last is None else f"{last:.4g}"),
            ("bytes sent", f"{sent / 2**20:.2f} MiB"),
            ("bytes dense DDP", f"{dense / 2**20:.2f} MiB"),
            ("traffic saved", f"{dense / sent:.1f}x"),
            # What the factors asked for would have saved, weighing each step by its bytes (a harmonic mean): the
            # traffic saved falls short of it where a method sent more than asked (DGC's warm-up, headers, probes).
            ("cf asked, harmonic mean", f"{asked:.1f}"),
            ("final cf", f"{self.history[-1]['gravac/cf']:g}"),
            # From the first step to the last: not the setup, the fit-start timings, nor the process start.
            ("training time", f"{wall_s:.1f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        line = "-" * (width + 24)
        table = [line, *(f"{k:<{width}}  {v:>20}" for k, v in rows), line]
        if dense / sent < 0.8 * asked:
            table.append(
                "The traffic saved is below what the factors asked for: the method sent more on some steps (a warm-up "
                "that sends denser, as DGC's; headers and at least one entry a tensor on small layers)."
            )
        quiet = sum(1 for r in self.history if not r["gravac/bytes_sent"])
        if self.local_steps and quiet:
            table.append(
                f"Local steps: {quiet} of the {len(self.history)} steps sent nothing (a round's inner steps); the "
                "traffic saved counts them, and cf is the code each round's change went in."
            )
        if last is None:
            logged = ", ".join(self.logged) or "none"
            table.append(f"No metric named {self.monitor!r} was logged (logged: {logged})" + self._why_unlogged())
        return "\n".join(table)

    def _why_unlogged(self) -> str:
        """The end of the line saying ``monitor`` was never logged: no validation ran, or the name is not logged."""
        if self.validates_every is None:
            return ": give RunSummary(monitor=...) the name the module logs, or log it."
        every = self.validates_every
        where = f"every {every:g} training batches here" if math.isfinite(every) else "at each epoch's end"
        return (
            f", and no validation ran in these {len(self.history)} steps (Lightning validates {where}): set "
            "trainer.val_check_interval to fewer steps than the run's, or train longer."
        )

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.validated = self.validated or not trainer.sanity_checking

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._collect(trainer)
        validates = is_overridden("validation_step", pl_module) and bool(trainer.limit_val_batches)
        every = trainer.val_check_batch
        self.validates_every = float(every or math.inf) if validates and not self.validated else None
        metrics = trainer.callback_metrics
        self.logged = sorted(name for name in metrics if not name.startswith("gravac/"))
        self.final = float(metrics[self.monitor]) if self.monitor in metrics else None
        state = self._controller.compression_state if self._controller is not None else None
        self.local_steps = state is not None and bool(state.carry.get(OuterUpdate))
        # `Trainer.log_dir` broadcasts from rank 0: every rank must ask for it, not rank 0 alone.
        log_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self._report(log_dir, time.perf_counter() - self._start)

    @rank_zero_only
    def _report(self, log_dir: Path, wall_s: float) -> None:
        print(self.table(wall_s))
        if self.plot and self.history:
            self.plot_path = self.save_plot(log_dir / "gravac.png")
            print(f"RunSummary: plot of {', '.join(self.plotted)} over the steps saved to {self.plot_path}")

    def save_plot(self, path: Path) -> Path:
        """Plot the factor sent (and the sequential search's candidate), the gain, the compression throughput and the
        monitored metric over the steps to ``path`` (PNG); a series never logged gets no panel."""
        # Imported on use: its backend must be chosen before pyplot loads, and a run that saves no plot pays nothing.
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")  # files only: no display on a training node
        import matplotlib.pyplot as plt  # noqa: PLC0415
        import matplotlib.ticker  # noqa: PLC0415

        steps = [r["step"] for r in self.history]

        def values(key: str) -> list[float]:
            if key == "gravac/compression_throughput":  # 0 until a window has measured it: a gap, not a value
                return [r.get(key) or float("nan") for r in self.history]
            return [r.get(key, float("nan")) for r in self.history]

        series = [
            ("gravac/cf", "compression factor (log)"),
            ("gravac/gain", "gain ||C(g)||²/||g||²"),
            ("gravac/compression_throughput", "samples/s x gain"),  # GraVAC's T_sys x gain
            (self.monitor, self.monitor),
        ]
        series = [(key, label) for key, label in series if any(math.isfinite(v) for v in values(key))]
        self.plotted = [key.removeprefix("gravac/") for key, _ in series]
        fig, axes = plt.subplots(len(series), 1, sharex=True, figsize=(8, 2.4 * len(series)), squeeze=False)
        for ax, (key, label) in zip(axes[:, 0], series, strict=True):
            ax.plot(steps, values(key), lw=1.2, label="sent" if key == "gravac/cf" else None)
            # The sequential search's candidate, where it moved: the model search probes its whole ladder instead.
            if key == "gravac/cf" and len({v for v in values("gravac/probe_cf") if math.isfinite(v)}) > 1:
                ax.plot(steps, values("gravac/probe_cf"), lw=1.0, ls="--", label="candidate probed")
                ax.legend(loc="upper left", fontsize="small")
            finite = [v for v in values(key) if math.isfinite(v)]
            if key == "gravac/cf" or (min(finite) > 0 and max(finite) > 10 * min(finite)):  # factors; a falling loss
                ax.set_yscale("log")
                # Plain numbers at 1, 2 and 5 of each decade (10, 20, 50, 100), not matplotlib's 2x10^1.
                ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        axes[-1, 0].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
