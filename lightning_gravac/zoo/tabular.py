"""A classifier of tabular rows: a CSV read into standardized numbers and one-hot categories, and an MLP for it."""

import csv
import io
import itertools
import tarfile
from collections.abc import Sequence
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import Tensor, nn


def read_table(
    path: Path | str, target: str, categorical: Sequence[str] = (), member: str | None = None
) -> tuple[Tensor, Tensor, list[str]]:
    """``(features, labels, classes)`` of a CSV with a header row: the ``categorical`` columns one-hot, every other
    column but ``target`` a number standardized to mean 0 and variance 1, the ``target`` column's values as class
    indices (``classes`` in sorted order). Columns without a name (a row index) are left out. With ``member``,
    ``path`` is a ``.tar.gz`` archive and the CSV is that member of it, read without unpacking the archive.

    Raises:
        FileNotFoundError: naming the path (and member) that was expected.
        ValueError: when ``target`` or a categorical column is not in the header.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"No table at {path}" + (f" (member {member})" if member else "") + ".")
    if member is None:
        text = path.read_text()
    else:
        with tarfile.open(path) as archive:
            handle = archive.extractfile(member)
            if handle is None:
                raise FileNotFoundError(f"{member} is not a file in {path}.")
            text = handle.read().decode()
    rows = list(csv.reader(io.StringIO(text)))
    header, rows = [h.strip('"') for h in rows[0]], rows[1:]
    missing = [c for c in (target, *categorical) if c not in header]
    if missing:
        raise ValueError(f"Columns {missing} are not in {path.name}'s header: {header}.")
    columns = {name: [row[i] for row in rows] for i, name in enumerate(header) if name}
    classes = sorted(set(columns.pop(target)))
    labels = torch.tensor([classes.index(v) for v in (row[header.index(target)] for row in rows)])
    parts = []
    for name, values in columns.items():
        if name in categorical:
            levels = sorted(set(values))
            parts.append(nn.functional.one_hot(torch.tensor([levels.index(v) for v in values]), len(levels)).float())
        else:
            numbers = torch.tensor([float(v) for v in values], dtype=torch.float64)
            parts.append(((numbers - numbers.mean()) / numbers.std().clamp_min(1e-12)).float().unsqueeze(1))
    return torch.cat(parts, dim=1), labels, classes


class TabularClassifier(pl.LightningModule):
    """An MLP with ``depth`` hidden ReLU layers of ``width``; cross-entropy; SGD at ``lr`` with ``momentum``."""

    def __init__(
        self, n_in: int, classes: int, width: int = 256, depth: int = 2, lr: float = 0.01, momentum: float = 0.9
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise([n_in] + [width] * depth):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, classes))
        self.lr, self.momentum = lr, momentum

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.cross_entropy(self(batch[0]), batch[1])
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
