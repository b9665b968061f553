"""Non-finite gradients, dead and stalled ranks, precision modes, accumulation, unused and frozen parameters."""

import math
import time
import warnings
from datetime import timedelta

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins import MixedPrecision
from pytorch_lightning.strategies import DDPStrategy
from torch import nn

from lightning_gravac import GraVACStrategy, RunSummary, Static
from lightning_gravac.adaptations import MomentumCorrection
from lightning_gravac.launch import run_distributed
from lightning_gravac.strategies.checkpoint import gather_rows
from lightning_gravac.zoo import TeacherRegression, teacher_dataset

from models import (
    Cycling,
    FaultyRegression,
    SparseBag,
    UnusedAndFrozen,
    bag_loader,
    loader,
    trainer_kwargs,
    weights,
)

pytestmark = pytest.mark.distributed


def _full_loss(model: nn.Module) -> float:
    data = teacher_dataset()
    with torch.no_grad():
        return nn.functional.mse_loss(model(data.tensors[0].to(next(model.parameters()).dtype)),
                                      data.tensors[1].to(next(model.parameters()).dtype)).item()  # fmt: skip


class Residuals(pl.Callback):
    """This rank's residuals as copies: after every step, or (``before_backward``) as the hook will find them, after
    the step's start and before its backward."""

    def __init__(self, before_backward: bool = False) -> None:
        self.before_backward = before_backward
        self.steps: list[dict[str, torch.Tensor]] = []
        self.compressor_steps: list[dict[str, torch.Tensor]] = []  # a method's own accumulations (DGC's u and v)

    def _take(self, trainer) -> None:
        self.steps.append(trainer.strategy.compression_state.carry.residuals.state_dict())
        self.compressor_steps.append(trainer.strategy.compressor.state_dict())

    def on_train_batch_end(self, trainer, *args) -> None:
        if not self.before_backward:
            self._take(trainer)

    def on_before_backward(self, trainer, *args) -> None:
        if self.before_backward:
            self._take(trainer)


def _nonfinite_once(rank, world_size, fault):
    pl.seed_everything(0)
    model = FaultyRegression(fault=fault, at_step=5, width=128, lr=0.1)
    before = _full_loss(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    residuals, summary, controller = Residuals(), RunSummary(), Static(cf=20)
    trainer = pl.Trainer(
        strategy=GraVACStrategy("topk"), callbacks=[controller, residuals, summary], max_steps=60,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], **trainer_kwargs(world_size),
    )  # fmt: skip
    trainer.fit(model, loader())
    return {
        "before": before, "after": _full_loss(model), "scale": scaler.get_scale(), "weights": weights(model),
        "residuals": residuals.steps, "nonfinite_steps": controller.nonfinite_steps,
        "finite_metrics": all(math.isfinite(v) for r in summary.history for v in r.values()),
    }  # fmt: skip


@pytest.mark.parametrize("fault", ["nan", "inf"])
def test_a_nonfinite_gradient_on_one_rank_is_skipped_and_never_enters_the_residuals(fault):
    ranks = run_distributed(_nonfinite_once, fault=fault)
    for r in ranks:
        # The scaler saw the overflow on every rank and halved its scale once (the step was skipped).
        assert r["scale"] == 2.0**7
        assert r["nonfinite_steps"] == 1 and r["finite_metrics"]
        # The residuals of the bad step (index 5) are those of the step before: kept, not poisoned.
        bad = r["residuals"][5]
        assert bad.keys() == r["residuals"][4].keys()
        assert all(torch.equal(bad[k], r["residuals"][4][k]) for k in bad)
        assert all(torch.isfinite(t).all() for step in r["residuals"] for t in step.values())
        assert all(torch.isfinite(w).all() for w in r["weights"].values())
        assert r["after"] < 0.2 * r["before"], "training went on learning"
    assert all(torch.equal(a, b) for a, b in zip(*(r["weights"].values() for r in ranks), strict=True))


