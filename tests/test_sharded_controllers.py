"""The compression controllers drive GraVACModelParallelStrategy: FSDP2 through Lightning's Trainer on 2 CPU ranks."""

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback
from sharded_models import EveryStep, ShardedMLP, sharded_kwargs, sharded_loader, stock_strategy

from lightning_gravac import Accordion, GraVAC, GraVACModelParallelStrategy, Static
from lightning_gravac.launch import run_distributed
from lightning_gravac.sharded import CodedReduceScatter
from lightning_gravac.sharded.control import CODED, EXACT, ShardedCompressionState, Split
from lightning_gravac.sharded.local_steps import ReplicaRounds
from lightning_gravac.sharded.replicas import CodedReplicaAllReduce
from lightning_gravac.state import Factors

STEPS = 6
METRICS = ("gravac/cf", "gravac/achieved_cf", "gravac/gain", "gravac/bytes_sent", "gravac/collective")
#: This rank's own host time: it differs between ranks.
TIMES = ("gravac/compress_ms",)


class Metrics(Callback):
    """The controller's metrics after each step (it publishes them before this callback runs)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        got = trainer.callback_metrics
        self.steps.append({k: float(got[k]) for k in (*METRICS, *TIMES) if k in got})


def _controller(spec: str | None) -> list[Callback]:
    if spec is None:
        return []
    return [{"exact": Static(cf=1), "coded": Static(cf=4), "accordion": Accordion(1, 4, 1.0, 1, "step")}[spec]]


def _fit(rank: int, world_size: int, method: str | None, controller: str | None) -> dict[str, Any]:
    """``STEPS`` AdamW steps of the sharded MLP (``method`` ``None``: stock ``ModelParallelStrategy``) under
    ``controller``: the whole parameters and the controller's metrics after each step, and the bytes sent."""
    pl.seed_everything(0)
    sizes = {"data_parallel_size": world_size, "tensor_parallel_size": 1}
    strategy = stock_strategy(world_size) if method is None else GraVACModelParallelStrategy(method, **sizes)
    steps, metrics, controllers = EveryStep(), Metrics(), _controller(controller)
    trainer = pl.Trainer(
        strategy=strategy, max_steps=STEPS, callbacks=[*controllers, steps, metrics], **sharded_kwargs(world_size)
    )
    trainer.fit(ShardedMLP(), sharded_loader())
    accordion = next((c for c in controllers if isinstance(c, Accordion)), None)
    layer_cf = dict(accordion.layer_cf) if accordion is not None else None
    return {
        "steps": steps.steps,
        "metrics": metrics.steps,
        "sent": getattr(strategy, "bytes_sent", None),
        "layer_cf": layer_cf,
    }


def _assert_runs_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert len(a["steps"]) == len(b["steps"]) == STEPS
    for before, after in zip(a["steps"], b["steps"], strict=True):
        assert before.keys() == after.keys()
        for name, tensor in before.items():
            assert torch.equal(tensor, after[name]), name


def _shared(run: dict[str, Any]) -> list[dict[str, float]]:
    """A run's metrics without this rank's own times."""
    return [{k: m[k] for k in METRICS} for m in run["metrics"]]


@pytest.mark.distributed
def test_static_at_factor_1_is_stock_model_parallel_bit_for_bit():
    stock = run_distributed(_fit, method=None, controller=None, timeout=240)
    exact = run_distributed(_fit, method="int8", controller="exact", timeout=240)
    for s, e in zip(stock, exact, strict=True):
        _assert_runs_equal(s, e)
        assert all(m["gravac/cf"] == 1.0 and m["gravac/achieved_cf"] == 1.0 for m in e["metrics"])
        # FSDP2's own reduce-scatter, summed on the wire, with nothing coded.
        assert all(m["gravac/collective"] == 1.0 and m["gravac/compress_ms"] == 0.0 for m in e["metrics"])


@pytest.mark.distributed
def test_static_at_the_codes_factor_is_the_code_bit_for_bit_with_its_statistics_the_same_on_every_rank():
    plain = run_distributed(_fit, method="int8", controller=None, timeout=240)
    static = run_distributed(_fit, method="int8", controller="coded", timeout=240)
    for p, s in zip(plain, static, strict=True):
        _assert_runs_equal(p, s)
        assert p["sent"] == s["sent"]
    assert _shared(static[0]) == _shared(static[1])  # every rank reads the same statistics, to the bit
    for m in static[0]["metrics"]:
        assert m["gravac/collective"] == 0.0  # payloads exchanged whole (an all-to-all), decoded before any sum
        assert m["gravac/compress_ms"] > 0.0
        assert m["gravac/cf"] == 4.0
        assert 3.0 < m["gravac/achieved_cf"] < 4.0  # int8 with a scale each 128 entries, chunks padded
        assert 0.9 < m["gravac/gain"] < 1.1  # an 8-bit code keeps the error-fed gradient's energy


