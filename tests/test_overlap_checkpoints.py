"""With overlap, a checkpoint saved mid-round holds the change in flight without changing the run that saved it:
through Lightning's Trainer on two gloo ranks, the run with mid-round checkpoints is the run without them bit for bit,
and a run resumed from one continues it bit for bit."""

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_gravac import GraVACStrategy, LocalSteps
from lightning_gravac.launch import run_distributed

from models import loader, trainer_kwargs


def _with_and_without_checkpoints(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    from local_steps_runs import StepData, Trace

    def fit(callbacks: list[pl.Callback], ckpt_path: str | None = None) -> list[torch.Tensor]:
        trace = Trace()
        pl.seed_everything(0)
        strategy = GraVACStrategy(local_steps=LocalSteps(every=8, overlap=True))  # 4-bit codes, one round late
        kwargs = trainer_kwargs(2, enable_checkpointing=bool(callbacks))
        trainer = pl.Trainer(strategy=strategy, callbacks=[trace, *callbacks], max_steps=32, **kwargs)
        trainer.fit(StepData(), loader(n=32768), ckpt_path=ckpt_path)
        return trace.after

    every_12 = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=12, save_top_k=-1)
    return {
        "without": fit([]),
        "with": fit([every_12]),
        "resumed": fit([], ckpt_path=f"{ckpt_dir}/epoch=0-step=12.ckpt"),
    }


@pytest.mark.distributed
def test_a_checkpoint_mid_round_with_overlap_changes_nothing_and_resumes_bit_for_bit(tmp_path):
    ranks = run_distributed(_with_and_without_checkpoints, timeout=300, ckpt_dir=str(tmp_path))
    # Saved after steps 12 and 24, four steps into the rounds of steps 9-16 and 17-24: the rounds ending at 8 and 16
    # are in flight there, landed at the next round's end.
    assert not torch.equal(ranks[0]["without"][11], ranks[1]["without"][11]), "mid-round: the ranks differ"
    for rank in ranks:
        for step, (a, b) in enumerate(zip(rank["without"], rank["with"], strict=True), start=1):
            assert torch.equal(a, b), f"step {step}: the run with checkpoints left the run without"
        assert len(rank["resumed"]) == 20
        for step, (a, b) in enumerate(zip(rank["without"][12:], rank["resumed"], strict=True), start=13):
            assert torch.equal(a, b), f"step {step}: the resumed run left the uninterrupted one"
