"""Adam's first moment moved into the comm hook, its second frozen after a warm-up (1-bit Adam's scheme, asked for with
``GraVAC(adam="moment")``): the update, the checkpoint, the ranks' agreement and the warm-up's length; the default
leaves Adam's moments where they are."""

import math

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_gravac import GraVACStrategy, RunSummary
from lightning_gravac.adaptations.adam import WARMUP_UNKNOWN_BUDGET, AdamMoments, warmup_steps
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo import TeacherRegression

from models import SimulatedLink, StopAfter, loader, trainer_kwargs, weights


def _frozen_reference(p0, grads, warmup, lr, betas, eps, decay, decoupled):
    """Adam by hand: ``warmup`` ordinary steps, then the second moment held at its bias-corrected value."""
    b1, b2 = betas
    p, m, v = p0.clone().double(), torch.zeros_like(p0).double(), torch.zeros_like(p0).double()
    held = None
    for t, raw in enumerate(grads, start=1):
        g = raw.double() if decoupled else raw.double() + decay * p
        m = b1 * m + (1 - b1) * g
        if t <= warmup:
            v = b2 * v + (1 - b2) * g * g
            held = v / (1 - b2**t)
        if decoupled:
            p = p * (1 - lr * decay)
        p = p - lr / (1 - b1**t) * m / (held.sqrt() + eps)
    return p, m, held


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam])
def test_moved_moments_step_as_adam_with_its_second_moment_held(optimizer):
    torch.manual_seed(0)
    p0 = torch.randn(50)
    grads = [torch.randn(50) * (1 + t) for t in range(8)]
    lr, betas, eps, decay, warmup = 1e-2, (0.9, 0.999), 1e-8, 0.05, 3
    param = torch.nn.Parameter(p0.clone())
    opt = optimizer([param], lr=lr, betas=betas, eps=eps, weight_decay=decay)
    moments = AdamMoments()
    assert moments.take_from_optimizers([opt], {id(param): "w"}) == ["w"]
    moments.frozen_from = warmup
    for step, g in enumerate(grads):
        grad = g.clone()
        if moments.active(step):  # one rank: what the hook sends is what arrives
            moments.own_moment_(["w"], [grad])
        param.grad = grad
        hidden = moments.step_()
        opt.step()
        moments.restore(hidden)
        assert param.grad is grad
    p, m, held = _frozen_reference(p0, grads, warmup, lr, betas, eps, decay, optimizer is torch.optim.AdamW)
    state = opt.state[param]
    assert int(state["step"]) == len(grads)
    torch.testing.assert_close(param.detach().double(), p, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(state["exp_avg"].double(), m, rtol=1e-5, atol=1e-6)  # float32, divided and multiplied
    # torch's own bias correction of the kept second moment gives the held value: an ordinary Adam state.
    torch.testing.assert_close(state["exp_avg_sq"].double() / (1 - betas[1] ** len(grads)), held, rtol=1e-5, atol=0)


def test_the_learning_rate_is_read_from_a_restored_optimizers_groups():
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([param], lr=1.0, weight_decay=0.0)
    moments = AdamMoments()
    moments.take_from_optimizers([opt], {id(param): "w"})
    param.grad = torch.ones(4)
    opt.step()  # the second moment exists: 1 everywhere
    opt.load_state_dict(opt.state_dict())  # as a checkpoint's restore does: new group dicts
    opt.param_groups[0]["lr"] = 0.5  # as a scheduler then does
    moments.frozen_from, before = 0, param.detach().clone()
    grad = torch.ones(4)
    moments.own_moment_(["w"], [grad])
    param.grad = grad
    moments.restore(moments.step_())
    # m = 0.9 x 0.1 + 0.1 x 1 = 0.19 = 1 - 0.9^2, its bias correction: the step is the new rate (1.0 if the stale one).
    torch.testing.assert_close(before - param.detach(), torch.full((4,), 0.5), rtol=1e-5, atol=0)


def test_unsupported_optimizers_keep_their_moments():
    param = torch.nn.Parameter(torch.ones(3))
    names = {id(param): "w"}
    for opt in (torch.optim.AdamW([param], amsgrad=True), torch.optim.RMSprop([param]), torch.optim.SGD([param])):
        assert AdamMoments().take_from_optimizers([opt], names) == []
    other = torch.nn.Parameter(torch.ones(3))  # a parameter the hook does not send dense (sparse): none is taken
    assert AdamMoments().take_from_optimizers([torch.optim.AdamW([param, other])], names) == []


def test_the_warm_up_follows_the_runs_length():
    assert [warmup_steps(b) for b in (1, 9, 100, 100_000)] == [1, 1, 10, 10_000]
    assert warmup_steps(math.inf) == WARMUP_UNKNOWN_BUDGET


class _AdamW(TeacherRegression):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def _fit(rank, world_size, ckpt_dir, max_steps, method):
    def run(callbacks, ckpt_path=None, stop=None):
        pl.seed_everything(0)
        model, summary = _AdamW(width=64), RunSummary()
        # GraVAC's model search on a modelled 10 Mbit/s link (an fp16 byte as dear as an fp32 one): decisions that
        # follow the bytes alone, the same in every run; Adam's moments moved, as asked.
        link = SimulatedLink(search="model", adam="moment")
        trainer = pl.Trainer(strategy=GraVACStrategy(method), callbacks=[link, summary, *callbacks],
                             max_steps=max_steps, **trainer_kwargs(world_size, enable_checkpointing=True))  # fmt: skip
        if stop:
            trainer.callbacks.append(StopAfter(stop))
        trainer.fit(model, loader(n=2048, batch_size=32), ckpt_path=ckpt_path)
        state = trainer.strategy.compression_state
        opt = trainer.optimizers[0]
        held = [opt.state[p]["exp_avg_sq"] / (1 - 0.999 ** float(opt.state[p]["step"])) for p in model.parameters()]
        return {
            "cf": [r["gravac/cf"] for r in summary.history],
            "weights": weights(model),
            "frozen_from": state.carry.get(AdamMoments).frozen_from,
            "method": state.compressor.name,
            "held": held,
        }

    # At the end of an epoch (32 steps): a checkpoint mid-epoch resumes the data loader from the epoch's start.
    every = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=32, save_top_k=-1)
    whole = run([every])
    frozen = run([], stop=whole["frozen_from"])  # the same run, stopped where the second moment froze
    resumed = run([], ckpt_path=f"{ckpt_dir}/epoch=0-step=32.ckpt")
    saved = torch.load(f"{ckpt_dir}/epoch=0-step=32.ckpt", weights_only=False)["optimizer_states"][0]
    return {"whole": whole, "frozen": frozen, "resumed": resumed, "saved": saved}


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["efsignsgd", "topk"])
def test_moments_move_after_the_warm_up_resume_bit_for_bit_and_agree_across_ranks(tmp_path, method):
    ranks = run_distributed(_fit, ckpt_dir=str(tmp_path), max_steps=48, method=method, timeout=300)
    whole = ranks[0]["whole"]
    # A tenth of the 48 steps sent whole (in fp16, which halves the bytes on this link), then the moments compressed:
    # the scaled signs at their one factor, Top-K at the factors its search chooses.
    assert whole["frozen_from"] == 5 and whole["method"] == method
    assert whole["cf"][:5] == [2.0] * 5
    if method == "efsignsgd":
        assert whole["cf"][5:] == [32.0] * 43
    else:  # the search decides on the moved moments' gains, measured from the first moved step (sent whole)
        assert whole["cf"][5] == 2.0 and all(cf in (1.0, 2.0) or cf >= 10 for cf in whole["cf"][6:])
    for rank in ranks:
        # Identical decisions and weights on every rank, and a resumed run continues bit for bit.
        assert rank["whole"]["cf"] == whole["cf"]
        for name, w in whole["weights"].items():
            assert torch.equal(rank["whole"]["weights"][name], w), name
            assert torch.equal(rank["resumed"]["weights"][name], w), name
        assert rank["resumed"]["cf"] == whole["cf"][32:]
        # The second moment stayed where the warm-up left it (bias-corrected), and moved before.
        for held, at_freeze in zip(rank["whole"]["held"], rank["frozen"]["held"], strict=True):
            torch.testing.assert_close(held, at_freeze, rtol=1e-5, atol=0)
    # The checkpoint holds AdamW's own state: its keys and the groups as configured, for a run without the strategy.
    saved = ranks[0]["saved"]
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in saved["state"].values())
    group = saved["param_groups"][0]
    assert (group["lr"], group["weight_decay"], tuple(group["betas"])) == (3e-3, 0.01, (0.9, 0.999))
    if method == "efsignsgd":  # and stock DDP resumes it as ordinary AdamW
        finite, steps = run_distributed(_stock_resume, ckpt=f"{tmp_path}/epoch=0-step=32.ckpt", timeout=300)[0]
        assert finite and steps == 40


def _default(rank, world_size):
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=GraVACStrategy(), callbacks=[StopAfter(3)], max_steps=100, **trainer_kwargs(world_size)
    )
    model = _AdamW(width=64)
    trainer.fit(model, loader())
    state = trainer.strategy.compression_state
    return state.compressor.name, state.carry.get(AdamMoments).frozen_from, weights(model)


@pytest.mark.distributed
def test_the_default_leaves_adams_moments_in_the_optimizer():
    ranks = run_distributed(_default, timeout=300)
    for method, frozen_from, w in ranks:
        assert (method, frozen_from) == ("topk", None)  # held dense or fp16: nothing compressed, nothing moved
        assert all(torch.equal(w[k], ranks[0][2][k]) for k in w)


def _stock_resume(rank, world_size, ckpt):
    pl.seed_everything(0)
    model = _AdamW(width=64)
    trainer = pl.Trainer(strategy="ddp", max_steps=40, **trainer_kwargs(world_size))
    trainer.fit(model, loader(n=2048, batch_size=32), ckpt_path=ckpt)
    return all(torch.isfinite(p).all() for p in model.parameters()), trainer.global_step
