"""Hybrid sharding between two emulated machines joined by a slow link: each machine's ranks shard the model over
its own fast loopback, and only the traffic between the machines crosses the shaped link.

    sudo -E python benchmarks/hsdp_link.py [--methods stock none int8 int8-every4 int8-every16 "no communication"]
                                           [--rate 100mbit] [--steps 150] [--seed 0] [--width 128] [--out DIR]

Two network namespaces are the two machines, joined by a veth pair whose two ends a token bucket shapes to
``--rate`` (``tc ... tbf``, as ``benchmarks/bandwidth.py`` shapes a loopback). Each machine runs 2 processes under
``torchrun`` (gloo bound to its end of the link, ``GLOO_SOCKET_IFNAME``); inside a machine the processes talk over
its own loopback, unshaped, as processes on one host do. Every method trains ``benchmarks/sharded.py``'s gpt task
(ByteGPT, AdamW) from one seed for ``--steps`` steps, then measures the held-out loss:

- ``stock``: Lightning's ``ModelParallelStrategy`` sharding over all 4 ranks, every collective across the link (what
  Lightning offers for two machines);
- ``none``: ``GraVACModelParallelStrategy("none", replica_groups=2)``, exact hybrid sharding: FSDP2's collectives
  within a machine, an exact all-reduce of each shard's gradient between them (stock HSDP's traffic);
- ``int8``: the same in ``int8`` block codes, gradients and parameters, the strategy's default;
- ``int8-every4`` (``int8-every16``): each machine trains on its own and the two average their parameter changes every
  4 (16) optimizer steps in ``int8`` (``replica_every``);
- ``no communication``: each process alone with the whole model on its share of the data, nothing sent: the limit.

Needs root (``ip netns``, ``tc``). Writes ``hsdp.json`` and ``hsdp.md`` under ``--out`` and prints the table: each
method's seconds for the fit, over stock's and over the limit's.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sharded import ALONE, _train  # the sharded benchmark's task, methods and fit

METHODS = ("stock", "none", "int8", "int8-every4", "int8-every16", ALONE)
#: The two machines: their network namespaces, their ends of the link and their addresses.
MACHINES = (("gravac-m0", "gravac-l0", "10.77.0.1"), ("gravac-m1", "gravac-l1", "10.77.0.2"))
NODES, DEVICES = 2, 2


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _link(rate: str) -> None:
    """The two machines and the shaped link between them (any left from an interrupted run replaced)."""
    _unlink()
    (_, end_a, _), (_, end_b, _) = MACHINES
    for namespace, *_ in MACHINES:
        _ip("netns", "add", namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")
    _ip("link", "add", end_a, "type", "veth", "peer", "name", end_b)
    for namespace, end, address in MACHINES:
        _ip("link", "set", end, "netns", namespace)
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", end)
        _ip("-n", namespace, "link", "set", end, "up")
        if rate != "unlimited":
            bits = float(rate.lower().replace("gbit", "e9").replace("mbit", "e6"))
            burst = max(16 * 1024, int(bits / 8 * 0.004))  # 4 ms of traffic
            tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
            subprocess.run(["tc", "-n", namespace, "qdisc", "replace", "dev", end, "root", *tbf], check=True)


def _unlink() -> None:
    for namespace, end, _ in MACHINES:
        subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", end], check=False, capture_output=True)  # left outside by an interruption


def _launch(args: argparse.Namespace, method: str, out: Path, port: int) -> dict[str, Any]:
    """One method on the two machines, ``torchrun`` on each; rank 0's result."""
    result = out / f"{method.replace(' ', '-')}.json"
    result.unlink(missing_ok=True)
    procs = []
    for node, (namespace, end, _) in enumerate(MACHINES):
        torchrun = ["-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(DEVICES),
                    "--node-rank", str(node), "--master-addr", MACHINES[0][2], "--master-port", str(port)]  # fmt: skip
        mine = ["--machine-process", "--method", method, "--result", str(result), "--steps", str(args.steps),
                "--seed", str(args.seed), "--width", str(args.width)]  # fmt: skip
        command = ["ip", "netns", "exec", namespace, "env", f"GLOO_SOCKET_IFNAME={end}", sys.executable, *torchrun,
                   str(Path(__file__).resolve()), *mine]  # fmt: skip
        procs.append(subprocess.Popen(command, cwd=Path(__file__).parent, start_new_session=True))
    deadline = time.monotonic() + args.timeout
    try:  # until both end, one fails (the other would wait for it) or the timeout
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                break
            time.sleep(1.0)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes) or not result.is_file():
        raise SystemExit(f"hsdp_link.py: {method!r} failed on the machines (exit codes {codes}).")
    return json.loads(result.read_text())


def _node(args: argparse.Namespace) -> None:
    """One process of one machine, under torchrun: the sharded benchmark's fit and validation on the two machines;
    rank 0 writes the result."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Ours gather the parameters as the strategy does by default: in int8 under a block code.
    row = _train(rank, world, args.method, args.seed, args.steps, args.width, replica_groups=NODES, nodes=NODES,
                 options={"all_gather_code": "auto"})  # fmt: skip
    if rank == 0:
        Path(args.result).write_text(json.dumps(row))


def _table(rows: list[dict[str, Any]], rate: str) -> list[str]:
    by = {r["method"]: r for r in rows}
    stock, alone = by["stock"], by.get(ALONE)
    lines = [
        f"\n{rate} between 2 machines of 2 ranks, {rows[0]['steps']} steps, seed {rows[0]['seed']}:\n",
        "| method | held-out loss x stock's | seconds | x stock's time |" + " x the limit's |" * (alone is not None),
        "|---|---|---|---|" + "---|" * (alone is not None),
    ]
    for row in rows:
        gap = "not judged" if row["method"] == ALONE else f"{row['held_out'] / stock['held_out'] - 1:+.2%}"
        line = f"| {row['method']} | {gap} | {row['seconds']:.1f} | {row['seconds'] / stock['seconds']:.2f}x |"
        if alone is not None:
            line += f" {row['seconds'] / alone['seconds']:.2f}x |"
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--rate", default="100mbit", help="the link between the machines: unlimited, 1gbit, 100mbit")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds a method may take")
    parser.add_argument("--out", default="benchmarks/results/hsdp-link")
    parser.add_argument("--machine-process", action="store_true", help=argparse.SUPPRESS)  # a machine's process
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.machine_process:
        _node(args)
        return
    if "stock" not in args.methods:
        parser.error("--methods must include stock, which the others are measured against")
    if os.geteuid() != 0:
        sys.exit("benchmarks/hsdp_link.py needs root: it makes two network namespaces joined by a shaped veth pair.")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        _link(args.rate)
        for i, method in enumerate(args.methods):
            row = {**_launch(args, method, out, 29600 + i), "steps": args.steps}
            rows.append(row)
            print(f"[{args.rate}] {method}: {row['seconds']:.1f} s, held-out {row['held_out']:.4f}", flush=True)
    finally:
        _unlink()
    seconds = {r["method"]: r["seconds"] for r in rows}
    text = "\n".join(_table(rows, args.rate))
    print(text)
    (out / "hsdp.md").write_text(text + "\n")
    (out / "hsdp.json").write_text(json.dumps({"args": vars(args), "rows": rows, "seconds": seconds}, indent=1))


if __name__ == "__main__":
    main()
