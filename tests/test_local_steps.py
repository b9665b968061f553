"""Local steps with a compressed outer update (``GraVACStrategy(local_steps=...)``), through Lightning's Trainer on two
gloo ranks: nothing sent within a round, the ranks one model at each round's end, the outer step's arithmetic, exact
resume mid-round, a non-finite inner step skipped, and the arguments checked."""

import pickle
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.precision import Precision
from torch import nn

from lightning_gravac import GraVAC, GraVACStrategy, LocalSteps, Static
from lightning_gravac.adaptations import OuterUpdate, Setup
from lightning_gravac.adaptations.outer_exchange import OuterExchange
from lightning_gravac.callbacks.gravac.rounds import choose_length, fitting_length
from lightning_gravac.compressors import get_compressor
from lightning_gravac.launch import run_distributed

from models import LinkOf, loader, trainer_kwargs


class StepData(pl.LightningModule):
    """A regression whose batch is drawn from (global step, rank), not from the loader: a run resumed mid-epoch (where
    Lightning restarts the epoch's loader) sees the batches the uninterrupted run saw. SGD with momentum 0.9; ``nan_at``
    makes rank ``nan_rank``'s loss NaN at that step, ``blow_at`` rank 1's gradient 10^4 times larger (its parameters
    thrown far off)."""

    def __init__(self, nan_at: int = -1, blow_at: int = -1, nan_rank: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.nan_at, self.blow_at, self.nan_rank = nan_at, blow_at, nan_rank
        teacher = torch.Generator().manual_seed(7)
        self.register_buffer("w", torch.randn(16, 4, generator=teacher) / 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        x = torch.randn(32, 16, generator=g)
        loss = nn.functional.mse_loss(self.net(x), torch.tanh(x @ self.w))
        if self.global_step == self.nan_at and self.global_rank == self.nan_rank:
            loss = loss * float("nan")
        if self.global_step == self.blow_at and self.global_rank == 1:
            loss = loss * 1e4
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class BagStepData(pl.LightningModule):
    """A regression on bags of token ids, drawn from (global step, rank) like ``StepData``'s: an ``EmbeddingBag`` of
    512 x 16 under a ``Linear(16, 1)``, nearly all of the parameters in the table (the default sends Top-K). SGD at
    ``lr`` 0.3, plain as the matrix's embedding bag (``momentum``: SGD's)."""

    lr = 0.3

    def __init__(self, momentum: float = 0.0) -> None:
        super().__init__()
        self.momentum = momentum
        self.bag = nn.EmbeddingBag(512, 16, mode="sum")
        nn.init.normal_(self.bag.weight, std=0.01)
        self.head = nn.Linear(16, 1)
        teacher = torch.Generator().manual_seed(7)
        self.register_buffer("w", torch.randn(512, generator=teacher))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens)).squeeze(1)

    def batch_at(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 512, (32, 8), generator=torch.Generator().manual_seed(1000 * step + rank))
        return tokens, torch.tanh(self.w[tokens].sum(1) / 8**0.5)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, target = self.batch_at(self.global_step, self.global_rank)
        loss = nn.functional.mse_loss(self(tokens), target)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class Trace(pl.Callback):
    """This rank's parameters after every optimizer step, and the loss."""

    def __init__(self) -> None:
        self.after: list[torch.Tensor] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.after.append(torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()]))
        self.losses.append(float(outputs["loss"]))


def _fit(strategy: GraVACStrategy, steps: int, model: pl.LightningModule | None = None, **kwargs: Any) -> Trace:
    trace = Trace()
    pl.seed_everything(0)
    callbacks = [trace, *kwargs.pop("callbacks", [])]
    trainer = pl.Trainer(strategy=strategy, callbacks=callbacks, max_steps=steps, **trainer_kwargs(2, **kwargs))
    trainer.fit(model or StepData(), loader(n=32768))  # 512 steps an epoch: no epoch ends a round here
    assert trainer.global_step == steps, "global_step counts inner steps"
    return trace


def _rounds(rank: int, world_size: int) -> dict[str, Any]:
    sent_whole = GraVACStrategy("none", local_steps=LocalSteps(every=4, cf=1))
    before: list[torch.Tensor] = []  # this rank's parameters as each round ends, before the outer step
    end_round = sent_whole.outer.end_round

    def recorded(**kwargs: bool) -> None:
        before.append(torch.cat([p.detach().reshape(-1).clone() for p in sent_whole.outer._params.values()]))
        end_round(**kwargs)

    sent_whole.outer.end_round = recorded  # type: ignore[method-assign]
    whole = _fit(sent_whole, 10)
    strategy = GraVACStrategy(local_steps=4)  # QSGD's 4-bit codes
    compressed = _fit(strategy, 10)
    outer = strategy.outer
    return {
        "whole": whole.after, "before": before, "compressed": compressed.after,
        "losses": compressed.losses, "bytes": outer.bytes_sent, "rounds": outer.rounds,
        "dense": sum(p.numel() * 4 for p in StepData().parameters()),
    }  # fmt: skip


