"""Two "nodes" on this machine, launched as on a cluster: torchrun --nnodes 2 --node-rank 0|1, one process each."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import LAUNCHER_VARIABLES

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(script: list[str], where: Path, timeout: float) -> None:
    """Run ``script`` (an example and its arguments) under torchrun as 2 nodes of 1 process each, in ``where``.

    Raises:
        AssertionError: with the end of each node's output, if a node failed.
    """
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES} | {"OMP_NUM_THREADS": "1"}

    def launch(node: int) -> subprocess.Popen:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
        torchrun += ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmd = [*torchrun, *script]
        return subprocess.Popen(cmd, env=env, cwd=where, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    nodes = [launch(0), launch(1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=timeout)[0])
    finally:
        for node in nodes:
            node.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)


@pytest.mark.distributed
def test_two_nodes_under_torchrun_train_alike_and_report_the_metrics(tmp_path):
    script = [str(ROOT / "examples" / "multinode.py"), "--nodes", "2", "--devices", "1", "--steps", "6"]
    two_nodes([*script, "--out", str(tmp_path)], tmp_path, timeout=180)
    first, second = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert (first["node"], second["node"]) == (0, 1) and first["world_size"] == second["world_size"] == 2
    for name, w in first["weights"].items():
        assert torch.equal(w, second["weights"][name]), name
    for result in (first, second):
        assert result["metrics"]["gravac/cf"] == 8
        assert result["metrics"]["gravac/bytes_sent"] < result["metrics"]["gravac/bytes_dense"]
    assert first["metrics"]["gravac/gain"] == second["metrics"]["gravac/gain"]
