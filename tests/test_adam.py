"""Adam-like optimizers: the default sends the gradient into the optimizer as configured (dense, fp16 or a block code
by the link), a lossy method is held dense or fp16 (said once), an explicit factor moves Adam's moments after a
warm-up, and the user can ask to compress the gradients."""

import warnings

import pytest
import pytorch_lightning as pl
import torch

from lightning_gravac import GraVAC, GraVACStrategy, RunSummary, Static, get_compressor
from lightning_gravac.launch import run_distributed
from lightning_gravac.state import CompressionState
from lightning_gravac.zoo import TeacherRegression

from models import LinkOf, StopAfter, loader, trainer_kwargs


class AdamW(TeacherRegression):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Link(GraVAC):
    """GraVAC on a modelled link: ``per_byte`` seconds a byte for fp32 (1 MB/s), ``half_ratio`` times an fp32 byte's
    cost for an fp16 byte."""

    def __init__(self, half_ratio: float, per_byte: float = 1e-6, **kwargs) -> None:
        super().__init__(**kwargs)
        self.half_ratio, self.per_byte = half_ratio, per_byte

    def measure_link(self, trainer):
        return 0.0, self.per_byte

    def measure_half(self, trainer):
        return self.half_ratio * self.per_byte, 0.0

    def compress_seconds(self, stats):
        return 0.0  # the casts cost nothing on the modelled link: the choice rests on the bytes alone

    def measure_compression(self, trainer):
        return 0.0


def _fit(rank, world_size, optimizer, controller, compressor):
    pl.seed_everything(0)
    model = AdamW(width=64) if optimizer == "adamw" else TeacherRegression(width=64, momentum=0.9)
    summary = RunSummary()
    callbacks = {
        "default": [],
        # Compressing pays on a slow link (100 kB/s; on a loopback the default sends dense).
        "compress": [_Link(half_ratio=1.0, per_byte=1e-5, adam="compress")],
        "slow-default": [_Link(half_ratio=1.0, per_byte=1e-5)],
        "static": [Static(cf=10)],
        "held-dense": [GraVAC(adam="dense")],
        "held-fp16": [GraVAC(adam="fp16")],  # held all the run: dense or fp16, said with a warning
        "slow-link": [_Link(half_ratio=1.0)],  # bytes dominate, an fp16 byte costs an fp32 one's: fp16
        "dear-fp16": [_Link(half_ratio=4.0)],  # an fp16 sum at 4x an fp32 byte (gloo on a fast link): dense
        "no-probe": [GraVAC(time_link=False, adam="fp16")],  # the link unknown: fp16 cannot be shown to pay, dense
    }[controller]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Eight steps of a long run: the factors a run admits follow its length.
        trainer = pl.Trainer(strategy=GraVACStrategy(compressor), callbacks=[*callbacks, summary, StopAfter(8)],
                             max_steps=100_000, **trainer_kwargs(world_size))  # fmt: skip
        trainer.fit(model, loader())
    said = [str(w.message) for w in caught if "second moment" in str(w.message)]
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    achieved = [r["gravac/achieved_cf"] for r in summary.history]
    return {"cf": [r["gravac/cf"] for r in summary.history], "achieved": achieved, "said": said, "weights": weights}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("optimizer", "controller", "compressor", "sent", "warned"),
    [
        # A lossy method named under GraVAC's default: held dense or fp16 by the measured link all the run, the
        # optimizer left as it is, said once.
        ("adamw", "default", "topk", {1.0, 2.0}, "dense or whole in fp16"),
        ("adamw", "held-fp16", "topk", {1.0, 2.0}, "dense or whole in fp16"),  # by the measured link, and said so
        ("adamw", "slow-link", "topk", {2.0}, "dense or whole in fp16"),  # bytes dominate: every step whole in fp16
        ("adamw", "dear-fp16", "topk", {1.0}, "dense or whole in fp16"),  # fp16's sum dearer than its saved bytes
        ("adamw", "no-probe", "topk", {1.0}, "sending dense (factor 1): the link was not measured"),
        ("adamw", "held-dense", "topk", {1.0}, "sending dense (factor 1): asked"),  # asked to hold dense
        ("adamw", "compress", "topk", None, "Prefer"),  # asked to compress: it does, with the warning
        # An explicit factor: dense through the warm-up, then Adam's moments at that factor (no warning).
        ("adamw", "static", "topk", {1.0}, None),
        ("adamw", "default", "fp16", {2.0}, None),  # a cast is safe with Adam: held at its factor, no warning
        ("sgd", "slow-default", "topk", None, None),  # SGD on a slow link: the default compresses, nothing said
    ],
)
def test_adam_like_optimizers_get_dense_fp16_or_a_warning(optimizer, controller, compressor, sent, warned):
    ranks = run_distributed(_fit, optimizer=optimizer, controller=controller, compressor=compressor, timeout=300)
    for rank in ranks:
        assert len(rank["cf"]) == 8
        if sent is None:  # compressing: some step above fp16's factor
            assert max(rank["cf"]) > 2.0, rank["cf"]
        else:
            assert set(rank["cf"]) <= sent, rank["cf"]
        for cf, achieved in zip(rank["cf"], rank["achieved"], strict=True):
            if cf == 2.0 and compressor == "topk":  # a step the hold sent whole in fp16: half the bytes, headers aside
                assert 1.95 < achieved <= 2.0, rank["achieved"]
    said = ranks[0]["said"]
    assert (len(said) == 1 and warned in said[0]) if warned else not said, said  # once a fit, saying what is sent
    assert ranks[0]["cf"] == ranks[1]["cf"]
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])  # the ranks stepped alike (fp16 steps too)


