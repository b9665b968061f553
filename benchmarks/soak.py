"""Soak test for hangs: many short 2-rank trainings through Lightning's Trainer, in random layouts.

    python benchmarks/soak.py [--runs 200] [--per-launch 10] [--seed 0] [--timeout 90]

Each run draws a compressor (every registered one), a granularity it allows, a bucket size (one bucket, a layer a
bucket, or in between), a model shape, and a controller that changes the factor at random steps (cf 1 among the
choices, so the dense path alternates with the compressed ones). Runs go in launches of ``--per-launch`` runs on
two gloo ranks; a launch that has not finished by ``--timeout`` seconds counts each of its unfinished runs as a
hang, with the stacks of the stuck ranks printed. Reports runs, hangs and ranks that disagreed on the weights.
"""

import argparse
import itertools
import random
import time
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gravac import Controller, GraVACStrategy, StepStats, get_compressor, list_compressors
from lightning_gravac.launch import run_distributed


@dataclass(frozen=True)
class Run:
    compressor: str
    granularity: str
    bucket_cap_mb: float
    widths: tuple[int, ...]
    factors: tuple[float, ...]  # the factor of each step
    seed: int


class Scripted(Controller):
    """Sends ``factors[i]`` at step ``i`` (the same script on every rank)."""

    def __init__(self, factors: tuple[float, ...]) -> None:
        super().__init__(cf=factors[0])
        self.factors, self.steps = factors, 0

    def observe(self, stats: StepStats, trainer: pl.Trainer) -> None:
        self.steps += 1
        self.cf = self.factors[min(self.steps, len(self.factors) - 1)]

    @property
    def max_cf(self) -> tuple[str, float]:
        return "factors", max(self.factors)


class Net(pl.LightningModule):
    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def draw(rng: random.Random, seed: int) -> Run:
    name = rng.choice(list_compressors())
    granularity = "layer" if get_compressor(name).layerwise else rng.choice(["layer", "bucket"])
    widths = tuple([rng.choice([8, 16, 32])] + [rng.choice([16, 48, 96, 200]) for _ in range(rng.randint(1, 4))] + [4])
    steps = rng.randint(4, 12)
    smallest = min(a * b for a, b in itertools.pairwise(widths))
    ladder = [f for f in (1, 2, 4, 8, 16, 64) if f <= smallest]
    return Run(
        compressor=name,
        granularity=granularity,
        bucket_cap_mb=rng.choice([25, 0.004, 0.001, rng.uniform(0.001, 0.05)]),
        widths=widths,
        factors=tuple(rng.choice(ladder) for _ in range(steps)),
        seed=seed,
    )


def _launch(rank: int, world_size: int, runs: list[Run]) -> list[dict[str, torch.Tensor]]:
    out = []
    for run in runs:
        pl.seed_everything(run.seed)
        g = torch.Generator().manual_seed(run.seed)
        x, y = torch.randn(256, run.widths[0], generator=g), torch.randn(256, run.widths[-1], generator=g)
        model = Net(run.widths)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=GraVACStrategy(run.compressor, granularity=run.granularity, bucket_cap_mb=run.bucket_cap_mb),
            callbacks=[Scripted(run.factors)],
            max_steps=len(run.factors),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--per-launch", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=90)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    runs = [draw(rng, args.seed * 100_000 + i) for i in range(args.runs)]
    done = hangs = disagreements = 0
    start = time.monotonic()
    for first in range(0, len(runs), args.per_launch):
        batch = runs[first : first + args.per_launch]
        try:
            ranks = run_distributed(_launch, timeout=args.timeout, runs=batch)
        except RuntimeError as error:  # run_distributed's report of a failed or hung rank
            hangs += len(batch)
            print(f"launch of runs {first}-{first + len(batch) - 1} failed or hung:\n{error}\n{batch}")
            continue
        for a, b in zip(ranks[0], ranks[1], strict=True):
            done += 1
            disagreements += any(not torch.equal(a[k], b[k]) for k in a)
        print(f"{done + hangs}/{len(runs)} runs, {hangs} hung or failed, {time.monotonic() - start:.0f} s", flush=True)
    by_method: dict[str, int] = {}
    for run in runs:
        by_method[run.compressor] = by_method.get(run.compressor, 0) + 1
    print(f"runs: {len(runs)}, finished: {done}, hangs or failures: {hangs}, ranks disagreeing: {disagreements}")
    print("runs by compressor: " + ", ".join(f"{k} {v}" for k, v in sorted(by_method.items())))


if __name__ == "__main__":
    main()
