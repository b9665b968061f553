"""GraVACModelParallelStrategy: FSDP2 through Lightning's Trainer on 2 CPU ranks (gloo), against stock."""

from datetime import timedelta
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import StrategyRegistry
from sharded_models import EveryStep, ShardedMLP, sharded_kwargs, sharded_loader, stock_strategy

from lightning_gravac import GraVACModelParallelStrategy
from lightning_gravac.launch import run_distributed

STEPS = 6


def _fit(rank: int, world_size: int, method: str | None, options: dict | None = None) -> dict[str, Any]:
    """``STEPS`` steps of the sharded MLP under ``method`` (``None``: stock ``ModelParallelStrategy``): the whole
    parameters after each step, and the bytes the reduce-scatters sent."""
    pl.seed_everything(0)
    sizes = {"data_parallel_size": world_size, "tensor_parallel_size": 1, **(options or {})}
    strategy = stock_strategy(world_size) if method is None else GraVACModelParallelStrategy(method, **sizes)
    steps = EveryStep()
    fit = pl.Trainer(strategy=strategy, max_steps=STEPS, callbacks=[steps], **sharded_kwargs(world_size))
    fit.fit(ShardedMLP(), sharded_loader())
    sent = strategy.bytes_sent if isinstance(strategy, GraVACModelParallelStrategy) else None
    return {"steps": steps.steps, "sent": sent}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


@pytest.mark.slow
@pytest.mark.distributed
def test_none_equals_stock_model_parallel_bit_for_bit():
    stock = run_distributed(_fit, method=None, timeout=240)
    dense = run_distributed(_fit, method="none", timeout=240)
    for s, d in zip(stock, dense, strict=True):
        assert len(s["steps"]) == len(d["steps"]) == STEPS
        for before, after in zip(s["steps"], d["steps"], strict=True):
            _assert_equal(before, after)
    assert dense[0]["sent"] > 0


def _close_to_stock(stock: list[dict], coded: list[dict], share: float) -> None:
    """The same whole parameters on every rank after each step, and after the last a gap to stock's under ``share``
    of the distance stock moved. AdamW moves each entry by about its learning rate a step, so an entry whose coded
    gradient rounds to zero can part by that much; over all entries the gap is a small share of the distance."""
    for step in range(STEPS):
        _assert_equal(coded[0]["steps"][step], coded[1]["steps"][step])
    ends = (stock[0]["steps"][0], stock[0]["steps"][-1], coded[0]["steps"][-1])
    first, last_stock, last_coded = (torch.cat([p.flatten() for p in ps.values()]) for ps in ends)
    gap, moved = (last_coded - last_stock).norm(), (last_stock - first).norm()
    assert 0 < gap < share * moved, (float(gap), float(moved))


@pytest.mark.slow
@pytest.mark.distributed
def test_int8_trains_close_to_stock_with_the_same_parameters_on_every_rank_and_fewer_bytes():
    stock = run_distributed(_fit, method=None, timeout=240)
    dense = run_distributed(_fit, method="none", timeout=240)
    coded = run_distributed(_fit, method="int8", options={"all_gather_code": None}, timeout=240)
    _close_to_stock(stock, coded, 0.2)  # measured 4.5% (int4: 19%)
    # About a quarter of fp32's bytes (a scale each 128 entries, chunks padded to whole scales).
    assert coded[0]["sent"] < 0.3 * dense[0]["sent"]


@pytest.mark.slow
@pytest.mark.distributed
def test_by_default_the_parameters_are_gathered_in_int8_too():
    stock = run_distributed(_fit, method=None, timeout=240)
    coded = run_distributed(_fit, method="int8", timeout=240)
    explicit = run_distributed(_fit, method="int8", options={"all_gather_code": "int8"}, timeout=240)
    gradients_only = run_distributed(_fit, method="int8", options={"all_gather_code": None}, timeout=240)
    _close_to_stock(stock, coded, 0.2)
    for a, b in zip(coded[0]["steps"], explicit[0]["steps"], strict=True):
        _assert_equal(a, b)
    assert not torch.equal(coded[0]["steps"][-1]["net.0.weight"], gradients_only[0]["steps"][-1]["net.0.weight"])