def _nonfinite_on_the_dense_path(rank, world_size, compressor):
    pl.seed_everything(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    residuals = Residuals()
    trainer = pl.Trainer(
        strategy=GraVACStrategy(compressor), callbacks=[Cycling(factors=(20, 1), every=5), residuals], max_steps=8,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], **trainer_kwargs(world_size),
    )  # fmt: skip
    model = FaultyRegression(fault="nan", at_step=5, width=128, lr=0.1)
    trainer.fit(model, loader())
    kept = residuals.compressor_steps if compressor == "dgc" else residuals.steps
    return {"residuals": kept, "scale": scaler.get_scale(), "weights": weights(model)}


@pytest.mark.parametrize("compressor", ["topk", "dgc"])
def test_a_nonfinite_step_sent_dense_keeps_the_residuals_it_would_have_delivered(compressor):
    # Steps 0-4 at cf 20 leave residuals (Top-K's; DGC's own u and v); step 5 is the first at cf 1 (plain all-reduce,
    # no header) and rank 1's gradient is NaN there: what was added into that step is kept, and the next finite step
    # delivers it (DGC keeps its momentum u).
    ranks = run_distributed(_nonfinite_on_the_dense_path, compressor=compressor)
    for r in ranks:
        assert r["scale"] == 2.0**7
        steps = r["residuals"]
        assert steps[4], "compressed steps left residuals"
        assert steps[5].keys() == steps[4].keys()
        assert all(torch.equal(steps[5][k], steps[4][k]) for k in steps[4])
        delivered = {k for k in steps[4] if not k.startswith("u/")}
        assert delivered and not delivered & steps[6].keys(), "the first finite dense step delivered them"
        assert steps[6].keys() == steps[4].keys() - delivered
    assert all(torch.equal(a, b) for a, b in zip(*(r["weights"].values() for r in ranks), strict=True))


def _scale_halved(rank, world_size, compressor):
    pl.seed_everything(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    after, before = Residuals(), Residuals(before_backward=True)
    trainer = pl.Trainer(
        strategy=GraVACStrategy(compressor), callbacks=[Static(cf=20), after, before], max_steps=8,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], **trainer_kwargs(world_size),
    )  # fmt: skip
    trainer.fit(FaultyRegression(fault="nan", at_step=5, width=128, lr=0.1), loader())
    return {
        "after": after.compressor_steps if compressor == "dgc" else after.steps,
        "before": before.compressor_steps if compressor == "dgc" else before.steps,
    }


@pytest.mark.parametrize("compressor", ["topk", "dgc"])
def test_when_the_gradient_scale_halves_the_residuals_follow_it(compressor):
    # Step 5 is not finite: the scaler skips it and halves its scale, so from step 6 on the hook sees gradients at
    # half the scale. What error feedback carries (Top-K's residuals; DGC's own u and v) must be halved with them, or
    # the pending update doubles.
    for r in run_distributed(_scale_halved, compressor=compressor):
        kept, carried = r["after"][5], r["before"][6]
        assert kept.keys() == carried.keys() and kept
        for name in kept:
            assert torch.equal(carried[name], kept[name] * 0.5), name
        for step in range(1, 5):  # an unchanged scale leaves them alone
            assert all(torch.equal(r["before"][step][k], r["after"][step - 1][k]) for k in r["after"][step - 1])


def _survivor(rank, world_size, fault, timeout_s, stall_s):
    pl.seed_everything(0)
    strategy = GraVACStrategy("topk", timeout=timedelta(seconds=timeout_s))
    trainer = pl.Trainer(strategy=strategy, callbacks=[Static(cf=10)], max_steps=50, **trainer_kwargs(world_size))
    start = time.perf_counter()
    try:
        trainer.fit(FaultyRegression(fault=fault, at_step=5, stall_s=stall_s), loader())
    except Exception as error:
        return {"raised": type(error).__name__, "message": str(error)[:300], "seconds": time.perf_counter() - start}
    return {"raised": None, "seconds": time.perf_counter() - start}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["exit", "stall"])
def test_when_a_rank_dies_or_stalls_the_other_raises_within_the_timeout(fault):
    timeout_s, bound = 10, 70
    # The stalled rank sleeps past the bound, then exits: raising before it is gone is the process group's timeout.
    survivor, faulty = run_distributed(_survivor, fault=fault, timeout_s=timeout_s, stall_s=bound + 10,
                                       allow_missing=True, timeout=150)  # fmt: skip
    assert faulty is None, "the faulty rank should not have finished"
    assert survivor["raised"] is not None, f"rank 0 finished although rank 1 {fault}ed"
    assert survivor["seconds"] < bound, survivor  # raised while the other rank was stalled, not once it was gone


