"""What Lightning's own DDP tests check, with GraVACStrategy where DDPStrategy would be, on a ``Linear(32, 2)``.

Each behaviour runs under stock ``DDPStrategy`` and under ``GraVACStrategy``: lossless (``compressor="none"``, which
must give stock DDP's results bit for bit), with its zero-argument default (GraVAC adapting QSGD: plain SGD, a dense
gradient) and with Top-K at a fixed factor (ranks identical, results finite). Two ranks
launched as torchrun would (``ddp``), and once through Lightning's own spawn launcher (``ddp_spawn``).
"""

import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

from lightning_gravac import Controller, GraVAC, GraVACStrategy, Static
from lightning_gravac.launch import run_distributed

from models import ExitCleanly, Failure, FrozenBackbone, OneWeight, Tiny, tiny_loader, trainer_kwargs, weights

pytestmark = pytest.mark.distributed

#: name -> (strategy, controllers) for each way of running the same behaviour.
SETUPS: dict[str, Callable[[], tuple[Any, list[pl.Callback]]]] = {
    "stock": lambda: (DDPStrategy(), []),
    "lossless": lambda: (GraVACStrategy("none"), []),
    "default": lambda: (GraVACStrategy(), []),
    "topk": lambda: (GraVACStrategy("topk"), [Static(cf=4)]),
}


def _trainer(setup: str, **overrides: Any) -> pl.Trainer:
    strategy, controllers = SETUPS[setup]()
    callbacks = controllers + overrides.pop("callbacks", [])
    kwargs = trainer_kwargs(2, **{"max_epochs": 2, **overrides})
    return pl.Trainer(strategy=strategy, callbacks=callbacks, **kwargs)


