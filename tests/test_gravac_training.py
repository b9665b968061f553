"""GraVAC in real 2-rank training through Lightning: decisions alike on uneven data, learning like dense, a
resumed search bit for bit, and step timing under gradient accumulation."""

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_gravac import GraVAC, GraVACStrategy, RunSummary, Static
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo import TeacherRegression, teacher_dataset

from models import SimulatedLink, Snapshot, loader, trainer_kwargs, weights

GRAVAC = {"cf_min": 10, "cf_max": 1000, "epsilon": 0.15, "omega": 0.5, "window": 20}


def _uneven_batches(rank, batches=64):
    """This rank's own batches, of a size other ranks do not share (32 on rank 0, 24 on rank 1), as a user batching by
    tokens or streaming an iterable data set has: a value the decisions must not depend on."""
    x, y = teacher_dataset().tensors
    size = 32 if rank == 0 else 24
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(rank))
    assert batches * size <= len(x)
    chunks = [order[i * size : (i + 1) * size] for i in range(batches)]
    return DataLoader([(x[c], y[c]) for c in chunks], batch_size=None)


def _gravac_vs_dense(rank, world_size, search):
    data = teacher_dataset()
    out = {}
    # "default": no controller, so the strategy installs the zero-argument GraVAC() (the model search, link timed,
    # steps timed: its choices follow the machine's speed). "model": the model search on a modelled link and clock.
    gravac: list[pl.Callback] = []
    if search == "model":
        gravac = [SimulatedLink(**GRAVAC, search="model")]
    elif search == "sequential":
        gravac = [GraVAC(**GRAVAC, search=search)]
    for name, callbacks in [("dense", [Static(cf=1)]), ("gravac", gravac)]:
        summary = RunSummary()
        pl.seed_everything(0)
        model = TeacherRegression(width=256, lr=0.1)
        with torch.no_grad():
            out["untrained"] = nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]).item()
        trainer = pl.Trainer(strategy=GraVACStrategy("topk"), callbacks=[*callbacks, summary], max_steps=200,
                             **trainer_kwargs(world_size, use_distributed_sampler=False))  # fmt: skip
        trainer.fit(model, _uneven_batches(rank))
        with torch.no_grad():
            loss = nn.functional.mse_loss(model(data.tensors[0]), data.tensors[1]).item()
        controller = next(c for c in trainer.callbacks if isinstance(c, (GraVAC, Static)))
        gravac = controller if isinstance(controller, GraVAC) else None
        out[name] = {"loss": loss, "cf": [r["gravac/cf"] for r in summary.history],
                     "probed": gravac.cost.timed if gravac else None, "gains": gravac.probes.gains if gravac else None,
                     "link": repr(gravac.cost.link if gravac else None),
                     "throughput": gravac.window.throughput if gravac else None}  # fmt: skip
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("search", ["sequential", "model", "default"])
def test_ranks_on_different_data_decide_alike_and_gravac_learns_like_dense(search):
    # Each rank its own data, in batches of its own size (32 and 24).
    ranks = run_distributed(_gravac_vs_dense, search=search)
    mine, theirs = ranks[0]["gravac"], ranks[1]["gravac"]
    assert mine["cf"] == theirs["cf"], "ranks took different decisions"
    # Every input of a decision is the same on every rank: the link timer's costs, the gains, the fitted step model,
    # and the throughputs the sequential search settles on (samples summed over ranks, not N x this rank's batch).
    assert (mine["probed"], mine["gains"], mine["link"]) == (theirs["probed"], theirs["gains"], theirs["link"])
    assert mine["throughput"] and mine["throughput"] == theirs["throughput"]
    if search == "sequential":
        assert mine["probed"] is None  # the paper's search does not probe the link
    elif search == "default":
        latency, per_byte = mine["probed"]
        assert latency >= 0 and per_byte > 0, "the setup probe did not measure the link"
    cfs = mine["cf"]
    # The paper starts at cf_min; on a probed link the model search's first step sends dense or the mildest factor.
    assert len(cfs) == 200 and cfs[0] in ((GRAVAC["cf_min"],) if search == "sequential" else (1.0, GRAVAC["cf_min"]))
    if search == "sequential":
        assert max(cfs) > GRAVAC["cf_min"], "the search never moved to a higher factor"
    if search == "default":  # factors chosen from timed steps: how far it compresses follows the machine's load
        assert ranks[0]["gravac"]["loss"] < 0.2 * ranks[0]["untrained"]
    else:  # scripted decisions: same steps, loss within 30% of dense training (error-fed Top-K at 10x to 40x)
        assert ranks[0]["gravac"]["loss"] < 1.3 * ranks[0]["dense"]["loss"]


