"""Local steps under AdamW: Adam's own inner steps against inner steps with its second moment held, fidelity only.

    python benchmarks/adam_local_steps.py --task gpt [--optimizer task] [--steps 120] [--rows dense held local8 ...]

A matrix task (``benchmarks/matrix.py``) on two gloo ranks on this machine's loopback (the link does not change a
trajectory), the held-out metric after ``--steps``. The first tenth of the run is sent whole (every row), as the
default's warm-up under Adam sends it; then, by row:

- ``dense``: AdamW on the averaged gradient all run;
- ``held``: every step averaged, Adam's bias-corrected second moment held from the warm-up's end (1-bit Adam's
  freeze, without compression);
- ``local<H>``: rounds of ``H`` local steps of AdamW from the warm-up's end, each round's change averaged in QSGD's
  4-bit codes (``OuterUpdate``, as the default starts it mid-fit);
- ``local<H> held``: the same rounds, each inner step AdamW with the second moment held from the warm-up's end;
- ``local<H> whole``, ``local<H> int8``, ``local<H> int4``: Adam's own inner steps, each round's change averaged whole
  or in a block code with error feedback;
- ``local<H> diloco``: Adam's own inner steps, the change averaged whole and applied by DiLoCo's outer Nesterov step
  (``lr=0.7, momentum=0.9``);
- ``held refresh<K>``: as ``held``, the held value replaced by the exact running one every ``K`` steps;
- ``held per tensor``: as ``held``, each tensor's held value rescaled by how the mean of its exact one moved.

``--optimizer adamw`` trains an SGD task with AdamW (the matrix's learning rates). Prints one JSON line a row.
"""

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

sys.path.insert(0, str(Path(__file__).parent))
import matrix
from matrix_tasks import TASKS

from lightning_gravac import GraVACStrategy, LocalSteps, Static
from lightning_gravac.adaptations import OuterUpdate
from lightning_gravac.launch import run_distributed


class SwitchedAdamW(torch.optim.AdamW):
    """torch's AdamW until its parameters have taken ``switch`` steps; from then on each parameter with a gradient is
    stepped by :meth:`switched_step` (its step count not yet advanced)."""

    switch = math.inf

    def after_switch(self) -> bool:
        first = next(iter(self.state.values()), None)
        return first is not None and float(first["step"]) >= self.switch

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.after_switch():
            super().step()
            return loss
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.switched_step(p, group, self.state[p])
        return loss

    def switched_step(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        raise NotImplementedError

    @classmethod
    def of(cls, opt: torch.optim.Optimizer) -> Any:
        """The same optimizer as this class: ``opt`` must be one group of torch's AdamW (exits otherwise)."""
        if type(opt) is not torch.optim.AdamW or len(opt.param_groups) != 1:
            raise SystemExit(f"This row needs one group of torch's AdamW (--optimizer adamw); the task has {opt!r}.")
        group = opt.param_groups[0]
        return cls(group["params"], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                   weight_decay=group["weight_decay"])  # fmt: skip


def wrap_optimizers(wrap: Callable[[torch.optim.Optimizer], torch.optim.Optimizer]) -> None:
    """Make the matrix's tasks (their own optimizer, or AdamW by ``--optimizer adamw``) train with ``wrap`` of it."""
    make_task, use_adamw = matrix.make_task, matrix.use_adamw

    def task(name: str, scale: float, momentum_in_optimizer: bool = True) -> dict[str, Any]:
        spec = make_task(name, scale, momentum_in_optimizer)
        own = spec["model"].configure_optimizers
        spec["model"].configure_optimizers = lambda: wrap(own())
        return spec

    def adamw(model: pl.LightningModule, lr: float) -> None:
        use_adamw(model, lr)
        own = model.configure_optimizers
        model.configure_optimizers = lambda: wrap(own())  # type: ignore[method-assign]

    matrix.make_task, matrix.use_adamw = task, adamw  # the names matrix._train calls


class HeldAdamW(SwitchedAdamW):
    """AdamW whose bias-corrected second moment is held from step ``switch`` on: each parameter's step is then its
    first moment over the held ``sqrt(v_hat) + eps`` (momentum SGD with a fixed per-coordinate step size).

    Two ways to move the held value, each told the exact average's running second moment (which Adam keeps updating
    here, unread otherwise): ``refresh`` > 0 takes it every ``refresh`` steps (0/1 Adam's refresh with the exact
    value, the best any refresh from compressed traffic could do); ``per_tensor`` rescales each tensor's held value
    by how its mean moved (one number a tensor, what a few scalars a step could share)."""

    refresh = 0
    per_tensor = False

    def switched_step(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        (beta1, beta2), lr, decay, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
        if "held" not in state:
            state["held"] = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))  # v_hat at the hold
        state["step"] += 1
        t = float(state["step"])
        state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        exact = state["exp_avg_sq"] / (1 - beta2**t)
        if self.refresh and (t - 1 - self.switch) % self.refresh == self.refresh - 1:
            state["held"] = exact
        held = state["held"] * (exact.mean() / state["held"].mean()) if self.per_tensor else state["held"]
        p.mul_(1 - lr * decay)
        p.addcdiv_(state["exp_avg"], held.sqrt().add_(eps), value=-lr / (1 - beta1**t))