def _precision(rank, world_size, precision, accumulate):
    pl.seed_everything(0)
    model = TeacherRegression(width=128, lr=0.1)
    before = _full_loss(model)
    summary = RunSummary()
    kwargs = trainer_kwargs(world_size, precision=precision, accumulate_grad_batches=accumulate)
    trainer = pl.Trainer(strategy=GraVACStrategy("topk"), callbacks=[Static(cf=20), summary], max_steps=40, **kwargs)
    trainer.fit(model, loader())
    return {"before": before, "after": _full_loss(model), "weights": weights(model),
            "steps": len(summary.history), "dtype": str(next(model.parameters()).dtype)}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "accumulate"), [("16-mixed", 1), ("bf16-mixed", 1), ("bf16-true", 1), ("32-true", 3)]
)
def test_precision_modes_and_gradient_accumulation(precision, accumulate):
    ranks = run_distributed(_precision, precision=precision, accumulate=accumulate)
    for r in ranks:
        assert r["steps"] == 40, "one communicated step per optimizer step"
        assert all(torch.isfinite(w.float()).all() for w in r["weights"].values())
        assert r["after"] < 0.5 * r["before"]
    assert all(torch.equal(a, b) for a, b in zip(*(r["weights"].values() for r in ranks), strict=True))
    if precision == "bf16-true":
        assert ranks[0]["dtype"] == "torch.bfloat16"


def _unused_and_frozen(rank, world_size):
    pl.seed_everything(0)
    model = UnusedAndFrozen(width=64, lr=0.1)
    strategy = GraVACStrategy("topk", find_unused_parameters=True)
    trainer = pl.Trainer(strategy=strategy, callbacks=[Static(cf=10)], max_steps=20, **trainer_kwargs(world_size))
    trainer.fit(model, loader())
    return {"weights": weights(model), "residuals": sorted(strategy.compression_state.carry.residuals)}


def test_unused_and_frozen_parameters():
    ranks = run_distributed(_unused_and_frozen)
    assert all(torch.equal(a, b) for a, b in zip(*(r["weights"].values() for r in ranks), strict=True))
    assert not any(name.startswith("frozen") for name in ranks[0]["residuals"])
    assert any(name.startswith("net") for name in ranks[0]["residuals"])


def _sparse_gradients(rank, world_size):
    out = {}
    for name, strategy, callbacks in [
        ("stock", DDPStrategy(), []),
        ("cf 1", GraVACStrategy("topk"), [Static(cf=1)]),
        ("cf 4", GraVACStrategy("topk"), [Static(cf=4)]),
        ("default", GraVACStrategy(), []),
    ]:
        pl.seed_everything(0)
        model = SparseBag()
        before = model.bag.weight.detach().clone()
        trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, max_steps=12, **trainer_kwargs(world_size))
        trainer.fit(model, bag_loader())
        out[name] = {**weights(model), "moved": not torch.equal(model.bag.weight, before)}
        if name == "cf 4":  # the head's momentum went into the hook, the embedding's stayed in the optimizer
            out["moved momentum"] = sorted(trainer.strategy.compression_state.carry.get(MomentumCorrection).settings)
        if name == "cf 1":  # the sparse bucket is sent as it is: its bytes count as dense's
            metrics = callbacks[0].last_metrics
            out["cf 1 traffic"] = (metrics["gravac/bytes_sent"], metrics["gravac/bytes_dense"])
    # One group for both: it keeps its momentum whole in the optimizer, and the strategy says so.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(strategy=GraVACStrategy("topk"), callbacks=[Static(cf=4)], max_steps=2,
                             **trainer_kwargs(world_size))  # fmt: skip
        trainer.fit(SparseBag(one_group=True), bag_loader())
    out["warned"] = [str(w.message) for w in caught if "sparse embedding" in str(w.message)]
    out["one group moved"] = sorted(trainer.strategy.compression_state.carry.get(MomentumCorrection).settings)
    return out


