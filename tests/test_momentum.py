"""Momentum correction: the optimizer's SGD momentum moved into the hook, before compression."""

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins import MixedPrecision
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_gravac import GraVACStrategy, Static
from lightning_gravac.adaptations.momentum import MomentumCorrection
from lightning_gravac.launch import run_distributed

from models import Cycling, FaultyRegression, Regression, loader, regression_data, trainer_kwargs, weights


def _fit(strategy, controllers, steps: int, **sgd) -> tuple[Regression, pl.Trainer]:
    pl.seed_everything(0)
    model = Regression(**sgd)
    trainer = pl.Trainer(strategy=strategy, callbacks=controllers, max_steps=steps, **trainer_kwargs(2))
    trainer.fit(model, DataLoader(regression_data(4096, seed=0), batch_size=32, shuffle=True))
    return model, trainer


SGD_SETTINGS = [
    pytest.param({"momentum": 0.9}, id="momentum"),
    pytest.param({"momentum": 0.9, "nesterov": True}, id="nesterov"),
    pytest.param({"momentum": 0.8, "dampening": 0.1, "weight_decay": 1e-3}, id="dampening-weight-decay"),
]


def _cf1_vs_stock(rank, world_size, sgd, granularity):
    stock, _ = _fit(DDPStrategy(), [], 12, **sgd)
    ours, trainer = _fit(GraVACStrategy("topk", granularity=granularity), [Static(cf=1)], 12, **sgd)
    group = trainer.optimizers[0].param_groups[0]
    settings = trainer.strategy.compression_state.carry.get(MomentumCorrection).settings
    moved = (group["momentum"], group["weight_decay"], len(settings))
    return weights(stock), weights(ours), moved


@pytest.mark.distributed
@pytest.mark.parametrize("sgd", SGD_SETTINGS)
@pytest.mark.parametrize("granularity", ["layer", "bucket"])
def test_at_cf1_the_moved_momentum_equals_stock_ddp_with_sgd_momentum_bit_for_bit(sgd, granularity):
    for stock, ours, moved in run_distributed(_cf1_vs_stock, sgd=sgd, granularity=granularity):
        assert moved == (0.0, 0.0, 6), "the optimizer's momentum and weight decay moved into the hook"
        for name in stock:
            assert torch.equal(stock[name], ours[name]), name


def _scaled_nan_vs_stock(rank, world_size):
    out = []
    for strategy, controllers in [(DDPStrategy(), []), (GraVACStrategy("topk"), [Static(cf=1)])]:
        pl.seed_everything(0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        model = FaultyRegression(fault="nan", at_step=5, width=64, lr=0.05, momentum=0.9)
        trainer = pl.Trainer(
            strategy=strategy, callbacks=controllers, max_steps=10,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], **trainer_kwargs(world_size),
        )  # fmt: skip
        trainer.fit(model, loader())
        out.append((weights(model), scaler.get_scale()))
    return out


@pytest.mark.distributed
def test_under_a_gradient_scaler_the_optimizer_keeps_its_momentum_and_skipped_steps_match_stock():
    # A scaler changes the scale the hook's gradients carry (halved here at the NaN step): momentum correction stays
    # off, and cf 1 is stock DDP + SGD momentum bit for bit, the skipped step included.
    for (stock, stock_scale), (ours, our_scale) in run_distributed(_scaled_nan_vs_stock):
        assert stock_scale == our_scale == 2.0**7  # one skipped step in both
        for name in stock:
            assert torch.equal(stock[name], ours[name]), name


def _table(rank, world_size, steps):
    test = regression_data(2048, seed=1)

    def loss(model):
        with torch.no_grad():
            return nn.functional.mse_loss(model(test.tensors[0]), test.tensors[1]).item()

    rows = {"dense": _fit(DDPStrategy(), [], steps, momentum=0.9)[0]}
    for cf in (10, 100):
        rows[f"topk{cf}"] = _fit(GraVACStrategy("topk"), [Static(cf=cf)], steps, momentum=0.9)[0]
        off = GraVACStrategy("topk", momentum_correction=False)
        rows[f"topk{cf}-uncorrected"] = _fit(off, [Static(cf=cf)], steps, momentum=0.9)[0]
    rows["cycling"] = _fit(GraVACStrategy("topk"), [Cycling(factors=(10, 1, 100, 1), every=7)], steps, momentum=0.9)[0]
    return {name: (loss(model), weights(model)) for name, model in rows.items()}


@pytest.mark.distributed
@pytest.mark.slow
def test_topk_with_sgd_momentum_learns_like_dense_once_the_momentum_is_corrected():
    ranks = run_distributed(_table, timeout=240, steps=150)
    losses = {name: loss for name, (loss, _) in ranks[0].items()}
    dense = losses["dense"]
    assert losses["topk10"] < 1.5 * dense, losses
    assert losses["topk100"] < 1.5 * dense, losses
    assert losses["cycling"] < 1.5 * dense, losses  # dense and compressed steps alternating
    # What the correction fixes: with the optimizer's momentum after error-fed Top-K, cf 100 ends at 3.6x dense's
    # loss here (measured 0.144 against 0.040; corrected 0.048).
    assert losses["topk100-uncorrected"] > 2 * losses["topk100"], losses
    for name, (_, w) in ranks[0].items():
        assert all(torch.equal(w[k], ranks[1][name][1][k]) for k in w), name


