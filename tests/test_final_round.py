"""The fit's last round of local steps under error feedback: its change and the residual in 8-bit block codes, nothing
kept owed after it; an unbiased outer code's last round goes in its own code."""

import pytest
import torch
from torch import nn

from lightning_gravac.adaptations.outer_exchange import FINAL_CF, OuterExchange
from lightning_gravac.compressors import get_compressor
from lightning_gravac.compressors.packing import Layout


def _exchange(method: str, error_feedback: bool) -> tuple[OuterExchange, dict[str, nn.Parameter]]:
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8))
    exchange, params = OuterExchange(), dict(model.named_parameters())
    exchange.configure(get_compressor(method), 8.0, error_feedback=error_feedback)
    exchange.take_from(params, torch.optim.SGD(model.parameters(), lr=0.1))
    return exchange, params


def _round(exchange: OuterExchange, params: dict[str, nn.Parameter], seed: int, final: bool) -> dict[str, torch.Tensor]:
    """One round's end on one process: ``start - x`` for a random start, sent and taken; returns the change formed."""
    g = torch.Generator().manual_seed(seed)
    starts = {n: p.detach() + torch.randn(p.shape, generator=g) for n, p in params.items()}
    change = {n: (starts[n] - p).detach().clone() for n, p in params.items()}
    with torch.no_grad():
        exchange.change(list(params), starts)
        exchange.send(list(params), whole=False, step=seed, final=final)
    return change


def test_the_last_round_sends_its_change_and_the_residual_in_8_bit_blocks_and_keeps_nothing_owed():
    exchange, params = _exchange("int4", error_feedback=True)
    _round(exchange, params, 0, final=False)
    with torch.no_grad():
        exchange.take()
    owed = {n: r.clone() for n, r in exchange.residual.kept.items()}
    assert set(owed) == set(params) and all(r.abs().sum() > 0 for r in owed.values()), "int4 leaves a residual"
    sent_before = exchange.bytes_sent
    change = _round(exchange, params, 1, final=True)
    with torch.no_grad():
        mean = exchange.take()
    flat = torch.cat([(change[n] + owed[n]).reshape(-1) for n in params])
    int8 = get_compressor("int8")
    payload = int8.compress(flat, FINAL_CF)
    expected = int8.decompress(payload)
    assert torch.equal(torch.cat([mean[n].reshape(-1) for n in params]), expected)
    assert not exchange.residual.kept, "nothing is kept owed after the fit's last round"
    assert exchange.sent_cf == FINAL_CF
    assert exchange.bytes_sent - sent_before == Layout.of([payload]).nbytes
    # Each entry within half a level of its block's largest (the block code's bound), so nearly all it owed is sent.
    pad = -flat.numel() % int8.block_size
    err = torch.nn.functional.pad(expected - flat, (0, pad)).abs().view(-1, int8.block_size)
    peaks = torch.nn.functional.pad(flat, (0, pad)).abs().view(-1, int8.block_size).amax(1, keepdim=True)
    assert (err <= peaks / 254 * (1 + 1e-6)).all()


def test_an_unbiased_outer_code_sends_the_last_round_in_its_own_code():
    exchange, params = _exchange("qsgd", error_feedback=False)
    _round(exchange, params, 0, final=True)
    with torch.no_grad():
        exchange.take()
    assert exchange.sent_cf == 8.0 and not exchange.residual.kept


def test_a_round_sent_whole_stays_whole_at_the_end():
    exchange, params = _exchange("int4", error_feedback=True)
    change = _round(exchange, params, 0, final=False)
    with torch.no_grad():
        exchange.take()
        owed = {n: r.clone() for n, r in exchange.residual.kept.items()}
        starts = {n: p.detach() + 1.0 for n, p in params.items()}
        exchange.change(list(params), starts)
        exchange.send(list(params), whole=True, step=1, final=True)
        mean = exchange.take()
    assert change and exchange.sent_cf == 1.0 and not exchange.residual.kept
    for n in params:
        torch.testing.assert_close(mean[n], 1.0 + owed[n], rtol=0, atol=1e-6)


def _ended_at_an_epoch(rank: int, world_size: int) -> dict[str, object]:
    import pytorch_lightning as pl

    from lightning_gravac import GraVACStrategy, LocalSteps
    from lightning_gravac.zoo import TeacherRegression

    from models import loader, trainer_kwargs

    pl.seed_everything(0)
    strategy = GraVACStrategy("int4", local_steps=LocalSteps(every=4))
    # No max_steps: the fit ends with its epoch, whose last batch closes a round (32 batches a rank, 8 rounds).
    trainer = pl.Trainer(strategy=strategy, max_epochs=1, **trainer_kwargs(world_size))
    trainer.fit(TeacherRegression(width=64), loader())
    exchange = strategy.outer.exchange
    return {"owed": len(exchange.residual.kept), "sent_cf": exchange.sent_cf, "rounds": strategy.outer.rounds,
            "params": [p.detach().clone() for p in strategy.lightning_module.parameters()]}  # fmt: skip


@pytest.mark.distributed
def test_a_fit_that_ends_with_its_epoch_sends_what_error_feedback_still_owes():
    from lightning_gravac.launch import run_distributed

    r0, r1 = run_distributed(_ended_at_an_epoch, timeout=300)
    assert r0["owed"] == r1["owed"] == 0, "the residual went with a last round at the fit's end"
    assert r0["sent_cf"] == FINAL_CF and r0["rounds"] == r1["rounds"] == 9  # 8 rounds of the epoch, then the residual
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))
