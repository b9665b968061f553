"""How far a run's end moves from a tiny change of its first gradient, beside a 16-bit cast every step: whether a
task at a budget can judge a code at all.

    python benchmarks/perturbation.py --task bag --steps 1000 --seeds 0 1 2 [--schedule cosine]

Two data-parallel ranks emulated in one process (each step two batches of 32, their gradients averaged as an
all-reduce averages them), AdamW at the matrix's learning rate, the matrix's regression tasks (``bag``, ``mlp``) at
scale 0.25. Rows, each from the same seed: ``dense``; ``perturbed``, dense whose first averaged gradient is scaled
by ``1 + 1e-6``; ``fp16`` and ``bf16``, each rank's half of the average cast to that type and the halves summed in it
(the default's fp16 step). Prints each row's held-out loss over ``dense``'s, per seed. Where ``perturbed`` moves the
end by more than the fidelity bar, the task's end at that budget measures chaos, not a code.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent))
from matrix_tasks import ADAMW_LR, make_task

ROWS = ("dense", "perturbed", "fp16", "bf16")
_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def held_out(task: str, steps: int, seed: int, row: str, cosine: bool) -> float:
    """The held-out loss after ``steps`` steps of ``row`` from ``seed``."""
    spec = make_task(task, 0.25)
    torch.manual_seed(seed)
    model = type(spec["model"])(**spec["model"].hparams)  # re-initialised from the seed
    inputs, targets = spec["train"].dataset.tensors
    held_inputs, held_targets = (torch.cat(parts) for parts in zip(*spec["held"], strict=True))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=ADAMW_LR[task], weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps) if cosine else None
    order, generator, at = torch.empty(0, dtype=torch.long), torch.Generator().manual_seed(seed), len(inputs)
    for step in range(steps):
        if at + 64 > len(inputs):
            order, at = torch.randperm(len(inputs), generator=generator), 0
        halves = []
        for batch in (order[at : at + 32], order[at + 32 : at + 64]):
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(inputs[batch]), targets[batch]).backward()
            halves.append([p.grad.clone() for p in params])
        at += 64
        for p, a, b in zip(params, *halves, strict=True):
            p.grad = _averaged(a, b, row, first=step == 0)
        optimizer.step()
        if schedule is not None:
            schedule.step()
    with torch.no_grad():
        return F.mse_loss(model(held_inputs), held_targets).item()


def _averaged(a: Tensor, b: Tensor, row: str, first: bool) -> Tensor:
    if row in _WIRE:  # each rank's half cast, summed in the wire's type, as the default's fp16 step sends it
        return (a.div(2).to(_WIRE[row]) + b.div(2).to(_WIRE[row])).float()
    mean = (a + b) / 2
    return mean * (1 + 1e-6) if row == "perturbed" and first else mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="bag", choices=["bag", "mlp"])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--schedule", default="constant", choices=["constant", "cosine"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for seed in args.seeds:
        dense = held_out(args.task, args.steps, seed, "dense", args.schedule == "cosine")
        cells = [f"dense {dense:.6g}"]
        for row in args.rows:
            if row != "dense":
                loss = held_out(args.task, args.steps, seed, row, args.schedule == "cosine")
                cells.append(f"{row} {loss / dense - 1:+.2%}")
        print(f"{args.task} {args.schedule} {args.steps} steps, seed {seed}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