@pytest.mark.distributed
def test_a_sparse_embedding_gradient_is_averaged_as_stock_ddp_does_beside_compressed_ones():
    r0, r1 = run_distributed(_sparse_gradients)
    assert r0.pop("moved momentum") == r1.pop("moved momentum") == ["head.bias", "head.weight"]
    assert r0.pop("one group moved") == r1.pop("one group moved") == []
    sent, dense = r0.pop("cf 1 traffic")
    assert sent == dense and r1.pop("cf 1 traffic") == (sent, dense)
    assert len(r0.pop("warned")) == 1 and r1.pop("warned") == []  # rank 0 warns, once
    for setup in ("stock", "cf 1", "cf 4", "default"):
        assert r0[setup].pop("moved") and r1[setup].pop("moved"), setup
        for name in r0[setup]:
            assert torch.equal(r0[setup][name], r1[setup][name]), (setup, name)  # the replicas stay identical
            assert torch.isfinite(r0[setup][name]).all(), (setup, name)
    # At factor 1 the sparse gradient and the dense ones give stock DDP's weights, bit for bit (SGD momentum 0.9:
    # the group with the sparse parameter keeps its momentum in the optimizer).
    for name in r0["stock"]:
        assert torch.equal(r0["cf 1"][name], r0["stock"][name]), name
    assert not torch.equal(r0["cf 4"]["head.weight"], r0["stock"]["head.weight"])  # the head was compressed


def _gather_every_dtype(rank, world_size):
    torch.manual_seed(rank)
    tensors = {
        "residual64": torch.randn(3, 2, dtype=torch.float64) / 3,  # not representable in float32
        "count": torch.tensor([2**60 + rank, -rank]),  # not representable in float32 either
        "buffer16": torch.randn(5).bfloat16(),
        "residual32": torch.randn(4, 1),
        "flag": torch.tensor(rank == 1),
        "empty": torch.zeros(0, 3),
        "not a tensor": "left out",
        f"only on rank {rank}": torch.arange(3 + rank, dtype=torch.float64) + rank,  # a slot one rank has not made
    }
    dist.init_process_group("gloo")
    gathered, absent = gather_rows(tensors, world_size)
    try:  # one name in two shapes: an error on every rank, not a hang
        gather_rows({"moment": torch.zeros(2 + rank)}, world_size)
        mismatch = ""
    except ValueError as error:
        mismatch = str(error)
    return tensors, gathered, absent, mismatch


@pytest.mark.distributed
def test_checkpoint_gather_keeps_every_rank_state_bit_for_bit_in_every_dtype():
    ranks = run_distributed(_gather_every_dtype, timeout=120)
    names = {n for mine, *_ in ranks for n in mine} - {"not a tensor"}
    for rank, (_, gathered, absent, mismatch) in enumerate(ranks):
        assert sorted(gathered) == sorted(names)
        assert absent == {"only on rank 0": [1], "only on rank 1": [0]}
        assert "'moment'" in mismatch
        for name, rows in gathered.items():
            for r, (mine, *_) in enumerate(ranks):
                if name not in mine:
                    assert not rows[r].any(), "a rank without the tensor gives zeros"
                    continue
                original = mine[name]
                assert rows.dtype == original.dtype and rows.shape == (2, *original.shape), (rank, name)
                # Bit for bit: the bytes, not a rounding that happens to compare equal.
                assert torch.equal(rows[r].reshape(-1).view(torch.uint8), original.reshape(-1).view(torch.uint8))


def _save_on_two(rank, world_size, ckpt_dir):
    pl.seed_everything(0)
    every_epoch = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True)
    kwargs = trainer_kwargs(world_size, enable_checkpointing=True)
    trainer = pl.Trainer(
        strategy=GraVACStrategy("topk"), callbacks=[Static(cf=20), every_epoch], max_steps=32, **kwargs
    )
    trainer.fit(TeacherRegression(width=64, lr=0.1), loader())


class ResidualsAtStart(pl.Callback):
    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.residuals = trainer.strategy.compression_state.carry.residuals.state_dict()