#: The outer update a row's suffix names: the strategy's method and ``LocalSteps``' outer settings (QSGD's 4 bits,
#: the rounds' default, without a suffix).
OUTER: dict[str, tuple[str, dict[str, Any]]] = {
    "": ("qsgd", {}),
    "whole": ("qsgd", {"cf": 1.0}),
    "diloco": ("qsgd", {"cf": 1.0, "lr": 0.7, "momentum": 0.9, "nesterov": True}),
    "int8": ("int8", {"cf": 4.0}),
    "int4": ("int4", {"cf": 8.0}),
}


class StartRounds(pl.Callback):
    """Rounds of ``every`` local steps from step ``at`` on, started as the default starts them mid-fit; ``outer``:
    ``LocalSteps``' outer settings."""

    def __init__(self, at: int, every: int, outer: dict[str, Any] | None = None) -> None:
        self.at, self.every, self.outer = at, every, outer or {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.every and trainer.global_step == self.at:
            state = trainer.strategy.compression_state
            rounds = LocalSteps(every=self.every, **self.outer)
            state.carry.get(OuterUpdate).start(rounds, state.compressor, state.error_feedback, state.step)
            state.config.local_sgd_from = state.step


def _train(rank: int, world_size: int, task: str, row: str, steps: int, optimizer: str) -> dict[str, Any]:
    warm_up = math.ceil(0.1 * steps)
    held = row == "held" or row.endswith(" held") or row.startswith("held ")
    length, _, suffix = row.removeprefix("local").partition(" ")
    every = int(length) if row.startswith("local") else 0
    method, outer = OUTER[suffix if every and suffix != "held" else ""]

    def held_or_not(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not held:
            return opt
        out = HeldAdamW.of(opt)
        out.switch = warm_up
        out.refresh = int(row.removeprefix("held refresh")) if row.startswith("held refresh") else 0
        out.per_tensor = row == "held per tensor"
        return out

    wrap_optimizers(held_or_not)
    # A method at factor 1 sends every step whole, bit for bit stock DDP's; the rounds' change as ``OUTER`` says.
    matrix.make_row = lambda *_, **__: (GraVACStrategy(method), [Static(cf=1), StartRounds(warm_up, every, outer)])
    return matrix._train(rank, world_size, task=task, row=row, scale=0.25, steps=steps, cap=1e9, optimizer=optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=TASKS, default="gpt")
    parser.add_argument("--optimizer", choices=("task", "adamw"), default="task")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rows", nargs="+", default=["dense", "held", "local8", "local8 held"])
    args = parser.parse_args()
    for row in args.rows:
        out = run_distributed(
            _train, world_size=2, timeout=3600, task=args.task, row=row, steps=args.steps, optimizer=args.optimizer
        )[0]
        print(json.dumps({"task": args.task, "row": row, "held_out": out["held_out"], "local": out["local"]}))


if __name__ == "__main__":
    main()
