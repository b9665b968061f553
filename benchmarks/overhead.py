"""Overhead of GraVACStrategy at cf 1 against stock DDPStrategy, side by side in one run.

    python benchmarks/overhead.py [--width 2048] [--depth 3] [--steps 40] [--rounds 5]

Two CPU ranks (gloo) train the same MLP from the same seed; the configurations alternate within each round, and
each is compared with the stock DDPStrategy run of its own round (paired ratios), so that drift in the speed of a
shared machine cancels. Reports the median time a step and the median and range of the paired ratios (target at
cf 1: <= 1.02). A Top-K row at cf 100 is shown for context: on loopback the link is fast, so it
measures compression cost more than savings.

Rows marked [CPU] give the process's CPU time a step (all its threads, gloo's included) instead of wall time: work
done, which the neighbours on a shared machine disturb less than they disturb wall time.

A second table isolates the hook: plain torch DDP (no Lightning) with no hook, torch's own ``allreduce_hook`` and
``gravac_hook`` at cf 1, timing forward + backward + optimizer step.
"""

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning import Callback
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from lightning_gravac import GraVACStrategy, Static
from lightning_gravac.compressors import get_compressor
from lightning_gravac.launch import run_distributed
from lightning_gravac.strategies import CompressionState, gravac_hook
from lightning_gravac.zoo import TeacherRegression, teacher_dataset


