"""GraVACStrategy: DDP whose gradients cross the network compressed."""

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.strategies.registry import _StrategyRegistry
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gravac._flavours import mixed_up, visible_to_the_other_trainer
from lightning_gravac.adaptations import LocalSteps, MomentumCorrection, OuterUpdate, Setup
from lightning_gravac.callbacks.controller import largest_trainable
from lightning_gravac.compressors.base import Compressor
from lightning_gravac.state import GATHER, REDUCE, BucketRecord, CompressionState, Granularity
from lightning_gravac.strategies.checkpoint import CHECKPOINT_KEY, restore_compression, saved_compression
from lightning_gravac.strategies.ddp_options import built_with, post_local_sgd, refuse_arguments, stop_buffer_sync
from lightning_gravac.strategies.default_controller import allow_rounds, attach_controller, hold_exact
from lightning_gravac.strategies.default_method import choose_method, method_of
from lightning_gravac.strategies.hook import gravac_hook


class GraVACStrategy(DDPStrategy):
    """Distributed data-parallel training with compressed gradients and an adaptive compression factor.

    A DDP communication hook compresses every gradient bucket before it crosses the network; a controller
    callback sets the factor: :class:`~lightning_gravac.GraVAC` with its defaults when the trainer has none (a
    ``Static`` controller at the method's one factor for ``"none"``, casts and sign methods, which have none to choose).
    Works on CPU (gloo) and CUDA (NCCL): unlike stock Lightning, the hook is registered on every device type.

    Args:
        compressor: a registered compressor name (see :func:`~lightning_gravac.list_compressors`) or an instance.
            ``None`` (the default): Top-K, except that the zero-argument default (no controller among the callbacks,
            ``error_feedback`` and ``momentum_masking`` unset) sends QSGD, every entry every step and unbiased, when
            the optimizer is ``torch.optim.SGD`` and the model is not mostly embedding tables, whose mostly-zero rows
            Top-K sends nearly exactly (BENCHMARKS.md). Said once at setup.
        granularity: ``"layer"`` compresses each parameter's gradient on its own (per-layer factors possible);
            ``"bucket"`` compresses each DDP bucket as one tensor (fewer, larger selections).
        error_feedback: keep what compression dropped and add it to the next gradient. ``None`` turns it on for
            biased methods (sparsifiers, 1-bit, EF-signSGD, PowerSGD) and off for unbiased ones (QSGD, TernGrad,
            casts) and for signSGD, which is defined without it.
        model_averaging_period: post-local SGD (Lin et al. 2020): from step ``start_local_sgd_step`` on, nothing is
            sent each step and the parameters are averaged dense every ``model_averaging_period`` steps (Lightning's
            ``PeriodicModelAverager``). ``None``: off.
        start_local_sgd_step: the step from which ``model_averaging_period``'s local SGD runs.
        local_steps: rounds of local steps whose outer update ``compressor`` compresses (QSGD's 4-bit codes when none
            is named): a round's length, or a :class:`~lightning_gravac.LocalSteps` (its factor, outer learning rate
            and momentum). Nothing is sent within a round; ``global_step`` counts inner steps. ``None``: off.
        momentum_correction: when the optimizer is ``torch.optim.SGD`` with momentum and the method uses error
            feedback, move the momentum (and SGD's weight decay) into the comm hook: each rank compresses its own
            ``u <- m u + g``, error feedback accumulating what is not sent, and the optimizer's momentum and weight
            decay are set to 0 there (Deep Gradient Compression's momentum correction, for every method; said once).
            Exact at ``cf=1``: stock DDP's updates bit for bit. Gradients seen after ``backward`` (clipping) are then
            update directions. Not applied under a gradient scaler, whose scale changes, nor with the block codes
            (``int8``, ``int4``), which leave the optimizer as it is. ``False``: the optimizer's.
        momentum_masking: with momentum correction, restart a parameter's moved momentum from 0 where its entry was
            just sent (Deep Gradient Compression's momentum factor masking; ``None``: on, as published). ``False``
            keeps the whole momentum (heavy-ball delayed by error feedback): faster at a learning rate well inside
            dense's stable range, but it can diverge near the largest rate dense survives, where masking trains
            (BENCHMARKS.md).
        embedding_rows: on a bucket sent dense with nothing probed, or whole in fp16, send an embedding table
            (``nn.Embedding``, ``nn.EmbeddingBag`` with a dense gradient, not tied to another layer) by the rows some
            rank's step touched: which rows (a byte a row), then those rows, the same sum (bit for bit on two ranks).
            A table a step touches more than half of goes whole. A compressed round of local steps sends a table by
            the rows some rank changed in it. ``False``: whole tables.
        **kwargs: everything :class:`~pytorch_lightning.strategies.DDPStrategy` takes (``start_method``,
            ``timeout``, ``find_unused_parameters``, ...), except a comm hook of your own.
            ``gradient_as_bucket_view`` defaults to ``True`` here (applied where the DDP model is built).

    Raises:
        ValueError: for an unknown compressor or granularity, an argument neither this class, ``DDPStrategy`` nor
            ``DistributedDataParallel`` takes, a ``ddp_comm_hook`` argument, or an ``error_feedback``
            or ``granularity`` the method does not allow.

    Example::

        Trainer(accelerator="cpu", devices=2, strategy=GraVACStrategy(compressor="topk"), callbacks=[Static(cf=100)])
    """

    strategy_name = "gravac"

    def __init__(
        self,
        compressor: str | Compressor | None = None,
        granularity: Granularity = "layer",
        error_feedback: bool | None = None,
        model_averaging_period: int | None = None,
        start_local_sgd_step: int = 0,
        local_steps: "int | LocalSteps | None" = None,
        momentum_correction: bool = True,
        momentum_masking: bool | None = None,
        embedding_rows: bool = True,
        **kwargs: Any,
    ) -> None:
        refuse_arguments(kwargs, GraVACStrategy.__init__, DDPStrategy.__init__)
        # A user of the other Lightning package who passes this class to its Trainer gets mixed_up's line.
        visible_to_the_other_trainer(type(self), pl.__name__)
        if local_steps is not None and model_averaging_period is not None:
            raise ValueError("Pass `local_steps` or `model_averaging_period`, not both.")
        rounds = LocalSteps(every=local_steps) if isinstance(local_steps, int) else local_steps
        # The zero-argument default's method follows the optimizer (`default_method`): decided at setup.
        self._method_open = compressor is None and error_feedback is None and momentum_masking is None and not rounds
        self._default_controller = False
        compressor = method_of("qsgd" if rounds and compressor is None else compressor, granularity, error_feedback)
        averaging, local_sgd = post_local_sgd(model_averaging_period, start_local_sgd_step)
        super().__init__(**kwargs, **averaging)
        self.momentum_correction = momentum_correction
        self.compression_state = CompressionState(
            compressor=compressor,
            error_feedback=compressor.error_feedback_default if error_feedback is None else error_feedback,
            granularity=granularity,
            local_sgd_from=0 if rounds else start_local_sgd_step if model_averaging_period is not None else None,
        )
        if rounds:
            self.outer.configure(rounds, compressor, self.compression_state.error_feedback)
        self.compression_state.carry.get(MomentumCorrection).masking = momentum_masking is not False
        self.compression_state.rows.enabled = embedding_rows
        if local_sgd is not None:
            self._ddp_comm_state = local_sgd

    @property
    def compressor(self) -> Compressor:
        """The compressor the hook uses."""
        return self.compression_state.compressor

    @property
    def outer(self) -> OuterUpdate:
        """Local steps' rounds and outer update (inactive without ``local_steps``)."""
        return self.compression_state.carry.get(OuterUpdate)

    @override
    def setup_environment(self) -> None:
        # Before the process group exists, so a bad combination fails at once instead of in a collective, and
        # before the trainer's `setup` hooks, so a default controller added here gets them like any callback.
        module = self.lightning_module
        if module is not None:
            self._attach_controller(module.trainer)
            # Fitting a model with nothing to train fails here, before the process group (one built in
            # `configure_model` has no parameters yet: checked where DDP wraps it).
            if module.trainer.state.fn == TrainerFn.FITTING and any(True for _ in module.parameters()):
                largest_trainable(module)
        super().setup_environment()

    @override
    def _configure_launcher(self) -> None:
        # The Trainer has handed over its accelerator: the first sight this strategy has of which package built it.
        if not isinstance(self.accelerator, pl.accelerators.Accelerator):
            raise mixed_up(type(self).__name__, pl.__name__)
        super()._configure_launcher()

    def _attach_controller(self, trainer: "pl.Trainer") -> None:
        # Known before the process group: the devices and nodes the trainer was given.
        alone = self.num_nodes * len(self.parallel_devices or []) == 1
        self._default_controller = attach_controller(trainer, self.compressor, alone, self.outer.config)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            # Validating, testing or predicting: Lightning sets up no optimizer and wraps no DDP model, so nothing is
            # sent and there is nothing to adapt (as under stock DDP).
            return
        # Optimizers exist from here on; no gradient has been communicated yet.
        state, module = self.compression_state, self.lightning_module
        in_trainer = module._trainer if module is not None else None
        if self._method_open and self._default_controller:
            if choose_method(state, self.optimizers, module, bool(trainer.gradient_clip_val)):
                hold_exact(trainer)
        for optimizer in self.optimizers:
            self.compressor.check_optimizer(optimizer)
        self.outer.take_from(Setup(self.optimizers, {}, module, in_trainer))  # the default may start local steps
        self.outer.tables = state.rows  # found when DDP wrapped the model; empty with `embedding_rows=False`
        # A round's bytes go after the optimizer's step, once `post_backward` has ended the step: they join its records.
        self.outer.sent = lambda nbytes, gathered: state.record_ended(
            BucketRecord(nbytes, 0, GATHER if gathered else REDUCE)
        )
        # The optimizer's state (SGD's momentum, Adam's first moment) moves into the hook where the method allows it.
        scaled = getattr(self.precision_plugin, "scaler", None) is not None
        state.carry.take_optimizer_state(
            Setup(self.optimizers, state.param_names, module, in_trainer),
            self.compressor,
            state.error_feedback,
            asked=self.momentum_correction,
            local_sgd=state.local_sgd_from is not None,
            scaled=scaled,
        )
        if self._method_open and self._default_controller:  # once it is known whether optimizer state moved here
            allow_rounds(trainer, state, self.optimizers)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # Lightning builds its PeriodicModelAverager afresh at setup, counting from 0, and does not checkpoint its
        # count: resumed, it would count the warm-up again and average out of phase. It counts optimizer steps, which
        # the trainer has restored by now.
        averager = getattr(self, "_model_averager", None)
        module = self.lightning_module
        if averager is not None and module is not None:
            averager.step = module.trainer.global_step
        if module is not None:
            trainer = module.trainer
            last_batch = trainer.fit_loop.epoch_loop.batch_progress  # set before each batch's step
            self.outer.begin_fit(trainer.global_step, trainer.max_steps, lambda: last_batch.is_last_batch)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self.outer.finish()  # a round begun is closed: the fit's model is the ranks' common one

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # The strategy owns the step: told at every batch, not in `on_train_epoch_start`, which Lightning skips for the
        # epoch a resumed run continues into (an epoch-driven schedule, DGC's warm-up, would stay an epoch behind).
        module = self.lightning_module
        if module is not None:
            self.compression_state.begin_step(module.trainer.current_epoch)
        if self.outer:
            stop_buffer_sync(self.model, self._ddp_kwargs)  # local steps the default may have started mid-fit
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            # On CUDA, reading the scale is one small device sync a step (written for CUDA, tested on CPU).
            self.compression_state.follow_scale(float(scaler.get_scale()))
        self.compression_state.carry.begin_batch()

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: "pl.LightningModule | torch.nn.Module | None" = None,
        **kwargs: Any,
    ) -> Any:
        with self.compression_state.carry.stepping(optimizer):
            return super().optimizer_step(optimizer, self.outer.watching(closure), model, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        # DDP's backward has waited for every bucket's future: the step's statistics are all in.
        self.compression_state.end_step()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The checkpoint shows the optimizer as the user configured it (momentum and weight decay written back), so a
        # run resumed without momentum correction applies them again; resumed with it, they are taken back at once.
        state = super().optimizer_state(optimizer)
        raw = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        if state and "param_groups" in state:
            return self.compression_state.carry.saved_groups(raw, state)
        return state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Lightning calls this on every rank and rank 0 alone writes: every rank's state is gathered to it.
        checkpoint[CHECKPOINT_KEY] = saved_compression(self.compression_state, self.world_size, self.root_device)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if CHECKPOINT_KEY in checkpoint:
            saved = checkpoint[CHECKPOINT_KEY]
            restore_compression(self.compression_state, saved, self.world_size, self.global_rank, self.root_device)
        return checkpoint

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # Gradients as bucket views, and no buffer sync under local steps (`built_with`). Applied here, where the DDP
        # model is built, rather than in `_ddp_kwargs`, which keeps exactly what the user passed (as DDPStrategy's
        # does); Lightning builds the model from `_ddp_kwargs`, so they are set for that call alone.
        largest_trainable(model)
        passed = self._ddp_kwargs
        self._ddp_kwargs = built_with(passed, local_steps=bool(self.outer))
        try:
            return super()._setup_model(model)
        finally:
            self._ddp_kwargs = passed

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self.compression_state.bind(self.model.module)
        # Stock Lightning registers hooks on CUDA only; DDP's comm hooks work with gloo on CPU as well.
        self.model.register_comm_hook(self.compression_state, gravac_hook)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "gravac", cls, description="DDP with compressed gradients and an adaptive compression factor"
        )
        strategy_registry.register(
            "gravac_spawn",
            cls,
            description="GraVACStrategy with `start_method` 'spawn'",
            start_method="spawn",
        )
