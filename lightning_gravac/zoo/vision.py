"""Image classification: ResNet and VGG-BN in their CIFAR forms, as one LightningModule.

CIFAR forms (He et al. 2016; Simonyan & Zisserman 2015, as the compression papers train them on 32x32 images): a 3x3
stem with stride 1 and no max-pool for ResNet, and a single linear classifier over the 512 features of the last
block for VGG. The number of classes comes from the data module (``num_classes``) unless given.
"""

from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_gravac.zoo.optim import configure_sgd

Architecture = Literal["resnet18", "resnet50", "resnet101", "vgg11_bn", "vgg16_bn"]

_RESNET_BLOCKS = {"resnet18": ("basic", [2, 2, 2, 2]), "resnet50": ("bottleneck", [3, 4, 6, 3]),
                  "resnet101": ("bottleneck", [3, 4, 23, 3])}  # fmt: skip
_VGG_LAYERS = {
    "vgg11_bn": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16_bn": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
}


class _Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
        )  # fmt: skip
        self.shortcut = _shortcut(cin, width, stride)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out),
        )  # fmt: skip
        self.shortcut = _shortcut(cin, out, stride)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


def _channels(channels: int, width: float) -> int:
    return max(1, round(channels * width))


def resnet(architecture: str, num_classes: int, width: float = 1.0) -> nn.Module:
    """A CIFAR ResNet: 3x3 stem, four stages (64 to 512 wide, times ``width``; strides 1, 2, 2, 2), global pool,
    linear."""
    kind, counts = _RESNET_BLOCKS[architecture]
    block = _Basic if kind == "basic" else _Bottleneck
    stem = _channels(64, width)
    layers: list[nn.Module] = [nn.Conv2d(3, stem, 3, 1, 1, bias=False), nn.BatchNorm2d(stem), nn.ReLU(inplace=True)]
    cin = stem
    for stage, count in enumerate(counts):
        width_here = _channels(64 * 2**stage, width)
        for i in range(count):
            layers.append(block(cin, width_here, 2 if stage > 0 and i == 0 else 1))
            cin = width_here * block.expansion
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))


def vgg(architecture: str, num_classes: int, width: float = 1.0) -> nn.Module:
    """A CIFAR VGG with batch norm: 3x3 convolutions (channels times ``width``), five max-pools to 1x1, one linear
    classifier."""
    layers: list[nn.Module] = []
    cin = 3
    for spec in _VGG_LAYERS[architecture]:
        if spec == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            assert isinstance(spec, int)
            out = _channels(spec, width)
            layers += [nn.Conv2d(cin, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(inplace=True)]
            cin = out
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(cin, num_classes))


class ImageClassifier(pl.LightningModule):
    """ResNet or VGG-BN on CIFAR-sized images, SGD with step decay, top-1 and top-5 accuracy from torchmetrics.

    Args:
        architecture: ``resnet18``, ``resnet50``, ``resnet101``, ``vgg11_bn`` or ``vgg16_bn``.
        num_classes: output classes; ``None`` takes ``num_classes`` from the trainer's data module.
        lr, momentum, weight_decay, milestones, gamma, scale_lr, reference_batch, warmup_epochs: the optimizer's,
            as :func:`~lightning_gravac.zoo.optim.configure_sgd` reads them (momentum 0 with DGC, whose momentum
            correction applies it; ``scale_lr`` for Goyal et al.'s large-minibatch rule).
        width: multiplies every layer's channels (0.5: a narrow net with about a quarter of the parameters and
            computation, for CPUs).
    """

    def __init__(
        self,
        architecture: Architecture = "resnet101",
        num_classes: int | None = None,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        milestones: list[int] | None = None,
        gamma: float = 0.1,
        scale_lr: bool = False,
        reference_batch: int = 256,
        warmup_epochs: float = 0.0,
        width: float = 1.0,
    ) -> None:
        super().__init__()
        if architecture not in (*_RESNET_BLOCKS, *_VGG_LAYERS):
            known = ", ".join((*_RESNET_BLOCKS, *_VGG_LAYERS))
            raise ValueError(f"Unknown architecture {architecture!r}. Known: {known}.")
        if not width > 0:
            raise ValueError(f"`width` multiplies the channels and must be positive, got {width}.")
        self.save_hyperparameters()
        self.net: nn.Module | None = None
        if num_classes is not None:
            self._build(num_classes)

    def _build(self, num_classes: int) -> None:
        build = resnet if self.hparams["architecture"] in _RESNET_BLOCKS else vgg
        self.net = build(self.hparams["architecture"], num_classes, self.hparams.get("width", 1.0))
        self.top1 = MulticlassAccuracy(num_classes, top_k=1)
        self.top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes))

    def configure_model(self) -> None:
        # Called before the strategy wraps the model, on every rank: the classes are known from the data by now.
        if self.net is None:
            datamodule = self.trainer.datamodule  # type: ignore[attr-defined]
            num_classes = getattr(datamodule, "num_classes", None)
            if num_classes is None:
                raise ValueError("ImageClassifier: pass `num_classes` or use a data module that has `num_classes`.")
            self.hparams["num_classes"] = num_classes
            self._build(num_classes)

    def forward(self, x: Tensor) -> Tensor:
        assert self.net is not None, "the network is built at configure_model (or pass num_classes)"
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.top1(logits, y)
        self.top5(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log_dict({"val_acc": self.top1, "val_acc_top5": self.top5}, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return configure_sgd(self)
