"""Does GraVAC's gain see what compression costs? Steps to a target per static factor, and the gain with and without
the residual, on the bandwidth benchmark's task (or a dense-gradient MLP), in one process (no root, no network).

    python benchmarks/gains.py [--task bag|mlp] [--cfs 1 10 100 1000] [--steps 600] [--targets 0.5 0.4 0.3]
                               [--ranks 2] [--compressor topk] [--probe-every 5] [--json PATH]

``--ranks`` ranks are simulated in one process, as the hook computes them with a sparse all-gather: each rank's
gradient of its share of the batch (32 examples), error feedback per rank and per parameter with the package's
compressor through the hook's own ``encode`` (error feedback, compression, residual), then the mean of the ranks'
decoded payloads, applied by plain SGD (``--task bag``: ``BagOfWordsRegression``, lr 0.05, the data and seed of
``benchmarks/bandwidth.py``; ``--task mlp``: ``TeacherRegression`` with 4 hidden layers of 1600, 10.2M parameters
whose gradients are dense, lr 0.05). A factor of 1 is dense SGD. For each factor: the steps until the smoothed loss
(an EWMA, factor 0.9) first reaches each target.

For the largest factor, every ``--probe-every`` steps, the gain ``sum_ranks ||C_cf(x)||^2 / sum_ranks ||x||^2`` at the
factors of GraVAC's default ladder (20, 160 and 1000 above ``cf_min`` 10): with ``x`` the error-fed gradient
(GraVAC's gain, ``docs/algorithms.md``), and with ``x`` the fresh gradient (what the step's own gradient keeps),
beside the residual's norm. On a task whose loss does not suffer from a factor, a gain that falls far below
``epsilon`` there is measuring the residual's backlog, not a loss of progress.
"""

import argparse
import json

import torch
from torch.utils.data import DataLoader

from lightning_gravac.adaptations import ErrorFeedback
from lightning_gravac.adaptations.residuals import encode
from lightning_gravac.compressors import get_compressor
from lightning_gravac.compressors.base import sq_norm
from lightning_gravac.zoo import BagOfWordsRegression, TeacherRegression, bag_of_words_dataset, teacher_dataset

LADDER = (20.0, 160.0, 1000.0)
PER_RANK = 32
TASKS = {
    "bag": (lambda: BagOfWordsRegression(lr=0.05), bag_of_words_dataset),
    "mlp": (lambda: TeacherRegression(width=1600, depth=5, lr=0.05), lambda: teacher_dataset(n=8192)),
}


def run(cf: float, args: argparse.Namespace, trace: bool) -> dict:
    torch.manual_seed(0)
    make_model, make_data = TASKS[args.task]
    model = make_model()
    lr = model.hparams["lr"]
    params = dict(model.named_parameters())
    compressor = get_compressor(args.compressor)
    memories = [ErrorFeedback() for _ in range(args.ranks)]
    loader = DataLoader(
        make_data(), batch_size=PER_RANK * args.ranks, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    ewma, reached, rows, step = None, {}, [], 0
    while step < args.steps:
        for inputs, targets in loader:
            probing = trace and step % args.probe_every == 0
            # Summed over ranks and layers, as the hook's header sums them: ||x||^2 and ||C_cf(x)||^2 at each factor.
            fed_sq, fed_kept = torch.zeros((), dtype=torch.float64), torch.zeros(len(LADDER), dtype=torch.float64)
            fresh_sq, fresh_kept = torch.zeros_like(fed_sq), torch.zeros_like(fed_kept)
            update = {name: torch.zeros_like(p) for name, p in params.items()}
            losses = []
            for rank in range(args.ranks):
                model.zero_grad()
                part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                loss = torch.nn.functional.mse_loss(model(inputs[part]), targets[part])
                loss.backward()
                losses.append(loss.item())
                for name, p in params.items():
                    grad = p.grad.reshape(-1)
                    if cf == 1:
                        update[name] += grad.view_as(p)
                        continue
                    if probing:
                        fresh_sq += sq_norm(grad)
                        fresh_kept += compressor.probe(grad, LADDER, key=name, step=step)
                    encoded = encode(
                        compressor, grad, cf, key=name, step=step, residual_mode="recycle", memory=memories[rank],
                        probe_cfs=LADDER if probing else (),
                    )  # fmt: skip
                    if encoded.probes is not None:  # of the error-fed gradient
                        fed_sq += encoded.basis
                        fed_kept += encoded.probes
                    update[name] += compressor.decompress(encoded.payload).view_as(p)
                    assert encoded.residual is not None  # Top-K and its kin: never sent unchanged
                    memories[rank].set(name, encoded.residual)
            with torch.no_grad():
                for name, p in params.items():
                    p.sub_(update[name], alpha=lr / args.ranks)
            loss = sum(losses) / len(losses)
            ewma = loss if ewma is None else 0.9 * ewma + 0.1 * loss
            step += 1
            for target in args.targets:
                if target not in reached and ewma <= target:
                    reached[target] = step
            if probing:
                residual = sum(float(sq_norm(r)) for m in memories for r in (m.get(n) for n in params) if r is not None)
                rows.append({
                    "step": step,
                    "error_fed": (fed_kept / fed_sq).tolist(),
                    "fresh": (fresh_kept / fresh_sq).tolist(),
                    "residual_norm": residual**0.5,
                })  # fmt: skip
            if step >= args.steps:
                break
    return {"cf": cf, "reached": reached, "final_loss": ewma, "trace": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(TASKS), default="bag")
    parser.add_argument("--cfs", type=float, nargs="+", default=[1.0, 10.0, 100.0, 1000.0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.4, 0.3])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--probe-every", type=int, default=5)
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [run(cf, args, trace=cf == max(args.cfs) and cf > 1) for cf in args.cfs]

    print(f"Steps until the smoothed loss reaches each target ({args.ranks} simulated ranks, {args.compressor}):\n")
    print("| factor | " + " | ".join(f"loss {t:g}" for t in args.targets) + " | final loss |")
    print("| ---: | " + " | ".join("---:" for _ in args.targets) + " | ---: |")
    for r in results:
        cells = [str(r["reached"].get(t, f"missed in {args.steps}")) for t in args.targets]
        print(f"| {r['cf']:g} | " + " | ".join(cells) + f" | {r['final_loss']:.3f} |")
    for r in results:
        if not r["trace"]:
            continue
        print(f"\nGains while sending at cf {r['cf']:g} (error-fed gradient / fresh gradient), residual norm:\n")
        print("| step | " + " | ".join(f"cf {c:g}" for c in LADDER) + " | residual norm |")
        print("| ---: | " + " | ".join("---:" for _ in LADDER) + " | ---: |")
        for row in r["trace"][:: max(1, len(r["trace"]) // 12)]:
            cells = [f"{e:.2f} / {f:.2f}" for e, f in zip(row["error_fed"], row["fresh"], strict=True)]
            print(f"| {row['step']} | " + " | ".join(cells) + f" | {row['residual_norm']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