def _interrupted_vs_uninterrupted(rank, world_size, ckpt_dir, compressor, search):
    def fit(callbacks, ckpt_path=None):
        summary = RunSummary()
        pl.seed_everything(0)
        model = TeacherRegression(width=256, lr=0.05, momentum=0.0 if compressor == "dgc" else 0.9)
        kwargs = trainer_kwargs(world_size, enable_checkpointing=True)
        strategy = GraVACStrategy(compressor)
        trainer = pl.Trainer(strategy=strategy, callbacks=[SimulatedLink(**GRAVAC, search=search), summary, *callbacks],
                             max_steps=80, **kwargs)  # fmt: skip
        trainer.fit(model, loader(), ckpt_path=ckpt_path)
        return [r["gravac/cf"] for r in summary.history], weights(model)

    # 32 steps an epoch: the checkpoint after step 32 falls mid-window (window 20) and mid-search. It is written
    # after the step (`every_n_train_steps`): Lightning 2.6 resumes a checkpoint written in `on_train_epoch_end` one
    # epoch ahead in its sampler's order, which no plugin state can make up for.
    saved = Snapshot(at_epoch=0)
    every_32 = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=32, save_top_k=-1)
    whole, whole_weights = fit([saved, every_32])
    restored = Snapshot()
    resumed, resumed_weights = fit([restored], ckpt_path=f"{ckpt_dir}/epoch=0-step=32.ckpt")
    return {
        "whole": whole, "resumed": resumed, "saved": saved.taken, "restored": restored.taken,
        "weights_equal": [torch.equal(whole_weights[k], resumed_weights[k]) for k in whole_weights],
    }  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("compressor", "search"), [("topk", "sequential"), ("dgc", "sequential"), ("topk", "model")])
def test_resume_mid_search_continues_bit_for_bit(tmp_path, compressor, search):
    ranks = run_distributed(_interrupted_vs_uninterrupted, ckpt_dir=str(tmp_path), compressor=compressor, search=search)
    first = GRAVAC["window"] if search == "sequential" else 3  # the first window's length
    for r, rank in enumerate(ranks):
        saved, restored = rank["saved"], rank["restored"]
        assert saved["controller"]["progress"] == (32 - first) % GRAVAC["window"] and saved["controller"]["tally"]
        if r > 0:
            # Lightning writes rank 0's callback state: other ranks resume with rank 0's partial-window times, the
            # only rank-local values here (they feed the window's MAX; the sample counts, summed, are equal with
            # these even batches). Everything else is the same on every rank.
            for tally in (*saved["controller"]["tally"].values(), *restored["controller"]["tally"].values()):
                for rank_local in ("comm_seconds", "compress_seconds", "plain_compress_seconds"):
                    tally.pop(rank_local)
        assert restored["controller"] == saved["controller"]
        assert restored["step"] == saved["step"] == 32
        assert saved["residuals"].keys() == restored["residuals"].keys()
        assert bool(saved["residuals"]) == (compressor != "dgc"), "DGC keeps its own residual"
        for name, residual in saved["residuals"].items():
            assert torch.equal(restored["residuals"][name], residual), name
        # DGC's momentum and velocity, every rank's own (they differ across ranks).
        assert saved["compressor"].keys() == restored["compressor"].keys()
        assert bool(saved["compressor"]) == (compressor == "dgc")
        for name, tensor in saved["compressor"].items():
            assert torch.equal(restored["compressor"][name], tensor), name
        # Momentum correction's buffers (Top-K with SGD momentum 0.9), every rank's own once a step was compressed.
        assert bool(saved["momentum"]) == (compressor != "dgc")
        assert saved["momentum"].keys() == restored["momentum"].keys()
        for name, tensor in saved["momentum"].items():
            assert torch.equal(restored["momentum"][name], tensor), name
        # The resumed run decides as the uninterrupted one did, step for step, and ends with the same weights.
        assert rank["resumed"] == rank["whole"][32:]
        assert len(set(rank["whole"])) > 1, "the search should have moved"
        assert all(rank["weights_equal"]), "resumed weights differ from the uninterrupted run's, bit for bit"


class StepStarts(pl.Callback):
    """When GraVAC's timing of the step under way began, as each micro-batch ends."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.starts.append(next(c for c in trainer.callbacks if isinstance(c, GraVAC)).clock.start)


def _accumulating(rank: int, world_size: int) -> list[float]:
    starts = StepStarts()
    trainer = pl.Trainer(strategy=GraVACStrategy("qsgd"), callbacks=[SimulatedLink(search="model"), starts],
                         max_steps=5, accumulate_grad_batches=4, **trainer_kwargs(world_size))  # fmt: skip
    trainer.fit(TeacherRegression(), loader())
    return starts.starts


@pytest.mark.distributed
def test_under_gradient_accumulation_a_step_is_timed_from_its_first_micro_batch():
    for starts in run_distributed(_accumulating):
        assert len(starts) == 20
        for step in range(5):  # four micro-batches a step, one start
            group = starts[4 * step : 4 * step + 4]
            assert len(set(group)) == 1, f"step {step} was timed from a later micro-batch"
        assert len(set(starts)) == 5
