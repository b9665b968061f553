"""GraVACStrategy: DDP whose gradients cross the network compressed."""

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.strategies.registry import _StrategyRegistry
from lightning_fabric.utilities.types import _PATH
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn
from pytorch_lightning.callbacks import Checkpoint
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_gravac._validation import choice, whole
from lightning_gravac.callbacks.controller import Controller, controllers_of, largest_trainable
from lightning_gravac.callbacks.gravac import GraVAC
from lightning_gravac.callbacks.static import Static
from lightning_gravac.compressors.base import Compressor, get_compressor
from lightning_gravac.feedback.adam import adam_groups_supported
from lightning_gravac.state import CompressionState, Granularity
from lightning_gravac.strategies.hook import gravac_hook
from lightning_gravac.tables import untied_tables

_GRANULARITIES = ("layer", "bucket")
#: Where the strategy keeps the step counter and every rank's residuals in a Lightning checkpoint.
CHECKPOINT_KEY = "gravac"
_OWN_HOOK_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")


def gather_rows(tensors: dict[str, Any], world_size: int, group: Any = None) -> dict[str, torch.Tensor]:
    """Every rank's tensors (the same names, shapes and dtypes on each), stacked along a leading rank dimension, on CPU,
    bit for bit.

    One collective for all of them: their bytes are concatenated into one ``uint8`` buffer, so a float64 residual, an
    integer counter or a bfloat16 buffer comes back exactly as it was (a float32 buffer would round the first and
    could not hold the second). Every rank must call it, on the same names.
    """
    names = sorted(name for name, t in tensors.items() if isinstance(t, torch.Tensor))
    if not names:
        return {}
    local = torch.cat([tensors[n].detach().contiguous().reshape(-1).view(torch.uint8) for n in names])
    if world_size > 1:
        gathered = torch.empty(world_size * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_single(gathered, local, group=group)
    else:
        gathered = local
    rows = gathered.view(world_size, local.numel()).cpu()
    out, offset = {}, 0
    for name in names:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        # Copied into a tensor of the saved dtype through its bytes: a slice of the rows need not be aligned for one.
        stacked = torch.empty((world_size, *tensor.shape), dtype=tensor.dtype)
        stacked.view(world_size, tensor.numel()).view(torch.uint8).copy_(rows[:, offset : offset + size])
        out[name] = stacked
        offset += size
    return out


#: The method of ``GraVACStrategy()``, and the ones its zero-argument default sends under SGD (``_method_for_sgd``)
#: and, as Adam's first moment, under Adam and AdamW (``_method_for_adam``).
DEFAULT_METHOD, SGD_METHOD, ADAM_METHOD = "topk", "qsgd", "efsignsgd"
#: The share of the trainable parameters above which a model counts as mostly embedding tables.
EMBEDDING_SHARE = 0.5


class GraVACStrategy(DDPStrategy):
    """Distributed data-parallel training with compressed gradients and an adaptive compression factor.

    A DDP communication hook compresses every gradient bucket before it crosses the network; a controller
    callback sets the factor: :class:`~lightning_gravac.GraVAC` with its defaults when the trainer has none (a
    ``Static`` controller at the method's one factor for ``"none"``, casts and sign methods, which have none to choose).
    Works on CPU (gloo) and CUDA (NCCL): unlike stock Lightning, the hook is registered on every device type.

    Args:
        compressor: a registered compressor name (see :func:`~lightning_gravac.list_compressors`) or an instance.
            ``None`` (the default): Top-K, except that the zero-argument default (no controller among the callbacks,
            ``error_feedback`` and ``momentum_masking`` unset) sends QSGD when the optimizer is ``torch.optim.SGD``
            and the model is not mostly embedding tables. Top-K's error feedback delays what it does not send, so
            a run of the user's length ends behind dense on a dense gradient (and under momentum, masking restarts
            the momentum of each entry sent); QSGD sends every entry every step, unbiased, and leaves any momentum to
            the optimizer. An embedding table's gradient is mostly zero rows, which Top-K sends nearly exactly and
            QSGD would spend bits on (measurements in BENCHMARKS.md). Said once at setup.
        granularity: ``"layer"`` compresses each parameter's gradient on its own (per-layer factors possible);
            ``"bucket"`` compresses each DDP bucket as one tensor (fewer, larger selections).
        error_feedback: keep what compression dropped and add it to the next gradient. ``None`` turns it on for
            biased methods (sparsifiers, 1-bit, EF-signSGD, PowerSGD) and off for unbiased ones (QSGD, TernGrad,
            casts) and for signSGD, which is defined without it.
        model_averaging_period: periodic model averaging (post-local SGD, Lin et al. 2020): from step
            ``start_local_sgd_step`` on, gradients are not communicated at all (each rank steps on its own), and every
            ``model_averaging_period`` steps the parameters are averaged across ranks (Lightning's
            ``PeriodicModelAverager``). Before that step, gradients go through the compressor as usual. ``None``: off.
        start_local_sgd_step: the step from which local SGD runs.
        momentum_correction: when the optimizer is ``torch.optim.SGD`` with momentum and the method uses error
            feedback, move the momentum (and the weight decay SGD applies before it) into the comm hook: each rank
            keeps its own ``u <- m u + g`` and compresses it, error feedback accumulating what is not sent, and the
            optimizer's momentum and weight decay are set to 0 for those parameters (said once on rank 0). Error
            feedback under heavy-ball momentum applied after communication diverges at high factors; this is Deep
            Gradient Compression's momentum correction, for every method. Exact at ``cf=1``: the same updates as
            stock DDP with SGD momentum, bit for bit. ``False`` leaves the optimizer alone. Gradients seen after
            ``backward`` (e.g. by gradient clipping) are then update directions, momentum included. Not applied under
            a gradient scaler (fp16 mixed precision), whose scale changes from step to step.
        momentum_masking: with momentum correction, restart a parameter's moved momentum from 0 where its entry was
            just sent (Deep Gradient Compression's momentum factor masking; ``None``: on, as published). ``False``
            keeps the whole momentum (heavy-ball delayed by error feedback): faster at a learning rate well inside
            dense's stable range, but it can diverge near the largest rate dense survives, where masking trains
            (BENCHMARKS.md).
        embedding_rows: on a bucket sent dense with nothing probed, or whole in fp16 (the 16-bit rung), send an
            embedding table (``nn.Embedding``, ``nn.EmbeddingBag`` with a dense gradient, not tied to another layer)
            by the rows some rank's step touched: first which rows (a byte a row), then those rows; the others are
            zero on every rank, so the sum is the whole table's (bit for bit on two ranks). Where a step touches more
            than half of a table, it goes whole. On a half step a bucket with a table keeps no fp16 rounding (a
            rounding left on a row would make it look touched). ``False``: whole tables.
        **kwargs: everything :class:`~pytorch_lightning.strategies.DDPStrategy` takes (``start_method``,
            ``timeout``, ``find_unused_parameters``, ...), except a comm hook of your own.
            ``gradient_as_bucket_view`` defaults to ``True`` here (applied where the DDP model is built).

    Raises:
        ValueError: for an unknown compressor or granularity, a ``ddp_comm_hook`` argument, or an ``error_feedback``
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
        momentum_correction: bool = True,
        momentum_masking: bool | None = None,
        embedding_rows: bool = True,
        **kwargs: Any,
    ) -> None:
        clashing = [name for name in _OWN_HOOK_ARGS if kwargs.get(name) is not None]
        if clashing:
            raise ValueError(
                f"GraVACStrategy registers its own DDP comm hook; remove {', '.join(clashing)} "
                "or use DDPStrategy for a hook of your own."
            )
        # The zero-argument default may send QSGD under SGD (`_method_for_sgd`): decided at setup.
        self._method_open = compressor is None and error_feedback is None and momentum_masking is None
        self._default_controller = False
        if compressor is None:
            compressor = DEFAULT_METHOD
        if isinstance(compressor, str):
            compressor = get_compressor(compressor)
        elif not isinstance(compressor, Compressor):
            raise ValueError(f"`compressor` must be a compressor name or a Compressor, got {compressor!r}.")
        choice(granularity, "granularity", _GRANULARITIES)
        if error_feedback and compressor.owns_feedback:
            raise ValueError(
                f"`error_feedback=True` with {compressor!r}: the method keeps its own residual, which error feedback "
                "would add a second time. Leave `error_feedback` unset."
            )
        if error_feedback is False and compressor.requires_feedback:
            raise ValueError(
                f"`error_feedback=False` with {compressor!r}: the method is defined with error feedback only."
            )
        if granularity == "bucket" and compressor.layerwise:
            raise ValueError(
                f"`granularity='bucket'` with {compressor!r}: the method needs each parameter's shape. "
                "Use granularity='layer'."
            )
        if model_averaging_period is not None:
            whole(model_averaging_period, "model_averaging_period", minimum=1)
            whole(start_local_sgd_step, "start_local_sgd_step", minimum=0)
            # Lightning's post-local-SGD machinery: with this state, DDPStrategy.setup builds a PeriodicModelAverager
            # and optimizer_step averages the parameters every period. Lightning registers the matching gradient hook on
            # CUDA only; here our own hook stops communicating gradients once local SGD starts, on every device.
            kwargs["model_averaging_period"] = model_averaging_period
            local_sgd = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=start_local_sgd_step)
        super().__init__(**kwargs)
        self.momentum_correction = momentum_correction
        self.compression_state = CompressionState(
            compressor=compressor,
            error_feedback=compressor.error_feedback_default if error_feedback is None else error_feedback,
            granularity=granularity,
            local_sgd_from=start_local_sgd_step if model_averaging_period is not None else None,
        )
        self.compression_state.feedback.momentum.masking = momentum_masking is not False
        self.compression_state.rows.enabled = embedding_rows
        if model_averaging_period is not None:
            self._ddp_comm_state = local_sgd

    @property
    def compressor(self) -> Compressor:
        """The compressor the hook uses."""
        return self.compression_state.compressor

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

    def _attach_controller(self, trainer: "pl.Trainer") -> None:
        controllers = controllers_of(trainer)
        if len(controllers) > 1:
            names = ", ".join(type(c).__name__ for c in controllers)
            raise ValueError(
                f"GraVACStrategy takes one compression controller, the trainer has {len(controllers)}: "
                f"{names}. Keep one."
            )
        # Known before the process group: the devices and nodes the trainer was given.
        alone = self.num_nodes * len(self.parallel_devices or []) == 1
        if controllers and alone and not (isinstance(controllers[0], Static) and controllers[0].cf == 1):
            rank_zero_warn(
                f"GraVACStrategy runs on one process: nothing crosses a network, so {controllers[0]!r} saves no time; "
                "its compression only changes the training, as it would on several processes. Give the Trainer "
                "`devices=2` or more (or `num_nodes`) to communicate less."
            )
        self._default_controller = not controllers
        if not controllers:
            # A method that sends the gradient unchanged has no factor to choose: a controller at cf 1 only reports. One
            # whose size is fixed by its encoding (a cast, signs) is held there: a search would only ask for factors it
            # clamps.
            method = self.compressor
            default: Controller = GraVAC()
            if alone:
                default = Static(cf=1)
                rank_zero_info(
                    "GraVACStrategy runs on one process: nothing crosses a network, so the gradients are sent dense "
                    "(cf 1), as compressing would save nothing. Pass a controller (e.g. `callbacks=[Static(cf=100)]`) "
                    "to see a factor's effect on accuracy."
                )
            elif method.passthrough:
                default = Static(cf=1)
            elif method.fixed_cf:
                # Never above the model's largest trainable tensor (a factor the controller checks, and a cast
                # ignores): fitted at setup, when the model exists (also one built in `configure_model`).
                default = Static(cf=method.fixed_cf, cap_to_model=True)
            rank_zero_info(f"GraVACStrategy: no controller among the callbacks, using {default!r}.")
            # Before the checkpoint callbacks, which Lightning has already moved last: a checkpoint then holds the
            # step's decisions, and a `ModelCheckpoint(monitor="gravac/...")` sees the step's values.
            # `Trainer.callbacks` is public but assigned by Lightning's connector, invisible to type checkers.
            callbacks: list[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
            first_checkpoint = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
            callbacks.insert(first_checkpoint, default)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        # Optimizers exist from here on; no gradient has been communicated yet.
        self._method_for_sgd()
        self._method_for_adam()
        for optimizer in self.optimizers:
            self.compressor.check_optimizer(optimizer)
        state = self.compression_state
        # Methods without error feedback (unbiased quantizers, casts, signSGD's vote) and methods with a momentum of
        # their own (DGC) keep the optimizer's momentum; so do local SGD and a gradient scaler (see the predicate).
        movable = self._hook_can_hold_optimizer_state() and state.error_feedback and not self.compressor.passthrough
        if movable and not self.compressor.owns_feedback:
            # A sparse gradient (`nn.Embedding(sparse=True)`) goes through the hook as it is: its parameters'
            # groups keep their momentum in the optimizer (a group with a parameter not named here stays whole).
            sparse = self._sparse_parameters()
            dense = {i: name for i, name in state.param_names.items() if i not in sparse}
            moved = [name for opt in self.optimizers for name in state.feedback.momentum.take_from(opt, dense)]
            self._warn_sparse_groups(sparse)
            if moved:
                rank_zero_info(
                    f"GraVACStrategy: momentum correction: the optimizer's momentum (and weight decay) for "
                    f"{len(moved)} parameters is applied in the comm hook before compression and set to 0 in the "
                    "optimizer. `GraVACStrategy(momentum_correction=False)` leaves the optimizer alone."
                )
            # Adam's first moment can move too, its second frozen after a warm-up: from when, the controller
            # decides at fit start (`Controller._freeze_adam`).
            if self._why_adam_stays() is None:
                state.feedback.adam.take_from(self.optimizers, dense)

    def _method_for_sgd(self) -> None:
        """The zero-argument default under ``torch.optim.SGD``: send QSGD instead of Top-K (see the ``compressor``
        argument), with any momentum left in the optimizer, unless most trainable parameters are embedding tables.
        Decided identically on every rank (the model and the optimizer's class are), before any gradient is sent."""
        state = self.compression_state
        if not (self._method_open and self._default_controller) or state.local_sgd_from is not None:
            return
        if not (self.optimizers and all(isinstance(opt, torch.optim.SGD) for opt in self.optimizers)):
            return
        share = self._embedding_share()
        if share >= EMBEDDING_SHARE:
            rank_zero_info(
                f"GraVACStrategy: {share:.0%} of the trainable parameters are embedding tables, whose gradient is "
                "mostly zero rows: the default sends Top-K, which sends those nearly exactly."
            )
            return
        method = get_compressor(SGD_METHOD)
        state.use_method(method, error_feedback=method.error_feedback_default)
        rank_zero_info(
            f"GraVACStrategy: the optimizer is SGD and the gradient dense, so the default sends {method!r}: every "
            "entry every step, unbiased, any momentum staying in the optimizer; a run of the length asked for ends "
            "where dense training would, where Top-K's error feedback delays what it does not send. "
            "`GraVACStrategy('topk')` sends Top-K."
        )

    def _hook_can_hold_optimizer_state(self) -> bool:
        """Whether the optimizer's momentum (SGD's, Adam's first moment) may move into the hook: asked for
        (``momentum_correction``), every step reaching the hook (no local SGD), and gradients in one unit from step to
        step (no gradient scaler, whose changing factor a momentum kept in the hook would mix up)."""
        scaled = getattr(self.precision_plugin, "scaler", None) is not None
        return self.momentum_correction and self.compression_state.local_sgd_from is None and not scaled

    def _method_for_adam(self) -> None:
        """The zero-argument default under ``torch.optim.Adam`` or ``AdamW``: Adam's first moment is sent as scaled
        signs with error feedback once the second is frozen (1-bit Adam's compression), where Top-K's few entries a
        step left the moment behind (``docs/optimizers.md``). Decided identically on every rank, before any
        gradient is sent. The moments move only where the strategy can move them (``momentum_correction``, no
        gradient scaler, no local SGD, no sparse gradient)."""
        state = self.compression_state
        if not (self._method_open and self._default_controller and self._hook_can_hold_optimizer_state()):
            return
        if self._sparse_parameters() or not self.optimizers:
            return
        if not all(adam_groups_supported(opt) for opt in self.optimizers):
            return
        why = self._why_adam_stays()
        if why is not None:
            tables = " (its embedding tables by the rows each step touched: the same sum)" if state.rows.rows else ""
            rank_zero_info(
                f"GraVACStrategy: {why}: Adam keeps its moments, and each step is sent dense or in fp16{tables}."
            )
            return
        method = get_compressor(ADAM_METHOD)
        state.use_method(method, error_feedback=True)
        rank_zero_info(
            f"GraVACStrategy: the optimizer is {type(self.optimizers[0]).__name__}, so the default sends its first "
            f"moment as {method!r} with error feedback once its second moment is frozen (1-bit Adam's scheme), dense "
            "or fp16 before. `GraVACStrategy('fp16')` casts every step instead."
        )

    def _why_adam_stays(self) -> str | None:
        """Why Adam's moments cannot move here, or ``None``. Lightning clips what the parameters' ``.grad`` hold after
        backward, which are the averaged moments once they move; a model that is mostly embedding tables has rows
        that no warm-up sees, whose frozen second moment is none, and its inactive rows would take a sign's noise
        every step (the embedding bag ended at NaN under AdamW; docs/optimizers.md)."""
        module = self.lightning_module
        if module is not None and module._trainer is not None and module.trainer.gradient_clip_val:
            return "the trainer clips gradients (`gradient_clip_val`), which would clip Adam's moved moments instead"
        share = self._embedding_share()
        if share >= EMBEDDING_SHARE:
            return f"{share:.0%} of the trainable parameters are embedding tables, whose rows no warm-up sees all of"
        return None

    def _embedding_share(self) -> float:
        """The share of the trainable parameters' entries held by embedding tables that no other layer shares (a table
        tied to an output layer gets a dense gradient)."""
        module = self.lightning_module
        if module is None:
            return 0.0
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        own = sum(p.numel() for p in untied_tables(module) if p.requires_grad)
        return own / trainable if trainable else 0.0

    def _sparse_parameters(self) -> set[int]:
        """The parameters whose gradients are sparse, found as DDP finds them: of an embedding with ``sparse=True``."""
        module = self.lightning_module
        embeddings = (torch.nn.Embedding, torch.nn.EmbeddingBag)
        sparse = [m for m in module.modules() if isinstance(m, embeddings) and m.sparse] if module is not None else []
        return {id(p) for m in sparse for p in m.parameters()}

    def _warn_sparse_groups(self, sparse: set[int]) -> None:
        """Say so where a sparse gradient keeps a whole group's momentum in the optimizer: its dense, compressed
        parameters then have error feedback under the optimizer's momentum, which momentum correction is for."""
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                params = group["params"]
                if group.get("momentum", 0) and any(id(p) in sparse for p in params) and len(params) > 1:
                    rank_zero_warn(
                        "GraVACStrategy: an optimizer group holds a sparse embedding (`sparse=True`) and other "
                        "parameters: the whole group keeps its momentum in the optimizer, so its compressed "
                        "gradients get no momentum correction. Give the embedding a parameter group of its own."
                    )
                    return

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # Lightning builds its PeriodicModelAverager afresh at setup, counting from 0, and does not checkpoint its
        # count. Resumed past the start of local SGD, it would count the warm-up again: each rank would train on its
        # own, unaveraged, for `start_local_sgd_step` steps, and average out of phase after. The averager counts
        # optimizer steps, which the trainer has restored by now.
        averager = getattr(self, "_model_averager", None)
        module = self.lightning_module
        if averager is not None and module is not None:
            averager.step = module.trainer.global_step

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        # The strategy owns the step: told at every batch, not in `on_train_epoch_start`, which Lightning skips for the
        # epoch a resumed run continues into (an epoch-driven schedule, DGC's warm-up, would stay an epoch behind).
        module = self.lightning_module
        if module is not None:
            self.compression_state.begin_step(module.trainer.current_epoch)
        self._follow_gradient_scale()
        self.compression_state.feedback.begin_batch()

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: "pl.LightningModule | torch.nn.Module | None" = None,
        **kwargs: Any,
    ) -> Any:
        feedback = self.compression_state.feedback
        if not feedback.moves_optimizer_state:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # A non-finite dense step defers the moved momentum's update to the gradients the optimizer applies, and Adam's
        # moved moments are applied here, the optimizer skipping their parameters. Both need the gradients after
        # Lightning's closure, which runs inside `optimizer.step` and ends with the user's `on_before_optimizer_step`
        # (where a guard may zero them, clipping clip them); Lightning has no hook between that and the step, so the
        # optimizer's `step` is wrapped for this call alone to act right after the closure.
        step = optimizer.step
        hidden: list[tuple[torch.Tensor, torch.Tensor]] = []

        def step_then_momentum(closure: Callable[[], Any] | None = None, **step_kwargs: Any) -> Any:
            def run() -> Any:
                result = closure() if closure is not None else None
                hidden.extend(feedback.after_closure())
                return result

            return step(closure=run, **step_kwargs)

        wrapped = optimizer.__dict__.get("step")  # a wrapper of someone else's, put back as it was
        optimizer.step = step_then_momentum  # type: ignore[method-assign]
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            feedback.adam.restore(hidden)
            if wrapped is None:
                del optimizer.step
            else:
                optimizer.step = wrapped  # type: ignore[method-assign]

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
            return self.compression_state.feedback.momentum.saved_groups(raw, state)
        return state

    def _follow_gradient_scale(self) -> None:
        """Keep the residuals (and a method's own accumulations) in the units of the gradients the hook will see.

        Under fp16 mixed precision the hook sees gradients multiplied by the scaler's scale, which halves after a
        skipped step and grows after a run of good ones. What error feedback carries over was stored in the old
        units: rescaled here by new / old (powers of 2, exact), so the pending update is neither doubled nor halved.
        (On CUDA, reading the scale is one small device sync a step; written for CUDA, tested on CPU.)
        """
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return
        state, scale = self.compression_state, float(scaler.get_scale())
        if state.grad_scale is not None and scale != state.grad_scale:
            state.rescale_(scale / state.grad_scale)
        state.grad_scale = scale

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Lightning calls this on every rank and rank 0 alone writes: every rank's residuals are gathered to it.
        feedback = self.compression_state.feedback.state_dict()
        checkpoint[CHECKPOINT_KEY] = {
            "step": self.compression_state.step,
            "world_size": self.world_size,
            "residuals": self._gather(feedback["residuals"]),
            "compressor": self._gather(self.compressor.state_dict()),
            "momentum": self._gather(feedback["momentum"]),
            "adam": feedback["adam"],  # the same on every rank
            "grad_scale": self.compression_state.grad_scale,  # the units the residuals are in (fp16 scaling)
        }
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if CHECKPOINT_KEY in checkpoint:
            self._restore_compression(checkpoint[CHECKPOINT_KEY])
        return checkpoint

    def _gather(self, tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Every rank's tensors, stacked along a leading rank dimension, on CPU (see :func:`gather_rows`)."""
        return gather_rows(tensors, self.world_size if dist.is_initialized() else 1)

    def _restore_compression(self, saved: dict[str, Any]) -> None:
        state = self.compression_state
        state.step = saved["step"]
        state.grad_scale = saved.get("grad_scale")
        residuals: dict[str, torch.Tensor] = saved["residuals"]
        same_world = saved["world_size"] == self.world_size
        if residuals and not same_world:
            # Every new rank starts from the mean of the old residuals: the sum over ranks of what is pending, divided
            # by the world size that averages it, is then exactly the update the old ranks still owed.
            rank_zero_warn(
                f"GraVACStrategy: resuming on {self.world_size} ranks from a checkpoint of {saved['world_size']}; "
                "each rank starts from the mean of the saved residuals, which preserves the pending update."
            )

        def mine(stacked: torch.Tensor) -> torch.Tensor:
            if same_world:
                own = stacked[self.global_rank]
            else:  # the mean in float64, which rounds no float32 or float64 residual's sum
                own = stacked.double().mean(0).to(stacked.dtype) if stacked.is_floating_point() else stacked[0]
            return own.to(self.root_device)

        self.compressor.load_state_dict({name: mine(stacked) for name, stacked in saved.get("compressor", {}).items()})
        state.feedback.load_state_dict(
            {
                "residuals": {name: mine(stacked) for name, stacked in residuals.items()},
                "momentum": {name: mine(stacked) for name, stacked in saved.get("momentum", {}).items()},
                "adam": saved.get("adam", {}),
            }
        )

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        # Gradients as views into DDP's buckets: no copy of each gradient into its bucket and back. A Python comm
        # hook pays one pass over the bucket for the 1/N that DDP's C++ reducer fuses into that copy; dropping the
        # copies more than pays for it (BENCHMARKS.md). Applied here, where the DDP model is built, rather than in
        # `_ddp_kwargs`, which keeps exactly what the user passed (as DDPStrategy's does); Lightning builds the model
        # from `_ddp_kwargs`, so it is set for that call alone. `gradient_as_bucket_view=False` turns it off.
        largest_trainable(model)
        passed = self._ddp_kwargs
        self._ddp_kwargs = {"gradient_as_bucket_view": True, **passed}
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
