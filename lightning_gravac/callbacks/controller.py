"""The base of every compression controller."""

import math
from dataclasses import replace
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn
from pytorch_lightning import Callback
from typing_extensions import override

from lightning_gravac.adaptations import OuterUpdate, scales_per_coordinate
from lightning_gravac.callbacks.guard import DivergenceGuard
from lightning_gravac.state import CompressionState, Factors, StepStats


def largest_trainable(module: torch.nn.Module) -> int:
    """The size of ``module``'s largest parameter that requires a gradient.

    Raises:
        ValueError: when it has none (every parameter frozen, or none at all): DDP would refuse it with an error of
            its own, after the process group exists.
    """
    largest = max((p.numel() for p in module.parameters() if p.requires_grad), default=0)
    if largest == 0:
        raise ValueError(
            f"{type(module).__name__} has no parameter that requires a gradient (every parameter is frozen, or it "
            "has none): data-parallel training has nothing to communicate. Unfreeze at least one parameter "
            "(`requires_grad_(True)`), or fit it without a distributed strategy."
        )
    return largest


def controllers_of(trainer: "pl.Trainer") -> list["Controller"]:
    """The compression controllers among ``trainer``'s callbacks (a GraVACStrategy accepts one)."""
    # `Trainer.callbacks` is public but assigned by Lightning's callback connector, invisible to type checkers.
    callbacks: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    return [c for c in callbacks if isinstance(c, Controller)]


