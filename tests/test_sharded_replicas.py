"""Hybrid sharding (HSDP): 2 replica groups of 2 ranks, the average between groups in block codes, on 4 CPU ranks."""

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from sharded_models import EveryStep, ShardedMLP, sharded_kwargs, sharded_loader, stock_strategy
from test_sharded_trainer import assert_resumed_bit_for_bit, resumed

from lightning_gravac import Accordion, GraVACModelParallelStrategy, Static
from lightning_gravac.compressors import get_compressor
from lightning_gravac.launch import run_distributed
from lightning_gravac.sharded.control import ShardedCompressionState
from lightning_gravac.sharded.replicas import CodedReplicaAllReduce
from lightning_gravac.state import Factors

STEPS = 4
WORLD = 4


def _fit(rank: int, world_size: int, method: str | None, controller: str | None = None) -> dict[str, Any]:
    """``STEPS`` steps sharded over all 4 ranks (``None``: stock) or in 2 groups of 2 under ``method``, with a
    ``controller`` ("exact": ``Static(cf=1)``; "accordion": every layer but the critical ones and the biases coded)."""
    pl.seed_everything(0)
    sizes = {"data_parallel_size": world_size, "tensor_parallel_size": 1}
    hybrid = {"replica_groups": 2, **sizes}
    strategy = stock_strategy(world_size) if method is None else GraVACModelParallelStrategy(method, **hybrid)
    steps = EveryStep()
    model = ShardedMLP()
    controllers = {"exact": [Static(cf=1)], "accordion": [Accordion(1, 4, 1.0, 1, "step")], None: []}[controller]
    callbacks = [*controllers, steps]
    trainer = pl.Trainer(strategy=strategy, max_steps=STEPS, callbacks=callbacks, **sharded_kwargs(world_size))
    trainer.fit(model, sharded_loader())
    ours = isinstance(strategy, GraVACModelParallelStrategy)
    return {
        "steps": steps.steps,
        "group": model.device_mesh["data_parallel"].size(),
        "between": strategy.bytes_between_groups if ours else None,
        "within": strategy.bytes_sent if ours else None,
        # Every decision input, not this rank's own timings.
        "metrics": {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gravac/") and "_ms" not in k
        },
    }


def _flat(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.flatten() for p in parameters.values()])


@pytest.mark.slow
@pytest.mark.distributed
def test_two_groups_of_two_train_as_four_ranks_do_and_send_codes_between_groups():
    stock = run_distributed(_fit, WORLD, timeout=400, method=None)
    exact = run_distributed(_fit, WORLD, timeout=400, method="none")
    coded = run_distributed(_fit, WORLD, timeout=400, method="int8")
    assert exact[0]["group"] == coded[0]["group"] == 2  # configure_model sharded over a group's 2 ranks
    # Exact averages, in two stages instead of one: stock's parameters to rounding.
    torch.testing.assert_close(_flat(exact[0]["steps"][-1]), _flat(stock[0]["steps"][-1]), rtol=1e-5, atol=1e-6)
    for step in range(STEPS):  # every rank of every group gathers the same whole parameters
        for rank in range(1, WORLD):
            assert torch.equal(_flat(coded[rank]["steps"][step]), _flat(coded[0]["steps"][step]))
    first, last = _flat(stock[0]["steps"][0]), _flat(stock[0]["steps"][-1])
    gap = (_flat(coded[0]["steps"][-1]) - last).norm()
    assert 0 < gap < 0.2 * (last - first).norm()
    # Between groups: a shard's codes to one replica, against a ring all-reduce's fp32 share.
    assert 0 < coded[0]["between"] < 0.3 * exact[0]["between"]
    assert 0 < coded[0]["within"] < 0.3 * exact[0]["within"]


