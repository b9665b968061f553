"""Fully sharded training (FSDP2) with block-coded gradients against stock ``ModelParallelStrategy``: held-out loss.

    python benchmarks/sharded.py [--methods stock int8 int4] [--seeds 0 1 2] [--steps 150] [--width 128]
                                 [--task gpt] [--world-size 2] [--replica-groups 1]
                                 [--links unlimited 1gbit 100mbit] [--out benchmarks/results]

Each method trains the matrix's gpt task (``ByteGPT``, AdamW at lr 1e-3, 64-byte windows of the text Lightning ships
with itself, the last tenth held out) with every transformer block and the whole model sharded by ``fully_shard``,
from the same seed on the same data, for ``--steps`` steps, then measures the held-out loss. ``stock`` is Lightning's
``ModelParallelStrategy``; ``none``, ``int8`` and ``int4`` are ``GraVACModelParallelStrategy``'s with FSDP2's own
all-gather (``all_gather_code=None``, not the strategy's default), and ``int8-w8`` (``int4-w8``) gathers the
parameters in 8-bit codes as well (``all_gather_code="int8"``). Seeds are paired:
each seed's methods start from one initialization and read one order of windows; the table gives each method's
held-out loss relative to stock's, seed by seed and their mean, and the bytes the gradient reduce-scatters sent (the
parameters' all-gather not counted). With ``--replica-groups R`` ours shard within R groups of ranks and average
between them in the method's code (stock shards over every rank); the table adds the bytes sent between groups.
``int8-every4`` (``int8-every16``) has each group train on its own and average the groups' parameter changes every 4
(16) optimizer steps in int8 with error feedback (``replica_every``; only with ``--replica-groups`` above 1);
``none-every4`` (``none-every16``) averages them exactly (fp32), each group's own reduce-scatter FSDP2's;
``int8-every4-diloco`` (``int8-every16-diloco``) moves the parameters by DiLoCo's outer step on the int8 average (lr
0.7, Nesterov momentum 0.9) instead of the average itself.

``--task diamonds`` trains the matrix's diamonds classifier instead (``TabularClassifier``: 3 hidden ReLU layers of
1100, 2.45M parameters, AdamW at lr 1e-3 and weight decay 0.01 as the matrix's ``--optimizer adamw``; ggplot2's
diamonds table, the cut's class from the other columns, the matrix's 4096 rows held out), each linear layer and the
whole model sharded by ``fully_shard``, 32 rows a rank a step, each seed reading its own order of the rows.

The held-out loss is measured after the fit by ``Trainer.validate`` through the same sharded modules: with ``-w8``
its forward computes with the parameters gathered in codes, as training's did (the bytes those gathers sent in the
validation are recorded). Those rows also give the held-out loss with the exact parameters (FSDP2's own all-gather
put back for a second validation) in a column of their own.

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
from matrix_tasks import ADAMW_LR, _diamonds, use_adamw  # the matrix's diamonds table and its AdamW
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from lightning_gravac import GraVACModelParallelStrategy, LocalSteps
from lightning_gravac.launch import run_distributed
from lightning_gravac.sharded.all_gather import CodedAllGather
from lightning_gravac.zoo import TabularClassifier
from lightning_gravac.zoo.gpt import ByteGPT, Windows, read_bytes

_INSIDE = "GRAVAC_SHARDED_NETNS"
ALONE = "no communication"
#: Local steps between replica groups: every 4 or 16 optimizer steps, the average in int8 or exact.
LOCAL_STEPS = tuple(f"{code}-every{h}" for code in ("int8", "none") for h in (4, 16))
#: The same in int8 with DiLoCo's outer step (lr 0.7, Nesterov momentum 0.9) in place of the plain average.
DILOCO = tuple(f"int8-every{h}-diloco" for h in (4, 16))
METHODS = ("stock", "none", "int8", "int4", "int8-w8", "int4-w8", *LOCAL_STEPS, *DILOCO, ALONE)
TASKS = ("gpt", "diamonds")
#: What a launcher sets: a rank alone drops it, so that its Trainer starts no process group.
LAUNCHER = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
CONTEXT = 64
#: The diamonds classifier's hidden width (the matrix's at its default scale) and rows a rank a step.
DIAMONDS_WIDTH, DIAMONDS_BATCH = 1100, 32


class ShardedGPT(ByteGPT):
    """ByteGPT whose ``configure_model`` shards each transformer block and then the whole model (FSDP2)."""

    def configure_model(self) -> None:
        if isinstance(self, FSDPModule):  # sharded by the fit already: Lightning calls this again to validate
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


class Diamonds(TabularClassifier):
    """The matrix's diamonds classifier under its AdamW, with a held-out loss (and accuracy) in ``validate``."""

    def __init__(self, n_in: int, classes: int) -> None:
        super().__init__(n_in, classes, width=DIAMONDS_WIDTH, depth=3)
        use_adamw(self, ADAMW_LR["diamonds"])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits = self(batch[0])
        self.log("val_loss", nn.functional.cross_entropy(logits, batch[1]), sync_dist=True)
        self.log("val_accuracy", (logits.argmax(1) == batch[1]).float().mean(), sync_dist=True)


