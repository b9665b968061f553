"""GraVACModelParallelStrategy: fully sharded training (FSDP2) whose gradient reduce-scatter sends block codes."""

import difflib
from collections.abc import Callable
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from lightning_fabric.strategies.registry import _StrategyRegistry
from lightning_fabric.utilities.types import _PATH
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn
from pytorch_lightning.strategies import ModelParallelStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_gravac._flavours import mixed_up, visible_to_the_other_trainer
from lightning_gravac._validation import argument_names
from lightning_gravac.adaptations import LocalSteps
from lightning_gravac.callbacks.controller import controllers_of
from lightning_gravac.callbacks.gravac import GraVAC
from lightning_gravac.compressors.base import Compressor, get_compressor, list_compressors
from lightning_gravac.compressors.blockwise import BlockCode
from lightning_gravac.compressors.none import NoCompression
from lightning_gravac.sharded.all_gather import CodedAllGather
from lightning_gravac.sharded.control import ShardedCompressionState
from lightning_gravac.sharded.local_steps import ReplicaRounds
from lightning_gravac.sharded.reduce_scatter import CodedReduceScatter
from lightning_gravac.sharded.replicas import CodedReplicaAllReduce
from lightning_gravac.strategies.checkpoint import gather_rows

#: Where the strategy keeps every rank's residuals in a Lightning checkpoint.
CHECKPOINT_KEY = "gravac_sharded"
#: The prefix of the residuals of the all-reduce between replica groups, by parameter name.
REPLICAS = "replicas."


class GraVACModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2's ``fully_shard`` in ``configure_model``) whose modules send their
    gradient reduce-scatter in 8- or 4-bit block codes, with error feedback on each rank.

    Each rank codes the chunk of the gradients it sends to each other rank; every payload is decoded to fp32 before
    it is added (:class:`~lightning_gravac.sharded.reduce_scatter.CodedReduceScatter`). The parameters' all-gather goes
    in ``int8`` block codes too (ZeRO++'s scheme), the optimizer's shards exact. With ``"none"`` the run is stock
    ``ModelParallelStrategy``'s bit for bit. A controller among the trainer's callbacks (``Static``, ``Accordion``)
    decides by parameter and step: factor 1 exact, any other the code (:attr:`compression_state`); ``GraVAC`` is
    refused. Tested on CPU with gloo; CUDA is untested.

    Args:
        compressor: ``"int8"``, ``"int4"``, ``"int2"`` (or a
            :class:`~lightning_gravac.compressors.blockwise.BlockCode`, for another block size) or ``"none"``. A
            method that needs each gradient whole (Top-K, PowerSGD, QSGD's norm) cannot code the slices FSDP sends
            each rank and is refused.
        error_feedback: keep what coding dropped and add it to the next step's gradient (a buffer of the unsharded
            parameters' size on each rank, saved in checkpoints by parameter name).
        all_gather_code: the code the parameters' shards are gathered in before each forward and backward
            (:class:`~lightning_gravac.sharded.all_gather.CodedAllGather`): the forward computes with rounded
            weights, the optimizer's shards stay exact. ``"auto"``: ``"int8"`` when ``compressor`` is a block code,
            FSDP2's own for ``"none"``; ``None``: FSDP2's own; ``"int8"``, ``"int4"``, ``"int2"`` or a ``BlockCode``.
            A step whose every parameter a controller holds at factor 1 gathers them exact.
        replica_groups: hybrid sharding (HSDP): the data-parallel ranks split into this many groups, each sharding
            the model (``self.device_mesh["data_parallel"]`` in ``configure_model`` is then a group's ranks), the
            groups holding replicas; each rank's reduced shard is averaged with its replicas' in ``compressor``'s
            code, with error feedback (:class:`~lightning_gravac.sharded.replicas.CodedReplicaAllReduce`). 1: plain
            sharding over every data-parallel rank.
        replica_every: local steps between replica groups (``replica_groups > 1``): no average between groups in
            each step; each group trains on its own (its own reduce-scatter, optimizer steps and states), and after
            every ``replica_every``-th optimizer step each rank averages the change of its parameter shards since
            the last average with its replicas', in ``compressor``'s code with error feedback, one collective a
            round (:class:`~lightning_gravac.sharded.local_steps.ReplicaRounds`; DiLoCo's structure, the outer step
            the average itself). A :class:`~lightning_gravac.LocalSteps` sets the round (``every``) and the outer step
            as the DDP strategy's local steps take it (``lr``, ``momentum``, ``nesterov``; DiLoCo's is ``lr=0.7,
            momentum=0.9, nesterov=True``; ``cf=1`` averages exactly, any other in ``compressor``'s code); no round
            is undone here (``guard`` and ``cooldown`` do not apply) and ``overlap`` is refused. A round left
            partial is averaged at the fit's end (the strategy's ``on_train_end``, after the callbacks'): every
            replica ends with the same parameters. ``None``: the gradients averaged between groups every step.
        data_parallel_size: the ranks that shard the model. ``"auto"``: every rank the tensor-parallel size leaves
            (all of them by default; ``ModelParallelStrategy``'s own ``"auto"`` is the number of nodes).
        tensor_parallel_size: ``ModelParallelStrategy``'s. ``"auto"``: 1 (each rank holds a whole replica's shard),
            or what the world size leaves beside an explicit ``data_parallel_size``.
        **kwargs: everything else ``ModelParallelStrategy`` takes (``save_distributed_checkpoint``, ``timeout``, ...).

    Raises:
        ValueError: for a ``compressor`` other than the block codes and ``"none"``, an ``all_gather_code`` other
            than a block code, ``replica_groups`` not a whole number >= 1 (at setup: not dividing the data-parallel
            ranks), or ``replica_every`` neither a whole number >= 1 nor a ``LocalSteps`` without ``overlap``, or
            without ``replica_groups > 1``; at setup, for a
            ``GraVAC`` controller among the trainer's callbacks.

    Example::

        Trainer(accelerator="cpu", devices=2, strategy=GraVACModelParallelStrategy())  # int8, sharded over both
    """

    strategy_name = "gravac_model_parallel"

    def __init__(
        self,
        compressor: str | Compressor = "int8",
        error_feedback: bool = True,
        all_gather_code: str | BlockCode | None = "auto",
        replica_groups: int = 1,
        replica_every: int | LocalSteps | None = None,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        **kwargs: Any,
    ) -> None:
        visible_to_the_other_trainer(type(self), pl.__name__)
        _refuse_unknown(kwargs)
        method = _named(compressor) if isinstance(compressor, str) else compressor
        if not isinstance(method, BlockCode | NoCompression):
            raise ValueError(
                f"GraVACModelParallelStrategy: `compressor` must be 'int8', 'int4', 'int2', a BlockCode or 'none', got "
                f"{compressor!r}: FSDP sends each rank a slice of every gradient, which only a code of independent "
                "blocks can code on its own (Top-K, PowerSGD and QSGD need each gradient whole)."
            )
        if all_gather_code == "auto":
            all_gather_code = "int8" if isinstance(method, BlockCode) else None
        gather = _named(all_gather_code) if isinstance(all_gather_code, str) else all_gather_code
        if not isinstance(gather, BlockCode) and (gather is not None or isinstance(all_gather_code, str)):
            raise ValueError(
                "GraVACModelParallelStrategy: `all_gather_code` must be 'auto', 'int8', 'int4', 'int2', a BlockCode or "
                f"None, got {all_gather_code!r}."
            )
        if isinstance(replica_groups, bool) or not isinstance(replica_groups, int) or replica_groups < 1:
            raise ValueError(
                f"GraVACModelParallelStrategy: `replica_groups` must be a whole number >= 1, got {replica_groups!r}."
            )
        rounds = _rounds(replica_every)
        if rounds is not None and replica_groups == 1:
            raise ValueError(
                f"GraVACModelParallelStrategy: `replica_every={replica_every}` averages between replica groups, so it "
                "needs `replica_groups` > 1, got 1."
            )
        super().__init__(data_parallel_size, tensor_parallel_size, **kwargs)
        self.compressor: Compressor = method
        self.error_feedback = error_feedback
        self.all_gather_code = gather
        self.replica_groups = replica_groups
        #: The rounds of local steps between replica groups and their outer step (``None``: none).
        self.replica_rounds = rounds
        #: The parameter average between replica groups every ``replica_every`` steps (made at fit setup).
        self.local_steps: ReplicaRounds | None = None
        self._restored_local: tuple[dict[str, torch.Tensor], int] | None = None  # this rank's, from a checkpoint
        #: Each sharded module's reduce-scatter, by the module's name ("" for the root).
        self.reduce_scatters: dict[str, CodedReduceScatter] = {}
        #: Each sharded module's all-reduce between replica groups, by the module's name (none without groups).
        self.replica_all_reduces: dict[str, CodedReplicaAllReduce] = {}
        self._replicas: torch.distributed.ProcessGroup | None = None  # this rank's shard's replicas
        self._group: torch.distributed.ProcessGroup | None = None  # this rank's replica group
        self._restored: dict[str, torch.Tensor] | None = None  # this rank's residuals from a checkpoint
        #: What a compression controller (``Static``, ``Accordion``) reads and decides: by parameter, each step's
        #: gradients exact (factor 1) or in the code; the code without a controller.
        self.compression_state = ShardedCompressionState(method, error_feedback, self._drop_residuals)

    @property
    def replica_every(self) -> int | None:
        """Optimizer steps a round between replica groups (``None``: the groups average every step's gradients)."""
        return None if self.replica_rounds is None else self.replica_rounds.every

    @property
    def bytes_sent(self) -> int:
        """The bytes this rank's gradient reduce-scatters have sent to the other ranks so far."""
        return sum(comm.bytes_sent for comm in self.reduce_scatters.values())

    @property
    def bytes_between_groups(self) -> int:
        """The bytes this rank has sent to its replicas in the other groups so far (0 without replica groups)."""
        outer = self.local_steps.average_changes.bytes_sent if self.local_steps is not None else 0
        return outer + sum(hook.bytes_sent for hook in self.replica_all_reduces.values())

    @override
    def setup_environment(self) -> None:
        # The sizes' "auto" made data-parallel: every rank shards the model (ModelParallelStrategy's own "auto" puts a
        # machine's processes in the tensor-parallel dimension, where `fully_shard` on the data-parallel mesh shards
        # nothing); an explicit size leaves the other what the world size allows.
        asked_data, asked_tensor = self._data_parallel_size, self._tensor_parallel_size
        if asked_tensor != "auto":
            tensor = asked_tensor
        else:
            tensor = 1 if asked_data == "auto" else max(1, self.world_size // asked_data)
        data = max(1, self.world_size // tensor) if asked_data == "auto" else asked_data
        self._data_parallel_size, self._tensor_parallel_size = data, tensor
        super().setup_environment()
        if data == 1 < self.world_size:
            rank_zero_warn(
                f"GraVACModelParallelStrategy: 1 data-parallel rank of {self.world_size}, so `fully_shard` on "
                "`device_mesh['data_parallel']` shards nothing and no gradient is sent; pass "
                f"`data_parallel_size={self.world_size}, tensor_parallel_size=1` to shard over every process."
            )
        if self.replica_groups == 1:
            return
        if data % self.replica_groups:
            raise ValueError(
                f"GraVACModelParallelStrategy: `replica_groups` must divide the {data} data-parallel ranks, got "
                f"{self.replica_groups}."
            )
        # The module shards over a group's ranks; the sampler still deals the data to every data-parallel rank.
        names = ("replicate", "data_parallel", "tensor_parallel")
        shape = (self.replica_groups, data // self.replica_groups, tensor)
        mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)
        self._replicas, self._group = mesh.get_group("replicate"), mesh.get_group("data_parallel")
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = mesh

    def said(self) -> str:
        """The one line the strategy says at fit start: what each collective sends."""
        method = self.compressor
        feedback = "with" if self.error_feedback else "without"
        if isinstance(method, BlockCode):
            grads = (
                f"gradients reduce-scattered in {method.name} block codes of {method.block_size} entries "
                f"(about {4 * 8 / (method.bits + 32 / method.block_size):.1f}x fewer bytes than fp32), "
                f"{feedback} error feedback"
            )
        else:
            grads = "gradients reduce-scattered as they are (FSDP2's own)"
        gather = self.all_gather_code
        params = f"parameters gathered in {gather.name} block codes" if gather else "parameters gathered as they are"
        groups = f"; {self.replica_groups} replica groups, averaged in the same code" if self.replica_groups > 1 else ""
        rounds = self.replica_rounds
        if rounds is not None:
            how = "exactly"
            if isinstance(method, BlockCode) and rounds.cf != 1:
                how = f"in {method.name} block codes {feedback} error feedback"
            every = f"every {rounds.every} steps" if rounds.every > 1 else "every step"
            groups = (
                f"; {self.replica_groups} replica groups, each training on its own, their parameter changes averaged "
                f"{every} {how}"
            )
            if rounds.lr != 1 or rounds.momentum:
                groups += f", the outer step at lr {rounds.lr:g}"
            if rounds.momentum:
                groups += f" with {'Nesterov ' if rounds.nesterov else ''}momentum {rounds.momentum:g}"
        return f"GraVACModelParallelStrategy: {grads}; {params}{groups}."

    @override
    def _configure_launcher(self) -> None:
        # The Trainer has handed over its accelerator: the first sight this strategy has of which package built it.
        if not isinstance(self.accelerator, pl.accelerators.Accelerator):
            raise mixed_up(type(self).__name__, pl.__name__)
        super()._configure_launcher()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            assert self.model is not None
            controllers = controllers_of(trainer)
            if any(isinstance(c, GraVAC) for c in controllers):
                raise ValueError(
                    "GraVACModelParallelStrategy: the GraVAC controller times DDP's all-reduce and probes factors a "
                    "block code does not have; use `Static(cf=1)` (exact), `Static(cf=4)` (the code) or "
                    "`Accordion(low_cf=1, high_cf=4)` (critical layers exact), or no controller."
                )
            state = self.compression_state
            state.measures = bool(controllers)
            # Under local steps each replica group trains, and decides, on its own: its statistics are its own.
            state.bind(self.model, self._group if self.replica_every is not None else None)
            state.forget_splits()
            self._install(self.model)
            rank_zero_info(self.said())

    def _install(self, model: nn.Module) -> None:
        """Give every module ``fully_shard`` made a coded reduce-scatter (the dense one for ``"none"``)."""
        code = self.compressor if isinstance(self.compressor, BlockCode) else None
        names = {id(p): name for name, p in model.named_parameters()}
        self.reduce_scatters = {}
        for prefix, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            layout = []
            for group in module._get_fsdp_state()._fsdp_param_groups:
                layout += [
                    (names[id(p.sharded_param)], p.sharded_param.numel(), p.padded_sharded_param_size.numel())
                    for p in group.fsdp_params
                ]
            comm = CodedReduceScatter(code, self.error_feedback, layout, self.compression_state)
            widths = comm.widths  # each parameter's name and entries in a chunk: what the controllers decide by
            module.set_custom_reduce_scatter(comm)
            if self.all_gather_code is not None:
                module.set_custom_all_gather(CodedAllGather(self.all_gather_code, self.compression_state, widths))
            if self._replicas is not None and self.replica_every is None:
                pieces = [(REPLICAS + name, per_chunk) for name, per_chunk in widths]
                hook = CodedReplicaAllReduce(
                    code, self._replicas, self.error_feedback, pieces, self.compression_state, widths
                )
                module.set_all_reduce_hook(hook)
                self.replica_all_reduces[prefix] = hook
            # Every parameter in every reduce-scatter (zeros where a step used none): the chunks' layout is fixed.
            module.set_reduce_scatter_unused_params(True, recurse=False)
            self.reduce_scatters[prefix] = comm
        if not self.reduce_scatters:
            raise ValueError(
                "GraVACModelParallelStrategy: the model has no module sharded with `fully_shard`; call it in the "
                "LightningModule's `configure_model` (on `self.device_mesh['data_parallel']`)."
            )
        if self._restored is not None:
            self._load_residuals(self._restored)
        if self._replicas is not None and (rounds := self.replica_rounds) is not None:
            self.local_steps = ReplicaRounds(
                rounds.every,
                None if rounds.cf == 1 else code,
                self._replicas,
                self.error_feedback,
                model,
                rounds.lr,
                rounds.momentum,
                rounds.nesterov,
            )
            if self._restored_local is not None:
                self.local_steps.load_state_dict(*self._restored_local, self.optimizers, self.root_device)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self.local_steps is not None:
            self.local_steps.start()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.local_steps is not None:
            self.local_steps.stepped()
        return out

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.local_steps is not None:
            self.local_steps.finish()

    def _drop_residuals(self) -> None:
        """Drop what coding still owes and the outer momentum (the divergence guard's remedy, through the compression
        state's ``reset``)."""
        for comm in self.reduce_scatters.values():
            comm.residual = None
        for hook in self.replica_all_reduces.values():
            hook.residual = None
        if self.local_steps is not None:
            self.local_steps.average_changes.residual = None
            self.local_steps.drop_momentum()

    def _residuals(self) -> dict[str, torch.Tensor]:
        comms = [comm.state_dict() for comm in self.reduce_scatters.values()]
        hooks = [hook.state_dict() for hook in self.replica_all_reduces.values()]
        return {name: t for state in [*comms, *hooks] for name, t in state.items()}

    def _load_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        module = self.lightning_module
        assert module is not None and module.device_mesh is not None
        world = module.device_mesh["data_parallel"].size()  # a group's under replica groups
        for comm in self.reduce_scatters.values():
            comm.load_state_dict(residuals, world, self.root_device)
        for hook in self.replica_all_reduces.values():
            hook.load_state_dict(residuals, self.root_device)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Every rank's residuals, stacked by rank on the one that writes (a collective: every rank is here).
        rows, _ = gather_rows(self._residuals(), self.world_size, device=self.root_device)
        checkpoint[CHECKPOINT_KEY] = {
            "residuals": rows,
            "world_size": self.world_size,
            "carried": self.compression_state.carried.saved(),
        }
        if self.local_steps is not None:
            # Every rank's anchor, outer residual, shards and optimizer state: the replicas differ within a round.
            local, _ = gather_rows(
                self.local_steps.state_dict(self.optimizers), self.world_size, device=self.root_device
            )
            checkpoint[CHECKPOINT_KEY]["local_steps"] = {"rows": local, "since": self.local_steps.since}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is not None:
            rows: dict[str, torch.Tensor] = saved["residuals"]
            self.compression_state.carried.restore(saved.get("carried", {}))
            if saved["world_size"] != self.world_size and rows:
                # Each rank starts from the mean of the saved residuals: what the ranks owed, in sum, is kept.
                # A residual between replica groups is of one rank's shard, which another world cuts elsewhere.
                rank_zero_warn(
                    f"GraVACModelParallelStrategy: resuming on {self.world_size} ranks from a checkpoint of "
                    f"{saved['world_size']}; each rank starts from the mean of the saved residuals (those between "
                    "replica groups from none)."
                )
                self._restored = {n: stacked.mean(0) for n, stacked in rows.items() if not n.startswith(REPLICAS)}
            else:
                self._restored = {name: stacked[self.global_rank] for name, stacked in rows.items()}
            if self.reduce_scatters:
                self._load_residuals(self._restored)
            self._load_local_steps(saved)
        return checkpoint

    def _load_local_steps(self, saved: dict[str, Any]) -> None:
        local = saved.get("local_steps")
        if local is None or self.replica_every is None:
            return
        if saved["world_size"] != self.world_size:
            rank_zero_warn(
                f"GraVACModelParallelStrategy: resuming local steps on {self.world_size} ranks from a checkpoint of "
                f"{saved['world_size']}; the anchors restart from the restored parameters, the outer residual and "
                "momentum from zero, and a new round starts."
            )
            return
        self._restored_local = ({n: rows[self.global_rank] for n, rows in local["rows"].items()}, local["since"])
        if self.local_steps is not None:
            self.local_steps.load_state_dict(*self._restored_local, self.optimizers, self.root_device)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 (ModelParallelStrategy) whose gradient reduce-scatter sends 8-bit block codes",
        )


def _rounds(replica_every: object) -> LocalSteps | None:
    """``replica_every`` as the rounds it asks for: a whole number is ``LocalSteps(every=n)``, the outer step the
    average itself."""
    if replica_every is None:
        return None
    if isinstance(replica_every, LocalSteps):
        if replica_every.overlap:
            raise ValueError(
                "GraVACModelParallelStrategy: `replica_every=LocalSteps(overlap=True)` is not supported between "
                "replica groups; each round's average is applied when the round ends (`overlap=False`)."
            )
        return replica_every
    if isinstance(replica_every, bool) or not isinstance(replica_every, int) or replica_every < 1:
        raise ValueError(
            "GraVACModelParallelStrategy: `replica_every` must be a whole number >= 1, a `LocalSteps` or None, got "
            f"{replica_every!r}."
        )
    return LocalSteps(every=replica_every)


def _named(name: str) -> Compressor | None:
    """The compressor ``name`` names, or ``None`` for a name that is none (the caller's message then says what is
    taken here, where the registry's would list every compressor, most of which this strategy refuses)."""
    return get_compressor(name) if name in list_compressors() else None


def _refuse_unknown(kwargs: dict[str, Any]) -> None:
    """Refuse a keyword argument neither this strategy nor ``ModelParallelStrategy`` takes, naming this strategy and
    the closest name (where ``ModelParallelStrategy.__init__`` would name itself)."""
    known = sorted(argument_names(GraVACModelParallelStrategy.__init__, ModelParallelStrategy.__init__))
    for name in kwargs:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean `{near[0]}`?" if near else f"; it takes {', '.join(f'`{k}`' for k in known)}."
            raise TypeError(f"GraVACModelParallelStrategy takes no argument `{name}`{hint}")
