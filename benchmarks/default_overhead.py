"""What the zero-argument default costs where compression cannot pay: stock DDP and ``GraVACStrategy()`` side by
side on the plain loopback, interleaved, several times.

    python benchmarks/default_overhead.py [--tasks cnn lstm] [--repeats 5] [--steps 200] [--scale 0.25]

On an unshaped loopback a dense step's bytes cost little, so the default should send dense and cost what stock DDP
costs. A single 10-second run of each cannot show a few percent: run-to-run spread on two cores is about as large.
So each task's pair is run ``--repeats`` times, alternating (dense, default, dense, ...), with the tasks, data and
seeds of ``benchmarks/matrix.py``; reported per task: each row's median time for the whole budget (the fit's start
included), time to target (dense's smoothed loss at half its steps, as the matrix sets it) and median step, the
spread (min-max) over the repeats, and the default's ratios to dense, median of the pairs. Two ranks, gloo, one
thread each. No root needed.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from matrix import _run  # the matrix's tasks, rows and recorder, run the same way
from matrix_report import step_profile, time_to

ROWS = ("dense DDP", "default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["cnn", "lstm"], choices=["bag", "mlp", "cnn", "lstm"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    run_args = argparse.Namespace(scale=args.scale, optimizer="task", sgd_lr=None, evals=0, steps=args.steps, seed=0)
    results: dict[str, Any] = {}
    for task in args.tasks:
        runs: dict[str, list[dict[str, Any]]] = {row: [] for row in ROWS}
        for _ in range(args.repeats):
            for row in ROWS:
                runs[row].append(_run(task, row, run_args, args.steps, cap=3600.0))
        dense = runs["dense DDP"][0]["steps"]
        target = dense[len(dense) // 2 - 1][1]
        summary: dict[str, Any] = {"target": target}
        for row in ROWS:
            reached = [time_to(r["steps"], target) for r in runs[row]]
            summary[row] = {
                "time_to_target": [x[0] if x else None for x in reached],
                "median_step": [step_profile(r["steps"])[1] for r in runs[row]],
                "whole": [r["steps"][-1][0] for r in runs[row]],  # the budget's time, the fit's start included
                "factors": sorted({s[2] for r in runs[row] for s in r["steps"]}),
            }
        pairs = zip(summary["dense DDP"]["time_to_target"], summary["default"]["time_to_target"], strict=True)
        summary["ratio_to_target"] = [b / a for a, b in pairs if a and b]
        summary["ratio_step"] = [
            b / a for a, b in zip(summary["dense DDP"]["median_step"], summary["default"]["median_step"], strict=True)
        ]
        summary["ratio_whole"] = [
            b / a for a, b in zip(summary["dense DDP"]["whole"], summary["default"]["whole"], strict=True)
        ]
        results[task] = summary
    print(f"Two ranks (gloo, one thread each), plain loopback, {args.steps} steps a run, scale {args.scale}, "
          f"{args.repeats} interleaved repeats\n")  # fmt: skip
    print("| task | row | the whole budget s | time to target s | median step ms | factors sent |")
    print("| --- | --- | ---: | ---: | ---: | --- |")

    def spread(values: list[float], unit: str = "") -> str:
        return f"{statistics.median(values):.3f}{unit} ({min(values):.3f}-{max(values):.3f})"

    for task, summary in results.items():
        for row in ROWS:
            t = [x for x in summary[row]["time_to_target"] if x is not None]
            s = [1e3 * x for x in summary[row]["median_step"]]
            print(f"| {task} | {row} | {spread(summary[row]['whole'])} | {spread(t)} | {spread(s)} | "
                  f"{summary[row]['factors']} |")  # fmt: skip
        w, r, q = summary["ratio_whole"], summary["ratio_to_target"], summary["ratio_step"]
        print(f"| {task} | default / dense | {spread(w, 'x')} | {spread(r, 'x')} | {spread(q, 'x')} | |")
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
