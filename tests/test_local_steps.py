"""Local steps with a compressed outer update (``GraVACStrategy(local_steps=...)``), through Lightning's Trainer on two
gloo ranks: nothing sent within a round, the ranks one model at each round's end, the outer step's arithmetic, exact
resume mid-round, the arguments checked, the rule that chooses a round's length, and a table sent by the rows that
changed."""

import pickle
import weakref
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from local_steps_runs import BagStepData, StepData, Trace, _fit
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from lightning_gravac import GraVACStrategy, LocalSteps, Static
from lightning_gravac.adaptations import OuterUpdate, Setup
from lightning_gravac.adaptations.outer_exchange import OuterExchange
from lightning_gravac.callbacks.gravac.rounds import choose_length, fitting_length
from lightning_gravac.compressors import get_compressor
from lightning_gravac.launch import run_distributed

from models import loader, trainer_kwargs


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