class ShardedDiamonds(Diamonds):
    """Diamonds whose ``configure_model`` shards each linear layer and then the whole model (FSDP2)."""

    def configure_model(self) -> None:
        if isinstance(self, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


def _text() -> torch.Tensor:
    path = Path(pl.__file__).parent / "CHANGELOG.md"
    if not path.is_file():
        raise SystemExit(f"The benchmark reads the text Lightning ships with itself, {path}: not found.")
    return read_bytes(path)


def _data(task: str, steps: int, world_size: int, seed: int) -> tuple[Dataset, Dataset, int, int]:
    """The task's training data (each seed's order), held-out data, and the batch sizes of each."""
    if task == "gpt":
        text = _text()
        cut = int(text.numel() * 0.9)
        train = Windows(text[:cut], CONTEXT, steps * 16 * world_size, seed=1 + seed)
        return train, Windows(text[cut:], CONTEXT, 512, seed=0), 16, 64
    features, labels = _diamonds()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))  # the matrix's split
    rows, held = order[:-4096], order[-4096:]
    rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(1 + seed))]  # this seed's order
    rows = rows[: steps * DIAMONDS_BATCH * world_size]
    return TensorDataset(features[rows], labels[rows]), TensorDataset(features[held], labels[held]), DIAMONDS_BATCH, 256


def _model(task: str, width: int, sharded: bool, data: Dataset) -> pl.LightningModule:
    if task == "gpt":
        return (ShardedGPT if sharded else ByteGPT)(width=width, layers=4, heads=4, context=CONTEXT, lr=1e-3)
    assert isinstance(data, TensorDataset)
    return (ShardedDiamonds if sharded else Diamonds)(data.tensors[0].shape[1], 5)


def _ours(method: str) -> tuple[str, dict[str, Any]]:
    """A method's code and the strategy's options: ``int8-w8`` gathers the parameters in int8, ``int8-every4``
    averages between replica groups every 4 steps, ``int8-every4-diloco`` with DiLoCo's outer step."""
    code, *options = method.split("-")
    ours: dict[str, Any] = {"all_gather_code": None, "replica_every": None}
    for option in options:
        if option.startswith("every"):
            ours["replica_every"] = int(option.removeprefix("every"))
        elif option == "diloco":
            ours["replica_every"] = LocalSteps(every=ours["replica_every"], lr=0.7, momentum=0.9, nesterov=True)
        else:
            ours["all_gather_code"] = f"int{option.removeprefix('w')}"
    return code, ours


def _coded_gathers(model: nn.Module) -> list[CodedAllGather]:
    groups = [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]
    return [g._all_gather_comm for g in groups if isinstance(g._all_gather_comm, CodedAllGather)]


