"""Local steps between replica groups (``replica_every``): 2 groups of 2 ranks each training on its own, their
parameter changes averaged every few steps, on 4 CPU ranks (gloo) through Lightning's Trainer."""

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback
from sharded_models import EveryStep, ShardedMLP, full_parameters, sharded_kwargs, sharded_loader

from lightning_gravac import Accordion, GraVACModelParallelStrategy, LocalSteps, LocalStepsDiverged
from lightning_gravac.launch import run_distributed
from lightning_gravac.sharded.local_steps import ReplicaRounds

WORLD = 4
#: Samples a rank reads an epoch: 4 batches of 16.
SAMPLES = 64


#: Rounds of 3 steps with DiLoCo's outer step.
DILOCO = LocalSteps(every=3, lr=0.7, momentum=0.9, nesterov=True)


def _strategy(
    method: str, every: int | LocalSteps | None, world_size: int, **kwargs: Any
) -> GraVACModelParallelStrategy:
    return GraVACModelParallelStrategy(
        method, replica_groups=2, replica_every=every, data_parallel_size=world_size, tensor_parallel_size=1, **kwargs
    )


def _flat(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.flatten() for p in parameters.values()])


class PlainSGD(ShardedMLP):
    """SGD without momentum: one step's change is the learning rate times the gradient."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(rank: int, world_size: int, method: str, model: type[ShardedMLP], steps: int, every: list[int | None]):
    """``steps`` steps for each of ``every``: the whole parameters after each step and at the fit's end."""
    out = []
    for each in every:
        pl.seed_everything(0)
        strategy = _strategy(method, each, world_size)
        after = EveryStep()
        trainer = pl.Trainer(strategy=strategy, max_steps=steps, callbacks=[after], **sharded_kwargs(world_size))
        module = model()
        trainer.fit(module, sharded_loader(SAMPLES * world_size))
        end = _flat(full_parameters(module))
        sent = strategy.bytes_between_groups
        out.append({"steps": [_flat(s) for s in after.steps], "end": end, "said": strategy.said(), "sent": sent})
    return out


@pytest.mark.distributed
def test_groups_train_on_their_own_and_end_each_round_with_the_same_parameters():
    ranks = run_distributed(_fit, WORLD, timeout=300, method="int8", model=ShardedMLP, steps=7, every=[3, None])
    local = [rank[0] for rank in ranks]
    assert "each training on its own, their parameter changes averaged every 3 steps in int8" in local[0]["said"]
    for step in (2, 5):  # after steps 3 and 6, and at the end (step 7 a round left partial): all 4 ranks alike
        assert all(torch.equal(r["steps"][step], local[0]["steps"][step]) for r in local[1:]), step
    assert all(torch.equal(r["end"], local[0]["end"]) for r in local[1:])
    for step in (0, 1, 3, 4, 6):  # within a round: the same within a group (ranks 0, 1 and 2, 3), not between
        assert torch.equal(local[1]["steps"][step], local[0]["steps"][step])
        assert torch.equal(local[3]["steps"][step], local[2]["steps"][step])
        assert not torch.equal(local[2]["steps"][step], local[0]["steps"][step]), step
    assert not torch.equal(local[0]["end"], local[0]["steps"][-1])  # the partial round was averaged at the end
    assert not torch.equal(local[0]["end"], ranks[0][1]["end"])  # the every-step average ends elsewhere
    assert 0 < local[0]["sent"] < 0.5 * ranks[0][1]["sent"]  # 3 averages of parameters against 7 of gradients