def _resume_on(rank, world_size, ckpt):
    at_start = ResidualsAtStart()
    trainer = pl.Trainer(strategy=GraVACStrategy("topk"), callbacks=[Static(cf=20), at_start], max_steps=40,
                         **trainer_kwargs(world_size))  # fmt: skip
    with pytest.warns(UserWarning, match=r"resuming on 1 ranks from a checkpoint of 2; each rank starts from the mean"):
        trainer.fit(TeacherRegression(width=64, lr=0.1), loader(), ckpt_path=ckpt)
    return at_start.residuals


def test_resume_on_another_world_size_gives_every_rank_the_mean_residual(tmp_path):
    run_distributed(_save_on_two, ckpt_dir=str(tmp_path))
    ckpt = str(tmp_path / "epoch=0-step=32.ckpt")
    saved = torch.load(ckpt, weights_only=False)["gravac"]
    assert saved["world_size"] == 2 and saved["step"] == 32
    stacked = saved["residuals"]
    assert stacked and all(t.shape[0] == 2 for t in stacked.values())
    assert any(not torch.equal(t[0], t[1]) for t in stacked.values()), "ranks saw different data"
    (restored,) = run_distributed(_resume_on, world_size=1, ckpt=ckpt)
    assert restored.keys() == stacked.keys()
    for name, pair in stacked.items():
        # The pending aggregate update, sum_r residual_r / N, is the same on 1 rank as it was on 2.
        torch.testing.assert_close(restored[name], pair.mean(0), rtol=0, atol=0)


class ZeroNonFinite(pl.Callback):
    """What many users' scripts do: zero every gradient when any is not finite, so the step changes nothing."""

    def __init__(self) -> None:
        self.zeroed = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if not all(torch.isfinite(g).all() for g in grads):
            self.zeroed += 1
            for g in grads:
                g.zero_()


def _zeroed_nan_step(rank, world_size, strategy):
    pl.seed_everything(0)
    model = FaultyRegression(fault="nan", at_step=10, on_rank=0, width=64, lr=0.05, momentum=0.9)
    guard = ZeroNonFinite()
    moved: list[dict[str, torch.Tensor]] = []

    class Weights(pl.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            moved.append(weights(model))

    callbacks: list[pl.Callback] = [guard, Weights()]
    if strategy == "stock":
        chosen: DDPStrategy = DDPStrategy()
    else:
        chosen = GraVACStrategy("topk")
        if strategy == "cf1":
            callbacks.append(Static(cf=1))
    trainer = pl.Trainer(strategy=chosen, callbacks=callbacks, max_steps=20, **trainer_kwargs(world_size))
    trainer.fit(model, loader())
    buffers = {}
    if strategy != "stock":
        buffers = trainer.strategy.compression_state.carry.get(MomentumCorrection).state_dict()
    return {"weights": moved, "zeroed": guard.zeroed, "buffers": buffers}


def test_a_nonfinite_step_zeroed_by_the_user_leaves_the_moved_momentum_as_stock_sgd_keeps_it():
    # Rank 0's loss is NaN at step 10 and a callback zeroes the gradients then. Stock DDP + SGD momentum skips the
    # gradient and trains on with its momentum; the momentum moved into the hook must do the same, not take the NaN.
    stock = run_distributed(_zeroed_nan_step, strategy="stock", timeout=180)
    exact = run_distributed(_zeroed_nan_step, strategy="cf1", timeout=180)
    default = run_distributed(_zeroed_nan_step, strategy="default", timeout=180)
    for ranks in (stock, exact, default):
        assert [r["zeroed"] for r in ranks] == [1, 1]
    for a, b in zip(stock[0]["weights"], exact[0]["weights"], strict=True):  # every step, the skipped one included
        assert all(torch.equal(a[k], b[k]) for k in a)
    for r in exact + default:
        assert r["buffers"] and all(torch.isfinite(t).all() for t in r["buffers"].values())
    # Under the default the weights keep moving after the zeroed step, and end near stock's.
    steps = default[0]["weights"]
    assert all(not torch.equal(steps[i][k], steps[i + 1][k]) for i in range(11, 19) for k in steps[i])
    assert all(torch.isfinite(w).all() for w in steps[-1].values())