def test_buffers_are_pending_until_the_step_is_known_finite_and_round_trip():
    correction = MomentumCorrection()
    p = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.5)
    assert correction.take_from_optimizer(optimizer, {id(p): "w"}) == ["w"]
    assert optimizer.param_groups[0]["momentum"] == 0 and optimizer.param_groups[0]["weight_decay"] == 0
    grad = torch.tensor([1.0, 2.0, 3.0])
    correction.own_direction_(["w"], [grad], [p])
    assert torch.equal(grad, torch.tensor([1.5, 2.5, 3.5]))  # first step: the buffer is g + wd p
    correction.buffers.discard(["w"])  # a non-finite step: nothing kept
    assert correction.state_dict() == {}
    correction.own_direction_(["w"], [grad.clone()], [p])
    correction.buffers.commit(["w"])
    grad2 = torch.zeros(3)
    correction.own_direction_(["w"], [grad2], [p])  # u = 0.9 u + (0 + 0.5 p)
    assert torch.allclose(grad2, 0.9 * torch.tensor([2.0, 3.0, 4.0]) + 0.5)
    saved = correction.state_dict()
    assert not correction.in_sync(["w"]) and bool(saved["local/w"])
    restored = MomentumCorrection()
    restored.load_state_dict(saved)
    assert torch.equal(restored.state_dict()["u/w"], saved["u/w"]) and not restored.in_sync(["w"])


def test_momentum_set_again_in_the_optimizer_is_taken_back_and_checkpoints_show_the_users_settings():
    p = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    stock_state = optimizer.state_dict()  # as a stock DDP checkpoint holds it, after one step with a buffer:
    stock_state["state"] = {0: {"momentum_buffer": torch.full((3,), 2.0)}}
    correction = MomentumCorrection()
    assert correction.take_from_optimizer(optimizer, {id(p): "w"}) == ["w"]
    assert correction.refresh() == []  # nothing set again
    # Lightning restores the optimizer's state after the strategy's setup: its groups come back with momentum 0.9.
    optimizer.load_state_dict(stock_state)
    assert optimizer.param_groups[0]["momentum"] == 0.9
    assert correction.refresh() == ["w"]
    assert optimizer.param_groups[0]["momentum"] == 0 and optimizer.param_groups[0]["weight_decay"] == 0
    assert torch.equal(correction.state_dict()["u/w"], torch.full((3,), 2.0))  # the stock buffer is kept
    assert "momentum_buffer" not in optimizer.state[p]
    # A momentum schedule (OneCycleLR writes group["momentum"] every step) reaches the hook.
    optimizer.param_groups[0]["momentum"] = 0.85
    correction.refresh()
    assert correction.settings["w"].momentum == 0.85 and optimizer.param_groups[0]["momentum"] == 0
    saved = correction.saved_groups(optimizer, optimizer.state_dict())
    assert saved["param_groups"][0]["momentum"] == 0.85 and saved["param_groups"][0]["weight_decay"] == 0.01
    assert optimizer.param_groups[0]["momentum"] == 0  # the live optimizer is untouched