@pytest.mark.distributed
def test_averaging_changes_after_every_sgd_step_is_averaging_gradients():
    ranks = run_distributed(_fit, WORLD, timeout=300, method="none", model=PlainSGD, steps=5, every=[1, None])
    for rank in ranks:
        local, every_step = rank
        assert "averaged every step exactly" in local["said"]
        for a, b in zip(local["steps"], every_step["steps"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(every_step["steps"][-1], every_step["steps"][0])


class SaveAtStep4(Callback):
    """A checkpoint after step 4 (the first epoch's last): mid-round for 3 steps a round."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 4:
            assert trainer.strategy.local_steps.since == 1  # type: ignore[attr-defined]
            trainer.save_checkpoint(self.path)


def _resumed(
    rank: int, world_size: int, where: str, distributed: bool, runs: tuple[str, ...] = ("whole", "resumed")
) -> dict[str, Any]:
    """7 steps (averages after 3, 6 and at the end, DiLoCo's outer step) saved after step 4, and steps 5 to 7 resumed
    from that."""
    path = str(Path(where, "step4.ckpt"))
    out = {}
    for run in runs:
        pl.seed_everything(0)
        strategy = _strategy("int8", DILOCO, world_size, save_distributed_checkpoint=distributed)
        after = EveryStep()
        callbacks: list[Callback] = [after, SaveAtStep4(path)] if run == "whole" else [after]
        trainer = pl.Trainer(strategy=strategy, max_steps=7, callbacks=callbacks, **sharded_kwargs(world_size))
        module = ShardedMLP()
        trainer.fit(module, sharded_loader(SAMPLES * world_size), ckpt_path=path if run == "resumed" else None)
        assert strategy.local_steps is not None
        out[run] = {
            "steps": [_flat(s) for s in after.steps[-3:]],
            "end": _flat(full_parameters(module)),
            "outer": strategy.local_steps.average_changes.residual,
            "velocity": strategy.local_steps.velocity,
            "since": strategy.local_steps.since,
        }
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("distributed", [True, False], ids=["sharded-checkpoint", "full-checkpoint"])
def test_a_run_resumed_mid_round_is_the_uninterrupted_run_bit_for_bit(tmp_path, distributed):
    ranks = run_distributed(_resumed, WORLD, timeout=300, where=str(tmp_path), distributed=distributed)
    for rank in ranks:
        whole, again = rank["whole"], rank["resumed"]
        assert len(again["steps"]) == 3
        for a, b in zip(whole["steps"], again["steps"], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(whole["end"], again["end"])
        assert whole["outer"].abs().sum() > 0 and torch.equal(whole["outer"], again["outer"])
        assert whole["velocity"].abs().sum() > 0 and torch.equal(whole["velocity"], again["velocity"])
    assert not torch.equal(ranks[0]["whole"]["steps"][0], ranks[2]["whole"]["steps"][0])  # step 5: mid-round


def _on_two_ranks(rank: int, world_size: int, path: str) -> dict[str, Any]:
    """Steps 5 and 6 on 2 ranks (2 groups of 1) from the 4 ranks' checkpoint of step 4."""
    pl.seed_everything(0)
    strategy = _strategy("int8", DILOCO, world_size, save_distributed_checkpoint=False)
    trainer = pl.Trainer(strategy=strategy, max_steps=6, **sharded_kwargs(world_size))
    module = ShardedMLP()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.fit(module, sharded_loader(SAMPLES * world_size), ckpt_path=path)
    assert strategy.local_steps is not None
    return {"said": [str(w.message) for w in said], "end": _flat(full_parameters(module))}


@pytest.mark.slow
@pytest.mark.distributed
def test_local_steps_resumed_on_another_world_size_restart_the_round_and_say_so(tmp_path):
    run_distributed(_resumed, WORLD, timeout=300, where=str(tmp_path), distributed=False, runs=("whole",))
    ranks = run_distributed(_on_two_ranks, 2, timeout=300, path=str(Path(tmp_path, "step4.ckpt")))
    said = " ".join(ranks[0]["said"])
    assert "the anchors restart from the restored parameters, the outer residual and momentum from zero" in said
    assert torch.equal(ranks[0]["end"], ranks[1]["end"])  # the replicas (one rank each) end alike


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            {"replica_groups": 2, "replica_every": 0},
            r"`replica_every` must be a whole number >= 1, a `LocalSteps` or None, got 0\.",
        ),
        (
            {"replica_groups": 2, "replica_every": 2.5},
            r"`replica_every` must be a whole number >= 1, a `LocalSteps` or None, got 2\.5",
        ),
        ({"replica_every": 4}, r"`replica_every=4` averages between replica groups, so it needs `replica_groups` > 1"),
        (
            {"replica_groups": 2, "replica_every": LocalSteps(every=4, overlap=True)},
            r"`replica_every=LocalSteps\(overlap=True\)` is not supported between replica groups",
        ),
    ],
)
def test_replica_every_is_refused_in_one_line(options, said):
    with pytest.raises(ValueError, match=said) as refused:
        GraVACModelParallelStrategy("int8", **options)
    assert "\n" not in str(refused.value)


