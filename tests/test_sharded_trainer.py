"""GraVACModelParallelStrategy as a Lightning strategy: checkpoints resumed bit for bit, clipping, validation, bf16,
errors, a rank that dies or stalls.

Each test runs 2 CPU ranks (gloo) through Lightning's Trainer.
"""

import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning import Callback
from sharded_models import EveryStep, ShardedMLP, full_parameters, sharded_kwargs, sharded_loader, stock_strategy
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_gravac import GraVACModelParallelStrategy
from lightning_gravac.launch import run_distributed

#: Samples a rank reads an epoch: 4 batches of 16, so an epoch's end is a step's.
SAMPLES = 64


def _strategy(method: str = "int8", world: int = 2, **kwargs: Any) -> GraVACModelParallelStrategy:
    return GraVACModelParallelStrategy(method, data_parallel_size=world, tensor_parallel_size=1, **kwargs)


def resumed(rank: int, world_size: int, where: str, distributed: bool, **options: Any) -> dict[str, Any]:
    """Two epochs in one fit, and one epoch then a second resumed from its checkpoint: the whole parameters after
    each of the last epoch's steps and the residuals at the end of each (``options``: the strategy's)."""
    out: dict[str, Any] = {}
    for run in ("whole", "first", "resumed"):
        pl.seed_everything(0)
        strategy = _strategy(world=world_size, save_distributed_checkpoint=distributed, **options)
        steps = EveryStep()
        epochs = 1 if run == "first" else 2
        trainer = pl.Trainer(strategy=strategy, max_epochs=epochs, callbacks=[steps], **sharded_kwargs(world_size))
        path = str(Path(where, "epoch1.ckpt"))
        loader = sharded_loader(SAMPLES * world_size)
        trainer.fit(ShardedMLP(), loader, ckpt_path=path if run == "resumed" else None)
        if run == "first":
            trainer.save_checkpoint(path)
        out[run] = {"steps": steps.steps[-4:], "residuals": strategy._residuals()}
    return out


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("distributed", [True, False], ids=["sharded-checkpoint", "full-checkpoint"])
def test_a_run_resumed_from_a_checkpoint_is_the_uninterrupted_run_bit_for_bit(tmp_path, distributed):
    assert_resumed_bit_for_bit(run_distributed(resumed, timeout=300, where=str(tmp_path), distributed=distributed))


def assert_resumed_bit_for_bit(ranks: list[dict[str, Any]]) -> None:
    """Every rank's residuals and last epoch's parameters the same resumed as uninterrupted."""
    for rank in ranks:
        whole, first, again = rank["whole"], rank["first"], rank["resumed"]
        assert first["residuals"] and any(r.abs().sum() > 0 for r in first["residuals"].values())
        assert again["residuals"].keys() == whole["residuals"].keys()
        for name, residual in whole["residuals"].items():
            assert torch.equal(again["residuals"][name], residual), name
        for a, b in zip(whole["steps"], again["steps"], strict=True):
            for name, p in a.items():
                assert torch.equal(b[name], p), name


