"""Memory a rank keeps for local steps, beside stock DDP and the every-step default: peak RSS by `/usr/bin/time -v`.

    python benchmarks/local_steps_memory.py [--entries 10000000] [--steps 16]

Each row runs alone, as ``/usr/bin/time -v python benchmarks/local_steps_memory.py --row NAME``: two CPU ranks (gloo)
train one ``Linear`` of about ``--entries`` weights under SGD with momentum 0.9 for ``--steps`` steps (rounds of 8:
two rounds at the default), and the time's "Maximum resident set size" is the largest rank's peak (the launcher's
processes are smaller). Reports each row's peak and its extra over stock DDP in MiB and in copies of the parameters.
What local steps need is the anchor (one copy) and, with the guard, the optimizer's state as each round began (one
more under SGD with momentum); a round's end writes its change into one flat tensor, which its mean is decoded into.
"""

import argparse
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gravac import GraVACStrategy, LocalSteps
from lightning_gravac.launch import run_distributed

ROWS: dict[str, Callable[[], Any]] = {
    "stock DDP": DDPStrategy,
    "every step (GraVACStrategy())": GraVACStrategy,
    "local steps (GraVACStrategy(local_steps=8))": lambda: GraVACStrategy(local_steps=8),
    "local steps, guard=None": lambda: GraVACStrategy(local_steps=LocalSteps(every=8, guard=None)),
    "local steps, overlap=True": lambda: GraVACStrategy(local_steps=LocalSteps(every=8, overlap=True)),
}
_N_IN = 4000


class Wide(pl.LightningModule):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.layer = nn.Linear(n_in, n_out)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


def _fit(rank: int, world_size: int, row: str, entries: int, steps: int) -> float:
    data = DataLoader(TensorDataset(torch.randn(8 * steps, _N_IN)), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=ROWS[row](), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Wide(_N_IN, entries // _N_IN), data)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB


def _measured(row: str, entries: int, steps: int) -> float:
    """The largest process's peak RSS in MiB of one row run under ``/usr/bin/time -v``."""
    command = [sys.executable, __file__, "--row", row, "--entries", str(entries), "--steps", str(steps)]
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, check=True)
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    assert found is not None, done.stderr[-2000:]
    return int(found.group(1)) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000_000)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--row", choices=list(ROWS), help="run this row alone (what the table runs under the time)")
    args = parser.parse_args()
    if args.row is not None:
        peaks = run_distributed(_fit, row=args.row, entries=args.entries, steps=args.steps, timeout=600)
        print(f"{args.row}: ranks' peak RSS {', '.join(f'{p:.0f}' for p in peaks)} MiB")
        return
    copy_mib = args.entries * 4 / 2**20
    peaks = {row: _measured(row, args.entries, args.steps) for row in ROWS}
    lines = [
        f"Peak RSS, 2 ranks, one Linear of {args.entries / 1e6:g}M weights ({copy_mib:.0f} MiB a copy), {args.steps} "
        "steps of SGD with momentum 0.9",
        "",
        "| row | peak MiB | extra MiB | extra copies |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row, peak in peaks.items():
        extra = peak - peaks["stock DDP"]
        lines.append(f"| {row} | {peak:.0f} | {extra:+.0f} | {extra / copy_mib:+.2f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