@pytest.mark.distributed
def test_rounds_send_nothing_within_and_end_with_the_ranks_one_model():
    r0, r1 = run_distributed(_rounds, timeout=300)
    # Rounds end after steps 4, 8 and at the budget's last step, 10: the ranks are one model there
    # and two in between (each stepped on its own batches, nothing sent).
    same = [True if step in (4, 8, 10) else False for step in range(1, 11)]
    for run in ("whole", "compressed"):
        assert [torch.equal(a, b) for a, b in zip(r0[run], r1[run], strict=True)] == same, run
    # Sent whole at outer lr 1, the outer step is the ranks' average (post-local SGD): ``anchor - mean(anchor - x_i)``,
    # which rounds differently from ``mean(x_i)``, equal to float32's precision.
    assert len(r0["before"]) == len(r1["before"]) == 3
    for k, step in enumerate((4, 8, 10)):
        mean = (r0["before"][k] + r1["before"][k]) / 2
        torch.testing.assert_close(r0["whole"][step - 1], mean, rtol=1e-6, atol=1e-6)
        assert not torch.equal(r0["before"][k], r1["before"][k])
    # Compressed: three rounds of 4-bit codes, the last too (an unbiased code owes nothing); it trains.
    assert r0["rounds"] == 3
    assert r0["bytes"] < 3 * r0["dense"] / 6, "three rounds at about 1/8 of dense"
    assert r0["losses"][-1] < 0.7 * r0["losses"][0]


def test_outer_nesterov_step_follows_its_definition():
    # One process, nothing to average: the change is this rank's own, and the outer step's arithmetic is seen whole.
    model = nn.Linear(3, 2)
    outer = OuterUpdate()
    outer.configure(LocalSteps(every=2, cf=1, lr=0.7, momentum=0.9, nesterov=True), get_compressor("none"), False)
    outer.take_from(Setup([torch.optim.SGD(model.parameters(), lr=0.1)], {}, model))
    outer.begin_fit(0, 0, lambda: False)
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    velocity: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for _ in range(2):  # two inner "steps": the parameters move as an optimizer would move them
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g))
            outer.after_closure()  # the step steps (no gradient to skip it for)
            outer.after_step()
        assert outer.since == 0, "a round of two steps ended"
    # Replayed by the definition: v <- mu v + delta; anchor <- anchor - lr (delta + mu v).
    g = torch.Generator().manual_seed(0)
    x = {n: t.clone() for n, t in anchor.items()}
    for _ in range(3):
        for _ in range(2):
            x = {n: value + torch.randn(value.shape, generator=g) for n, value in x.items()}
        for n, value in x.items():
            delta = anchor[n] - value
            velocity[n] = delta.clone() if n not in velocity else velocity[n] * 0.9 + delta
            anchor[n] = anchor[n] - 0.7 * (delta + 0.9 * velocity[n])
        x = {n: anchor[n].clone() for n in x}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), anchor[n], rtol=1e-6, atol=1e-6)
        assert torch.equal(p.detach(), outer.anchor.kept[n])
    assert outer.rounds == 3


def test_overlap_applies_each_round_one_round_late():
    # One process: each round's change is the rank's own; the outer step at lr 0.5 lands one round late, and each
    # round continues from the anchor minus its own progress since.
    model = nn.Linear(3, 2)
    x = {n: p.detach().clone() for n, p in model.named_parameters()}
    outer = OuterUpdate()
    outer.configure(LocalSteps(every=2, cf=1, lr=0.5, overlap=True), get_compressor("none"), False)
    outer.take_from(Setup([torch.optim.SGD(model.parameters(), lr=0.1)], {}, model))
    outer.begin_fit(0, 0, lambda: False)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        for _ in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g))
            outer.after_closure()  # the step steps (no gradient to skip it for)
            outer.after_step()
        assert outer.exchange.in_flight, "the round's change is in flight"
    outer.finish()  # the fit ends: the change in flight lands, and the last round's own is sent
    assert outer.rounds == 5 and not outer.exchange.in_flight and not outer.began.kept
    # Replayed by the definition.
    g = torch.Generator().manual_seed(0)
    anchor, began, pending = dict(x), None, None
    for _ in range(4):
        for _ in range(2):
            x = {n: value + torch.randn(value.shape, generator=g) for n, value in x.items()}
        change = {n: (began or anchor)[n] - value for n, value in x.items()}
        if pending is not None:
            anchor = {n: a - 0.5 * pending[n] for n, a in anchor.items()}
        pending, x = change, {n: anchor[n] - change[n] for n in x}
        began = dict(x)
    assert began is not None and pending is not None
    anchor = {n: a - 0.5 * pending[n] for n, a in anchor.items()}
    anchor = {n: a - 0.5 * (began[n] - x[n]) for n, a in anchor.items()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), anchor[n], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("method", "residual"), [("qsgd", False), ("topk", True)])