def _accordion_in_rounds(rank: int, world_size: int) -> dict[str, Any]:
    pl.seed_everything(0)
    strategy, accordion = _strategy("int8", 2, world_size), Accordion(1, 4, 0.3, 1, "step")
    trainer = pl.Trainer(strategy=strategy, max_steps=6, callbacks=[accordion], **sharded_kwargs(world_size))
    module = ShardedMLP()
    trainer.fit(module, sharded_loader(SAMPLES * world_size))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gravac/") and "_ms" not in k}
    return {"layer_cf": dict(accordion.layer_cf), "metrics": metrics, "end": _flat(full_parameters(module))}


@pytest.mark.distributed
def test_a_controller_under_local_steps_decides_within_each_group_and_every_rank_ends_alike():
    ranks = run_distributed(_accordion_in_rounds, WORLD, timeout=300)
    for first, second in ((0, 1), (2, 3)):  # a group's ranks decide from the group's own gradients
        assert ranks[first]["layer_cf"] == ranks[second]["layer_cf"]
        assert ranks[first]["metrics"] == ranks[second]["metrics"]
    assert ranks[0]["layer_cf"] != ranks[2]["layer_cf"]  # here the groups decided apart, and nothing waited
    for rank in ranks[1:]:
        assert torch.equal(rank["end"], ranks[0]["end"])