def _behaviours(rank: int, world_size: int, setup: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # fit, then validate, test and predict with the fitted model; which samples each rank trained on; logging.
    pl.seed_everything(0)
    model = Tiny()
    trainer = _trainer(setup)
    trainer.fit(model, tiny_loader(), tiny_loader(16))
    out["fit"] = weights(model)
    out["seen"] = sorted(model.seen)
    out["val_rank"] = float(trainer.callback_metrics["val_rank"])
    out["validate"] = trainer.validate(model, tiny_loader(16), verbose=False)
    out["test"] = trainer.test(model, tiny_loader(16), verbose=False)
    out["predict"] = torch.cat(trainer.predict(model, tiny_loader(16)))
    out["controllers"] = [repr(c) for c in trainer.callbacks if type(c).__name__ in ("GraVAC", "Static")]
    # torch.save of the whole trained module, loaded back.
    torch.save(model, f"model-{rank}.pt")
    out["torch_save"] = weights(torch.load(f"model-{rank}.pt", weights_only=False))

    for precision in ("16-mixed", "bf16-mixed"):
        pl.seed_everything(0)
        model = Tiny()
        _trainer(setup, precision=precision).fit(model, tiny_loader())
        out[precision] = weights(model)

    # Checkpoint after one epoch, resume to two: the same weights as two epochs in one run.
    pl.seed_everything(0)
    model = Tiny()
    checkpoint = ModelCheckpoint(dirpath=f"ckpt-{setup}", save_last=True)
    _trainer(setup, max_epochs=1, enable_checkpointing=True, callbacks=[checkpoint]).fit(model, tiny_loader())
    resumed = Tiny()
    _trainer(setup, enable_checkpointing=True).fit(resumed, tiny_loader(), ckpt_path=f"ckpt-{setup}/last.ckpt")
    out["resumed"] = weights(resumed)
    out["loaded"] = weights(Tiny.load_from_checkpoint(f"ckpt-{setup}/last.ckpt"))
    out["checkpointed"] = weights(model)

    # ZeroRedundancyOptimizer, with a checkpoint (which consolidates its state on rank 0).
    pl.seed_everything(0)
    model = Tiny(optimizer="zero")
    zero_ckpt = ModelCheckpoint(dirpath=f"zero-{setup}")
    _trainer(setup, enable_checkpointing=True, callbacks=[zero_ckpt]).fit(model, tiny_loader())
    out["zero"] = weights(model)

    # Early stopping: the monitored value differs by rank; the decision to stop is the same on every rank.
    pl.seed_everything(0)
    stopper = EarlyStopping(monitor="val_rank", patience=1, mode="min")
    trainer = _trainer(setup, max_epochs=10, callbacks=[stopper])
    trainer.fit(Tiny(), tiny_loader(), tiny_loader(16))
    out["stopped_epoch"] = trainer.current_epoch

    # An error in any stage's step reaches the caller on every rank (and nothing hangs).
    out["errors"] = {}
    for stage in ("train", "validate", "test", "predict"):
        try:
            _run_stage(_trainer(setup), Tiny(fail_in=stage), stage)
            out["errors"][stage] = None
        except Failure as error:
            out["errors"][stage] = str(error)
    return out


def _run_stage(trainer: pl.Trainer, model: Tiny, stage: str) -> None:
    if stage == "train":
        trainer.fit(model, tiny_loader())
    else:
        getattr(trainer, stage)(model, tiny_loader(16))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    # Module-scoped, so it runs before the per-test scratch directory exists: its own, for the checkpoints and saved
    # models the ranks (which start in the parent's directory) write.
    here, scratch = os.getcwd(), tmp_path_factory.mktemp("lightning_ddp")
    os.chdir(scratch)
    try:
        return {setup: run_distributed(_behaviours, timeout=300, setup=setup) for setup in SETUPS}
    finally:
        os.chdir(here)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


WEIGHTS = ("fit", "torch_save", "16-mixed", "bf16-mixed", "resumed", "loaded", "checkpointed", "zero")


@pytest.mark.slow
def test_lossless_gravac_gives_stock_ddp_results_bit_for_bit_in_every_behaviour(results):
    for rank in (0, 1):
        stock, ours = results["stock"][rank], results["lossless"][rank]
        for key in WEIGHTS:
            assert _equal(stock[key], ours[key]), key
        assert torch.equal(stock["predict"], ours["predict"])
        for key in ("seen", "val_rank", "validate", "test", "stopped_epoch", "errors"):
            assert stock[key] == ours[key], key


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["stock", "lossless", "default", "topk"])
def test_every_behaviour_holds_on_every_rank(results, setup):
    r0, r1 = results[setup]
    for key in WEIGHTS:
        assert _equal(r0[key], r1[key]), key  # ranks hold the same model
        assert all(torch.isfinite(w).all() for w in r0[key].values()), key
    # The distributed sampler splits each epoch between the ranks.
    for epoch in (0, 1):
        mine, theirs = ({i for e, i in r["seen"] if e == epoch} for r in (r0, r1))
        assert mine | theirs == set(range(64)) and not mine & theirs and len(mine) == 32, epoch
    assert (r0["val_rank"], r1["val_rank"]) == (0.0, 1.0)  # logged per rank, not reduced
    # sync_dist: reduced over ranks; rank_zero_only=False without it: each rank's own
    assert r0["validate"][0]["val_loss"] == r1["validate"][0]["val_loss"] and r0["test"] == r1["test"]
    assert (r0["validate"][0]["val_rank"], r1["validate"][0]["val_rank"]) == (0.0, 1.0)
    assert math.isfinite(r0["test"][0]["test_loss"])
    assert r0["predict"].shape == (8, 2)  # each rank predicts its half of 16 samples
    assert _equal(r0["checkpointed"], r0["loaded"])  # the checkpoint holds the model it was written from
    assert _equal(r0["fit"], r0["resumed"])  # one epoch, checkpoint, resume to two: as two epochs in one run
    assert _equal(r0["fit"], r0["torch_save"])
    assert r0["stopped_epoch"] == r1["stopped_epoch"] < 9
    for stage, message in r0["errors"].items():
        assert message == f"{stage} failed on rank 0", stage
        assert r1["errors"][stage] == f"{stage} failed on rank 1", stage


@pytest.mark.slow
def test_the_zero_argument_default_fits_its_method_and_sends_dense_on_a_loopback(results):
    # Plain SGD on a dense gradient: QSGD, GraVAC's factors its 8- to 2-bit codes (within the 64-entry gradient).
    for r in results["default"]:
        (controller,) = r["controllers"]
        assert controller.startswith("GraVAC(cf_min=3.96899, cf_max=15.5152,"), controller
    assert results["lossless"][0]["controllers"] == [repr(Static(cf=1))]
    # A loopback: compressing would save nothing of a step, so the default sends dense: stock DDP's run, bit for bit.
    assert _equal(results["default"][0]["fit"], results["stock"][0]["fit"])


def _fit_tiny(rank: int, world_size: int, strategy: Any, callbacks: list[pl.Callback]) -> str:
    pl.seed_everything(0)
    try:
        pl.Trainer(strategy=strategy, callbacks=callbacks, **trainer_kwargs(2, max_steps=2)).fit(Tiny(), tiny_loader())
    except ValueError as error:
        return str(error)
    return "trained"


def test_the_default_trains_a_linear_32_2_and_an_explicit_impossible_cf_max_still_raises():
    assert run_distributed(_fit_tiny, strategy=GraVACStrategy(), callbacks=[]) == ["trained", "trained"]
    refused = run_distributed(_fit_tiny, strategy=GraVACStrategy(), callbacks=[GraVAC(cf_max=1000)])
    for message in refused:
        assert "`cf_max`=1000 exceeds the size of the largest gradient (64 entries)" in message


