"""Per-key tensors carried from step to step, whose new values wait until the step is known finite on every rank."""

from collections.abc import Iterable

import torch
from torch import Tensor


class Staged:
    """Kept tensors by key, the step's new ones pending beside them, and the buffers a commit freed for reuse.

    A step writes each new value into :meth:`take`'s buffer (a freed one when its shape fits: no allocation a step
    once running) and :meth:`stage` s it; :meth:`commit` makes it the kept one once every rank's gradient was finite,
    :meth:`discard` drops it otherwise, the kept one staying as if the step had not happened.
    """

    def __init__(self) -> None:
        self.kept: dict[str, Tensor] = {}
        self.pending: dict[str, Tensor | None] = {}  # None: the kept one is dropped at commit (all of it was sent)
        self.spares: dict[str, Tensor] = {}

    def take(self, key: str, like: Tensor, dtype: torch.dtype | None = None, recycle: bool = True) -> Tensor:
        """A buffer of ``like``'s shape and device (and ``dtype``, default ``like``'s) for ``key``'s new value: a freed
        one when it fits and ``recycle``, else a new one."""
        dtype = like.dtype if dtype is None else dtype
        spare = self.spares.pop(key, None) if recycle else None
        if spare is None or spare.shape != like.shape or spare.dtype != dtype or spare.device != like.device:
            spare = torch.empty(like.shape, dtype=dtype, device=like.device)
        return spare

    def stage(self, key: str, new: Tensor | None) -> None:
        """``new`` is ``key``'s value once the step is known finite (``None``: none, the kept one dropped)."""
        self.pending[key] = new

    def release(self, key: str, buffer: Tensor) -> None:
        """``buffer`` holds nothing to keep: reused for ``key``'s next value."""
        self.spares[key] = buffer

    def commit(self, keys: Iterable[str]) -> None:
        """The step was finite on every rank: the pending values of ``keys`` become the kept ones."""
        for key in keys:
            if key not in self.pending:
                continue
            new = self.pending.pop(key)
            old = self.kept.pop(key, None) if new is None else self.kept.get(key)
            if new is not None:
                self.kept[key] = new
            if old is not None:
                self.spares[key] = old

    def discard(self, keys: Iterable[str]) -> None:
        """The step was not finite: the pending values of ``keys`` are dropped, their buffers free again."""
        for key in keys:
            new = self.pending.pop(key, None)
            if new is not None:
                self.spares[key] = new

    def clear(self) -> None:
        """Drop every kept and pending value (their buffers stay for reuse)."""
        for key, buffer in self.kept.items():
            self.spares.setdefault(key, buffer)
        self.kept = {}
        self.pending.clear()

    def scale_(self, factor: float) -> None:
        """Multiply every kept value by ``factor``."""
        for tensor in self.kept.values():
            tensor.mul_(factor)

    def load(self, kept: dict[str, Tensor]) -> None:
        """Replace the kept values with copies of ``kept``; nothing pending, no spare."""
        self.kept = {key: tensor.clone() for key, tensor in kept.items()}
        self.pending.clear()
        self.spares = {}