@pytest.mark.slow
@pytest.mark.distributed
def test_controllers_decide_between_groups_too_the_same_on_every_rank():
    exact = run_distributed(_fit, WORLD, timeout=400, method="none")
    static = run_distributed(_fit, WORLD, timeout=400, method="int8", controller="exact")
    for e, s in zip(exact, static, strict=True):  # factor 1: the exact average within and between groups
        for before, after in zip(e["steps"], s["steps"], strict=True):
            assert torch.equal(_flat(before), _flat(after))
        assert e["between"] == s["between"]
    accordion = run_distributed(_fit, WORLD, timeout=400, method="int8", controller="accordion")
    for rank in range(1, WORLD):
        assert accordion[rank]["metrics"] == accordion[0]["metrics"]
        for step in range(STEPS):
            assert torch.equal(_flat(accordion[rank]["steps"][step]), _flat(accordion[0]["steps"][step]))
    # Weights coded, biases exact, within and between groups: fewer bytes than exact, more than all coded (0.3x).
    assert 0.3 * exact[0]["between"] < accordion[0]["between"] < exact[0]["between"]
    assert 1.0 < accordion[0]["metrics"]["gravac/achieved_cf"] < 3.9


@pytest.mark.slow
@pytest.mark.distributed
def test_resumed_between_groups_bit_for_bit(tmp_path):
    ranks = run_distributed(resumed, WORLD, timeout=600, where=str(tmp_path), distributed=True, replica_groups=2)
    assert any(name.startswith("replicas.") for name in ranks[0]["whole"]["residuals"])
    assert_resumed_bit_for_bit(ranks)


def test_replica_groups_must_be_a_whole_number():
    with pytest.raises(ValueError, match=r"`replica_groups` must be a whole number >= 1, got 0"):
        GraVACModelParallelStrategy("int8", replica_groups=0)


def _three_groups_of_two_ranks(rank: int, world_size: int) -> None:
    strategy = GraVACModelParallelStrategy("int8", replica_groups=3, data_parallel_size=2, tensor_parallel_size=1)
    pl.Trainer(strategy=strategy, max_steps=1, **sharded_kwargs(world_size)).fit(ShardedMLP(), sharded_loader())


@pytest.mark.distributed
def test_replica_groups_that_do_not_divide_the_ranks_are_refused_before_a_step():
    with pytest.raises(RuntimeError, match=r"`replica_groups` must divide the 2 data-parallel ranks, got 3"):
        run_distributed(_three_groups_of_two_ranks, 2, timeout=120)


def _replica_split(rank: int, world_size: int) -> dict[str, Any]:
    """One error-fed int8 average with "b" (the last 400 entries of the shard) at factor 1, then one all at 1."""
    dist.init_process_group("gloo")
    code = get_compressor("int8")
    state = ShardedCompressionState(code, True, lambda: None)
    state.decide(Factors(cf=4.0, param_cf={"b": 1.0}))
    layout = [("replicas.w", 600), ("replicas.b", 400)]
    hook = CodedReplicaAllReduce(code, dist.group.WORLD, True, layout, state, [("w", 600), ("b", 400)])
    shards = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    first = shards[rank].clone()
    hook(first)
    assert hook.residual is not None
    residual = hook.residual.clone()
    state.decide(Factors(cf=1.0))
    second = shards[rank].clone()
    hook(second)
    owed = [torch.empty(1000) for _ in range(world_size)]
    dist.all_gather(owed, residual)
    return {"first": first, "second": second, "shards": shards, "owed": owed, "residual": residual,
            "after": hook.residual}  # fmt: skip


@pytest.mark.distributed
def test_a_parameter_at_factor_1_is_averaged_exact_beside_the_codes_between_groups():
    ranks = run_distributed(_replica_split, 2, timeout=120)
    shards = ranks[0]["shards"]
    mean = (shards[0] + shards[1]) * 0.5
    for rank in ranks:
        first = rank["first"]
        assert torch.equal(first, ranks[0]["first"])  # every replica the same bits
        assert torch.equal(first[600:], mean[600:])  # "b": the exact mean
        assert 0 < (first[:600] - mean[:600]).abs().max() < 1e-2 * mean.abs().max()
        assert rank["residual"][600:].abs().max() == 0 and rank["residual"][:600].abs().max() > 0
        # All at factor 1: the exact mean of the shards plus what coding still owed, which is owed no more.
        owed = rank["owed"]
        torch.testing.assert_close(rank["second"], (shards[0] + owed[0] + shards[1] + owed[1]) * 0.5)
        assert rank["after"] is None
