"""Fully sharded training (FSDP2) with block-coded gradients against stock ``ModelParallelStrategy``: held-out loss.

    python benchmarks/sharded.py [--methods stock int8 int4] [--seeds 0 1 2] [--steps 150] [--width 128]
                                 [--world-size 2] [--replica-groups 1] [--links unlimited 1gbit 100mbit]
                                 [--out benchmarks/results]

Each method trains the matrix's gpt task (``ByteGPT``, AdamW at lr 1e-3, 64-byte windows of the text Lightning ships
with itself, the last tenth held out) with every transformer block and the whole model sharded by ``fully_shard``,
from the same seed on the same data, for ``--steps`` steps, then measures the held-out loss. ``stock`` is Lightning's
``ModelParallelStrategy``; ``none``, ``int8`` and ``int4`` are ``GraVACModelParallelStrategy``'s, and ``int8-w8``
(``int4-w8``) gathers the parameters in 8-bit codes as well (``all_gather_code="int8"``). Seeds are paired:
each seed's methods start from one initialization and read one order of windows; the table gives each method's
held-out loss relative to stock's, seed by seed and their mean, and the bytes the gradient reduce-scatters sent (the
parameters' all-gather not counted). With ``--replica-groups R`` ours shard within R groups of ranks and average
between them in the method's code (stock shards over every rank); the table adds the bytes sent between groups.

``no communication`` (not in the default ``--methods``; add it with ``--links``) is the time a sharded run is judged
against: each rank trains its own unsharded copy of the same model (a one-device Trainer, no process group) on the
same per-rank batch, the windows the sharded rank reads, for the same steps, with nothing sent, the ranks running
side by side as the sharded ones do. Its time is the limit because FSDP2's ranks each run the whole model's forward
and backward on their own batch: sharding adds the communication and the (un)sharding work, not compute. (Only the
optimizer's step is smaller sharded, a rank stepping its shard; for AdamW on this model a small part of a step.) Its
held-out loss is said but not judged: a rank alone trains on a 1/world of the data, so it is no fidelity row.

Without ``--links`` nothing is shaped and the wall time is not a measurement (the machine may be busy): fidelity only.
With ``--links`` the script re-executes itself as root in a private network namespace whose loopback ``tc`` shapes,
as ``benchmarks/bandwidth.py`` does, and every method runs on each link: the table adds its seconds for the steps,
and each method's time over stock's and over the limit's (``no communication``'s, when it runs).

Writes ``sharded.json`` and ``sharded.md`` under ``--out`` and prints the table.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from bandwidth import _shape, prepare_namespace, run_in_namespace  # the bandwidth benchmark's token-bucket shaping
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_gravac import GraVACModelParallelStrategy
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo.gpt import ByteGPT, Windows, read_bytes

_INSIDE = "GRAVAC_SHARDED_NETNS"
ALONE = "no communication"
METHODS = ("stock", "none", "int8", "int4", "int8-w8", "int4-w8", ALONE)
#: What a launcher sets: a rank alone drops it, so that its Trainer starts no process group.
LAUNCHER = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
CONTEXT = 64


class ShardedGPT(ByteGPT):
    """ByteGPT whose ``configure_model`` shards each transformer block and then the whole model (FSDP2)."""

    def configure_model(self) -> None:
        if isinstance(self, FSDPModule):  # sharded by the fit already: Lightning calls this again to validate
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def _text() -> torch.Tensor:
    path = Path(pl.__file__).parent / "CHANGELOG.md"
    if not path.is_file():
        raise SystemExit(f"The benchmark reads the text Lightning ships with itself, {path}: not found.")
    return read_bytes(path)


def _train(
    rank: int, world_size: int, method: str, seed: int, steps: int, width: int, replica_groups: int = 1
) -> dict[str, Any]:
    pl.seed_everything(seed)
    text = _text()
    cut = int(text.numel() * 0.9)
    train = Windows(text[:cut], CONTEXT, steps * 16 * world_size, seed=1 + seed)
    held = Windows(text[cut:], CONTEXT, 512, seed=0)
    strategy: ModelParallelStrategy | str = "auto"
    if method == ALONE:
        # This rank's unsharded copy (the sharded runs' initialization) on one device, no process group, reading the
        # windows the sharded rank reads (the distributed sampler's, unshuffled).
        for name in LAUNCHER:
            os.environ.pop(name, None)
        model: ByteGPT = ByteGPT(width=width, layers=4, heads=4, context=CONTEXT, lr=1e-3)
        data: Dataset = Subset(train, range(rank, len(train), world_size))
    else:
        model, data = ShardedGPT(width=width, layers=4, heads=4, context=CONTEXT, lr=1e-3), train
        sizes = {"data_parallel_size": world_size, "tensor_parallel_size": 1}
        code, _, weights = method.partition("-w")  # "int8-w8": int8 gradients, parameters gathered in int8
        ours = {"all_gather_code": f"int{weights}" if weights else None, "replica_groups": replica_groups}
        strategy = (
            ModelParallelStrategy(**sizes) if code == "stock" else GraVACModelParallelStrategy(code, **sizes, **ours)
        )
    quiet = {f"enable_{part}": False for part in ("checkpointing", "progress_bar", "model_summary")}
    devices = 1 if method == ALONE else world_size
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         num_sanity_val_steps=0, limit_val_batches=0, **quiet)  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, DataLoader(data, 16, shuffle=False))
    seconds = time.perf_counter() - start
    trainer.limit_val_batches = 1.0
    (metrics,) = trainer.validate(model, DataLoader(held, 64), verbose=False)
    mine = isinstance(strategy, GraVACModelParallelStrategy)
    sent, between = (strategy.bytes_sent, strategy.bytes_between_groups) if mine else (None, None)
    return {
        "method": method,
        "seed": seed,
        "held_out": float(metrics["val_loss"]),
        "seconds": seconds,
        "bytes_sent": sent,
        "bytes_between_groups": between,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _table(rows: list[dict[str, Any]], link: str | None) -> list[str]:
    stock = {r["seed"]: r["held_out"] for r in rows if r["method"] == "stock"}
    seeds = sorted(stock)
    groups = any(r.get("bytes_between_groups") for r in rows)
    seconds = {m: statistics.mean(r["seconds"] for r in rows if r["method"] == m) for m in ("stock", ALONE)
               if any(r["method"] == m for r in rows)}  # fmt: skip
    head = "| method | held-out loss, mean | x stock's, by seed | mean | bytes a rank sent |"
    head += " between groups |" * groups
    if link:
        head += " seconds | x stock's time |" + " x the limit's |" * (ALONE in seconds)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = {r["seed"]: r for r in rows if r["method"] == method}
        mean_loss = statistics.mean(r["held_out"] for r in mine.values())
        if method == ALONE:  # each rank on its share of the data alone: a time limit, not a fidelity row
            line = f"| {method} | {mean_loss:.4f} | not judged | not judged | 0 |"
        else:
            gaps = [mine[s]["held_out"] / stock[s] - 1 for s in seeds if s in mine]
            by_seed = ", ".join(f"{g:+.2%}" for g in gaps)
            sent = [r["bytes_sent"] for r in mine.values() if r["bytes_sent"] is not None]
            sent_text = f"{statistics.mean(sent) / 1e6:.1f} MB" if sent else ""
            line = f"| {method} | {mean_loss:.4f} | {by_seed} | {statistics.mean(gaps):+.2%} | {sent_text} |"
        if groups:
            between = [r["bytes_between_groups"] for r in mine.values() if r["bytes_between_groups"] is not None]
            line += f" {statistics.mean(between) / 1e6:.1f} MB |" if between else " |"
        if link:
            mean_seconds = statistics.mean(r["seconds"] for r in mine.values())
            line += f" {mean_seconds:.1f} | {mean_seconds / seconds['stock']:.2f}x |"
            if ALONE in seconds:
                line += f" {mean_seconds / seconds[ALONE]:.2f}x |"
        lines.append(line)
    if ALONE in seconds:
        lines.append(
            f"\n{ALONE}: each rank alone on its share of the data, nothing sent: the time limit, its loss not judged."
        )
    return lines


def _run(args: argparse.Namespace, out: Path, links: list[str | None]) -> None:
    results: dict[str, list[dict[str, Any]]] = {}
    lines = []
    for link in links:
        if link is not None:
            _shape(link)
        rows = []
        for seed in args.seeds:
            for method in args.methods:
                run = {"method": method, "seed": seed, "steps": args.steps, "width": args.width}
                row = run_distributed(_train, args.world_size, 7200, replica_groups=args.replica_groups, **run)[0]
                rows.append(row)
                print(f"[{link or 'unshaped'}] seed {seed} {method}: held-out {row['held_out']:.4f}", flush=True)
        results[link or "unshaped"] = rows
        lines += [f"\n{link or 'unshaped'}, {args.steps} steps, {rows[0]['parameters'] / 1e6:.2f}M parameters:\n"]
        lines += _table(rows, link)
    if any(links):
        _shape("unlimited")
    text = "\n".join(lines)
    print(text)
    (out / "sharded.md").write_text(text + "\n")
    (out / "sharded.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["stock", "int8", "int4"], choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--width", type=int, default=128, help="the transformer's width (256: ByteGPT's 3.3M)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--replica-groups", type=int, default=1, help="ours: shard within groups, average between")
    parser.add_argument("--links", nargs="+", default=None, help="shaped links, e.g. unlimited 1gbit 100mbit (root)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if "stock" not in args.methods:
        parser.error("--methods must include stock, which the others are measured against")
    if args.links is None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        _run(args, out, [None])
    elif os.environ.get(_INSIDE) == "1":
        _run(args, prepare_namespace(args.out), args.links)
    else:
        run_in_namespace(_INSIDE, "benchmarks/sharded.py")


if __name__ == "__main__":
    main()