def test_a_compressed_change_is_let_go_once_sent_unless_its_residual_holds_it(method, residual):
    # One process: what the exchange keeps while the collective runs is its layout and the gathered bytes; the change
    # stays only where error feedback makes it the residual, the codes not at all. The mean is the code decoded.
    model = nn.Linear(64, 32)
    codes, decoded = [], []

    class Spy(type(get_compressor(method))):  # type: ignore[misc]
        def compress(self, tensor, cf, *, key="", step=0):
            payload = super().compress(tensor, cf, key=key, step=step)
            codes.extend(weakref.ref(w) for w in payload.wire)
            decoded.append(self.decompress(payload))
            return payload

    exchange, params = OuterExchange(), dict(model.named_parameters())
    exchange.configure(Spy(), 8.0, error_feedback=residual)
    exchange.take_from(params, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    starts = {n: p.detach() + torch.randn(p.shape, generator=g) for n, p in params.items()}
    with torch.no_grad():  # as at a round's end
        change = weakref.ref(exchange.change(list(params), starts))
        exchange.send(list(params), whole=False, step=0)
        assert (change() is not None) == residual and codes and all(code() is None for code in codes)
        mean = exchange.take()
    assert torch.equal(torch.cat([mean[n].reshape(-1) for n in params]), decoded[0])


def _resumed(rank: int, world_size: int, ckpt_dir: str, overlap: bool) -> dict[str, Any]:
    def fit(callbacks: list[pl.Callback], ckpt_path: str | None = None) -> list[torch.Tensor]:
        trace = Trace()
        pl.seed_everything(0)
        strategy = GraVACStrategy("topk", local_steps=LocalSteps(every=4, cf=10, momentum=0.5, overlap=overlap))
        kwargs = trainer_kwargs(2, enable_checkpointing=True)
        trainer = pl.Trainer(strategy=strategy, callbacks=[Static(cf=1), trace, *callbacks], max_steps=12, **kwargs)
        trainer.fit(StepData(), loader(n=4096), ckpt_path=ckpt_path)
        return trace.after

    every_6 = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=6, save_top_k=-1)
    whole = fit([every_6])
    return {"whole": whole, "resumed": fit([], ckpt_path=f"{ckpt_dir}/epoch=0-step=6.ckpt")}


@pytest.mark.distributed
@pytest.mark.parametrize("overlap", [False, True])
def test_resume_mid_round_is_bit_for_bit(tmp_path, overlap):
    ranks = run_distributed(_resumed, timeout=300, ckpt_dir=str(tmp_path), overlap=overlap)
    # Saved after step 6, two steps into the second round: the ranks' parameters differ there, each rank's inner
    # momentum and Top-K's residual are its own, and the outer momentum is one; with overlap, the first round's
    # average is in flight (landed by the checkpoint).
    assert not torch.equal(ranks[0]["whole"][5], ranks[1]["whole"][5])
    for rank in ranks:
        assert len(rank["resumed"]) == 6
        for step, (a, b) in enumerate(zip(rank["whole"][6:], rank["resumed"], strict=True), start=7):
            assert torch.equal(a, b), f"step {step} differs from the uninterrupted run"


def _non_finite(rank: int, world_size: int) -> dict[str, Any]:
    trace = _fit(GraVACStrategy(local_steps=4), 8, model=StepData(nan_at=2))
    return {"after": trace.after}


@pytest.mark.distributed
def test_a_non_finite_inner_step_is_skipped_on_its_rank_and_nothing_is_lost():
    r0, r1 = run_distributed(_non_finite, timeout=300)
    # Rank 1's step 3 (global step 2) had a NaN loss: it kept its parameters; rank 0 stepped.
    assert torch.equal(r1["after"][2], r1["after"][1])
    assert not torch.equal(r0["after"][2], r0["after"][1])
    for rank in (r0, r1):
        assert all(bool(torch.isfinite(p).all()) for p in rank["after"])
    assert torch.equal(r0["after"][3], r1["after"][3]) and torch.equal(r0["after"][7], r1["after"][7])


def _skipped_and_resumed(rank: int, world_size: int, ckpt_dir: str, nan_rank: int) -> dict[str, Any]:
    def fit(callbacks: list[pl.Callback], ckpt_path: str | None = None) -> list[torch.Tensor]:
        trace = Trace()
        pl.seed_everything(0)
        kwargs = trainer_kwargs(2, enable_checkpointing=True)
        trainer = pl.Trainer(
            strategy=GraVACStrategy(local_steps=4), callbacks=[trace, *callbacks], max_steps=6, **kwargs
        )
        trainer.fit(StepData(nan_at=0, nan_rank=nan_rank), loader(n=4096), ckpt_path=ckpt_path)
        return trace.after

    whole = fit([ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1)])
    return {"whole": whole, "resumed": fit([], ckpt_path=f"{ckpt_dir}/epoch=0-step=1.ckpt")}


@pytest.mark.distributed
@pytest.mark.parametrize("nan_rank", [0, 1])
def test_a_checkpoint_where_one_rank_has_no_optimizer_state_yet_saves_and_resumes_bit_for_bit(tmp_path, nan_rank):
    # One rank skipped the first step (NaN): saved after it, the other has SGD's momentum buffers and it has none. The
    # gather of every rank's state must not assume the same slots on each; resumed, a rank that had none must not
    # keep the buffers Lightning restored from rank 0's optimizer, and rank 1 must get its own where rank 0 had none.
    ranks = run_distributed(_skipped_and_resumed, timeout=300, ckpt_dir=str(tmp_path), nan_rank=nan_rank)
    for rank in ranks:
        assert len(rank["resumed"]) == 5
        for step, (a, b) in enumerate(zip(rank["whole"][1:], rank["resumed"], strict=True), start=2):
            assert torch.equal(a, b), f"step {step} differs from the uninterrupted run"


class Momenta(pl.Callback):
    """This rank's SGD momentum buffers after every optimizer step."""

    def __init__(self) -> None:
        self.after: list[torch.Tensor | None] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        state = trainer.optimizers[0].state
        buffers = [state[p].get("momentum_buffer") for p in pl_module.parameters() if p in state]
        self.after.append(torch.cat([b.reshape(-1).clone() for b in buffers]) if buffers else None)


