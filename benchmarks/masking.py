"""How much of dense momentum's step momentum factor masking keeps, measured on the matrix's tasks.

    python benchmarks/masking.py --task diamonds --steps 100 --rows "topk cf=10" "topk cf=100" "topk cf=1000"

With SGD momentum ``m`` moved into the hook, a sparsifier sends an entry's accumulation ``v`` and masking restarts
its momentum ``u`` there. Unmasked, that ``u`` would still have added ``m / (1 - m) u`` to later steps; so a step keeps

    R = sum |v_sent| / (sum |v_sent| + m / (1 - m) sum |u_sent|)

of what heavy-ball momentum delivers (under a constant gradient, an entry sent every ``T`` steps gives exactly
:func:`~lightning_gravac.adaptations.momentum.masking_retention` of ``T``). Measured on rank 0 at every compressed
bucket, from the error-fed values and the momentum where the new residual is 0, with the matrix's task settings
(2 CPU ranks, scale 0.25). Not a timing: it may run beside other work.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_gravac.adaptations.momentum import MomentumCorrection
from lightning_gravac.adaptations.residuals import ErrorFeedback
from lightning_gravac.launch import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from matrix_rows import make_row  # the matrix's rows and tasks
from matrix_tasks import make_task


def _retention(rank: int, world_size: int, task: str, row: str, steps: int) -> list[float]:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    sent: dict[str, float] = {}
    kept: list[float] = []
    absorb, mask = ErrorFeedback.absorb, MomentumCorrection.mask_

    def absorbing(self: ErrorFeedback, key: str, error_fed: torch.Tensor, *args: Any) -> torch.Tensor:
        residual = absorb(self, key, error_fed, *args)
        sent[key] = float(error_fed[residual == 0].abs().double().sum())
        return residual

    def masking(self: MomentumCorrection, residuals: dict[str, torch.Tensor | None]) -> None:
        delivered = dropped = 0.0
        for name, residual in residuals.items():
            u = self._pending.get(name)
            if residual is None or u is None or name not in sent:
                continue
            m = self.settings[name].momentum
            dropped += m / (1 - m) * float(u[residual.view_as(u) == 0].abs().double().sum())
            delivered += sent.pop(name)
        if delivered + dropped > 0:
            kept.append(delivered / (delivered + dropped))
        mask(self, residuals)

    ErrorFeedback.absorb, MomentumCorrection.mask_ = absorbing, masking  # type: ignore[method-assign]
    spec = make_task(task, 0.25)
    strategy, callbacks = make_row(row, 0.0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, callbacks=callbacks, max_steps=steps,
        max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=spec["clip"],
    )  # fmt: skip
    trainer.fit(spec["model"], spec["train"])
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="diamonds", choices=["cnn", "diamonds"])  # the tasks trained with momentum
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", nargs="+", default=["topk cf=10", "topk cf=100", "topk cf=1000"])
    args = parser.parse_args()
    print(f"| task | row | R, mean of the second half | R at 25% / 50% / 75% / end of {args.steps} steps |")
    print("| --- | --- | ---: | --- |")
    for row in args.rows:
        kept = run_distributed(_retention, task=args.task, row=row, steps=args.steps, timeout=1800)[0]
        half = kept[len(kept) // 2 :]
        marks = " / ".join(f"{kept[int(q * (len(kept) - 1))]:.2f}" for q in (0.25, 0.5, 0.75, 1.0))
        print(f"| {args.task} | {row} | {sum(half) / len(half):.2f} | {marks} |", flush=True)


if __name__ == "__main__":
    main()
