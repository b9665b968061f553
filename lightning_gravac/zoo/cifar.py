"""CIFAR-10 and CIFAR-100 from the standard python-pickle archives, or synthetic images of the same shapes.

The archives are the ones published at https://www.cs.toronto.edu/~kriz/cifar.html: ``cifar-10-python.tar.gz``
(``cifar-10-batches-py/data_batch_1`` .. ``_5``, ``test_batch``) and ``cifar-100-python.tar.gz``
(``cifar-100-python/train``, ``test``), each a pickled dict with ``b"data"`` (``N x 3072`` uint8, channel-major)
and ``b"labels"`` (CIFAR-10) or ``b"fine_labels"`` (CIFAR-100).
"""

import hashlib
import pickle
import shutil
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pytorch_lightning as pl
import torch
from lightning_utilities.core.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_gravac.missing_data import MissingData, raise_on_every_rank
from lightning_gravac.zoo.transforms import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR100_MEAN,
    CIFAR100_STD,
    normalize,
    random_crop,
    random_flip,
)

Variant = Literal["cifar10", "cifar100"]


@dataclass(frozen=True)
class _Archive:
    url: str
    md5: str
    folder: str
    train: tuple[str, ...]
    test: str
    label_key: bytes
    classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


ARCHIVES = {
    "cifar10": _Archive(
        "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a",
        "cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)), "test_batch", b"labels", 10,
        CIFAR10_MEAN, CIFAR10_STD,
    ),
    "cifar100": _Archive(
        "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85",
        "cifar-100-python", ("train",), "test", b"fine_labels", 100, CIFAR100_MEAN, CIFAR100_STD,
    ),
}  # fmt: skip
#: Images in the real training and test splits.
TRAIN_SIZE, TEST_SIZE = 50_000, 10_000
#: Seconds a download waits for the server before saying how to do without it.
DOWNLOAD_TIMEOUT = 30


def read_split(root: Path, variant: Variant, train: bool) -> tuple[Tensor, Tensor]:
    """Images (``[N, 3, 32, 32]`` uint8) and labels (int64) of a split, from the extracted archive under ``root``."""
    archive = ARCHIVES[variant]
    folder = Path(root) / archive.folder
    names = archive.train if train else (archive.test,)
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise MissingData(
            f"{variant}: expected {', '.join(str(folder / n) for n in missing)} (the extracted "
            f"{archive.url.rsplit('/', 1)[1]}). Set `download: true` where the network allows, place the archive's "
            f"contents there, or set `synthetic: true` for images of the same shapes."
        )
    images, labels = [], []
    for name in names:
        with open(folder / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[archive.label_key], dtype=np.int64))
    return torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels))


def download(root: Path, variant: Variant) -> None:
    """Fetch the archive into ``root``, check its MD5, extract it. Does nothing if it is already extracted."""
    archive = ARCHIVES[variant]
    root = Path(root)
    if (root / archive.folder / archive.test).is_file():
        return
    root.mkdir(parents=True, exist_ok=True)
    target = root / archive.url.rsplit("/", 1)[1]
    if not target.is_file():
        rank_zero_info(f"Downloading {archive.url} to {target}")
        partial = target.with_name(target.name + ".part")  # renamed once whole: a failed download leaves no archive
        try:
            with urllib.request.urlopen(archive.url, timeout=DOWNLOAD_TIMEOUT) as response, open(partial, "wb") as f:
                shutil.copyfileobj(response, f)
        except OSError as error:  # no network, a refused or timed-out connection (URLError is an OSError)
            partial.unlink(missing_ok=True)
            raise MissingData(
                f"{variant}: could not download {archive.url} ({getattr(error, 'reason', error)}). Place the "
                f"extracted archive in {root / archive.folder}, or train on images of the same shapes with "
                "`synthetic: true` (on the command line: data.init_args.synthetic=true)."
            ) from error
        partial.replace(target)
    digest = hashlib.md5(target.read_bytes()).hexdigest()
    if digest != archive.md5:
        raise OSError(f"{target}: MD5 {digest}, expected {archive.md5}. Delete it and download again.")
    with tarfile.open(target) as tar:
        tar.extractall(root, filter="data")


