"""GraVACModelParallelStrategy from LightningCLI: by class path with its arguments, fitted on 2 CPU ranks (gloo) as the
Trainer fits it; by its registry name; a refused argument said in one line."""

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from sharded_models import EveryStep, ShardedMLP, sharded_kwargs

from lightning_gravac import GraVACModelParallelStrategy, LocalSteps
from lightning_gravac.cli import RefusedArgument, cli_main
from lightning_gravac.compressors.blockwise import BlockCode
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo import TeacherDataModule

QUIET = [
    "--trainer.logger",
    "false",
    "--trainer.enable_checkpointing",
    "false",
    "--trainer.enable_progress_bar",
    "false",
]
MODEL = ["--model", "sharded_models.ShardedMLP", "--data", "lightning_gravac.zoo.TeacherDataModule", *QUIET]
#: What a user writes for 2 ranks sharding the model, int4 gradients, parameters gathered in int8.
STRATEGY = [
    "--trainer.strategy", "lightning_gravac.GraVACModelParallelStrategy",
    "--trainer.strategy.compressor", "int4",
    "--trainer.strategy.all_gather_code", "int8",
    "--trainer.strategy.data_parallel_size", "2",
    "--trainer.strategy.tensor_parallel_size", "1",
]  # fmt: skip


def _fit(rank: int, world_size: int, cli: bool) -> dict[str, Any]:
    """3 steps: through LightningCLI's ``fit`` as a user writes it, or a Trainer given the same strategy."""
    if cli:
        args = ["fit", *MODEL, *STRATEGY, "--seed_everything", "0", "--trainer.callbacks", "sharded_models.EveryStep"]
        args += ["--trainer.accelerator", "cpu", "--trainer.devices", str(world_size), "--trainer.max_steps", "3"]
        run = cli_main(args)
        trainer, model = run.trainer, run.model
    else:
        pl.seed_everything(0)
        strategy = GraVACModelParallelStrategy(
            "int4", all_gather_code="int8", data_parallel_size=world_size, tensor_parallel_size=1
        )
        trainer = pl.Trainer(strategy=strategy, max_steps=3, callbacks=[EveryStep()], **sharded_kwargs(world_size))
        model = ShardedMLP()
        trainer.fit(model, datamodule=TeacherDataModule())
    strategy = trainer.strategy
    assert isinstance(strategy, GraVACModelParallelStrategy) and isinstance(strategy.all_gather_code, BlockCode)
    (steps,) = [c for c in trainer.callbacks if isinstance(c, EveryStep)]
    return {
        "steps": steps.steps,
        "sent": strategy.bytes_sent,
        "codes": (strategy.compressor.name, strategy.all_gather_code.name),
        "sharded_over": strategy.device_mesh["data_parallel"].size(),
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_the_strategy_by_class_path_from_lightning_cli_fits_on_2_ranks_as_the_trainer_does():
    cli = run_distributed(_fit, timeout=240, cli=True)
    trainer = run_distributed(_fit, timeout=240, cli=False)
    for rank in cli:
        assert rank["codes"] == ("int4", "int8") and rank["sharded_over"] == 2 and rank["sent"] > 0
        assert len(rank["steps"]) == 3
    assert cli[0]["sent"] == trainer[0]["sent"]
    for a, b in zip(cli[0]["steps"], trainer[0]["steps"], strict=True):  # the CLI's run is the Trainer's, bit for bit
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    for a, b in zip(cli[0]["steps"], cli[1]["steps"], strict=True):
        assert all(torch.equal(a[name], b[name]) for name in a)


def test_the_registry_name_reaches_the_strategy_from_lightning_cli():
    args = [*MODEL, "--trainer.strategy", "gravac_model_parallel", "--trainer.accelerator", "cpu"]
    strategy = cli_main(args, run=False).trainer.strategy
    assert isinstance(strategy, GraVACModelParallelStrategy) and strategy.compressor.name == "int8"


def test_a_compressor_the_strategy_refuses_is_said_in_one_line_naming_the_strategy_once():
    args = [*MODEL, "--trainer.strategy", "lightning_gravac.GraVACModelParallelStrategy"]
    with pytest.raises(RefusedArgument) as refused:
        cli_main([*args, "--trainer.strategy.compressor", "topk"], run=False)
    assert str(refused.value).startswith(
        "GraVACModelParallelStrategy: `compressor` must be 'int8', 'int4', 'int2', a BlockCode"
    )


def test_local_steps_between_replica_groups_with_diloco_s_outer_step_from_lightning_cli():
    args = [*MODEL, "--trainer.strategy", "lightning_gravac.GraVACModelParallelStrategy"]
    args += ["--trainer.strategy.replica_groups", "2", "--trainer.strategy.replica_every", "{every: 8, lr: 0.7, "
             "momentum: 0.9, nesterov: true}"]  # fmt: skip
    strategy = cli_main(args, run=False).trainer.strategy
    assert isinstance(strategy, GraVACModelParallelStrategy) and strategy.replica_every == 8
    assert strategy.replica_rounds == LocalSteps(every=8, lr=0.7, momentum=0.9, nesterov=True)
    args[-1] = "4"
    assert cli_main(args, run=False).trainer.strategy.replica_rounds == LocalSteps(every=4)