class ClosureFirst(Precision):
    """Runs the step's closure itself, then the optimizer's step without one: as fp16's gradient scaler does."""

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure()
        return optimizer.step(**kwargs)


def _blown(rank: int, world_size: int, guard: float | None, closure_first: bool = False) -> dict[str, Any]:
    momenta = Momenta()
    strategy = GraVACStrategy(local_steps=LocalSteps(every=4, guard=guard, cooldown=3))
    plugins = [ClosureFirst()] if closure_first else []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = _fit(strategy, 14, model=StepData(blow_at=5), callbacks=[momenta], plugins=plugins)
    said = [str(w.message) for w in caught if "Local steps diverged" in str(w.message)]
    return {"after": trace.after, "momenta": momenta.after, "triggers": strategy.outer.guard.triggers, "said": said}


@pytest.mark.distributed
@pytest.mark.parametrize("closure_first", [False, True], ids=["optimizer-runs-closure", "precision-runs-closure"])
def test_a_round_that_diverges_is_undone_and_the_next_steps_are_synchronous(closure_first):
    r0, r1 = run_distributed(_blown, timeout=300, guard=4.0, closure_first=closure_first)
    # Told by the ranks' mean training loss, whoever runs the step's closure (under fp16's scaler, the precision
    # plugin does, before the optimizer's step).
    assert len(r0["said"]) == 1 and "mean training loss" in r0["said"][0]
    # Rank 1 is thrown off at step 6 (global step 5), in the second round (steps 5-8): the round's mean loss is far
    # above the first round's, so the round is undone. Every rank is back where the round began (the parameters after
    # step 4) with its own momentum as it was then, as though steps 5-8 had not been taken.
    assert r0["triggers"] == r1["triggers"] == 1
    for rank in (r0, r1):
        assert torch.equal(rank["after"][7], rank["after"][3])
        assert torch.equal(rank["momenta"][7], rank["momenta"][3])
        assert all(bool(torch.isfinite(p).all()) for p in rank["after"])
    assert not torch.equal(r0["momenta"][3], r1["momenta"][3]), "each rank's momentum is its own"
    # Steps 9-11 are synchronous: the ranks are one model after each; the rounds go on from step 12 (12-14 the last).
    same = [torch.equal(a, b) for a, b in zip(r0["after"], r1["after"], strict=True)]
    assert same == [step in (4, 8, 9, 10, 11, 14) for step in range(1, 15)]
    if closure_first:
        return
    # Without the guard the blown-up round is averaged in: the ranks' model lands far off, where no round moves it any
    # more, and the run stops there on both ranks (where it ended its fit with those weights frozen).
    with pytest.raises(RuntimeError, match=r"(?s)rank 0.*LocalStepsDiverged: .*rank 1.*LocalStepsDiverged: "):
        run_distributed(_blown, timeout=300, guard=None)


def _blown_and_resumed(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    def fit(callbacks: list[pl.Callback], ckpt_path: str | None = None) -> list[torch.Tensor]:
        trace = Trace()
        pl.seed_everything(0)
        strategy = GraVACStrategy("topk", local_steps=LocalSteps(every=4, cf=10, momentum=0.5, cooldown=5))
        kwargs = trainer_kwargs(2, enable_checkpointing=True)
        trainer = pl.Trainer(strategy=strategy, callbacks=[Static(cf=1), trace, *callbacks], max_steps=16, **kwargs)
        trainer.fit(StepData(blow_at=6), loader(n=4096), ckpt_path=ckpt_path)
        return trace.after

    every_6 = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=6, save_top_k=-1)
    whole = fit([every_6])
    return {
        "whole": whole,
        "at_6": fit([], ckpt_path=f"{ckpt_dir}/epoch=0-step=6.ckpt"),
        "at_12": fit([], ckpt_path=f"{ckpt_dir}/epoch=0-step=12.ckpt"),
    }


@pytest.mark.distributed
def test_a_run_resumed_before_a_round_is_undone_or_within_the_hold_after_it_is_bit_for_bit(tmp_path):
    ranks = run_distributed(_blown_and_resumed, timeout=300, ckpt_dir=str(tmp_path))
    # Resumed after step 6, two steps into the round that rank 1 throws off at step 7: the round is undone to each
    # rank's momentum as the round began, restored from the checkpoint. Resumed after step 12: within the synchronous
    # steps that follow (9-13), with the outer momentum and Top-K's residual dropped.
    r0, r1 = ranks
    assert torch.equal(r0["whole"][7], r0["whole"][3]), "the round was undone"
    assert torch.equal(r0["whole"][11], r1["whole"][11]) and not torch.equal(r0["whole"][14], r1["whole"][14])
    for rank in ranks:
        for at in (6, 12):
            resumed = rank[f"at_{at}"]
            assert len(resumed) == 16 - at
            for step, (a, b) in enumerate(zip(rank["whole"][at:], resumed, strict=True), start=at + 1):
                assert torch.equal(a, b), f"resumed after step {at}: step {step} differs from the uninterrupted run"