class SyntheticImages(Dataset):
    """``size`` CIFAR-shaped uint8 images, each its class's fixed random pattern plus noise: learnable, no files.

    Image ``i`` is generated from ``(seed, i)`` when asked for, so the set costs no memory and every rank agrees.
    """

    def __init__(self, size: int, classes: int, seed: int = 0) -> None:
        self.size, self.classes, self.seed = size, classes, seed
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randint(0, 256, (classes, 3, 32, 32), generator=g, dtype=torch.uint8)
        self.labels = torch.randint(0, classes, (size,), generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = self.labels[i]
        noise = torch.randint(-64, 65, (3, 32, 32), generator=g)
        return (self.patterns[label].int() + noise).clamp_(0, 255).to(torch.uint8), label


class _Augmented(Dataset):
    """Images of another dataset, cropped and flipped (training) and normalized, as float tensors."""

    def __init__(self, images: Dataset, mean: tuple[float, ...], std: tuple[float, ...], train: bool) -> None:
        self.images, self.mean, self.std, self.train = images, mean, std, train

    def __len__(self) -> int:
        return len(self.images)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        image, label = self.images[i]
        if self.train:
            image = random_flip(random_crop(image, 32, 4))
        return normalize(image, self.mean, self.std), label


class _Tensors(Dataset):
    def __init__(self, images: Tensor, labels: Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.images[i], self.labels[i]


class CIFARDataModule(pl.LightningDataModule):
    """CIFAR-10 or CIFAR-100: random crop (padding 4) and flip for training, per-channel normalization.

    Args:
        variant: ``"cifar10"`` or ``"cifar100"``.
        root: where the extracted archive lies (or is downloaded to).
        batch_size: per-rank batch size (the papers' 32).
        download: fetch the archive (MD5-checked) when it is missing; rank 0 downloads, the others wait.
        synthetic: generated images of the same shapes, classes and split sizes instead of files.
        synthetic_size: training images in synthetic mode (default: the real 50,000).
        num_workers: data loader workers per rank.
    """

    def __init__(
        self,
        variant: Variant = "cifar10",
        root: str = "data",
        batch_size: int = 32,
        download: bool = False,
        synthetic: bool = False,
        synthetic_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if variant not in ARCHIVES:
            raise ValueError(f"`variant` must be one of {tuple(ARCHIVES)}, got {variant!r}.")
        self.variant, self.root, self.batch_size = variant, Path(root), batch_size
        self.download, self.synthetic, self.synthetic_size, self.num_workers = (
            download, synthetic, synthetic_size, num_workers,
        )  # fmt: skip
        self.archive = ARCHIVES[variant]
        self.train_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self._missing: MissingData | None = None  # what rank 0's download could not fetch

    @property
    def num_classes(self) -> int:
        """Classes of the variant: 10 or 100."""
        return self.archive.classes

    def prepare_data(self) -> None:
        # Lightning calls this on one process per node before `setup`, while the others wait: a failure is kept for
        # `setup`, where every rank learns of it.
        self._missing = None
        if self.download and not self.synthetic:
            try:
                download(self.root, self.variant)
            except MissingData as missing:
                self._missing = missing

    def setup(self, stage: str) -> None:
        if self.synthetic:
            train_size = self.synthetic_size or TRAIN_SIZE
            train: Dataset = SyntheticImages(train_size, self.num_classes, seed=0)
            test: Dataset = SyntheticImages(max(1, train_size * TEST_SIZE // TRAIN_SIZE), self.num_classes, seed=1)
        else:
            missing = self._missing
            if missing is None:
                try:
                    train = _Tensors(*read_split(self.root, self.variant, train=True))
                    test = _Tensors(*read_split(self.root, self.variant, train=False))
                except MissingData as error:
                    missing = error
            raise_on_every_rank(self.trainer, missing)
        self.train_set = _Augmented(train, self.archive.mean, self.archive.std, train=True)
        self.test_set = _Augmented(test, self.archive.mean, self.archive.std, train=False)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, self.batch_size, shuffle=True, num_workers=self.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.test_set is not None
        return DataLoader(self.test_set, self.batch_size, num_workers=self.num_workers)
