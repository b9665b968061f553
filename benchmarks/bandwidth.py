"""Time to a target loss on a rate-limited network: dense DDP, static Top-K and DGC, Accordion and GraVAC.

    python benchmarks/bandwidth.py [--rates unlimited 1gbit 100mbit] [--world-size 2] [--target 0.5]
                                   [--budget 240] [--configs ...] [--out benchmarks/results]

Needs root (a network namespace and tc): the script re-executes itself under ``unshare -n``, in a private network
namespace whose loopback it brings up with an MTU of 1500 (the default 64 KiB loopback MTU hides per-packet costs)
and shapes with a token bucket, ``tc qdisc replace dev lo root tbf rate R burst B latency 100ms``. Every rank talks
over that one loopback, so all the bytes of all ranks cross one shaped queue: N ranks share the rate R, as hosts
behind one link do.

Each configuration trains the same model (``BagOfWordsRegression``: a 10.2M-parameter embedding bag whose gradients
are sparse and heavy-tailed, as in NLP and recommendation models) from the same seed on the same data, with plain
SGD, until the smoothed loss (an EWMA, factor 0.9, of the ranks' mean loss) reaches ``--target``, or until
``--budget`` seconds have passed. It records wall time, steps, bytes sent, the factor over steps and the final loss.

A configuration whose trajectory does not depend on the link (all but GraVAC, which reacts to measured step times)
takes the same steps at every rate. When one misses the target within the budget at a slow rate, its
time-to-target is also *projected*: the steps it took at the unlimited rate times its mean step time at this rate,
marked as such. Rates run fastest first for that reason.

Also a model of scale: alpha (per message) and beta (per byte) measured on the unlimited loopback, and the predicted
communication time of dense ring all-reduce, sparse all-gather and the hook's automatic choice (gather when
``N x payload < 2 x dense``) for world sizes up to 1024, on per-node links of 1 and 10 Gbit/s.

Writes ``bandwidth.json`` (raw figures), ``bandwidth.png`` (loss against wall time per configuration and rate) and
``bandwidth.md`` (the tables) under ``--out``, and prints the tables.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning import Callback
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_gravac import Accordion, GraVAC, GraVACStrategy, Static
from lightning_gravac.callbacks.controller import controllers_of
from lightning_gravac.compressors import DGC
from lightning_gravac.launch import run_distributed
from lightning_gravac.meprop import MeProp
from lightning_gravac.state import gathers, ring_share
from lightning_gravac.zoo import BagOfWordsRegression, bag_of_words_dataset

_INSIDE = "GRAVAC_BANDWIDTH_NETNS"

#: The model search without the default's link probe and gain weighing (its first form, measured in BENCHMARKS.md).
UNPROBED: dict[str, Any] = {"gain_power": 1.0, "time_link": False}
UNPROBED_ERROR_FED: dict[str, Any] = {**UNPROBED, "gain_of": "error_fed"}


def _unprobed_model(epsilon: float) -> tuple[GraVACStrategy, list[Callback]]:
    """The model search with the error-fed gain, the link unprobed and the throughput weighed by the gain itself."""
    controller = GraVAC(cf_min=10, cf_max=1000, epsilon=epsilon, window=25, search="model", probe_every=25,
                        first_window=3, **UNPROBED_ERROR_FED)  # fmt: skip
    return GraVACStrategy("topk"), [controller]


#: name -> (strategy and callbacks factory, trajectory independent of the link)
CONFIGS: dict[str, tuple[Any, bool]] = {
    "dense DDP": (lambda: (DDPStrategy(), []), True),
    "topk cf=10": (lambda: (GraVACStrategy("topk"), [Static(cf=10)]), True),
    "topk cf=100": (lambda: (GraVACStrategy("topk"), [Static(cf=100)]), True),
    "topk cf=1000": (lambda: (GraVACStrategy("topk"), [Static(cf=1000)]), True),
    # Plain SGD for every row, so DGC's momentum correction is off (momentum 0); no warm-up, like the static rows.
    "dgc cf=100": (lambda: (GraVACStrategy(DGC(momentum=0.0, warmup_epochs=0)), [Static(cf=100)]), True),
    "dgc cf=1000": (lambda: (GraVACStrategy(DGC(momentum=0.0, warmup_epochs=0)), [Static(cf=1000)]), True),
    "accordion 10/1000": (
        lambda: (GraVACStrategy("topk"), [Accordion(low_cf=10, high_cf=1000, window=25, interval="step")]),
        True,
    ),
    # Periodic model averaging (post-local SGD): dense all-reduce for 20 steps, then local steps and a parameter
    # average every 4. Its averaging traffic is outside the hook: bytes sent counts the all-reduce steps only.
    "local SGD, average every 4": (
        lambda: (GraVACStrategy("none", model_averaging_period=4, start_local_sgd_step=20), [Static(cf=1)]),
        True,
    ),
    # meProp (a compute saving): each example's output gradient of the embedding bag keeps its top 10%.
    "dense DDP + meProp 10%": (lambda: (DDPStrategy(), [MeProp(ratio=0.1)]), True),
    # GraVAC probes the gains at its factors on one step in 25 (every step of its first window); the model search
    # fits its link model after 3 steps and again at each window's end.
    "gravac sequential": (
        lambda: (
            GraVACStrategy("topk"),
            [GraVAC(cf_min=10, cf_max=1000, epsilon=0.7, omega=0.05, window=25, probe_every=25, search="sequential")],
        ),
        False,
    ),
    "gravac model": (lambda: _unprobed_model(epsilon=0.7), False),
    # The same with epsilon 0.3: with error feedback this task keeps less than 0.7 of the energy beyond cf 40.
    "gravac model, epsilon 0.3": (lambda: _unprobed_model(epsilon=0.3), False),
    # Gains of the step's own gradient (`gain_of="gradient"`), the paper's epsilon: `benchmarks/gains.py` shows the
    # error-fed gain measuring the residual's backlog on this task. The model search decides after one step.
    "gravac sequential, gain of the gradient": (
        lambda: (
            GraVACStrategy("topk"),
            [
                GraVAC(
                    cf_min=10,
                    cf_max=1000,
                    omega=0.05,
                    window=25,
                    probe_every=25,
                    gain_of="gradient",
                    search="sequential",
                )
            ],
        ),
        False,
    ),
    "default": (lambda: (GraVACStrategy(), []), False),
    "gravac model, gain of the gradient": (
        lambda: (
            GraVACStrategy("topk"),
            [
                GraVAC(
                    cf_max=1000,
                    window=25,
                    search="model",
                    probe_every=25,
                    first_window=1,
                    gain_of="gradient",
                    epsilon=0.7,
                    **UNPROBED,
                )
            ],
        ),
        False,
    ),
}


class TargetStop(Callback):
    """Stops every rank together when the smoothed mean loss reaches ``target`` or ``budget`` seconds have passed."""

    def __init__(self, target: float, budget: float, numel: int) -> None:
        self.target, self.budget, self.numel = target, budget, numel
        self.start = 0.0
        self.ewma: float | None = None
        self.reached_at: tuple[float, int] | None = None
        self.trajectory: list[tuple[float, int, float, float, int]] = []  # wall s, step, smoothed loss, cf, bytes

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        elapsed = time.perf_counter() - self.start
        # One tiny all-reduce: the loss summed, and whether any rank ran out of time (so all stop together).
        shared = torch.tensor([float(outputs["loss"]), float(elapsed > self.budget)], dtype=torch.float64)
        dist.all_reduce(shared)
        loss = shared[0].item() / trainer.world_size
        self.ewma = loss if self.ewma is None else 0.9 * self.ewma + 0.1 * loss
        controller = next(iter(controllers_of(trainer)), None)
        metrics = controller.last_metrics if controller is not None else {}
        cf = float(metrics.get("gravac/achieved_cf", 1.0))
        sent = int(metrics.get("gravac/bytes_sent", self.numel * 4))
        self.trajectory.append((elapsed, trainer.global_step, self.ewma, cf, sent))
        if self.ewma <= self.target:
            self.reached_at = (elapsed, trainer.global_step)
            trainer.should_stop = True
        elif shared[1].item() > 0:
            trainer.should_stop = True


def _train(rank: int, world_size: int, config: str, target: float, budget: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    model = BagOfWordsRegression(lr=0.05)
    numel = sum(p.numel() for p in model.parameters())
    strategy, callbacks = CONFIGS[config][0]()
    stop = TargetStop(target, budget, numel)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, callbacks=[*callbacks, stop], max_epochs=1000,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1_000_000,
    )  # fmt: skip
    trainer.fit(model, DataLoader(bag_of_words_dataset(), batch_size=32, shuffle=True))
    steps = len(stop.trajectory)
    return {
        "config": config,
        "reached": stop.reached_at is not None,
        "seconds": stop.reached_at[0] if stop.reached_at else stop.trajectory[-1][0],
        "steps": stop.reached_at[1] if stop.reached_at else steps,
        "final_loss": stop.ewma,
        "bytes_sent": sum(t[4] for t in stop.trajectory),
        "bytes_dense": numel * 4 * steps,
        "mean_step_s": stop.trajectory[-1][0] / steps,
        "trajectory": stop.trajectory,
        "parameters": numel,
    }


def _link_costs(rank: int, world_size: int) -> dict[str, float]:
    """alpha (s a message) and beta (s a byte) of gloo's all-reduce here, from a small and a large message."""
    dist.init_process_group("gloo")
    times = {}
    for nbytes in (1024, 16 * 2**20):
        tensor = torch.zeros(nbytes // 4)
        dist.all_reduce(tensor)
        start = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(tensor)
        times[nbytes] = (time.perf_counter() - start) / 5
    # A ring all-reduce of n bytes on N ranks: 2 (N-1) messages and 2 (N-1)/N n bytes a rank.
    messages, share = 2 * (world_size - 1), ring_share(world_size)
    beta = (times[16 * 2**20] - times[1024]) / (share * (16 * 2**20 - 1024))
    alpha = max(0.0, (times[1024] - share * 1024 * beta) / messages)
    return {"alpha_s": alpha, "beta_s_per_byte": beta}


def _shape(rate: str) -> None:
    if rate == "unlimited":
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False, capture_output=True)
        return
    bits = float(rate.lower().replace("gbit", "e9").replace("mbit", "e6"))
    burst = max(16 * 1024, int(bits / 8 * 0.004))  # 4 ms of traffic
    subprocess.run(
        ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"],
        check=True,
    )