def _corrected_steps(rank, world):
    """Top-K cf 8 with the momentum moved into the hook (torch DDP, 2 ranks), against a reference from every rank's
    plain gradients: u <- m u + g, x = u + e, s = topk(x), e = x - s, the mean of the ranks' s applied; with
    masking, u restarts from 0 where x was sent. Returns, per step, whether the hook matched the reference of its own
    mode and whether the two modes' references differ, for each mode."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return {masking: _corrected_run(rank, world, masking) for masking in (False, True)}


def _corrected_run(rank, world, masking):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gravac.compressors import get_compressor
    from lightning_gravac.state import CompressionState
    from lightning_gravac.strategies.hook import gravac_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 4))
    state = CompressionState(get_compressor("topk"), error_feedback=True, granularity="layer", cf=8)
    state.carry.get(MomentumCorrection).masking = masking
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    names = {id(p): n for n, p in model.named_parameters()}
    state.carry.get(MomentumCorrection).take_from_optimizer(optimizer, names)
    ddp = DistributedDataParallel(model)
    state.bind(model)
    ddp.register_comm_hook(state, gravac_hook)
    topk = state.compressor
    u = {mode: {} for mode in (False, True)}
    e = {mode: {} for mode in (False, True)}
    out = []
    for step in range(5):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        grads = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))  # this rank's own gradient
        expected = {}
        for mode in (False, True):
            for (n, _), g in zip(model.named_parameters(), grads, strict=True):
                u[mode][n] = g.clone() if n not in u[mode] else 0.9 * u[mode][n] + g
                fed = u[mode][n] + e[mode].get(n, torch.zeros_like(g))
                sent = topk.decompress(topk.compress(fed, 8, key=n, step=step))
                e[mode][n] = fed - sent
                if mode:
                    u[mode][n] = u[mode][n].masked_fill(e[mode][n] == 0, 0.0)
                gathered = [torch.empty_like(sent) for _ in range(world)]
                dist.all_gather(gathered, sent)
                expected[(mode, n)] = sum(s * (1.0 / world) for s in gathered)
        state.pop_stats()
        out.append(
            {
                "matches": all(
                    torch.allclose(p.grad, expected[(masking, n)], rtol=1e-5, atol=1e-7)
                    for n, p in model.named_parameters()
                ),
                "modes_differ": any(
                    # beyond what `matches` tolerates, so that a hook matching either mode is told apart
                    not torch.allclose(expected[(False, n)], expected[(True, n)], rtol=1e-3, atol=1e-5)
                    for n, _ in model.named_parameters()
                ),
            }
        )
        optimizer.step()
    return out


@pytest.mark.distributed
def test_corrected_topk_is_delayed_heavy_ball_and_masking_restarts_sent_entries():
    for modes in run_distributed(_corrected_steps, timeout=300):
        for masking, steps in modes.items():
            assert all(s["matches"] for s in steps), (masking, steps)
            assert any(s["modes_differ"] for s in steps), (masking, steps)  # the reference tells the modes apart


def test_masking_is_on_as_published_unless_turned_off():
    assert GraVACStrategy("topk").compression_state.carry.get(MomentumCorrection).masking is True
    unmasked = GraVACStrategy("topk", momentum_masking=False).compression_state.carry
    assert unmasked.get(MomentumCorrection).masking is False


def _masked_mass(momentum: float, nesterov: bool, sent_at, steps: int, n: int, burn_in: int = 0) -> torch.Tensor:
    """Each entry's update directions summed from step ``burn_in`` on, under the hook's momentum with masking, a
    constant gradient of 1, and error feedback sending the entries ``sent_at(step)`` marks (their residual 0). Every
    direction is sent in the end (error feedback), so this is what the entry's momentum delivers."""
    w = nn.Parameter(torch.zeros(n))
    moved = MomentumCorrection(masking=True)
    moved.take_from_optimizer(torch.optim.SGD([w], lr=0.1, momentum=momentum, nesterov=nesterov), {id(w): "w"})
    residual, mass = torch.zeros(n), torch.zeros(n)
    for step in range(steps):
        direction = torch.ones(n)
        moved.own_direction_(["w"], [direction], [w])
        if step >= burn_in:
            mass += direction
        fed, now = residual + direction, sent_at(step)
        residual = torch.where(now, 0.0, fed)
        moved.mask_({"w": residual})
        moved.buffers.commit(["w"])
    return mass


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("momentum", [0.5, 0.9])
@pytest.mark.parametrize("wait", [2, 10, 40])
def test_masking_retention_is_what_the_hooks_masked_momentum_delivers_against_dense(wait, momentum, nesterov):
    from lightning_gravac.adaptations.momentum import masking_retention

    # Sent every `wait` steps, over whole periods: exactly the periodic formula (dense applies 1 / (1 - m) a step in
    # steady state, with Nesterov too).
    steps = 20 * wait
    periodic = _masked_mass(momentum, nesterov, lambda step: torch.full((1,), (step + 1) % wait == 0), steps, 1)
    expected = masking_retention(wait, momentum, nesterov=nesterov)
    assert float(periodic[0]) / (steps / (1 - momentum)) == pytest.approx(expected, rel=1e-6)  # float32 sums
    # Sent at random with probability 1 / wait: the geometric formula, to the sampling error of 4000 entries.
    # The first 60 steps (six momentum horizons at 0.9) start from an empty buffer: left out, as dense's filling is.
    generator = torch.Generator().manual_seed(wait)
    steps, n, burn_in = 260, 4000, 60
    drawn = torch.rand(steps, n, generator=generator) < 1 / wait
    mass = _masked_mass(momentum, nesterov, lambda step: drawn[step], steps, n, burn_in)
    expected = masking_retention(wait, momentum, nesterov=nesterov, random=True)
    assert float(mass.mean()) / ((steps - burn_in) / (1 - momentum)) == pytest.approx(expected, rel=0.01)


def test_masking_retention_limits():
    from lightning_gravac.adaptations.momentum import masking_retention

    assert masking_retention(10, 0.0) == 1.0 and masking_retention(1, 0.9) == 1.0  # no momentum; the dense path
    assert masking_retention(10, 1.0) == masking_retention(10, 0.999)
    assert masking_retention(20, 0.9) == pytest.approx(0.604709, abs=1e-6)  # 1 - 0.9 (1 - 0.9^20) / 2
    assert masking_retention(10, 0.9, random=True) == pytest.approx(0.1 / 0.19)