@pytest.mark.distributed
def test_accordion_sends_critical_layers_and_biases_exact_and_the_rest_in_the_code_the_same_on_every_rank():
    first, second = run_distributed(_fit, method="int8", controller="accordion", timeout=240)
    assert first["layer_cf"] == second["layer_cf"]  # decided from the sharded gradients' whole norms
    assert _shared(first) == _shared(second)
    for a, b in zip(first["steps"], second["steps"], strict=True):
        for name, tensor in a.items():
            assert torch.equal(tensor, b[name]), name
    # The first interval and the one after it are critical (every layer exact); with eta 1 no later one is: the
    # weights go coded, the biases exact, in fewer bytes than dense's and more than the code's alone (about 3.6x).
    achieved = [m["gravac/achieved_cf"] for m in first["metrics"]]
    assert achieved[:2] == [1.0, 1.0]
    assert all(1.5 < cf < 3.5 for cf in achieved[2:]), achieved
    assert {cf for name, cf in first["layer_cf"].items() if name.endswith("bias")} == {1.0}
    assert 4.0 in {cf for name, cf in first["layer_cf"].items() if name.endswith("weight")}


def _gravac(rank: int, world_size: int) -> None:
    strategy = GraVACModelParallelStrategy("int8", data_parallel_size=world_size, tensor_parallel_size=1)
    trainer = pl.Trainer(strategy=strategy, max_steps=1, callbacks=[GraVAC()], **sharded_kwargs(world_size))
    trainer.fit(ShardedMLP(), sharded_loader())


@pytest.mark.distributed
def test_gravac_is_refused_in_one_line_naming_what_works():
    with pytest.raises(RuntimeError, match=r"GraVAC controller times DDP's all-reduce.*`Static\(cf=1\)`"):
        run_distributed(_gravac, timeout=120)


def test_the_decision_splits_a_chunk_by_parameter():
    state = ShardedCompressionState(GraVACModelParallelStrategy("int8").compressor, True, lambda: None)
    layout = (("a.weight", 3), ("a.bias", 1), ("b.weight", 2))
    assert state.split(layout, torch.device("cpu")) == CODED  # the code's own factor before any controller
    state.decide(Factors(cf=1.0))
    assert state.split(layout, torch.device("cpu")) == EXACT
    state.decide(Factors(cf=4.0, half=True))
    assert state.split(layout, torch.device("cpu")) == EXACT  # a half step goes exact: more than fp16 keeps
    state.decide(Factors(cf=4.0, param_cf={"a.bias": 1.0}))
    split = state.split(layout, torch.device("cpu"))
    assert isinstance(split, Split)
    assert split.coded.tolist() == [0, 1, 2, 4, 5] and split.exact.tolist() == [3]


def test_the_guards_reset_drops_every_residual_and_the_outer_momentum():
    strategy = GraVACModelParallelStrategy("int8")
    comm = CodedReduceScatter(strategy.compressor)
    hook = CodedReplicaAllReduce(strategy.compressor, None)  # type: ignore[arg-type]  # never called here
    rounds = ReplicaRounds.__new__(ReplicaRounds)  # its average's residual and momentum alone matter
    rounds.average_changes = CodedReplicaAllReduce(strategy.compressor, None)  # type: ignore[arg-type]
    rounds._drop_velocity = False
    for owed in (comm, hook, rounds.average_changes):
        owed.residual = torch.ones(2, 4)
    strategy.reduce_scatters[""], strategy.replica_all_reduces[""], strategy.local_steps = comm, hook, rounds
    strategy.compression_state.reset()
    assert comm.residual is None and hook.residual is None and rounds.average_changes.residual is None
    assert rounds._drop_velocity  # dropped at the round's end, on every replica alike


def _accordion_resumed(rank: int, world_size: int, where: str) -> dict[str, Any]:
    """Accordion over windows of 2 steps, 3 steps an epoch: two epochs in one fit, and one then a second resumed from
    its checkpoint (saved mid-window, the window's sharded sums in it)."""
    out: dict[str, Any] = {}
    for run in ("whole", "first", "resumed"):
        pl.seed_everything(0)
        sizes = {"data_parallel_size": world_size, "tensor_parallel_size": 1}
        strategy = GraVACModelParallelStrategy("int8", save_distributed_checkpoint=False, **sizes)
        accordion, steps = Accordion(1, 4, 0.3, 2, "step"), EveryStep()
        epochs = 1 if run == "first" else 2
        trainer = pl.Trainer(strategy=strategy, max_epochs=epochs, callbacks=[accordion, steps],
                             **sharded_kwargs(world_size))  # fmt: skip
        path = str(Path(where, "epoch1.ckpt"))
        trainer.fit(ShardedMLP(), sharded_loader(3 * 16 * world_size), ckpt_path=path if run == "resumed" else None)
        if run == "first":
            trainer.save_checkpoint(path)
        out[run] = {"steps": steps.steps[-3:], "norms": dict(accordion.previous_norms), "sums": len(accordion._sums)}
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_accordion_resumed_mid_window_under_sharding_is_the_uninterrupted_run_bit_for_bit(tmp_path):
    for rank in run_distributed(_accordion_resumed, timeout=300, where=str(tmp_path)):
        assert rank["first"]["sums"] > 0  # saved mid-window
        assert rank["resumed"]["norms"] == rank["whole"]["norms"]  # from the restored sums, to the bit
        for a, b in zip(rank["whole"]["steps"], rank["resumed"]["steps"], strict=True):
            for name, p in a.items():
                assert torch.equal(b[name], p), name
