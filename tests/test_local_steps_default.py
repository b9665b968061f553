"""The zero-argument default's switch to local steps on a scripted link, through Lightning's Trainer on two gloo
ranks: where the link and the budget say, with each rank's buffers its own, what Top-K owed landing, the round length
chosen again once measured, and resumed runs that decide as the uninterrupted ones did."""

from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from local_steps_runs import BagStepData, SlowBeforeTheSwitch, StepData, Trace, _fit
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn

from lightning_gravac import GraVAC, GraVACStrategy
from lightning_gravac.launch import run_distributed

from models import LinkOf, loader, trainer_kwargs


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
    # Mostly an embedding table under SGD: Top-K every step, then rounds whose change is sent in 4-bit block codes (a
    # 120-step budget: rounds of 32 do not fit 7 times).
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
