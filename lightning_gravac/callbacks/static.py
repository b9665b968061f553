"""The static controller: one factor for the whole run."""

import math

import pytorch_lightning as pl
import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_gravac.adaptations.momentum import MomentumCorrection
from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.callbacks.gravac.prediction import masking_weight
from lightning_gravac.compressors.base import Compressor, validate_cf

#: Factor of the controller GraVACStrategy adds when the trainer has none.
DEFAULT_CF = 10.0

#: The share of dense training's progress (:func:`share_of_dense`) below which a fixed factor is said, at fit start, to
#: end behind dense. Measured on a 22K-parameter MLP classifier under SGD (lr 0.05, momentum 0.9), two ranks, held-out
#: loss against stock DDP's, Top-K: at cf 2, 4, 10 and 20 for 96 steps (shares 0.22 to 0.48) 173%, 149%, 87% and 57%
#: above it; at cf 100 (its entries waiting longer than the run: 0) 71% above; at cf 10 without masking, 19% above for
#: 96 steps (0.79) and 4% for 160 (0.88). Where dense's loss has levelled off before the run ends, a share below this
#: can end level with it (cf 10 with masking for 240 steps, 0.56: 8% below).
MIN_SHARE = 0.9


def share_of_dense(
    method: Compressor, momentum: MomentumCorrection, cf: float, dtype: torch.dtype, steps: float
) -> float:
    """The share of dense training's progress a run of ``steps`` steps of ``method`` at ``cf`` makes, for a method that
    sends entries exactly (Top-K, DGC, the threshold methods, Random-K): none of an entry's first
    :meth:`~lightning_gravac.compressors.base.Compressor.masked_wait` steps (its wait to be sent; error feedback
    carries it until then) and, after them, the share of momentum's step that momentum factor masking leaves
    (:func:`~lightning_gravac.callbacks.gravac.prediction.masking_weight`). 1 for a method that sends every entry
    every step, and for a run of unknown length."""
    wait = method.masked_wait(cf, dtype)
    if wait is None or cf <= 1 or not math.isfinite(steps) or steps <= 0:
        return 1.0
    return max(0.0, 1.0 - wait / steps) * masking_weight(method, momentum, cf, dtype)


class Static(Controller):
    """Compress every step at the same factor: the baseline adaptive controllers are measured against.

    At fit start, on several processes, it says once when the factor is expected to end the run behind dense training
    (:func:`share_of_dense` below :data:`MIN_SHARE`: an entry of a sparsifier waits a large part of the run to be sent,
    or momentum factor masking keeps too little of momentum's step), and what keeps dense's result instead.

    Args:
        cf: compression factor, dense bytes / sent bytes; 1 is plain DDP. Default 10, GraVAC's starting factor.
        cap_to_model: lower ``cf`` at setup to the size of the model's largest trainable tensor, where that is smaller,
            instead of refusing the model. ``GraVACStrategy`` installs its default controller so for a method whose
            size its encoding fixes (a 16-bit cast, signs): a frozen backbone under a small head is a valid model.

    Raises:
        ValueError: if ``cf`` is not a finite number >= 1.

    Example::

        Trainer(strategy=GraVACStrategy(compressor="topk"), callbacks=[Static(cf=100)])
    """

    def __init__(self, cf: float = DEFAULT_CF, cap_to_model: bool = False) -> None:
        super().__init__(cf=validate_cf(cf))
        self._caps = cap_to_model
        self._asked = self.cf

    def fit_to_model(self, largest: int) -> None:
        """With ``cap_to_model``, the factor asked for, or the largest trainable tensor's size if that is smaller."""
        if self._caps and largest >= 1:
            self.cf = min(self._asked, float(largest))

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_fit_start(trainer, pl_module)
        if trainer.world_size > 1:  # on one process GraVACStrategy has said that compression saves nothing
            self._say_if_behind(float(trainer.estimated_stepping_batches), pl_module)

    def _say_if_behind(self, steps: float, pl_module: "pl.LightningModule") -> None:
        """Say on rank 0 when :func:`share_of_dense` of this run is below :data:`MIN_SHARE`: from the method, the
        optimizer's momentum settings and the run's length, the same on every rank."""
        method, momentum = self.state.compressor, self.state.carry.get(MomentumCorrection)
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        dtype = max(trainable, key=lambda p: p.numel()).dtype if trainable else torch.float32
        share = share_of_dense(method, momentum, self.cf, dtype, steps)
        if share >= MIN_SHARE:
            return
        wait = method.masked_wait(self.cf, dtype) or math.inf
        kept = masking_weight(method, momentum, self.cf, dtype)
        why = (
            f"an entry waits about {wait:.0f} steps to be sent, longer than the run's {steps:.0f}"
            if wait >= steps
            else f"an entry waits about {wait:.0f} of the run's {steps:.0f} steps to be sent"
        )
        if kept < 1:
            why += f", and momentum factor masking keeps {kept:.0%} of momentum's step"
        rank_zero_warn(
            f"Static: {method.name!r} at cf {self.cf:g} is expected to end behind dense training while the loss still "
            f"falls at the run's end ({why}: about {share:.0%} of dense's progress). For dense's result: "
            f"`GraVACStrategy('int8')` (every entry every step in 8 bits, 3.9x fewer bytes), the default "
            f"`GraVACStrategy()`, or {_longer(wait, kept, steps)}."
        )

    def __repr__(self) -> str:
        return f"Static(cf={self.cf}, cap_to_model=True)" if self._caps else super().__repr__()


def _longer(wait: float, kept: float, steps: float) -> str:
    """What reaches :data:`MIN_SHARE` at this factor, for a method whose entries wait ``wait`` steps, of which masking
    keeps ``kept`` of momentum's step, on a run of ``steps``: a longer run, with masking off where it keeps too little
    for any length."""
    if kept >= MIN_SHARE:
        return f"a run of {wait / (1 - MIN_SHARE / kept):.0f} steps or more"
    unmasked = wait / (1 - MIN_SHARE)
    return "`momentum_masking=False`" + (f" with a run of {unmasked:.0f} steps or more" if unmasked > steps else "")
