"""What GraVAC sends for an Adam-like optimizer: dense or whole in fp16 while it holds, and what it says of it.

An optimizer that divides each coordinate by a running second moment (Adam, AdamW, RMSprop, Adagrad) is upset by
error-fed sparse or quantized gradients, not by a 16-bit cast. So GraVAC holds such an optimizer at dense or fp16:
all the run, or until Adam's second moment is frozen and its first moment is sent compressed (``adam="moment"``).
"""

from typing import TYPE_CHECKING, Literal

import pytorch_lightning as pl
import torch

from lightning_gravac.callbacks.gravac.cost import DENSE
from lightning_gravac.callbacks.gravac.prediction import seconds_by_factor
from lightning_gravac.state import HALF

if TYPE_CHECKING:
    from lightning_gravac.callbacks.gravac.controller import GraVAC

#: What GraVAC does for an Adam-like optimizer and a lossy method (the ``adam`` argument).
AdamPolicy = Literal["moment", "fp16", "dense", "compress"]


def check_rung(c: "GraVAC", pl_module: "pl.LightningModule") -> None:
    """Turn ``c``'s fp16 rung off where it cannot be sent: 16-bit parameters, a method with its own accumulation or
    one factor, a ladder from 2 or less (at setup, and again at fit start for layers built in configure_model). Turn
    it on for the hold of an Adam-like optimizer (``adam="fp16"``), where it is the only factor besides 1."""
    method = c.state.compressor
    fp32 = all(p.dtype == torch.float32 for p in pl_module.parameters() if p.requires_grad)
    held = c.adaptive_optimizer and c.adam in ("fp16", "moment") and c.rule.models_cost
    # Held for Adam, a method of one factor (the moments' scaled signs) leaves fp16 a choice of its own.
    own_state = method.owns_feedback or method.near_lossless or (method.fixed_cf is not None and not held)
    # From the user's choice, not from what the last fit derived: an Adam fit's rung does not outlive that fit.
    c.fp16_rung = (c.fp16_rung_asked or held) and fp32 and not own_state and (held or c.search_state.cf_min > HALF)


def held_factor(c: "GraVAC") -> float | None:
    """The factor to send next step when Adam decides it, ``None`` when the search does. While ``c`` holds an
    Adam-like optimizer: fp16 if the rung can be sent and the cost model predicts it faster than dense (before the
    first window ends, from the fit-start probe alone: the rest of the step is the same for both), else dense. Once
    Adam's moments move under a method of one factor (scaled signs): dense, fp16 or that factor, whichever the cost
    model predicts fastest; that factor while the link is unknown. Nothing to search: what a step keeps of the moment
    is carried by error feedback, and the second moment no longer sees it."""
    if c.holds_for_adam:
        seconds = seconds_by_factor(c)
        if c.adam == "dense" or not c.rungs or seconds is None:
            return DENSE
        return HALF if seconds(HALF) < seconds(DENSE) else DENSE
    if c.moments_moved() and c.state.compressor.fixed_cf is not None:
        fixed, seconds = float(c.state.compressor.fixed_cf or DENSE), seconds_by_factor(c)
        if seconds is None:
            return fixed
        return min([DENSE, *c.rungs, fixed], key=lambda cf: (seconds(cf), cf))
    return None


def hold_warning(c: "GraVAC") -> str:
    """What an Adam-like optimizer gets from ``c``'s hold: dense or fp16 by the link, or dense and why."""
    if c.rungs and c.adam in ("fp16", "moment"):
        sending = "sending each step dense or whole in fp16, whichever the measured link makes faster"
    else:
        sending = f"sending dense (factor 1): {_why_no_half(c)}"
    if c.state.rows.rows:
        sending += " (embedding tables by the rows each step touched: the same sum)"
    return (
        f"GraVAC: the optimizer scales each coordinate by a running second moment (Adam-like), which lossy "
        f"{c.state.compressor.name!r} gradients upset: {sending}. `GraVAC(adam='compress')` compresses anyway."
    )


def _why_no_half(c: "GraVAC") -> str:
    """Why ``c``'s hold cannot send fp16 (with no rung to send)."""
    if c.adam == "dense":
        return "asked with `adam='dense'`"
    if not c.rule.models_cost:
        return "the sequential search has no cost model to weigh fp16 against dense"
    if not c.fp16_rung:
        return (
            f"fp16 cannot be sent here (parameters not in fp32, or {c.state.compressor.name!r} keeps an "
            "accumulation of its own or sends one fixed factor)"
        )
    return "the link was not measured (one rank, or `link_probe=False`), so fp16 cannot be shown to pay"