class GradientNorms(Callback):
    """The gradients' whole norm before the optimizer steps (as the Trainer hands them over) and after (clipped)."""

    def __init__(self) -> None:
        self.before: list[float] = []
        self.after: list[float] = []

    @staticmethod
    def norm(module: pl.LightningModule) -> float:
        squares = torch.zeros(())
        for p in module.parameters():
            if p.grad is not None:
                local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                squares += local.float().square().sum()
        dist.all_reduce(squares)
        return float(squares.sqrt())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.before.append(self.norm(pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append(self.norm(pl_module))


def _clipped_and_validated(rank: int, world_size: int) -> dict[str, Any]:
    pl.seed_everything(0)
    norms = GradientNorms()
    trainer = pl.Trainer(
        strategy=_strategy(),
        max_steps=4,
        gradient_clip_val=0.05,
        val_check_interval=2,
        limit_val_batches=2,
        callbacks=[norms],
        **sharded_kwargs(world_size),
    )
    model = ShardedMLP()
    trainer.fit(model, sharded_loader(SAMPLES * 8), sharded_loader(64))
    return {
        "before": norms.before,
        "after": norms.after,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "parameters": full_parameters(model),
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_gradients_are_clipped_to_their_whole_norm_and_validation_runs():
    ranks = run_distributed(_clipped_and_validated, timeout=240)
    for rank in ranks:
        assert len(rank["after"]) == 4
        assert all(before > 0.05 for before in rank["before"]), "the clip must bind to be tested"
        assert all(after <= 0.05 * (1 + 1e-4) for after in rank["after"])
        assert torch.isfinite(torch.tensor(rank["val_loss"]))
    assert ranks[0]["val_loss"] == ranks[1]["val_loss"]
    for name, p in ranks[0]["parameters"].items():
        assert torch.equal(ranks[1]["parameters"][name], p)


class Unsharded(ShardedMLP):
    def configure_model(self) -> None:
        pass  # no fully_shard


def _unsharded(rank: int, world_size: int) -> None:
    trainer = pl.Trainer(strategy=_strategy(), max_steps=1, **sharded_kwargs(world_size))
    trainer.fit(Unsharded(), sharded_loader(SAMPLES))


@pytest.mark.distributed
def test_a_model_without_fully_shard_is_refused_before_a_step():
    with pytest.raises(RuntimeError, match="no module sharded with `fully_shard`"):
        run_distributed(_unsharded, timeout=120)


def _bf16(rank: int, world_size: int, method: str | None) -> dict[str, Any]:
    pl.seed_everything(0)
    strategy = stock_strategy(world_size) if method is None else _strategy(method)
    steps = EveryStep()
    trainer = pl.Trainer(
        strategy=strategy, max_steps=3, callbacks=[steps], precision="bf16-true", **sharded_kwargs(world_size)
    )
    trainer.fit(ShardedMLP(), sharded_loader())
    return {"steps": steps.steps, "sent": getattr(strategy, "bytes_sent", None)}


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_parameters_and_gradients_train_coded_alike_on_both_ranks_near_stock():
    stock = run_distributed(_bf16, timeout=240, method=None)
    coded = run_distributed(_bf16, timeout=240, method="int8")
    assert coded[0]["sent"] > 0
    for a, b in zip(coded[0]["steps"], coded[1]["steps"], strict=True):
        for name, p in a.items():
            assert p.dtype == torch.bfloat16 and torch.equal(b[name], p), name
    flat = [torch.cat([p.float().flatten() for p in run["steps"][i].values()]) for run, i in
            ((stock[0], 0), (stock[0], -1), (coded[0], -1))]  # fmt: skip
    assert (flat[2] - flat[1]).norm() < 0.2 * (flat[1] - flat[0]).norm()


class Policy(ShardedMLP):
    """Sharded with FSDP2's ``MixedPrecisionPolicy``: bf16 parameters in the forward and backward, gradients reduced
    in ``reduce``."""

    def __init__(self, reduce: torch.dtype | None) -> None:
        super().__init__()
        self.policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=self.policy)
        fully_shard(self, mesh=mesh, mp_policy=self.policy)


def _policy(rank: int, world_size: int, method: str | None, reduce: torch.dtype | None) -> dict[str, Any]:
    pl.seed_everything(0)
    strategy = stock_strategy(world_size) if method is None else _strategy(method, all_gather_code=method)
    steps = EveryStep()
    trainer = pl.Trainer(strategy=strategy, max_steps=3, callbacks=[steps], **sharded_kwargs(world_size))
    trainer.fit(Policy(reduce), sharded_loader())
    return {"steps": steps.steps, "sent": getattr(strategy, "bytes_sent", None)}


@pytest.mark.distributed
@pytest.mark.parametrize("reduce", [torch.float32, None])
def test_fsdp2s_mixed_precision_policy_trains_coded_alike_on_both_ranks_near_stock(reduce):
    stock = run_distributed(_policy, timeout=240, method=None, reduce=reduce)
    coded = run_distributed(_policy, timeout=240, method="int8", reduce=reduce)
    assert coded[0]["sent"] > 0
    for a, b in zip(coded[0]["steps"], coded[1]["steps"], strict=True):
        for name, p in a.items():
            assert p.dtype == torch.float32 and torch.equal(b[name], p), name  # the sharded parameters stay fp32
    flat = [torch.cat([p.flatten() for p in run["steps"][i].values()]) for run, i in
            ((stock[0], 0), (stock[0], -1), (coded[0], -1))]  # fmt: skip
    assert 0 < (flat[2] - flat[1]).norm() < 0.2 * (flat[1] - flat[0]).norm()


class Faulty(ShardedMLP):
    """Rank 1 exits, or stalls past the test's bound, after its forward at step 3: in the middle of a sharded step."""

    def __init__(self, fault: str) -> None:
        super().__init__()
        self.fault = fault

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 3 and self.global_rank == 1:
            if self.fault == "stall":
                time.sleep(80)
            os._exit(0)
        return loss


def _survivor(rank: int, world_size: int, fault: str) -> dict[str, Any]:
    pl.seed_everything(0)
    strategy = _strategy(timeout=timedelta(seconds=10))
    trainer = pl.Trainer(strategy=strategy, max_steps=20, **sharded_kwargs(world_size))
    start = time.perf_counter()
    try:
        trainer.fit(Faulty(fault), sharded_loader(SAMPLES * 8))
    except Exception as error:
        return {"raised": type(error).__name__, "seconds": time.perf_counter() - start}
    return {"raised": None, "seconds": time.perf_counter() - start}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["exit", "stall"])
def test_when_a_rank_dies_or_stalls_mid_step_the_other_raises_within_the_timeout(fault):
    survivor, faulty = run_distributed(_survivor, allow_missing=True, timeout=150, fault=fault)
    assert faulty is None, "the faulty rank should not have finished"
    assert survivor["raised"] is not None, f"rank 0 finished although rank 1 {fault}ed"
    assert survivor["seconds"] < 70, survivor  # the process group's 10 s, not the stalled rank's 80 s


def _sizes(rank: int, world_size: int, **sizes: Any) -> dict[str, Any]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = GraVACModelParallelStrategy(**sizes)
        pl.Trainer(strategy=strategy, max_steps=1, **sharded_kwargs(world_size)).fit(ShardedMLP(), sharded_loader())
    mesh = strategy.device_mesh
    return {
        "said": [str(w.message) for w in caught if "data-parallel rank" in str(w.message)],
        "mesh": (mesh["data_parallel"].size(), mesh["tensor_parallel"].size()),
        "sent": strategy.bytes_sent,
        "between": strategy.bytes_between_groups,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("sizes", [{}, {"data_parallel_size": 2}], ids=["no-arguments", "data-parallel-only"])
def test_the_sizes_default_to_sharding_over_every_process(sizes):
    for rank in run_distributed(_sizes, timeout=120, **sizes):
        assert rank["mesh"] == (2, 1) and rank["said"] == [] and rank["sent"] > 0


@pytest.mark.distributed
def test_replica_groups_alone_split_every_process_into_groups():
    for rank in run_distributed(_sizes, timeout=120, replica_groups=2):  # 2 groups of 1 rank: replicas only
        assert rank["said"] == [] and rank["between"] > 0


@pytest.mark.distributed
def test_one_data_parallel_rank_of_several_is_said():
    first, _ = run_distributed(_sizes, timeout=120, data_parallel_size=1)
    said = first["said"]
    assert first["mesh"] == (1, 2) and first["sent"] == 0
    assert said == [
        "GraVACModelParallelStrategy: 1 data-parallel rank of 2, so `fully_shard` on `device_mesh['data_parallel']` "
        "shards nothing and no gradient is sent; pass `data_parallel_size=2, tensor_parallel_size=1` to shard over "
        "every process."
    ]
