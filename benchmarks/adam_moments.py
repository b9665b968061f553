"""What compressing does to AdamW's training, link aside: which quantity is sent, and how, side by side.

    python benchmarks/adam_moments.py [--steps 100] [--warmup 10] [--seeds 0]

Two ranks simulated in one process (each its own batches; their sends averaged exactly as an all-reduce would),
the zoo's ``ByteGPT`` (3.3M parameters) on the text Lightning ships with itself, AdamW lr 1e-3 and weight decay 0.01,
held-out loss after ``--steps``. Rows:

- ``dense``: AdamW on the averaged gradient;
- ``moments, <method>``: ``--warmup`` dense steps, then the second moment frozen and each rank's first moment sent
  through the method with error feedback (``AdamMoments``, as the strategy runs it);
- ``gradient, <method>``: each rank's gradient sent through the method with error feedback into an unchanged AdamW.
"""

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import pytorch_lightning
import torch
from torch import Tensor

from lightning_gravac.adaptations.adam import AdamMoments
from lightning_gravac.adaptations.residuals import ErrorFeedback
from lightning_gravac.compressors import get_compressor
from lightning_gravac.zoo.gpt import ByteGPT, Windows, read_bytes

ROWS = {
    "dense": (None, None, 1.0),
    "moments, efsignsgd": ("moments", "efsignsgd", 32.0),
    "moments, topk cf=32": ("moments", "topk", 32.0),
    "gradient, efsignsgd": ("gradient", "efsignsgd", 32.0),
}


def _batches(data: Tensor, seed: int, batch: int = 16) -> Iterator[tuple[Tensor, Tensor]]:
    windows = Windows(data, 64, 10**9, seed=seed)
    index = 0
    while True:
        items = [windows[index + i] for i in range(batch)]
        index += batch
        yield torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def run(row: str, steps: int, warmup: int, seed: int) -> float:
    send, method_name, cf = ROWS[row]
    text = read_bytes(Path(pytorch_lightning.__file__).parent / "CHANGELOG.md")
    cut = int(text.numel() * 0.9)
    torch.manual_seed(seed)
    model = ByteGPT()
    params = list(model.parameters())
    names = {id(p): str(i) for i, p in enumerate(params)}
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    moments = AdamMoments()
    moments.take_from_optimizers([optimizer], names)
    moments.frozen_from = warmup
    method = get_compressor(method_name) if method_name else None
    residuals = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    streams = [_batches(text[:cut], seed=100 * seed + 1 + r) for r in range(2)]
    for step in range(steps):
        sent = []
        for rank in range(2):
            model.zero_grad()
            inputs, targets = next(streams[rank])
            torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
            grads = [p.grad.detach().clone() for p in params]
            compressing = method is not None and (send == "gradient" or step >= warmup)
            if send == "moments" and step >= warmup:
                if rank > 0:  # what one process's hook leaves to apply: one record of the parameters moved
                    moments.drop_moved()
                moments.own_moment_([names[id(p)] for p in params], grads)
            if compressing:
                for i, g in enumerate(grads):
                    g.add_(residuals[rank][i])
                    payload = method.compress(g, cf, key=str(i), step=step)
                    residuals[rank][i] = ErrorFeedback.residual_of(method, g, payload)
                    grads[i] = method.decompress(payload)
            sent.append(grads)
        for p, a, b in zip(params, *sent, strict=True):
            p.grad = (a + b) / 2
        hidden = moments.step_()
        optimizer.step()
        moments.restore(hidden)
    held = Windows(text[cut:], 64, 512, seed=0)
    with torch.no_grad():
        inputs = torch.stack([held[i][0] for i in range(len(held))])
        targets = torch.stack([held[i][1] for i in range(len(held))])
        return float(torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"| row | held-out loss after {args.steps} steps (seeds {args.seeds}) | over dense |\n| --- | ---: | ---: |")
    dense = None
    for row in args.rows:
        start = time.perf_counter()
        losses = [run(row, args.steps, args.warmup, seed) for seed in args.seeds]
        mean = sum(losses) / len(losses)
        dense = mean if row == "dense" else dense
        ratio = f"{mean / dense:.3f}" if dense else "-"
        print(f"| {row} | {', '.join(f'{x:.4f}' for x in losses)} | {ratio} |  ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