def _outer_steps(rank: int, world_size: int, lr: float, momentum: float, nesterov: bool) -> dict[str, Any]:
    """Three rounds of one step on a plain module, each rank moving the parameters by its own change, averaged
    exactly: the parameters at the start and after each round, what each rank moved by, and round 3 again from a
    copy resumed from round 2's state."""
    torch.distributed.init_process_group("gloo")
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    torch.manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape))
    flat = lambda: torch.cat([p.detach().flatten().clone() for p in params])  # noqa: E731
    start = flat()

    def move(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            mine = [torch.randn(p.shape, generator=g) for p in params]
            for p, d in zip(params, mine, strict=True):
                p.add_(d)
        return torch.cat([d.flatten() for d in mine])

    group = torch.distributed.group.WORLD
    rounds = ReplicaRounds(1, None, group, True, model, lr=lr, momentum=momentum, nesterov=nesterov)
    rounds.start()
    moved, after, saved = [], [], {}
    for k in range(3):
        moved.append(move(10 * k + rank))
        rounds.stepped()
        after.append(flat())
        if k == 1:
            saved = {name: t.clone() for name, t in rounds.state_dict([]).items()}
    again = ReplicaRounds(1, None, group, True, model, lr=lr, momentum=momentum, nesterov=nesterov)
    again.load_state_dict(saved, 0, [], torch.device("cpu"))  # the parameters as round 2 left them, too
    move(20 + rank)
    again.stepped()
    return {"start": start, "moved": moved, "after": after, "resumed": flat()}


@pytest.mark.distributed
@pytest.mark.parametrize(("lr", "momentum", "nesterov"), [(1.0, 0.0, False), (0.7, 0.9, True), (0.5, 0.8, False)])
def test_the_outer_step_moves_the_anchor_by_sgd_on_the_averaged_change(lr, momentum, nesterov):
    ranks = run_distributed(_outer_steps, 2, timeout=120, lr=lr, momentum=momentum, nesterov=nesterov)
    anchor, velocity = ranks[0]["start"], None
    for k in range(3):
        change = (ranks[0]["moved"][k] + ranks[1]["moved"][k]) / 2
        update = change
        if momentum:
            velocity = change.clone() if velocity is None else velocity * momentum + change
            update = change + momentum * velocity if nesterov else velocity
        anchor = anchor + lr * update
        for rank in ranks:
            torch.testing.assert_close(rank["after"][k], anchor, rtol=1e-6, atol=1e-6)
    # Resumed after round 2 (its anchor and momentum from the checkpoint), round 3 is the uninterrupted one's.
    for rank in ranks:
        assert torch.equal(rank["resumed"], rank["after"][2])


def test_the_fit_start_line_names_the_outer_step_and_an_exact_average():
    diloco = _strategy("int8", LocalSteps(every=16, lr=0.7, momentum=0.9, nesterov=True), WORLD).said()
    assert diloco.endswith("averaged every 16 steps in int8 block codes with error feedback, the outer step at lr 0.7 "
                           "with Nesterov momentum 0.9.")  # fmt: skip
    assert _strategy("int8", LocalSteps(every=16, cf=1), WORLD).said().endswith("averaged every 16 steps exactly.")
    assert _strategy("int8", 4, WORLD).said().endswith("every 4 steps in int8 block codes with error feedback.")


def _lost_rounds(rank: int, world_size: int) -> dict[str, Any]:
    """Rounds of one step, exact average, DiLoCo's outer step: round 2 has rank 1 move by NaN; round 3 is finite
    again, with the guard's reset on rank 0 alone before it; rounds 4 and 5 are both NaN on rank 1."""
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    flat = lambda: torch.cat([p.detach().flatten().clone() for p in params])  # noqa: E731
    rounds = ReplicaRounds(1, None, torch.distributed.group.WORLD, True, model, lr=0.7, momentum=0.9, nesterov=True)
    rounds.start()
    out: dict[str, Any] = {"after": [], "said": [], "velocity": []}
    for k in range(5):
        g = torch.Generator().manual_seed(10 * k + rank)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=g) * (float("nan") if rank == 1 and k in (1, 3, 4) else 1.0))
        if k == 2 and rank == 0:
            rounds.drop_momentum()
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                rounds.stepped()
        except LocalStepsDiverged as stopped:
            out["stopped"] = (k, str(stopped))
            break
        out["said"].append([str(w.message) for w in said])
        out["after"].append(flat())
        out["velocity"].append(None if rounds.velocity is None else rounds.velocity.clone())
    return out


@pytest.mark.distributed
def test_a_non_finite_round_is_lost_on_every_rank_two_in_a_row_stop_the_fit_and_the_guard_drops_the_momentum():
    ranks = run_distributed(_lost_rounds, 2, timeout=120)
    for rank in ranks:
        after, velocity = rank["after"], rank["velocity"]
        # Round 2 lost: every rank back on round 1's parameters, its momentum kept, said once.
        assert torch.equal(after[1], after[0]) and torch.equal(velocity[1], velocity[0])
        # Round 3: the guard's reset on rank 0 reached rank 1 too: the momentum restarts as the change itself.
        change = (after[2] - after[1]) / (0.7 * 1.9)  # Nesterov's first step: change + 0.9 * change
        torch.testing.assert_close(velocity[2], change, rtol=1e-5, atol=1e-6)
        # Rounds 4 and 5 lost: the second stops the fit, on both ranks at the same round.
        assert rank["stopped"][0] == 4 and "cannot go on" in rank["stopped"][1]
        assert torch.isfinite(after[3]).all() and torch.equal(after[3], after[2])
    assert torch.equal(ranks[0]["velocity"][2], ranks[1]["velocity"][2])
    assert any("averaged change was not finite; every rank goes on" in m for m in ranks[0]["said"][1])
