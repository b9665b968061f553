"""A synthetic task that needs no download: a student MLP learns a fixed random teacher MLP."""

import itertools

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


class TeacherRegression(pl.LightningModule):
    """An MLP regressor with a known, reachable minimum: the teacher that made the data.

    Args:
        width: hidden width; parameters grow as ``width**2 * (depth - 1)``.
        depth: number of hidden layers.
        n_in: input features (must match the data).
        lr: SGD learning rate.
        momentum: SGD momentum.
    """

    def __init__(self, width: int = 64, depth: int = 2, n_in: int = 16, lr: float = 0.05, momentum: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise([n_in] + [width] * depth):
            layers += [nn.Linear(a, b), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        self.lr, self.momentum = lr, momentum

    @property
    def num_parameters(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def teacher_dataset(n: int = 2048, n_in: int = 16, seed: int = 0) -> TensorDataset:
    """``n`` inputs from N(0, I) and the outputs of a random one-hidden-layer tanh teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=g)
    w1, w2 = torch.randn(n_in, 32, generator=g) / n_in**0.5, torch.randn(32, 1, generator=g) / 32**0.5
    return TensorDataset(x, torch.tanh(x @ w1) @ w2)


class TeacherDataModule(pl.LightningDataModule):
    """The teacher's data. Each rank reads its own shard (Lightning adds the distributed sampler).

    Args:
        n: number of samples.
        n_in: input features.
        batch_size: per-rank batch size.
        seed: seed of the teacher and the inputs.
        val_n: of the ``n`` samples, the last ``val_n`` held out to validate on; 0, the default, validates nothing.
    """

    def __init__(self, n: int = 2048, n_in: int = 16, batch_size: int = 32, seed: int = 0, val_n: int = 0) -> None:
        super().__init__()
        if not 0 <= val_n < n:
            raise ValueError(f"`val_n` holds out some of the `n`={n} samples: 0 <= val_n < n, got {val_n}.")
        self.n, self.n_in, self.batch_size, self.seed, self.val_n = n, n_in, batch_size, seed, val_n

    def _split(self, held_out: bool) -> TensorDataset:
        """The last ``val_n`` samples if ``held_out``, else the others (all of them when ``val_n`` is 0)."""
        data, cut = teacher_dataset(self.n, self.n_in, self.seed), self.n - self.val_n
        return TensorDataset(*(t[cut:] if held_out else t[:cut] for t in data.tensors)) if self.val_n else data

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._split(held_out=False), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        # No loader at all (not an empty one) without a held-out set: Lightning then skips validation, as before.
        return DataLoader(self._split(held_out=True), batch_size=self.batch_size) if self.val_n else []


def bag_of_words_dataset(
    n: int = 8192, vocab: int = 20_000, words: int = 20, dim: int = 16, seed: int = 0
) -> TensorDataset:
    """``n`` bags of ``words`` word ids (Zipf-distributed over ``vocab``) and a teacher's target for each.

    The teacher sums a fixed random ``dim``-vector per word and projects it to one number: a linear model of the
    bag that a student embedding can represent exactly.
    """
    g = torch.Generator().manual_seed(seed)
    weights = 1 / torch.arange(1, vocab + 1, dtype=torch.float) ** 1.1
    bags = torch.multinomial(weights, n * words, replacement=True, generator=g).view(n, words)
    teacher = torch.randn(vocab, dim, generator=g) / dim**0.5
    projection = torch.randn(dim, 1, generator=g) / words**0.5
    return TensorDataset(bags, teacher[bags].sum(1) @ projection)


class BagOfWordsRegression(pl.LightningModule):
    """An embedding bag and a linear read-out: the gradient of a large, sparsely used table, as in NLP and
    recommendation models.

    Each step touches only the rows of the words in its batch, so most of the embedding's gradient is exactly zero
    and the rest is heavy-tailed (frequent words get large updates): the gradients Top-K and GraVAC are made for.
    The embedding's gradient is dense (``sparse=False``), so DDP sends all of it. ``vocab x dim`` parameters
    (10.2M by default).

    Args:
        vocab: words in the table.
        dim: embedding width.
        lr: SGD learning rate.
        momentum: SGD momentum.
    """

    def __init__(self, vocab: int = 20_000, dim: int = 512, lr: float = 0.5, momentum: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embedding = nn.EmbeddingBag(vocab, dim, mode="sum")
        nn.init.normal_(self.embedding.weight, std=0.01)
        self.readout = nn.Linear(dim, 1)

    def forward(self, bags: Tensor) -> Tensor:
        return self.readout(self.embedding(bags))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        bags, y = batch
        loss = nn.functional.mse_loss(self(bags), y)
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"])