def test_local_steps_arguments_are_checked():
    with pytest.raises(ValueError, match="not both"):
        GraVACStrategy(local_steps=4, model_averaging_period=4)
    with pytest.raises(ValueError, match=r"`LocalSteps.every` must be a whole number >= 1, got 0"):
        GraVACStrategy(local_steps=0)
    with pytest.raises(ValueError, match=r"`LocalSteps.momentum` must be in \[0, 1\)"):
        LocalSteps(momentum=1.0)
    with pytest.raises(ValueError, match=r"`LocalSteps.guard` must be a finite number > 1 or None, got 1"):
        LocalSteps(guard=1)
    with pytest.raises(ValueError, match=r"`LocalSteps.cooldown` must be a whole number >= 1, got 0"):
        LocalSteps(cooldown=0)
    with pytest.raises(ValueError, match="one-round method; 'powersgd'"):
        GraVACStrategy("powersgd", local_steps=4)
    with pytest.raises(ValueError, match="one-round method; 'dgc'"):
        GraVACStrategy("dgc", local_steps=4)
    strategy = GraVACStrategy(local_steps=8)
    assert strategy.compressor.name == "qsgd" and not strategy.compression_state.error_feedback
    assert strategy.outer.config == LocalSteps(every=8)
    assert GraVACStrategy("topk", local_steps=8).compression_state.error_feedback
    assert not GraVACStrategy("topk").outer, "inactive without local steps"
    assert isinstance(strategy.compression_state.carry.get(OuterUpdate), OuterUpdate)
    assert pickle.loads(pickle.dumps(strategy)).outer.config == LocalSteps(every=8), "ddp_spawn pickles it"


def test_the_link_and_the_budget_change_the_choice_as_the_rule_says():
    # 10 ms of computation; every-step sending predicted at 15 ms; a round's communication 5.4 ms.
    assert choose_length(0.010, 0.015, 0.0054, 1000) == 8, "the shortest round within a tenth of a step"
    assert choose_length(0.010, 0.015, 0.0054, 56) == 8, "the budget holds 7 rounds of 8"
    assert choose_length(0.010, 0.015, 0.0054, 55) == 4, "the budget holds 7 rounds of 4, not of 8"
    assert choose_length(0.010, 0.015, 0.0054, 27) is None, "not 7 rounds of even 4 steps"
    assert choose_length(0.010, 0.015, 0.0300, 1000) == 32, "the shortest round within a tenth of a step"
    assert choose_length(0.010, 0.015, 0.0300, 223) == 16, "the budget holds 7 rounds of 16, not of 32"
    assert choose_length(0.010, 0.015, 0.1000, 1000) == 64, "no round fits: the longest allowed"
    assert choose_length(0.010, 0.015, 0.1000, 447) == 32, "the budget holds 7 rounds of 32, not of 64"
    # Chosen again after the first round: the rounds left and the one done make 7.
    assert fitting_length(0.010, 0.0054, 48, done=1) == 8 and fitting_length(0.010, 0.0054, 47, done=1) == 4
    assert fitting_length(0.001, 0.0054, 96, done=1) == 16, "a tenth of 1 ms: no round fits, the longest allowed"
    # A fast link: sending every step costs 5% over the computation; local steps cannot save a tenth of it.
    assert choose_length(0.010, 0.0105, 0.0001, 1000) is None


