"""Each rank its own Adam moments, the step averaged every step: fidelity against dense AdamW, nothing compressed.

    python benchmarks/adam_per_rank.py --task mlp --optimizer adamw [--steps 120] [--rows dense per-rank blended]

A matrix task (``benchmarks/matrix.py``) on two gloo ranks on this machine's loopback, the held-out metric after
``--steps``. The first tenth of the run is AdamW on the averaged gradient (every row); then, by row, a comm hook
replaces each rank's gradient by a step direction computed from its own gradient alone, and the average of those
directions is the step (what a compressed scheme would send, here sent whole so that only the scheme differs):

- ``dense``: AdamW on the averaged gradient all run;
- ``check``: each rank's own first moment, averaged: the average of the ranks' moments is the whole batch's, so the
  step is dense AdamW's (a check of the machinery: it must end where ``dense`` does);
- ``per-rank``: each rank's own Adam step ``m_i / (sqrt(v_i) + eps)``, bias-corrected, averaged. ``v_i`` is the
  second moment of the rank's own batch, larger than the whole batch's by the noise the other batches would
  average away;
- ``blended``: as ``per-rank``, with ``v_i`` unbiased for that noise by the rank's own estimate of it:
  ``v_i / N + (1 - 1/N) m_i^2`` (the noise is ``v_i - m_i^2``, of which the whole batch keeps ``1/N``).

The hook is registered on DDP directly: Lightning's ``DDPStrategy`` registers a comm hook on CUDA only. Prints one
JSON line a row.
"""

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy

sys.path.insert(0, str(Path(__file__).parent))
import matrix
from adam_local_steps import SwitchedAdamW, wrap_optimizers
from matrix_tasks import TASKS

from lightning_gravac.launch import run_distributed

ROWS = ("dense", "check", "per-rank", "blended")


class AveragedSteps(SwitchedAdamW):
    """AdamW until step ``switch``; from then on ``.grad`` holds the averaged step direction the hook made (or, in
    the ``check`` row, the averaged first moment), applied with AdamW's decoupled decay and bias correction."""

    row = "dense"

    def switched_step(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        (beta1, beta2), lr, decay, eps = group["betas"], group["lr"], group["weight_decay"], group["eps"]
        state["step"] += 1
        t = float(state["step"])
        p.mul_(1 - lr * decay)
        if self.row == "check":  # the averaged moment: the whole batch's gradient and second moment follow
            m = p.grad
            g = (m - beta1 * state["exp_avg"]) / (1 - beta1)
            state["exp_avg"].copy_(m)
            state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        else:
            p.add_(p.grad, alpha=-lr / (1 - beta1**t))


def direction_hook(optimizer_of: Any) -> Any:
    """A comm hook that, after the switch, replaces each rank's gradients by its own direction (by the row of the
    optimizer ``optimizer_of()`` returns: Lightning makes it after DDP), then averages the bucket; before the switch,
    the plain average, stock DDP's."""

    def hook(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        optimizer = optimizer_of()
        buffer = bucket.buffer()
        if optimizer.after_switch():
            world = dist.get_world_size()
            directions = []
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                group = next(gr for gr in optimizer.param_groups if any(q is p for q in gr["params"]))
                (beta1, beta2), eps, state = group["betas"], group["eps"], optimizer.state[p]
                if "own_avg" not in state:  # this rank's moments, from the whole batch's at the switch
                    state["own_avg"], state["own_avg_sq"] = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
                t = float(state["step"]) + 1
                m, v = state["own_avg"], state["own_avg_sq"]
                m.mul_(beta1).add_(g.view_as(m), alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g.view_as(v), g.view_as(v), value=1 - beta2)
                if optimizer.row == "check":
                    directions.append(m.reshape(-1).clone())
                    continue
                v_hat = v / (1 - beta2**t)
                if optimizer.row == "blended":
                    v_hat = v_hat / world + (1 - 1 / world) * (m / (1 - beta1**t)).square()
                directions.append((m / (v_hat.sqrt() + eps)).reshape(-1))
            buffer.copy_(torch.cat(directions))
        buffer.div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])

    return hook


def _train(rank: int, world_size: int, task: str, row: str, steps: int, optimizer: str) -> dict[str, Any]:
    made: list[AveragedSteps] = []

    def averaged(opt: torch.optim.Optimizer) -> AveragedSteps:
        out = AveragedSteps.of(opt)
        out.switch, out.row = (math.inf if row == "dense" else math.ceil(0.1 * steps)), row
        made.append(out)
        return out

    wrap_optimizers(averaged)

    class Hooked(DDPStrategy):
        def _register_ddp_hooks(self) -> None:
            assert self.model is not None
            self.model.register_comm_hook(None, direction_hook(lambda: made[-1]))

    matrix.make_row = lambda *_, **__: (Hooked(), [])
    return matrix._train(rank, world_size, task=task, row=row, scale=0.25, steps=steps, cap=1e9, optimizer=optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=TASKS, default="mlp")
    parser.add_argument("--optimizer", choices=("task", "adamw"), default="adamw")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    args = parser.parse_args()
    for row in args.rows:
        out = run_distributed(
            _train, world_size=2, timeout=3600, task=args.task, row=row, steps=args.steps, optimizer=args.optimizer
        )[0]
        print(json.dumps({"task": args.task, "row": row, "held_out": out["held_out"]}))


if __name__ == "__main__":
    main()
