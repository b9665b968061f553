"""Memory a rank keeps beyond stock DDP with the same optimizer, per method: peak RSS side by side in one run.

    python benchmarks/memory.py [--entries 10000000] [--steps 6]

Two CPU ranks (gloo) train one ``Linear`` of about ``--entries`` weights (the gradient's size dominates everything
else) for a few steps; every row is a fresh pair of processes, and its peak resident set (``ru_maxrss``) is compared
with stock ``DDPStrategy``'s under the same optimizer (SGD with momentum 0.9; DGC's rows and its stock baseline with
momentum 0, DGC applying its own). Reports the extra MB a rank and the extra in gradient-sized buffers.
"""

import argparse
import json
import resource
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gravac import GraVACStrategy, Static
from lightning_gravac.launch import run_distributed

ROWS: list[tuple[str, str | None, float | None, float]] = [
    # (row, compressor ("default": GraVACStrategy()), static factor or None for the default controller, SGD momentum)
    ("stock DDP", None, None, 0.9),
    ("default (GraVACStrategy())", "default", None, 0.9),
    ("Top-K cf 100", "topk", 100, 0.9),
    ("Top-K cf 10", "topk", 10, 0.9),
    ("Random-K cf 100", "randomk", 100, 0.9),
    ("PowerSGD cf 100", "powersgd", 100, 0.9),
    ("QSGD", "qsgd", 8, 0.9),
    ("fp16", "fp16", 2, 0.9),
    ("stock DDP, no momentum", None, None, 0.0),
    ("Top-K cf 100, no momentum", "topk", 100, 0.0),
    ("default, no momentum", "default", None, 0.0),
    ("DGC cf 100 (its own momentum)", "dgc", 100, 0.0),
]


class Wide(pl.LightningModule):
    def __init__(self, n_in: int, n_out: int, momentum: float) -> None:
        super().__init__()
        self.layer, self.momentum = nn.Linear(n_in, n_out), momentum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=self.momentum)


def _peak(rank: int, world_size: int, row: tuple, entries: int, steps: int) -> float:
    _, compressor, cf, momentum = row
    n_in = 4000
    model = Wide(n_in, entries // n_in, momentum)
    if compressor is None:
        strategy = DDPStrategy()
    else:  # "default": the zero-argument strategy, whose method follows the optimizer
        strategy = GraVACStrategy() if compressor == "default" else GraVACStrategy(compressor)
    callbacks = [] if cf is None else [Static(cf=cf)]
    data = DataLoader(TensorDataset(torch.randn(8 * steps, n_in)), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, callbacks=callbacks, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    args = parser.parse_args()
    gradient_mb = args.entries * 4 / 2**20
    peaks = {row[0]: max(run_distributed(_peak, row=row, entries=args.entries, steps=args.steps, timeout=300))
             for row in ROWS}  # fmt: skip
    lines = [
        f"Peak RSS a rank, 2 ranks, one Linear of {args.entries / 1e6:g}M weights ({gradient_mb:.0f} MiB a gradient)",
        "",
        "| row | peak MiB | extra MiB | extra gradients |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, _, _, momentum in ROWS:
        base = peaks["stock DDP" if momentum else "stock DDP, no momentum"]
        extra = peaks[name] - base
        lines.append(f"| {name} | {peaks[name]:.0f} | {extra:+.0f} | {extra / gradient_mb:+.2f} |")
    print("\n".join(lines))
    Path(args.out).write_text(json.dumps({"entries": args.entries, "steps": args.steps, "peak_mib": peaks}, indent=1))
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