class StepTimer(Callback):
    """Wall time of the steps after ``warmup`` (DDP rebuilds its buckets after the first)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end, self.steps = warmup, 0.0, 0.0, 0
        self.cpu_start, self.cpu_end = 0.0, 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.end, self.steps = time.perf_counter(), trainer.global_step - self.warmup
            self.cpu_end = time.process_time()

    @property
    def seconds_per_step(self) -> float:
        return (self.end - self.start) / self.steps

    @property
    def cpu_seconds_per_step(self) -> float:
        """CPU time of this process (every thread, gloo's included) a step: less sensitive to the neighbours."""
        return (self.cpu_end - self.cpu_start) / self.steps


#: name -> (strategy, controllers) factory, and the SGD momentum of the model's optimizer.
CONFIGS = {
    "DDPStrategy": (lambda: (DDPStrategy(), []), 0.0),
    "DDPStrategy gradient_as_bucket_view": (lambda: (DDPStrategy(gradient_as_bucket_view=True), []), 0.0),
    "GraVACStrategy topk cf=1 (default: gradient_as_bucket_view)": (
        lambda: (GraVACStrategy("topk"), [Static(cf=1)]),
        0.0,
    ),
    "GraVACStrategy topk cf=1 gradient_as_bucket_view=False": (
        lambda: (GraVACStrategy("topk", gradient_as_bucket_view=False), [Static(cf=1)]),
        0.0,
    ),
    "GraVACStrategy topk cf=100": (lambda: (GraVACStrategy("topk"), [Static(cf=100)]), 0.0),
    # With SGD momentum the strategy moves the momentum into the hook (momentum correction): at cf 1 the hook then
    # does the optimizer's momentum arithmetic and one finiteness check of the averaged bucket.
    "DDPStrategy, SGD momentum 0.9": (lambda: (DDPStrategy(), []), 0.9),
    "GraVACStrategy topk cf=1, SGD momentum 0.9 (moved into the hook)": (
        lambda: (GraVACStrategy("topk"), [Static(cf=1)]),
        0.9,
    ),
    # With a logger written every step: stock DDP logs the model's one metric (train_loss); GraVACStrategy adds its
    # gravac/* metrics, into trainer.callback_metrics and to the logger, every step.
    "DDPStrategy, CSVLogger every step": (lambda: (DDPStrategy(), []), 0.0),
    "GraVACStrategy topk cf=1, CSVLogger every step": (lambda: (GraVACStrategy("topk"), [Static(cf=1)]), 0.0),
}


def _pin(rank: int) -> None:
    # One core a rank (where there are enough): the scheduler moving ranks and gloo threads between two shared
    # cores is most of the noise in a 2-core measurement.
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _rank(rank: int, world_size: int, width: int, depth: int, steps: int, rounds: int) -> dict[str, list[float]]:
    _pin(rank)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    data = teacher_dataset(n=32 * world_size * (steps + 1))
    for _ in range(rounds):
        for name, (make, momentum) in CONFIGS.items():
            strategy, callbacks = make()
            timer = StepTimer(warmup=3)
            pl.seed_everything(0, verbose=False)
            every_step = "every step" in name
            logger = CSVLogger(tempfile.mkdtemp(), name="overhead") if every_step else False
            trainer = pl.Trainer(
                accelerator="cpu", devices=world_size, strategy=strategy, callbacks=[*callbacks, timer],
                max_steps=steps, logger=logger, log_every_n_steps=1 if every_step else 50, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            model = TeacherRegression(width=width, depth=depth, momentum=momentum)
            trainer.fit(model, DataLoader(data, batch_size=32))
            times[name].append(timer.seconds_per_step)
            times.setdefault(f"{name} [CPU]", []).append(timer.cpu_seconds_per_step)
    return times


HOOKS = ("no hook (C++ reducer)", "torch allreduce_hook", "gravac_hook cf=1")


def _raw_rank(rank: int, world_size: int, width: int, depth: int, steps: int, rounds: int) -> dict[str, list[float]]:
    _pin(rank)
    dist.init_process_group("gloo")
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {name: [] for name in HOOKS}
    for _ in range(rounds):
        for name in HOOKS:
            torch.manual_seed(0)
            model = TeacherRegression(width=width, depth=depth)
            ddp = DistributedDataParallel(model)
            if name == HOOKS[1]:
                ddp.register_comm_hook(None, allreduce_hook)
            elif name == HOOKS[2]:
                state = CompressionState(get_compressor("topk"), error_feedback=True, cf=1.0)
                state.bind(model)
                ddp.register_comm_hook(state, gravac_hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for step in range(steps):
                if step == 3:
                    start, cpu_start = time.perf_counter(), time.process_time()
                optimizer.zero_grad()
                ddp(x).square().mean().backward()
                optimizer.step()
            times[name].append((time.perf_counter() - start) / (steps - 3))
            times.setdefault(f"{name} [CPU]", []).append((time.process_time() - cpu_start) / (steps - 3))
    return times


def _table(times: dict[str, list[float]], base: str) -> None:
    print(f"| configuration | ms / step | steps / s | time ratio to {base}, median | range over rounds |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, runs in times.items():
        # "[CPU]" rows: process CPU time a step, compared with the baseline's CPU time.
        reference = times[f"{base} [CPU]"] if name.endswith("[CPU]") else times[base]
        median = statistics.median(runs)
        ratios = [t / d for t, d in zip(runs, reference, strict=True)]
        spread = f"{min(ratios):.3f} - {max(ratios):.3f}"
        print(f"| {name} | {1e3 * median:.1f} | {1 / median:.2f} | {statistics.median(ratios):.3f} | {spread} |")


def _slowest(ranks: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    # Ranks step in lockstep; take the slower rank's time for each run.
    return {name: [max(times) for times in zip(*(r[name] for r in ranks), strict=True)] for name in ranks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    params = TeacherRegression(width=args.width, depth=args.depth).num_parameters
    lightning = _slowest(run_distributed(_rank, timeout=3600, **vars(args)))
    raw = _slowest(run_distributed(_raw_rank, timeout=3600, **vars(args)))
    print(f"MLP {args.width}x{args.depth} ({params / 1e6:.1f}M parameters, fp32), 2 CPU ranks (gloo), a core each,")
    print("batch 32 a rank,")
    print(f"{args.steps} steps a run (first 3 not timed), {args.rounds} interleaved rounds; median over rounds.\n")
    print("Through Lightning's Trainer:\n")
    _table(lightning, "DDPStrategy")
    print("\nThe hook alone, torch DDP without Lightning:\n")
    _table(raw, HOOKS[0])


if __name__ == "__main__":
    main()