def test_registered_under_its_name():
    assert GraVACModelParallelStrategy.strategy_name in StrategyRegistry
    strategy = StrategyRegistry.get(GraVACModelParallelStrategy.strategy_name)
    assert isinstance(strategy, GraVACModelParallelStrategy)


@pytest.mark.parametrize("method", ["topk", "powersgd", "qsgd"])
def test_a_method_that_needs_a_whole_gradient_is_refused(method):
    with pytest.raises(ValueError, match=rf"`compressor` must be 'int8', 'int4', 'int2'.*got '{method}'"):
        GraVACModelParallelStrategy(method)


def test_the_lightning_flavour_has_its_own_registered():
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import ModelParallelStrategy as UnifiedModelParallel
    from lightning.pytorch.strategies import StrategyRegistry as UnifiedRegistry

    from lightning_gravac.lightning import GraVACModelParallelStrategy as Unified

    assert issubclass(Unified, UnifiedModelParallel) and Unified is not GraVACModelParallelStrategy
    assert isinstance(UnifiedRegistry.get(Unified.strategy_name), Unified)


def test_an_all_gather_code_that_is_not_a_block_code_is_refused():
    with pytest.raises(ValueError, match=r"`all_gather_code` must be 'auto', 'int8', 'int4', 'int2'.*got 'topk'"):
        GraVACModelParallelStrategy("int8", all_gather_code="topk")
    with pytest.raises(ValueError, match=r"`all_gather_code` must be 'auto', 'int8', 'int4', 'int2'.*got 'int16'"):
        GraVACModelParallelStrategy("int8", all_gather_code="int16")  # no compressor's name: not quietly FSDP2's


def test_a_name_no_compressor_has_is_refused_naming_what_the_strategy_takes():
    with pytest.raises(ValueError, match=r"^GraVACModelParallelStrategy: `compressor` must be 'int8', 'int4', 'int2', "
                       r"a BlockCode or 'none', got 'int16'"):  # fmt: skip
        GraVACModelParallelStrategy("int16")


def test_an_argument_neither_strategy_takes_is_refused_naming_this_one_and_the_closest():
    with pytest.raises(TypeError, match=r"^GraVACModelParallelStrategy takes no argument `replica_group`; did you "
                       r"mean `replica_groups`\?$"):  # fmt: skip
        GraVACModelParallelStrategy(replica_group=2)
    with pytest.raises(TypeError, match=r"takes no argument `zzz`; it takes `all_gather_code`, `compressor`"):
        GraVACModelParallelStrategy(zzz=1)
    assert GraVACModelParallelStrategy(timeout=timedelta(seconds=30))._timeout == timedelta(seconds=30)  # passed on


def test_it_says_what_each_collective_sends():
    assert GraVACModelParallelStrategy("int8").said() == (
        "GraVACModelParallelStrategy: gradients reduce-scattered in int8 block codes of 128 entries (about 3.9x fewer "
        "bytes than fp32), with error feedback; parameters gathered in int8 block codes."
    )
    assert GraVACModelParallelStrategy("int8", all_gather_code=None).said().endswith("parameters gathered as they are.")
    both = GraVACModelParallelStrategy("int4", error_feedback=False, all_gather_code="int8")
    assert "int4 block codes of 128 entries (about 7.5x fewer bytes than fp32), without error feedback" in both.said()
    assert both.said().endswith("parameters gathered in int8 block codes.")
    assert "as they are (FSDP2's own)" in GraVACModelParallelStrategy("none").said()
    assert GraVACModelParallelStrategy("none").all_gather_code is None