def _train(
    rank: int,
    world_size: int,
    method: str,
    seed: int,
    steps: int,
    width: int,
    replica_groups: int = 1,
    task: str = "gpt",
    nodes: int = 1,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One method's fit and validation on this rank (one of ``nodes`` machines' ``world_size`` ranks, ``options``
    over the method's own strategy options); the row of the table."""
    pl.seed_everything(seed)
    train, held, batch, held_batch = _data(task, steps, world_size, seed)
    strategy: ModelParallelStrategy | str = "auto"
    if method == ALONE:
        # This rank's unsharded copy (the sharded runs' initialization) on one device, no process group, reading the
        # windows the sharded rank reads (the distributed sampler's, unshuffled).
        for name in LAUNCHER:
            os.environ.pop(name, None)
        model = _model(task, width, False, held)
        data: Dataset = Subset(train, range(rank, len(train), world_size))
    else:
        model, data = _model(task, width, True, held), train
        sizes = {"data_parallel_size": world_size, "tensor_parallel_size": 1}
        code, ours = _ours(method)
        ours.update(replica_groups=replica_groups, **(options or {}))
        strategy = (
            ModelParallelStrategy(**sizes) if code == "stock" else GraVACModelParallelStrategy(code, **sizes, **ours)
        )
    quiet = {f"enable_{part}": False for part in ("checkpointing", "progress_bar", "model_summary")}
    devices, nodes = (1, 1) if method == ALONE else (world_size // nodes, nodes)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy, max_steps=steps,
                         logger=False, num_sanity_val_steps=0, limit_val_batches=0, **quiet)  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch, shuffle=False))
    seconds = time.perf_counter() - start
    trainer.limit_val_batches = 1.0
    gathers = _coded_gathers(model)
    before = sum(g.bytes_sent for g in gathers)
    (metrics,) = trainer.validate(model, DataLoader(held, held_batch), verbose=False)
    exact = None
    if gathers:  # the validation gathered the parameters in codes: again with FSDP2's own all-gather
        coded_in_validation = sum(g.bytes_sent for g in gathers) - before
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(DefaultAllGather())
        (exact,) = trainer.validate(model, DataLoader(held, held_batch), verbose=False)
    mine = isinstance(strategy, GraVACModelParallelStrategy)
    sent, between = (strategy.bytes_sent, strategy.bytes_between_groups) if mine else (None, None)
    row = {
        "method": method,
        "seed": seed,
        "held_out": float(metrics["val_loss"]),
        "seconds": seconds,
        "bytes_sent": sent,
        "bytes_between_groups": between,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if "val_accuracy" in metrics:
        row["held_out_accuracy"] = float(metrics["val_accuracy"])
    if exact is not None:
        row["held_out_exact"] = float(exact["val_loss"])
        row["coded_gather_bytes_in_validation"] = coded_in_validation
    return row


def _table(rows: list[dict[str, Any]], link: str | None) -> list[str]:
    stock = {r["seed"]: r["held_out"] for r in rows if r["method"] == "stock"}
    seeds = sorted(stock)
    groups = any(r.get("bytes_between_groups") for r in rows)
    exact = any("held_out_exact" in r for r in rows)  # coded all-gathers: the exact parameters' loss as well
    accuracy = any("held_out_accuracy" in r for r in rows)
    seconds = {m: statistics.mean(r["seconds"] for r in rows if r["method"] == m) for m in ("stock", ALONE)
               if any(r["method"] == m for r in rows)}  # fmt: skip
    head = "| method | held-out loss, mean | x stock's, by seed | mean | bytes a rank sent |"
    head += " between groups |" * groups
    head += " exact parameters: x stock's, by seed | mean |" * exact + " accuracy, mean |" * accuracy
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
        if exact and method != ALONE:
            gaps = [mine[s].get("held_out_exact", mine[s]["held_out"]) / stock[s] - 1 for s in seeds if s in mine]
            line += f" {', '.join(f'{g:+.2%}' for g in gaps)} | {statistics.mean(gaps):+.2%} |"
        elif exact:
            line += " | |"
        if accuracy:
            line += f" {statistics.mean(r.get('held_out_accuracy', float('nan')) for r in mine.values()):.2%} |"
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
                run = {"method": method, "seed": seed, "steps": args.steps, "width": args.width, "task": args.task}
                row = run_distributed(_train, args.world_size, 7200, replica_groups=args.replica_groups, **run)[0]
                rows.append(row)
                print(f"[{link or 'unshaped'}] seed {seed} {method}: held-out {row['held_out']:.4f}", flush=True)
        results[link or "unshaped"] = rows
        task = "" if args.task == "gpt" else f"{args.task}, "
        size = f"{rows[0]['parameters'] / 1e6:.2f}M parameters"
        lines += [f"\n{link or 'unshaped'}, {task}{args.steps} steps, {size}:\n"]
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
    parser.add_argument("--task", default="gpt", choices=TASKS, help="the model and data (diamonds: an MLP)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--replica-groups", type=int, default=1, help="ours: shard within groups, average between")
    parser.add_argument("--links", nargs="+", default=None, help="shaped links, e.g. unlimited 1gbit 100mbit (root)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if "stock" not in args.methods:
        parser.error("--methods must include stock, which the others are measured against")
    if args.replica_groups == 1 and any("-every" in m for m in args.methods):
        parser.error("the -every methods average between replica groups: give --replica-groups 2 (or more)")
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
