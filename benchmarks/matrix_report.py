"""The benchmark matrix's analysis and report (``benchmarks/matrix.py``): each row's time to target, measured or
projected from timing runs on a shaped link, its regret and fidelity, the repeats combined, the tables, the default's
check against its bar and the heatmap."""

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matrix_rows import FIXED, LIMIT, LINK_DEPENDENT, ONCE
from matrix_tasks import CLASSIFIERS


def time_to(steps: list[tuple[float, float, float]], target: float) -> tuple[float, int] | None:
    """(wall s, steps) when the smoothed loss first reaches ``target``."""
    for i, (elapsed, ewma, _) in enumerate(steps):
        if ewma <= target:
            return elapsed, i + 1
    return None


def step_profile(steps: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(wall s to the end of step 2, median step s after that) of a timing run."""
    walls = [s[0] for s in steps]
    later = [b - a for a, b in itertools.pairwise(walls[1:])]
    return walls[1], statistics.median(later)


def project(
    trajectory: list[tuple[float, float, float]], k: int, profile: Callable[[float], tuple[float, float]]
) -> float:
    """Seconds to run the first ``k`` steps of ``trajectory`` on a link whose step profile at a factor is given."""
    first, _ = profile(trajectory[0][2])
    return first + sum(profile(trajectory[i][2])[1] for i in range(2, k))


def analyse(results: dict[str, Any], tasks: list[str], links: list[str], rows: list[str]) -> dict[str, Any]:
    """Per task x link x row: time to target (measured or projected), final metric, regret."""
    cells: dict[str, Any] = {}
    for task in tasks:
        full = results["full"][task]
        dense = full["dense DDP"]["steps"]
        target = dense[len(dense) // 2 - 1][1]
        for link in links:
            out: dict[str, Any] = {"target": target}
            for row in rows:
                run = results["adaptive"][task][link][row] if row in LINK_DEPENDENT else full[row]
                reached = time_to(run["steps"], target)
                seconds: float | None = None
                how = "measured"
                if reached is not None:
                    seconds = reached[0]
                    if row not in LINK_DEPENDENT and link != "unlimited":
                        how = "projected"
                        seconds = project(run["steps"], reached[1], _profile_of(results, task, link, row))
                final = run["held_out"]
                # The whole budget's time (a run that finished): what the user waits for the model they asked for.
                budget = None
                if run["finished"] and run["steps"]:
                    budget = run["steps"][-1][0]
                    if row not in LINK_DEPENDENT and link != "unlimited":
                        budget = project(run["steps"], len(run["steps"]), _profile_of(results, task, link, row))
                out[row] = {"seconds": seconds, "steps": reached[1] if reached else None, "how": how,
                            "final": final, "ran_steps": len(run["steps"]), "budget_seconds": budget}  # fmt: skip
            dense_final = out["dense DDP"]["final"] if "dense DDP" in rows else None
            for row in rows:
                run = results["adaptive"][task][link][row] if row in LINK_DEPENDENT else full[row]
                shaped = row not in LINK_DEPENDENT and link != "unlimited"
                profile = _profile_of(results, task, link, row) if shaped else None
                out[row]["to_final"] = time_to_metric(run, dense_final, profile)
            keeping = [r for r in FIXED if r in rows and out[r]["seconds"] is not None
                       and keeps_fidelity(out[r]["final"], dense_final)]  # fmt: skip
            best = min((out[r]["seconds"] for r in keeping), default=None)
            dense_s = out["dense DDP"]["seconds"] if "dense DDP" in rows else None
            for row in rows:
                s = out[row]["seconds"]
                out[row]["regret"] = s / best if s is not None and best else None
                out[row]["vs_dense"] = s / dense_s if s is not None and dense_s else None
                out[row]["keeps_fidelity"] = keeps_fidelity(out[row]["final"], dense_final)
            out["best_fixed"] = min(keeping, key=lambda r: out[r]["seconds"], default=None)
            cells[f"{task}|{link}"] = out
    return cells


def time_to_metric(
    run: dict[str, Any], dense_final: dict[str, float] | None, profile: Callable[[float], tuple[float, float]] | None
) -> float | None:
    """Seconds until the run's held-out metric, evaluated along it (``--evals``) and at its end, first keeps fidelity
    to dense's final one (``None``: never, or not evaluated); projected with ``profile`` on a shaped link."""
    points = [*run.get("evals", []), *([(len(run["steps"]), run["held_out"])] if run["held_out"] else [])]
    for done, metric in points:
        if keeps_fidelity(metric, dense_final):
            return project(run["steps"], done, profile) if profile is not None else run["steps"][done - 1][0]
    return None


def keeps_fidelity(final: dict[str, float] | None, dense: dict[str, float] | None) -> bool:
    """Whether a held-out metric after the budget is within 1% of dense's loss, or (a classifier) 1 point of its
    accuracy."""
    if final is None or dense is None:
        return False
    if final["loss"] <= 1.01 * dense["loss"]:
        return True
    return "accuracy" in final and final["accuracy"] >= dense["accuracy"] - 0.01


def _profile_of(results: dict[str, Any], task: str, link: str, row: str) -> Callable[[float], tuple[float, float]]:
    timing = results["timing"][task][link]
    if row == "accordion 10/1000":  # Top-K at the factor it sent that step
        return lambda cf: timing["topk cf=10" if cf <= 10 else "topk cf=1000"]
    if row not in ("dense DDP", LIMIT) and "dense DDP" in timing:  # a step sent dense (Adam's warm-up) at dense's cost
        return lambda cf: timing["dense DDP"] if cf == 1 else timing[row]
    return lambda cf: timing[row]


def tables(cells: dict[str, Any], tasks: list[str], links: list[str], rows: list[str], params: dict) -> list[str]:
    lines = []
    for task in tasks:
        metric = "held-out loss / accuracy" if task in CLASSIFIERS else "held-out loss"
        lines += [f"\n### {task} ({params[task] / 1e6:.2f}M parameters)\n",
                  "| row | " + " | ".join(f"{link}: time to target s" for link in links) + f" | {metric} |",
                  "| --- | " + " | ".join("---:" for _ in links) + " | ---: |"]  # fmt: skip
        for row in rows:
            cells_here = []
            for link in links:
                c = cells[f"{task}|{link}"][row]
                if c["seconds"] is None:
                    cells_here.append(f"missed ({c['ran_steps']} steps)")
                else:
                    mark = "*" if c["how"] == "projected" else ""
                    spread = ""
                    if "regret_range" in c:
                        low, high = c["regret_range"]
                        spread = f", {low:.2f}-{high:.2f}" if math.isfinite(high) else f", {low:.2f}-miss"
                    cells_here.append(f"{c['seconds']:.1f}{mark} ({c['regret']:.2f}x{spread})")
            finals = []
            for link in links:
                f = cells[f"{task}|{link}"][row]["final"]
                if row in LINK_DEPENDENT or link == links[0]:
                    finals.append(
                        "-"
                        if f is None
                        else (f"{f['loss']:.4f}" + (f" / {f['accuracy']:.3f}" if "accuracy" in f else ""))
                    )
            lossy = [link for link in links if not cells[f"{task}|{link}"][row].get("keeps_fidelity", True)
                     and (row in LINK_DEPENDENT or link == links[0])]  # fmt: skip
            mark = f" (not within fidelity: {', '.join(lossy)})" if lossy and row != "dense DDP" else ""
            lines.append(f"| {row} | " + " | ".join(cells_here) + " | " + ", ".join(finals) + mark + " |")
        target = cells[f"{task}|{links[0]}"]["target"]
        lines.append(f"\nTarget: smoothed training loss {target:.4f}. `*`: projected. (x): regret, time over the "
                     "fastest fixed factor's that keeps fidelity on that link.")  # fmt: skip
        lines += _seconds_table(cells, task, links, rows, "budget_seconds", "the whole budget", "-")
        lines += _seconds_table(cells, task, links, rows, "to_final", "to dense's final held-out metric", "never")
    return lines


def _seconds_table(
    cells: dict[str, Any], task: str, links: list[str], rows: list[str], key: str, what: str, missing: str
) -> list[str]:
    """A task's table of each row's seconds under ``key`` on each link, over dense's and over the limit's whole budget
    (``missing`` where none)."""
    lines = ["\n| row | " + " | ".join(f"{link}: {what} s (x dense, x limit)" for link in links) + " |",
             "| --- | " + " | ".join("---:" for _ in links) + " |"]  # fmt: skip
    for row in rows:
        values = []
        for link in links:
            cell = cells[f"{task}|{link}"]
            t, d = cell[row].get(key), cell.get("dense DDP", {}).get(key)
            limit = cell.get(LIMIT, {}).get("budget_seconds")
            ratios = [f"{t / d:.2f}x" if t is not None and d else "", f"{t / limit:.2f}x" if t and limit else ""]
            values.append(missing if t is None else f"{t:.1f}" + (f" ({', '.join(r for r in ratios if r)})"
                                                                  if any(ratios) else ""))  # fmt: skip
        lines.append(f"| {row} | " + " | ".join(values) + " |")
    return lines


def check_default(cells: dict[str, Any], tasks: list[str], links: list[str], rows: list[str]) -> list[str]:
    """The zero-argument default against its bar, cell by cell: regret, its time against dense's, fidelity."""
    lines = ["\n### The zero-argument default against the bar\n",
             "| task | link | regret <= 1.3 | <= 1.10x dense (unlimited) | >= 5x faster than dense (100 Mbit/s) | "
             "reached | final within 1% of dense's loss (or 1 point of accuracy) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for task in tasks:
        for link in links:
            cell = cells[f"{task}|{link}"]
            d, dense = cell["default"], cell["dense DDP"]
            ok = lambda b: "yes" if b else "**no**"  # noqa: E731
            regret = f"{d['regret']:.2f} {ok(d['regret'] <= 1.3)}" if d["regret"] else "**missed**"
            if d["regret"] and "regret_range" in d:
                low, high = d["regret_range"]
                regret += f" [{low:.2f}-{high:.2f}]"
            vs_dense, faster, ratio = "-", "-", d.get("vs_dense")  # paired: each repeat's over its own dense run
            if ratio and link == "unlimited":
                vs_dense = f"{ratio:.2f}x {ok(ratio <= 1.10)}"
            if ratio and link == "100mbit":
                faster = f"{1 / ratio:.1f}x {ok(1 / ratio >= 5)}"
            final = "-"
            if d["final"] and dense["final"]:
                # The bar: within 1% of dense's loss, or (a classifier) within 1 point of its accuracy. Both are shown
                # for a classifier: where accuracy saturates (the synthetic CNN's is 1.000 in every row) the loss is
                # the only one that can tell rows apart.
                rel = d["final"]["loss"] / dense["final"]["loss"] - 1
                final = f"{rel * 100:+.1f}%"
                if "accuracy" in d["final"]:
                    final += f", {(d['final']['accuracy'] - dense['final']['accuracy']) * 100:+.1f} points"
                final += f" {ok(keeps_fidelity(d['final'], dense['final']))}"
            lines.append(
                f"| {task} | {link} | {regret} | {vs_dense} | {faster} | {ok(d['seconds'] is not None)} | {final} |"
            )
    worst = {}
    for row in rows:
        regrets = [cells[f"{t}|{link}"][row]["regret"] for t in tasks for link in links]
        worst[row] = max((r if r is not None else math.inf) for r in regrets)
    lines += ["\nWorst cell of each row (regret; inf: missed somewhere):\n", "| row | worst regret |", "| --- | ---: |"]
    lines += [f"| {row} | {worst[row]:.2f} |" for row in rows]
    return lines


def heatmap(cells: dict[str, Any], tasks: list[str], links: list[str], rows: list[str], path: Path) -> None:
    """Each row's time for the whole budget over the no-communication run's on the same task and link (the limit no
    compression beats), when that row ran; else each row's regret against the fastest fidelity-keeping fixed factor.
    A cell whose held-out metric misses dense's by more than 1% (1 point of accuracy) says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    over_limit = LIMIT in rows
    shown_rows = [r for r in rows if r != LIMIT] if over_limit else rows
    columns = [(t, link) for t in tasks for link in links]
    values = np.full((len(shown_rows), len(columns)), np.nan)
    for j, (t, link) in enumerate(columns):
        cell = cells[f"{t}|{link}"]
        for i, row in enumerate(shown_rows):
            if over_limit:
                mine, limit = cell[row]["budget_seconds"], cell[LIMIT]["budget_seconds"]
                r = mine / limit if mine is not None and limit else None
            else:
                r = cell[row]["regret"]
            values[i, j] = r if r is not None else np.nan
    fig, ax = plt.subplots(figsize=(1.0 * len(columns) + 3, 0.45 * len(shown_rows) + 1.5))
    shown = np.log2(np.clip(np.nan_to_num(values, nan=64.0), 1, 64))
    ax.imshow(shown, cmap="RdYlGn_r", vmin=0, vmax=4, aspect="auto")
    for i in range(len(shown_rows)):
        for j in range(len(columns)):
            v = values[i, j]
            keeps = cells[f"{columns[j][0]}|{columns[j][1]}"][shown_rows[i]].get("keeps_fidelity", True)
            ax.text(j, i, ("miss" if np.isnan(v) else f"{v:.2f}") + ("" if keeps else "\nlossy"), ha="center",
                    va="center", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(columns)), [f"{t}\n{link}" for t, link in columns], fontsize=8)
    ax.set_yticks(range(len(shown_rows)), shown_rows, fontsize=8)
    what = (
        "time for the budget / the same run with nothing communicated (1.00 = the limit"
        if over_limit
        else "time to target / fastest fidelity-keeping fixed factor's (1.00 = best"
    )
    ax.set_title(f"{what}; green good, red bad; 'lossy': held-out metric not within 1% / 1 point of dense's)",
                 fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _as_results(repeat: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    """A repeat's runs in the shape ``analyse`` reads, with the rows run once borrowed from the first repeat."""
    out: dict[str, Any] = {"full": {}, "timing": {}, "adaptive": {}}
    for task, block in repeat.items():
        out["full"][task] = block["full"]
        out["timing"][task] = block["timing"]
        out["adaptive"][task] = {
            link: {**{r: first[task]["adaptive"][link][r] for r in ONCE & first[task]["adaptive"][link].keys()},
                   **runs}
            for link, runs in block["adaptive"].items()
        }  # fmt: skip
    return out


def combine(per_repeat: list[dict[str, Any]], rows: list[str]) -> dict[str, Any]:
    """One table from several repeats: per cell and row the median time, the median of the paired regrets (each
    repeat's time over the same repeat's best fixed factor), their range, and the median final metric. A row
    missed in a cell when it missed in most repeats."""
    if len(per_repeat) == 1:
        return per_repeat[0]

    def median(values: list[float | None]) -> float | None:
        m = statistics.median(math.inf if v is None else v for v in values)
        return None if math.isinf(m) else m

    cells: dict[str, Any] = {}
    for key, first in per_repeat[0].items():
        cell: dict[str, Any] = {"target": first["target"], "best_fixed": first["best_fixed"]}
        for row in rows:
            runs = [c[key][row] for c in per_repeat]
            regrets = [r["regret"] for r in runs]
            finals = [r["final"] for r in runs if r["final"] is not None]
            final = None
            if finals:
                final = {m: statistics.median(f[m] for f in finals) for m in finals[0]}
            cell[row] = {
                "seconds": median([r["seconds"] for r in runs]),
                "steps": median([r["steps"] for r in runs]),
                "how": first[row]["how"],
                "final": final,
                "ran_steps": max(r["ran_steps"] for r in runs),
                "regret": median(regrets),
                "vs_dense": median([r.get("vs_dense") for r in runs]),
                "budget_seconds": median([r.get("budget_seconds") for r in runs]),
                "to_final": median([r.get("to_final") for r in runs]),
                "keeps_fidelity": sum(bool(r.get("keeps_fidelity")) for r in runs) * 2 > len(runs),
                "regret_range": [min(r if r is not None else math.inf for r in regrets),
                                 max(r if r is not None else math.inf for r in regrets)],
            }  # fmt: skip
        cells[key] = cell
    return cells


def report(results: dict[str, Any], out: Path) -> None:
    """Tables, the bar's check and the heatmap from a run's results (``matrix.json``): at the end of a run, or again
    from a saved run with ``--report``."""
    args = argparse.Namespace(**results["args"])
    first = results["repeats"][0]
    per_repeat = [analyse(_as_results(rep, first), args.tasks, args.links, args.rows) for rep in results["repeats"]]
    cells = combine(per_repeat, args.rows)
    whole = f" Whole run {results['seconds']:.0f} s." if "seconds" in results else ""
    repeats = (
        ""
        if args.repeats == 1
        else f" Each cell is the median of {args.repeats} repeats (regret: the median of the paired regrets, its "
        f"range in brackets); {', '.join(sorted(ONCE))} trained in the first repeat only."
    )
    lines = [
        f"Two ranks (gloo, one thread each), {args.steps} steps a run, scale {args.scale}, cap {args.cap:g} s a "
        f"GraVAC run; links shaped with tc on a private loopback (MTU 1500).{whole}{repeats}",
        *tables(cells, args.tasks, args.links, args.rows, results["parameters"]),
    ]
    if "default" in args.rows and all(r in args.rows for r in FIXED):
        lines += check_default(cells, args.tasks, args.links, args.rows)
    text = "\n".join(lines)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.md").write_text(text + "\n")
    results["cells"], results["per_repeat"] = cells, per_repeat
    (out / "matrix.json").write_text(json.dumps(results))
    heatmap(cells, args.tasks, args.links, args.rows, out / "matrix.png")
    print(f"\nWrote {out / 'matrix.md'}, {out / 'matrix.json'}, {out / 'matrix.png'}")


def paired_seeds(results: dict[tuple[int, int], dict[str, Any]]) -> str:
    """Each budget's rows against dense DDP from the same seed: the held-out loss over dense's, seed by seed, and their
    mean, which judges fidelity where dense itself moves between seeds (the first repeat, the unlimited link)."""
    lines = ["Held-out loss over dense DDP's from the same seed (paired), the unlimited link; accuracy in points.\n"]
    for steps in sorted({s for s, _ in results}):
        seeds = sorted(seed for s, seed in results if s == steps)
        first = results[steps, seeds[0]]["repeats"][0]
        lines += [f"\n### {steps} steps, seeds {', '.join(map(str, seeds))}\n",
                  "| task | row | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |", "| --- | --- |"
                  + " ---: |" * (len(seeds) + 1)]  # fmt: skip
        for task, block in first.items():
            for row in [*block["full"], *block["adaptive"].get("unlimited", {})]:
                if row == "dense DDP":
                    continue
                cells, deltas = [], []
                for seed in seeds:
                    got = results[steps, seed]["repeats"][0][task]
                    run = got["full"].get(row) or got["adaptive"].get("unlimited", {}).get(row)
                    dense = got["full"]["dense DDP"]["held_out"]
                    if not run or not run["held_out"] or not dense:
                        cells.append("missed")
                        continue
                    delta = run["held_out"]["loss"] / dense["loss"] - 1
                    deltas.append(delta)
                    points = ""
                    if "accuracy" in dense:
                        points = f", {100 * (run['held_out']['accuracy'] - dense['accuracy']):+.1f} pt"
                    cells.append(f"{100 * delta:+.2f}%{points}")
                mean = f"{100 * sum(deltas) / len(deltas):+.2f}%" if len(deltas) == len(seeds) else "-"
                lines.append(f"| {task} | {row} | " + " | ".join(cells) + f" | {mean} |")
    return "\n".join(lines) + "\n"
