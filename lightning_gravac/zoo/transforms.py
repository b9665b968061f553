"""The few image transforms the recipes need, in plain torch (no torchvision): crop with padding, flip, normalize."""

import torch
from torch import Tensor

#: Per-channel mean and standard deviation of the CIFAR-10 training images (on the 0..1 scale).
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
#: The same for CIFAR-100.
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


def random_crop(image: Tensor, size: int, padding: int, generator: torch.Generator | None = None) -> Tensor:
    """A ``size`` x ``size`` crop at a uniformly random position of ``image`` (``[C, H, W]``) zero-padded by
    ``padding`` on every side."""
    padded = torch.nn.functional.pad(image, (padding, padding, padding, padding))
    top, left = torch.randint(0, padded.shape[1] - size + 1, (2,), generator=generator).tolist()
    return padded[:, top : top + size, left : left + size]


def random_flip(image: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """``image`` mirrored left to right with probability 1/2."""
    return image.flip(-1) if torch.rand((), generator=generator) < 0.5 else image


def normalize(image: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """A ``uint8`` ``[C, H, W]`` image scaled to 0..1, minus ``mean`` and divided by ``std`` per channel."""
    scaled = image.float().div_(255)
    return scaled.sub_(torch.tensor(mean).view(-1, 1, 1)).div_(torch.tensor(std).view(-1, 1, 1))