class Controller(Callback):
    """A callback that reads each step's compression statistics and sets the compression factor.

    Statistics come from the comm hook and crossed the network, so they are identical on every rank, and so is
    every decision made from them: ranks that chose different factors would send payloads of different sizes
    and deadlock the collective. Subclasses implement :meth:`observe` (and may override :meth:`metrics`);
    they change the factor by setting ``self.cf``, and complete the decision in :meth:`decide` (per-layer factors,
    probes).

    The controller owns the decision (:attr:`decided`, whose ``cf`` is :attr:`cf`) and the state reads it: the hook's
    :attr:`~lightning_gravac.CompressionState.factors` is this very object, handed over by :meth:`apply`, except while
    a hold sends the steps whole in its place. The decision lives here rather than in the state because it outlives
    what the hook sends: the divergence guard's hold and a warm-up replace it and give it back, a checkpoint
    carries it, and it exists before any state does (a controller is built before its trainer) and stays with the
    controller when it is attached to another.

    Every step it computes :attr:`last_metrics`: ``gravac/cf`` (factor in force), ``gravac/achieved_cf`` (dense /
    sent bytes), ``gravac/gain`` (``sum ||C(g)||^2 / sum ||g||^2``), ``gravac/bytes_sent``, ``gravac/bytes_dense``,
    ``gravac/compress_ms``, ``gravac/comm_ms`` (this rank's host time), ``gravac/collective`` (the fraction of
    buckets that were reduced rather than gathered: 0 all gathered, 1 all reduced) and ``gravac/guarded`` (1 when
    the divergence guard, :attr:`guard`, holds the next step at factor 1); under local steps the two factors are the
    rounds' (:meth:`_round_factors`). Every step's values are in
    ``trainer.callback_metrics`` on every rank right after the step (so a callback or ``ModelCheckpoint(monitor=...)``
    sees them fresh), and go to every configured logger on the steps Lightning writes to its loggers (every
    ``Trainer(log_every_n_steps=...)``).

    Raises:
        ValueError: at setup, before any collective, if the trainer's strategy is not a ``GraVACStrategy``, if the
            model has no trainable parameter, or if the controller's largest factor exceeds the size of the model's
            largest gradient.
    """

    def __init__(self, cf: float = 1.0) -> None:
        #: The decision for the next step: what :meth:`apply` hands the hook.
        self.decided = Factors(cf=cf)
        #: Whether the optimizer scales each coordinate by a running second moment: known at fit start.
        self.adaptive_optimizer = False
        #: Sends dense for a while when a compressed step's gradient norm explodes; ``None`` turns it off.
        self.guard: DivergenceGuard | None = DivergenceGuard()
        self.last_metrics: dict[str, float] = {}
        #: The step (``state.step``) :attr:`last_metrics` are of; 0 before the first.
        self.metrics_step = 0
        self.nonfinite_steps = 0
        self._state: CompressionState | None = None
        self._round_cf: float | None = None  # under local steps: the last round's dense bytes over its bytes sent

    @property
    def cf(self) -> float:
        """The factor this controller chose (the hook's, unless a hold sends the step whole)."""
        return self.decided.cf

    @cf.setter
    def cf(self, cf: float) -> None:
        self.decided = replace(self.decided, cf=cf)

    @property
    def state(self) -> CompressionState:
        """The strategy's compression state (available from ``setup`` on)."""
        if self._state is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a GraVACStrategy yet.")
        return self._state

    @property
    def compression_state(self) -> CompressionState | None:
        """The strategy's compression state, ``None`` before setup (when :attr:`state` raises). Setup sets it; set it by
        hand to drive the controller without a trainer (the next :meth:`apply` hands the decision over)."""
        return self._state

    @compression_state.setter
    def compression_state(self, state: CompressionState | None) -> None:
        self._state = state

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # By the state the strategy carries, not by its class: the strategy module imports the controllers.
        state = getattr(trainer.strategy, "compression_state", None)
        if not isinstance(state, CompressionState):
            raise ValueError(
                f"{type(self).__name__} controls GraVACStrategy's compression, but the trainer's strategy is "
                f"{type(trainer.strategy).__name__}. Use `Trainer(strategy=GraVACStrategy(...))` (or "
                "`GraVACModelParallelStrategy(...)` for FSDP2) or drop the callback."
            )
        # A model that builds its layers in `configure_model` (sized by the data) has none yet: checked at fit start.
        # Only fitting communicates gradients: validating or testing a frozen model is fine.
        if stage == "fit" and any(True for _ in pl_module.parameters()):
            self._fit_and_check(pl_module)
        self._state = state
        self.apply(state)

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._fit_and_check(pl_module)
        optimizers = getattr(trainer, "optimizers", [])
        self.adaptive_optimizer = scales_per_coordinate(optimizers) and not self.state.compressor.near_lossless
        if self.adaptive_optimizer:
            # When the optimizer's moments move into the hook (after a warm-up) is their part's decision.
            self.state.carry.on_fit_start(trainer, self.moves_moments, type(self).__name__, self.state.compressor.name)
            self._on_adaptive_optimizer()
        self.apply(self.state)

    @property
    def moves_moments(self) -> bool:
        """Whether, under an optimizer whose moments can move into the comm hook after a warm-up (an adaptation of
        :mod:`lightning_gravac.adaptations`), this controller has them move: a controller that compresses does; one held
        at factor 1 leaves the optimizer as it is."""
        return self.max_cf[1] > 1

    def moments_moved(self) -> bool:
        """Whether the next step sends the optimizer's moved moment (the warm-up is over)."""
        return self._state is not None and self._state.carry.sends_moved(self._state.step)

    def _on_adaptive_optimizer(self) -> None:
        """The optimizer divides each coordinate by a running second moment (RMSprop, Adagrad and the like): say what
        compression measured there. A controller that holds dense instead overrides this."""
        if self.state.carry.sends_from is not None or self.state.compressor.near_exact:
            return  # its moments move after the warm-up (said when that was decided), or a block code: nothing to say
        rank_zero_warn(
            f"{type(self).__name__}: the optimizer scales each coordinate by a running second moment, "
            f"and {self.state.compressor.name!r} sends lossy gradients, which upset that scaling: the loss can end "
            "many times dense's. Prefer `GraVACStrategy('fp16')` with Adam, or watch the loss."
        )

    def fit_to_model(self, largest: int) -> None:
        """Fit the factors the user left at their defaults to the model, whose largest gradient has ``largest``
        entries. Called at setup (and again at fit start) before the factors are checked; explicit ones stay."""

    def _fit_and_check(self, pl_module: "pl.LightningModule") -> None:
        largest = largest_trainable(pl_module)
        self.fit_to_model(largest)
        argument, factor = self.max_cf
        if factor > largest:
            raise ValueError(
                f"`{argument}`={factor:g} exceeds the size of the largest gradient ({largest} entries): no tensor can "
                f"be compressed that far, at least one entry is always sent. Allowed: 1 <= {argument} <= {largest}."
            )

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The strategy ended the step after backward (and advanced its count); a backward pass that did not go
        # through the strategy (a plain `loss.backward()` under manual optimization) is ended here. No-op otherwise.
        self.state.end_step()
        stats = self.state.take_stats()
        if stats is None:  # no communication this batch (gradient accumulation)
            return
        if not stats.finite:
            # Some rank's gradient had a NaN or Inf: the hook kept the residuals and returned NaN for the scaler to
            # skip the step. Its statistics would poison every average: leave the decisions as they are.
            self.nonfinite_steps += 1
            rank_zero_warn(
                f"{type(self).__name__}: a non-finite gradient at step {trainer.global_step}; "
                "the step's statistics are ignored and the residuals kept."
            )
            return
        self.last_metrics = self.metrics(stats)  # of the step that produced `stats`, before the next decision
        self.metrics_step = self.state.step
        if self.guard is not None and self.state.carry.sends_from == self.state.step - 1:
            self.guard.restart()  # the first step that sent a moved moment: a new quantity's norms from here on
        guarded = self._guarded(stats, trainer, outputs)
        if guarded == "free":  # a step the guard sent dense is not the controller's to observe
            self.observe(stats, trainer)
        self.apply(self.state)
        self.last_metrics["gravac/guarded"] = float(guarded == "hold")  # whether the next step is held dense
        self._publish(trainer)

    def _publish(self, trainer: "pl.Trainer") -> None:
        """This step's metrics into ``trainer.callback_metrics`` on every rank, every step, and to every logger on
        the steps Lightning writes to its loggers (``log_every_n_steps``), at the step Lightning logs its own at.

        Around ``LightningModule.log`` on purpose: a call a metric costs, for our dozen metrics, as much as a small
        model's step at cf 1, and between the steps Lightning writes, the values it holds reach no logger and
        go stale in ``callback_metrics``. A plain dict update and the logger connector's own ``log_metrics`` cost
        microseconds. (``_logger_connector`` is Lightning's private connector, the one its ``self.log`` ends in.)
        """
        metrics = {key: torch.tensor(value) for key, value in self.last_metrics.items()}
        trainer.callback_metrics.update(metrics)
        connector = trainer._logger_connector
        if getattr(connector, "should_update_logs", True):
            connector.log_metrics(metrics)

    def _guarded(self, stats: StepStats, trainer: "pl.Trainer", outputs: Any = None) -> str:
        """``"hold"``: the divergence guard holds the next step dense; ``"released"``: this step was its last dense
        one; ``"free"``: the controller decides."""
        guard = self.guard
        if guard is None:
            return "free"
        was_holding = guard.holding > 0
        # The ranks' mean loss, on compressed steps only: whether a step was is the same on every rank (its byte counts
        # are), so every rank joins this all-reduce or none does. Dense steps, probed or not, pay nothing.
        watch = guard.watches_loss and stats.compressed and not guard.holding
        loss = self._mean_loss(trainer, outputs) if watch else None
        if guard.check(stats, loss):
            # Identical on every rank (the norms and losses crossed the network); said on rank 0.
            rank_zero_warn(
                f"{type(self).__name__}: training diverged at step {trainer.global_step} while compressing (the "
                f"gradient norm above {guard.ratio:g}x its recent median, or the loss above {guard.loss_ratio}x its "
                f"lowest): sending dense for {guard.holding} steps and dropping the residuals. Set "
                "`controller.guard = None` to turn the guard off."
            )
            self.state.reset()
            return "hold"
        if guard.holding > 0:
            return "hold"
        return "released" if was_holding else "free"

    @property
    def max_cf(self) -> tuple[str, float]:
        """The most aggressive factor this controller may use, and the argument that sets it."""
        return "cf", self.cf

    def observe(self, stats: StepStats, trainer: "pl.Trainer") -> None:
        """Take one step's statistics into account and decide the next factor. Static controllers do nothing."""

    def decide(self, state: CompressionState) -> Factors:
        """The decision for ``state``'s next step: the factor (and, in subclasses, probes or per-layer factors)."""
        return Factors(cf=self.cf)

    def apply(self, state: CompressionState) -> None:
        """Hand the decision (:meth:`decide`) to the comm hook, unless a hold sends the step whole: the divergence
        guard's (factor 1), or a moved moment's warm-up (factor 1, or fp16 when GraVAC chose it)."""
        self.decided = factors = self.decide(state)
        if self.guard is not None and self.guard.holding > 0:
            factors = factors.dense()
        if state.carry.warming_up(state.step) and not factors.half:
            factors = factors.dense()
        state.decide(factors)

    def metrics(self, stats: StepStats) -> dict[str, float]:
        """The ``gravac/*`` metrics of the step that produced ``stats`` (under local steps, the factors of the rounds:
        :meth:`_round_factors`)."""
        metrics = {
            "gravac/cf": self.state.cf,
            "gravac/achieved_cf": stats.achieved_cf,
            "gravac/gain": stats.gain,
            "gravac/bytes_sent": float(stats.bytes_sent),
            "gravac/bytes_dense": float(stats.bytes_dense),
            "gravac/compress_ms": 1e3 * stats.compress_s,
            "gravac/comm_ms": 1e3 * stats.comm_s,
            "gravac/collective": 1.0 - stats.gathered / stats.buckets,
        }
        outer = self.state.carry.get(OuterUpdate)
        if outer:
            self._round_factors(outer, stats, metrics)
        return metrics

    def _round_factors(self, outer: OuterUpdate, stats: StepStats, metrics: dict[str, float]) -> None:
        """Under local steps the hook sends nothing and the rounds send their change in the outer code: ``gravac/cf``
        is that code's factor (on the step a round's change is sent, the one it went at; on the others, the one the
        round's will go at; 1 sent whole), ``gravac/achieved_cf`` the round's dense bytes over its bytes sent (what
        each of its steps saved against stock DDP): from the step the first round's change is sent on, each inner step
        the last round's, none before."""
        if stats.bytes_sent:  # only a round's change is sent under local steps
            self._round_cf = outer.sent_steps * stats.bytes_dense / stats.bytes_sent
            metrics["gravac/cf"] = outer.sent_cf
        else:
            metrics["gravac/cf"] = outer.cf
        if self._round_cf is None:
            del metrics["gravac/achieved_cf"]
        else:
            metrics["gravac/achieved_cf"] = self._round_cf

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"cf": self.cf, "guard": self.guard.state_dict() if self.guard is not None else None}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cf = state_dict["cf"]
        if self.guard is not None and state_dict.get("guard") is not None:
            self.guard.load_state_dict(state_dict["guard"])
        if self._state is not None:
            self.apply(self._state)

    def _all_reduce(
        self, trainer: "pl.Trainer", values: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """``values`` reduced over the compression's process group, returned on the CPU: the same on every rank, which
        must all call it on the same step. Reduced on the strategy's device (NCCL reduces device tensors only), by a
        plain all-reduce rather than ``strategy.reduce``, which puts a barrier (a second collective) before it."""
        shared = values.to(trainer.strategy.root_device)
        dist.all_reduce(shared, op=op, group=self.state.process_group)
        return shared.cpu()

    def _mean_loss(self, trainer: "pl.Trainer", outputs: Any) -> float | None:
        """The ranks' mean training loss of this step (an all-reduce of one float64), or ``None`` where a rank has none
        to give (``training_step`` returned no loss: manual optimization). Every rank calls it on the same steps."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else math.nan
        if not hasattr(trainer, "strategy") or not dist.is_available() or not dist.is_initialized():
            return None if math.isnan(value) else value  # one process (a test's stand-in trainer): its own
        # NaN where a rank has no loss: the mean is NaN on every rank, and the loss test skips the step everywhere.
        total = self._all_reduce(trainer, torch.tensor([value], dtype=torch.float64))
        mean = float(total.item()) / dist.get_world_size(self.state.process_group)
        return None if math.isnan(mean) else mean

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cf={self.cf})"
