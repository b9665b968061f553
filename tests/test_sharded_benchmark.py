"""benchmarks/sharded.py's ``no communication`` row: each rank trains alone, no process group, and the table says its
loss is not judged and gives every row's time over stock's and over it."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sharded  # the benchmark script (it imports the bandwidth benchmark beside it)

from lightning_gravac.launch import run_distributed


def _alone(rank: int, world_size: int) -> dict[str, Any]:
    row = sharded._train(rank, world_size, sharded.ALONE, seed=0, steps=2, width=16)
    return {**row, "process_group": dist.is_initialized()}


@pytest.mark.distributed
def test_the_no_communication_row_trains_each_rank_alone_to_a_finite_held_out_loss():
    ranks = run_distributed(_alone, timeout=180)
    for row in ranks:
        assert row["method"] == sharded.ALONE and not row["process_group"] and row["bytes_sent"] is None
        assert math.isfinite(row["held_out"]) and row["seconds"] > 0
    # Each rank its own share of the windows: two copies from one initialization that read different data.
    assert ranks[0]["held_out"] != ranks[1]["held_out"]


def _row(method: str, seconds: float, held_out: float = 2.0) -> dict[str, Any]:
    sent = None if method in ("stock", sharded.ALONE) else 1e6
    return {"method": method, "seed": 0, "held_out": held_out, "seconds": seconds, "bytes_sent": sent,
            "bytes_between_groups": None}  # fmt: skip


def test_the_table_marks_the_limit_not_judged_and_gives_times_over_stock_and_the_limit():
    rows = [_row("stock", 4.0), _row("int8", 3.0, 2.02), _row(sharded.ALONE, 2.0, 3.0)]
    head, _, stock, int8, alone, note = sharded._table(rows, "100mbit")
    assert head.endswith("| seconds | x stock's time | x the limit's |")
    assert stock.endswith("| 4.0 | 1.00x | 2.00x |") and int8.endswith("| 3.0 | 0.75x | 1.50x |")
    assert "| +1.00% |" in int8
    assert alone.startswith("| no communication | 3.0000 | not judged | not judged |") and alone.endswith("| 1.00x |")
    assert "not judged" in note
    # Without the limit, only stock's ratio; unshaped, no time at all.
    head, *_ = sharded._table(rows[:2], "100mbit")
    assert head.endswith("| seconds | x stock's time |")
    assert "seconds" not in sharded._table(rows, None)[0]


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    made = subprocess.run(["ip", "netns", "add", "gravac-probe"], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "del", "gravac-probe"], capture_output=True, check=False)
    return made.returncode == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_hybrid_sharding_between_two_emulated_machines_runs_each_method_and_tables_it(tmp_path):
    if not _can_make_namespaces():
        pytest.skip("needs root and network namespaces")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "hsdp_link.py"
    methods = ["stock", "int8", "int8-every4", sharded.ALONE]
    command = [sys.executable, str(script), "--steps", "2", "--width", "16", "--rate", "unlimited", "--out",
               str(tmp_path), "--timeout", "300", "--methods", *methods]  # fmt: skip
    subprocess.run(command, check=True, timeout=1500, capture_output=True)  # each method ends within --timeout
    result = json.loads((tmp_path / "hsdp.json").read_text())
    rows = {row["method"]: row for row in result["rows"]}
    assert rows.keys() == {"stock", "int8", "int8-every4", sharded.ALONE}
    assert rows["stock"]["bytes_between_groups"] is None and rows["int8"]["bytes_between_groups"] > 0
    assert all(math.isfinite(row["held_out"]) and row["seconds"] > 0 for row in rows.values())
    table = (tmp_path / "hsdp.md").read_text()
    assert "| stock | +0.00% |" in table and f"| {sharded.ALONE} | not judged |" in table
    left = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    assert "gravac-m" not in left  # the machines are taken down