def test_the_fp16_rung_of_an_adam_fit_does_not_outlive_it():
    controller = GraVAC()  # the default: no fp16 rung under SGD
    controller.compression_state = CompressionState(get_compressor("topk"), error_feedback=True)
    module = torch.nn.Linear(4, 2)
    controller.adaptive_optimizer = True
    controller.check_rung(module)
    assert controller.fp16_rung  # the Adam hold's only factor besides dense
    controller.adaptive_optimizer = False  # the next fit, under SGD
    controller.check_rung(module)
    assert not controller.fp16_rung
    asked = GraVAC(fp16_rung=True)  # asked for: kept under SGD too
    asked.compression_state = controller.compression_state
    asked.check_rung(module)
    assert asked.fp16_rung
    held = GraVAC(adam="dense", fp16_rung=True)  # asked to hold dense under Adam: the rung is not used for the hold
    held.compression_state, held.adaptive_optimizer = controller.compression_state, True
    held.cost.timed = (0.0, 1e-6)
    held.check_rung(module)
    held.cost.half_per_byte = 1e-7  # fp16 modelled far cheaper than fp32: the hold still sends dense
    assert held.rungs and held.choose() == 1.0


class _Replay(pl.Callback):
    """The parameters as the fit starts and, every step, the gradients the optimizer is handed."""

    def __init__(self) -> None:
        self.start: list[torch.Tensor] = []
        self.grads: list[list[torch.Tensor]] = []

    def on_train_start(self, trainer, pl_module):
        self.start = [p.detach().clone() for p in pl_module.parameters()]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])


def _default_under_adamw(rank, world_size, bits_per_second, compressor):
    from lightning_gravac.strategies import default_controller

    # The default controller, its link scripted: a slow link, where fp16 and the code pay.
    default_controller._default_controller = lambda method, alone: LinkOf(bits_per_second)
    pl.seed_everything(0)
    model, replay, summary = AdamW(width=64), _Replay(), RunSummary()
    strategy = GraVACStrategy(compressor)
    trainer = pl.Trainer(strategy=strategy, callbacks=[replay, summary], max_steps=12, **trainer_kwargs(world_size))
    trainer.fit(model, loader())
    # The same steps by a fresh AdamW of the same settings, handed the same gradients.
    params = [p.clone().requires_grad_() for p in replay.start]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    for grads in replay.grads:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
    live = trainer.optimizers[0]
    return {
        "method": strategy.compressor.name,
        "cf": [r["gravac/cf"] for r in summary.history],
        "same_weights": all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True)),
        "same_state": all(
            torch.equal(optimizer.state[a][k], live.state[b][k])
            for a, b in zip(params, model.parameters(), strict=True)
            for k in ("exp_avg", "exp_avg_sq")
        ),
        "last_grads": replay.grads[-1],
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("compressor", "slow"), [(None, {2.0}), ("int8", {4.0})], ids=["default", "int8"])
def test_under_adamw_the_optimizer_steps_on_the_averaged_gradient_unchanged(compressor, slow):
    # On a slow link the default sends every step whole in fp16 and `GraVACStrategy("int8")` in int8 codes; either
    # way the optimizer's step is AdamW's own on the average that arrived: a fresh AdamW handed the same gradients ends
    # at the same weights and moments, bit for bit (a frozen second moment, or a moment moved into the hook, would
    # not).
    ranks = run_distributed(_default_under_adamw, bits_per_second=1e6, compressor=compressor, timeout=300)
    for rank in ranks:
        assert rank["method"] == (compressor or "topk")  # the default's Top-K is never sent: the hold decides
        assert set(rank["cf"]) == slow, rank["cf"]
        assert rank["same_weights"] and rank["same_state"]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["last_grads"], ranks[1]["last_grads"], strict=True))
    fast = run_distributed(_default_under_adamw, bits_per_second=1e11, compressor=compressor, timeout=300)
    for rank in fast:  # a fast link: dense once the first window has measured a step's computation (free codes before)
        assert set(rank["cf"][3:]) == {1.0} and rank["same_weights"] and rank["same_state"], rank["cf"]