class WideBag(BagStepData):
    """``BagStepData`` whose table has 1024 rows, its batches drawing from the first 512: a round of two steps changes
    about 63% of those on each rank, and none of the others."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(1024, 16, mode="sum")
        nn.init.normal_(self.bag.weight, std=0.01)


def _tables_by_rows(rank: int, world_size: int) -> dict[tuple[str, bool], dict[str, Any]]:
    out = {}
    for code, cf in (("fp16", 2), ("qsgd", 8)):
        for rows in (True, False):
            pl.seed_everything(0)
            model = WideBag()
            initial = model.bag.weight[512:].detach().clone()
            strategy = GraVACStrategy(code, local_steps=LocalSteps(every=2, cf=cf), embedding_rows=rows)
            trace = _fit(strategy, 9, model)
            out[(code, rows)] = {"after": trace.after, "bytes": strategy.outer.bytes_sent, "losses": trace.losses,
                                 "untouched": torch.equal(model.bag.weight[512:], initial)}  # fmt: skip
    return out


@pytest.mark.distributed
def test_a_compressed_round_sends_a_table_by_the_rows_some_rank_changed():
    ranks = run_distributed(_tables_by_rows, timeout=300)
    for rank in ranks:
        # fp16 codes each entry alone (with error feedback): by rows or whole, every step's parameters are the same
        # bits, and the rows sent are about half the table's.
        by_rows, whole = rank[("fp16", True)], rank[("fp16", False)]
        for step, (a, b) in enumerate(zip(by_rows["after"], whole["after"], strict=True)):
            assert torch.equal(a, b), f"step {step}: the rows sent differ from the whole table"
        assert by_rows["bytes"] < 0.75 * whole["bytes"]
        qsgd = rank[("qsgd", True)]
        assert qsgd["bytes"] < 0.75 * rank[("qsgd", False)]["bytes"]
        assert qsgd["untouched"] and by_rows["untouched"], "rows no batch looks up stay where they began"
        assert sum(qsgd["losses"][-3:]) < sum(qsgd["losses"][:3])
    for step in (2, 4, 6, 8, 9):  # the ranks are one model after each round
        assert torch.equal(ranks[0][("qsgd", True)]["after"][step - 1], ranks[1][("qsgd", True)]["after"][step - 1])


class SlowFirstStep(LinkOf):
    """The scripted link, the fit's first step 1 s slower (allocations, warm-up): it bounds a step's computation only
    loosely from above."""

    def step_seconds(self, stats: Any) -> float:
        return super().step_seconds(stats) + (1.0 if self.window.steps == 1 else 0.0)


def _default_on_a_scripted_link(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_gravac.strategies import default_controller

    out: dict[str, Any] = {}
    runs = (("slow", LinkOf, 1e6, 200), ("short", LinkOf, 1e6, 20), ("fast", LinkOf, 1e10, 200),
            ("warm-up", SlowFirstStep, 1e6, 80))  # fmt: skip
    for name, link, bits_per_second, steps in runs:
        # The zero-argument default, its controller's link and step times scripted (`LinkOf`).
        default_controller._default_controller = lambda method, alone, k=link, b=bits_per_second: k(b)
        strategy = GraVACStrategy()
        trace = _fit(strategy, steps)
        controller = next(c for c in strategy.lightning_module.trainer.callbacks if isinstance(c, LinkOf))
        out[name] = {
            "method": strategy.compressor.name, "every": controller.rounds.every, "start": controller.rounds.start,
            "rounds": strategy.outer.rounds, "after": trace.after, "losses": trace.losses,
            "timed": controller.rounds_timed,
        }  # fmt: skip
    return out


@pytest.mark.distributed
def test_the_default_switches_to_local_steps_where_the_link_and_the_budget_say():
    r0, r1 = run_distributed(_default_on_a_scripted_link, timeout=600)
    for name in ("slow", "short", "fast", "warm-up"):
        for key in ("method", "every", "start", "rounds"):
            assert r0[name][key] == r1[name][key], (name, key)  # every rank decides alike
        assert r0[name]["method"] == "qsgd"
    slow = r0["slow"]
    # 1 Mbit/s, 10 ms of computation: rounds of 8 from step 1, once the first step bounds a step's computation.
    assert (slow["every"], slow["start"]) == (8, 1)
    assert slow["rounds"] >= 24
    for step in range(1 + 8, 200, 8):  # the ranks are one model after each round, and two within
        assert torch.equal(r0["slow"]["after"][step - 1], r1["slow"]["after"][step - 1]), step
        assert not torch.equal(r0["slow"]["after"][step - 5], r1["slow"]["after"][step - 5]), step
    assert slow["losses"][-1] < 0.5 * slow["losses"][0]
    assert r0["short"]["every"] == 0, "a budget of 20 steps holds no 7 rounds"
    assert r0["fast"]["every"] == 0, "on a fast link sending every step costs too little to save a tenth"
    # A round's own work is timed once where rounds could pay, never where they could not whatever it took.
    assert (r0["slow"]["timed"], r0["warm-up"]["timed"], r0["short"]["timed"], r0["fast"]["timed"]) == (1, 1, 0, 0)
    # A first step of 1 s bounds the computation too loosely for rounds to pay; the first window (3 steps) measures it.
    assert (r0["warm-up"]["every"], r0["warm-up"]["start"]) == (8, 3)


class NormedStepData(StepData):
    """``StepData`` behind a batch norm of its inputs; what running mean each step's forward saw, after DDP's
    pre-forward."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(self.norm.running_mean.clone())
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        x = torch.randn(32, 16, generator=g) + self.global_rank  # the ranks' batches differ in their mean
        return nn.functional.mse_loss(self.net(self.norm(x)), torch.tanh(x @ self.w))


class RunningMeans(pl.Callback):
    """This rank's batch norm running mean after every step."""

    def __init__(self) -> None:
        self.after: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append(pl_module.norm.running_mean.clone())