def _fit_one_weight(rank: int, world_size: int) -> tuple[str, float]:
    pl.seed_everything(0)
    model = OneWeight()
    before = float(model.layer.weight)
    trainer = pl.Trainer(strategy=GraVACStrategy(), **trainer_kwargs(world_size, max_steps=3))
    trainer.fit(model, tiny_loader())
    controller = next(c for c in trainer.callbacks if isinstance(c, Controller))
    return repr(controller), float(model.layer.weight) - before


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_default_trains_a_single_parameter_on_one_or_two_ranks(world_size):
    for controller, moved in run_distributed(_fit_one_weight, world_size=world_size):
        # Nothing to compress: every factor fitted to 1; on one process the default sends dense anyway.
        assert controller == repr(GraVAC(cf_min=1, cf_max=1) if world_size == 2 else Static(cf=1))
        assert moved != 0.0


def _fit_frozen_backbone(rank: int, world_size: int, method: str) -> dict[str, Any]:
    pl.seed_everything(0)
    model = FrozenBackbone()
    backbone, head = model.backbone.weight.clone(), model.layer.weight.clone()
    trainer = pl.Trainer(strategy=GraVACStrategy(method), **trainer_kwargs(world_size, max_steps=3))
    trainer.fit(model, tiny_loader())
    controller = next(c for c in trainer.callbacks if isinstance(c, Static))
    return {
        "cf": controller.cf,
        "frozen": torch.equal(model.backbone.weight, backbone),
        "trained": not torch.equal(model.layer.weight, head),
        "head": model.layer.weight.detach().clone(),
    }


@pytest.mark.parametrize("method", ["signsgd", "terngrad"])
def test_a_fixed_size_method_trains_a_small_head_over_a_frozen_backbone(method):
    # The default controller of a sign or ternary method sits at its encoding's factor (32, 16), above the 8 entries of
    # the only gradient: it is capped to the largest trainable tensor, not to the frozen backbone's 128 entries.
    ranks = run_distributed(_fit_frozen_backbone, method=method)
    for rank in ranks:
        assert rank["cf"] == 8.0 and rank["frozen"] and rank["trained"]
    assert torch.equal(ranks[0]["head"], ranks[1]["head"])
    # A factor the user asked for is still checked, not silently lowered.
    asked = Static(cf=32)
    asked.fit_to_model(8)
    assert asked.cf == 32.0


def test_a_default_cf_min_fits_too_but_an_explicit_one_is_kept():
    tiny = GraVAC()
    tiny.fit_to_model(6)
    assert (tiny.ladder.cf_min, tiny.ladder.cf_max, tiny.ladder.factors) == (6, 6, (6,))
    kept = GraVAC(cf_min=10)
    kept.fit_to_model(6)
    # Then refused at setup, naming cf_min's clash with the model.
    assert (kept.ladder.cf_min, kept.ladder.cf_max) == (10, 6)
    untouched = GraVAC()
    untouched.fit_to_model(10**6)
    assert (untouched.ladder.cf_min, untouched.ladder.cf_max) == (10, 1000)


@pytest.mark.parametrize("name", ["gravac", "gravac_spawn"])
def test_registry_entries_keep_exactly_the_ddp_kwargs_passed(name):
    entry = StrategyRegistry[name]
    strategy = entry["strategy"](**entry["init_params"])
    assert strategy._ddp_kwargs == {}
    assert GraVACStrategy(gradient_as_bucket_view=False)._ddp_kwargs == {"gradient_as_bucket_view": False}


@pytest.mark.slow
def test_ddp_spawn_fit_test_predict_through_lightning_own_launcher():
    results = {}
    for setup, strategy in [
        ("stock", DDPStrategy(start_method="spawn")),
        ("ours", GraVACStrategy(start_method="spawn")),
    ]:
        pl.seed_everything(0)
        model = Tiny()
        trainer = pl.Trainer(strategy=strategy, callbacks=[ExitCleanly()], **trainer_kwargs(2, max_epochs=1))
        trainer.fit(model, tiny_loader())
        results[setup] = {
            "weights": weights(model),
            "test": trainer.test(model, tiny_loader(16), verbose=False),
            "predict": trainer.predict(model, tiny_loader(16)),
        }
    assert _equal(results["stock"]["weights"], results["ours"]["weights"])  # a loopback: the default sends dense
    assert math.isfinite(results["ours"]["test"][0]["test_loss"])
    # Lightning's spawn launcher hands the parent what it hands it under stock DDP (no predictions: they stay in the
    # workers), so the two must agree.
    assert type(results["ours"]["predict"]) is type(results["stock"]["predict"])