def _scale_table(alpha: float, numel: int, links: dict[str, float]) -> list[str]:
    """Predicted communication seconds a step: dense ring all-reduce, sparse all-gather, the hook's choice."""
    dense = numel * 4
    lines = []
    for link, bits in links.items():
        beta = 8 / bits
        lines += [
            f"\n{link} per node, {numel / 1e6:.1f}M fp32 parameters (alpha = {alpha * 1e6:.0f} us measured):\n",
            "| ranks | dense all-reduce s | gather cf=10 s | gather cf=100 s | gather cf=1000 s | hook at cf=100 |",
            "| ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            reduce_s = 2 * (n - 1) * alpha + ring_share(n) * dense * beta
            gather_s = [(n - 1) * alpha + (n - 1) * dense / cf * beta for cf in (10, 100, 1000)]
            pick = "gather" if gathers(dense / 100, dense, n) else "dense reduce of decoded"
            cells = " | ".join(f"{g:.3f}" for g in gather_s)
            lines.append(f"| {n} | {reduce_s:.3f} | {cells} | {pick} |")
    return lines


def _tables(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = []
    reached_at_unlimited = {r["config"]: r for r in results.get("unlimited", []) if r["reached"]}
    for rate, rows in results.items():
        dense = next((r for r in rows if r["config"] == "dense DDP"), None)
        statics = [r for r in rows if r["config"].startswith(("topk", "dgc")) and r["reached"]]
        best_static = min(statics, key=lambda r: r["seconds"], default=None)
        lines += [f"\n### {rate}\n",
                  "| configuration | time to target s | steps | ratio to dense | ratio to best static | "
                  "bytes sent / dense | mean step s | final loss |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
        dense_s = _time_or_projection(dense, reached_at_unlimited)[0] if dense else None
        for r in rows:
            seconds, label = _time_or_projection(r, reached_at_unlimited)
            to_dense = f"{dense_s / seconds:.2f}x faster" if dense_s and seconds else "-"
            to_static = f"{best_static['seconds'] / seconds:.2f}x" if best_static and seconds else "-"
            lines.append(
                f"| {r['config']} | {label} | {r['steps']} | {to_dense} | {to_static} | "
                f"{r['bytes_sent'] / r['bytes_dense']:.4f} | {r['mean_step_s']:.3f} | {r['final_loss']:.3f} |"
            )
        if best_static:
            lines.append(f"\nBest static setting that reached the target: {best_static['config']}.")
    return lines


def _time_or_projection(row: dict[str, Any] | None, reached: dict[str, dict[str, Any]]) -> tuple[float | None, str]:
    if row is None:
        return None, "-"
    if row["reached"]:
        return row["seconds"], f"{row['seconds']:.1f}"
    fast = reached.get(row["config"])
    if fast is not None and CONFIGS[row["config"]][1]:
        projected = fast["steps"] * row["mean_step_s"]
        return projected, f"missed in {row['seconds']:.0f}; projected {projected:.0f}"
    return None, f"missed in {row['seconds']:.0f}"


def _plot(results: dict[str, list[dict[str, Any]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (rate, rows) in zip(axes[0], results.items(), strict=True):
        for i, r in enumerate(rows):
            t = r["trajectory"]
            color = plt.get_cmap("tab20")(i % 20)  # more rows than the default cycle's 10 colours
            ax.plot([p[0] for p in t], [p[2] for p in t], label=r["config"], lw=1.2, color=color)
        ax.axhline(target, color="k", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"link {rate}")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("smoothed training loss")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def prepare_namespace(out: str) -> Path:
    """Inside the private namespace: bring its loopback up with an MTU of 1500, and make the output folder."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "link", "set", "lo", "mtu", "1500"], check=True)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_in_namespace(flag: str, script: str) -> None:
    """Run this command again under ``unshare -n`` with ``flag=1`` in its environment (needs root and tc)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("tc") is None:
        sys.exit(
            f"{script} needs root and the `unshare` and `tc` commands (iproute2): it shapes the loopback of a "
            f"private network namespace. Run it as root, e.g. `sudo -E python {script}`."
        )
    done = subprocess.run(["unshare", "-n", sys.executable, *sys.argv], env={**os.environ, flag: "1"}, check=False)
    if done.returncode != 0:
        sys.exit(f"{script}: the run inside the network namespace failed (exit {done.returncode}).")


def _inside(args: argparse.Namespace) -> None:
    out = prepare_namespace(args.out)
    _shape("unlimited")
    costs = run_distributed(_link_costs, world_size=args.world_size, timeout=300)[0]
    results: dict[str, list[dict[str, Any]]] = {}
    for rate in args.rates:
        _shape(rate)
        results[rate] = []
        for config in args.configs:
            timeout = args.budget * 3 + 300
            row = run_distributed(
                _train,
                world_size=args.world_size,
                timeout=timeout,
                config=config,
                target=args.target,
                budget=args.budget,
            )[0]
            results[rate].append(row)
            status = "reached" if row["reached"] else "missed"
            print(f"[{rate}] {config}: {status} in {row['seconds']:.1f} s, {row['steps']} steps", flush=True)
    _shape("unlimited")
    numel = results[args.rates[0]][0]["parameters"]
    lines = [
        f"Target: smoothed training loss <= {args.target}; budget {args.budget:g} s a configuration; "
        f"{args.world_size} ranks (gloo, one thread each); {numel / 1e6:.2f}M parameters.",
        *_tables(results),
        "\n### Model of scale\n",
        f"Measured on the unlimited loopback: alpha = {costs['alpha_s'] * 1e6:.0f} us a message, "
        f"beta = {costs['beta_s_per_byte'] * 1e9:.3f} ns a byte.",
        *_scale_table(costs["alpha_s"], numel, {"1 Gbit/s": 1e9, "10 Gbit/s": 1e10}),
    ]
    text = "\n".join(lines)
    print(text)
    (out / "bandwidth.md").write_text(text + "\n")
    (out / "bandwidth.json").write_text(json.dumps({"args": vars(args), "costs": costs, "results": results}))
    _plot(results, args.target, out / "bandwidth.png")
    print(f"\nWrote {out / 'bandwidth.md'}, {out / 'bandwidth.json'}, {out / 'bandwidth.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["unlimited", "1gbit", "100mbit"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.5)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds a configuration may train")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if os.environ.get(_INSIDE) == "1":
        _inside(args)
        return
    run_in_namespace(_INSIDE, "benchmarks/bandwidth.py")


if __name__ == "__main__":
    main()