def _default_with_buffers(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_gravac.strategies import default_controller

    default_controller._default_controller = lambda method, alone: LinkOf(1e6)
    model, means = NormedStepData(), RunningMeans()
    strategy = GraVACStrategy()
    _fit(strategy, 64, model=model, callbacks=[means])
    controller = next(c for c in model.trainer.callbacks if isinstance(c, GraVAC))
    return {"seen": model.seen, "after": means.after, "rounds": (controller.rounds.every, controller.rounds.start)}


@pytest.mark.distributed
def test_local_steps_the_default_starts_leave_each_ranks_buffers_its_own_within_a_round():
    r0, r1 = run_distributed(_default_with_buffers, timeout=300)
    assert r0["rounds"] == (8, 1)
    # From the first local step on, each forward sees the running mean this rank's last step left (averaged at each
    # round's end): DDP no longer broadcasts rank 0's buffers at every forward, a collective a step.
    for rank in (r0, r1):
        for step in range(2, 64):
            assert torch.equal(rank["seen"][step], rank["after"][step - 1]), step
    assert not torch.equal(r0["after"][4], r1["after"][4]), "within a round each rank's statistics are its own"
    assert torch.equal(r0["after"][8], r1["after"][8]), "averaged at the round's end"


class Owed(pl.Callback):
    """How many residuals error feedback holds before each step, and at step ``at`` (the first local one) what plain
    SGD makes of this rank's own gradient plus what it owed, against what the step did."""

    def __init__(self, at: int) -> None:
        self.at, self.held = at, []
        self.expected: dict[str, torch.Tensor] = {}
        self.got: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        residuals = trainer.strategy.compression_state.carry.residuals
        self.held.append(len(residuals))
        if trainer.global_step == self.at:
            params = {n: p.detach().clone().requires_grad_() for n, p in pl_module.named_parameters()}
            tokens, target = pl_module.batch_at(self.at, trainer.global_rank)
            out = torch.func.functional_call(pl_module, params, (tokens,))
            grads = torch.autograd.grad(nn.functional.mse_loss(out, target), list(params.values()))
            for (name, p), g in zip(params.items(), grads, strict=True):
                owed = residuals.get(name)
                self.expected[name] = p.detach() - pl_module.lr * (g if owed is None else g + owed.view_as(g))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.at + 1:
            self.got = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def _topk_default_on_a_scripted_link(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_gravac.strategies import default_controller

    default_controller._default_controller = lambda method, alone: LinkOf(1e6, cf_max=20)
    strategy, owed = GraVACStrategy(), Owed(at=1)
    pl.seed_everything(0)  # the model's initial values: the same every run
    trace = _fit(strategy, 120, BagStepData(), callbacks=[owed])
    controller = next(c for c in strategy.lightning_module.trainer.callbacks if isinstance(c, GraVAC))
    return {
        "method": strategy.compressor.name, "outer": strategy.outer.compressor.name, "every": controller.rounds.every,
        "start": controller.rounds.start, "held": owed.held, "expected": owed.expected, "got": owed.got,
        "left": len(strategy.compression_state.carry.residuals), "after": trace.after, "losses": trace.losses,
    }  # fmt: skip


@pytest.mark.distributed
def test_the_topk_default_switches_to_rounds_in_4_bit_block_codes_and_what_topk_owed_lands():
    ranks = run_distributed(_topk_default_on_a_scripted_link, timeout=300)
    for key in ("method", "outer", "every", "start"):
        assert ranks[0][key] == ranks[1][key], key  # every rank decides alike
    r0 = ranks[0]
    # Mostly an embedding table under SGD: Top-K every step, then rounds whose change is sent in 4-bit block codes.
    assert (r0["method"], r0["outer"]) == ("topk", "int4")
    # 1 Mbit/s, 10 ms of computation, Top-K at cf 20 at most: after the first step, rounds of 16 from step 1.
    assert (r0["every"], r0["start"]) == (16, 1)
    for rank in ranks:
        assert rank["held"][1] > 0, "Top-K's error feedback held residuals before the switch"
        assert max(rank["held"][2:]) == 0 and rank["left"] == 0, "the first local step took them all"
        for name, expected in rank["expected"].items():  # the step applied this rank's gradient plus what it owed
            torch.testing.assert_close(rank["got"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
    for step in range(1 + 16, 120, 16):  # the ranks are one model after each round, and two within
        assert torch.equal(r0["after"][step - 1], ranks[1]["after"][step - 1]), step
        assert not torch.equal(r0["after"][step - 9], ranks[1]["after"][step - 9]), step
    assert sum(r0["losses"][-10:]) < 0.5 * sum(r0["losses"][:10])


class SlowBeforeTheSwitch(LinkOf):
    """The scripted link, its steps before local steps 50 ms slower than the model predicts (a compressed step's
    overheads): the computation estimated from them is 6x the 10 ms an inner step then measures."""

    def step_seconds(self, stats: Any) -> float:
        return super().step_seconds(stats) + (0.0 if self.rounds.every else 0.05)


def _default_measuring_its_first_round(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_gravac.strategies import default_controller

    default_controller._default_controller = lambda method, alone: SlowBeforeTheSwitch(1e6)
    strategy = GraVACStrategy()
    trace = _fit(strategy, 60)
    controller = next(c for c in strategy.lightning_module.trainer.callbacks if isinstance(c, GraVAC))
    return {"every": controller.rounds.every, "start": controller.rounds.start, "rounds": strategy.outer.rounds,
            "measured": controller.rounds.measured, "after": trace.after}  # fmt: skip


@pytest.mark.distributed
def test_the_first_round_measures_a_step_and_the_round_length_is_chosen_again():
    r0, r1 = run_distributed(_default_measuring_its_first_round, timeout=300)
    for key in ("every", "start", "rounds", "measured"):
        assert r0[key] == r1[key], key  # every rank decides alike
    # Estimated at 60 ms a step, a round of 4 adds a tenth of it; measured at 10 ms, the rounds become 8 steps long
    # after the first: rounds end after steps 5, 13, 21, ... (1 + 4, then 8 at a time).
    assert (r0["every"], r0["start"], r0["measured"]) == (8, 1, True)
    assert r0["rounds"] == 1 + (60 - 5) // 8 + 1  # the fit's last steps end one more round
    for step in (5, 13, 21, 29, 37, 45, 53):
        assert torch.equal(r0["after"][step - 1], r1["after"][step - 1]), step
    for step in (4, 9, 17, 25):
        assert not torch.equal(r0["after"][step - 1], r1["after"][step - 1]), step


def _whole_and_resumed(ckpt_dir: str, make: Callable[[], pl.LightningModule], at: int) -> dict[str, Any]:
    """The default over 60 steps, checkpointed after step ``at``, then resumed from there: each run's parameters after
    every step and the round length it ended with."""

    def fit(callbacks: list[pl.Callback], ckpt_path: str | None = None) -> tuple[list[torch.Tensor], int, int]:
        trace = Trace()
        pl.seed_everything(0)
        strategy = GraVACStrategy()
        kwargs = trainer_kwargs(2, enable_checkpointing=True)
        trainer = pl.Trainer(strategy=strategy, callbacks=[trace, *callbacks], max_steps=60, **kwargs)
        trainer.fit(make(), loader(n=32768), ckpt_path=ckpt_path)
        controller = next(c for c in trainer.callbacks if isinstance(c, GraVAC))
        return trace.after, strategy.outer.config.every if strategy.outer.config else 0, controller.rounds.start

    whole, every, start = fit([ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=at, save_top_k=-1)])
    resumed, resumed_every, resumed_start = fit([], ckpt_path=f"{ckpt_dir}/epoch=0-step={at}.ckpt")
    return {"whole": whole, "resumed": resumed, "every": every, "resumed_every": resumed_every, "start": start,
            "resumed_start": resumed_start}  # fmt: skip


def _resumed_on(rank: int, world_size: int, ckpt_dir: str, link: type[LinkOf], at: int) -> dict[str, Any]:
    """:func:`_whole_and_resumed` of the default on the scripted 1 Mbit/s ``link``, checkpointed after step ``at``."""
    from lightning_gravac.strategies import default_controller

    default_controller._default_controller = lambda method, alone: link(1e6)
    return _whole_and_resumed(ckpt_dir, StepData, at=at)


@pytest.mark.distributed
def test_a_run_resumed_within_the_first_round_chooses_its_length_again_alike(tmp_path):
    # Saved after step 3: two local steps into the first round of 4 (from step 1), before it measured a step.
    ranks = run_distributed(_resumed_on, timeout=300, ckpt_dir=str(tmp_path), link=SlowBeforeTheSwitch, at=3)
    for rank in ranks:
        assert rank["every"] == rank["resumed_every"] == 8
        assert len(rank["resumed"]) == 57
        for step, (a, b) in enumerate(zip(rank["whole"][3:], rank["resumed"], strict=True), start=4):
            assert torch.equal(a, b), f"step {step} differs from the uninterrupted run"


@pytest.mark.distributed
def test_a_run_resumed_after_its_first_step_switches_where_the_uninterrupted_run_does(tmp_path):
    # The fit's first step took 1 s (its warm-up): no switch after it, rounds from the first window's end (step 3).
    # Resumed after step 1, the resumed fit's own first step is not the fit's first: it does not decide again. (The
    # first window's own factors follow the resumed fit's first step, which is not checkpointed: not bit for bit.)
    for rank in run_distributed(_resumed_on, timeout=300, ckpt_dir=str(tmp_path), link=SlowFirstStep, at=1):
        assert (rank["every"], rank["start"]) == (rank["resumed_every"], rank["resumed_start"]) == (8, 3)


def _topk_default_with_momentum(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_gravac.strategies import default_controller

    default_controller._default_controller = lambda method, alone: LinkOf(1e6, cf_max=20)
    strategy = GraVACStrategy()
    pl.seed_everything(0)
    _fit(strategy, 40, BagStepData(momentum=0.9))
    controller = next(c for c in strategy.lightning_module.trainer.callbacks if isinstance(c, GraVAC))
    return {"method": strategy.compressor.name, "moved": strategy.compression_state.carry.moves_optimizer_state,
            "allowed": controller.rounds.allowed, "every": controller.rounds.every}  # fmt: skip


@pytest.mark.distributed
def test_the_topk_default_keeps_sending_every_step_where_sgd_momentum_moved_into_the_hook():
    # The momentum lives in the hook (momentum correction): local steps would step without it. On the link where
    # the plain-SGD bag switches at step 3, this one goes on sending every step.
    for rank in run_distributed(_topk_default_with_momentum, timeout=300):
        assert rank == {"method": "topk", "moved": True, "allowed": False, "every": 0}


def _default_resumed(rank: int, world_size: int, ckpt_dir: str, bag: bool) -> dict[str, Any]:
    from lightning_gravac.strategies import default_controller

    # The bag: Top-K's factor held to 20 at most, so that sending every step costs more than rounds on this link.
    default_controller._default_controller = lambda method, alone: LinkOf(1e6, **({"cf_max": 20} if bag else {}))
    return _whole_and_resumed(ckpt_dir, BagStepData if bag else StepData, at=30)


@pytest.mark.distributed
@pytest.mark.parametrize("bag", [False, True], ids=["qsgd", "topk"])
def test_the_defaults_local_steps_resume_mid_round_bit_for_bit(tmp_path, bag):
    ranks = run_distributed(_default_resumed, timeout=300, ckpt_dir=str(tmp_path), bag=bag)
    for rank in ranks:
        # A budget of 60 steps holds 7 rounds of 8 (from step 3, ending at 11, 19, 27, 35...): the checkpoint after
        # step 30 is mid-round.
        assert rank["every"] == rank["resumed_every"] == 8
        assert len(rank["resumed"]) == 30
        for step, (a, b) in enumerate(zip(rank["whole"][30:], rank["resumed"], strict=True), start=31):
            assert torch.equal(a, b), f"step {step} differs from the uninterrupted run"
    assert not torch.equal(ranks[0]["whole"][29], ranks[1]["whole"][29])
