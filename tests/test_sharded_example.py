"""examples/sharded.py under torchrun: two "machines" on this one, a process each, each machine a replica group."""

from pathlib import Path

import pytest
import torch
from test_multinode import two_nodes

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.distributed
def test_two_machines_average_their_shards_in_codes_and_end_alike(tmp_path):
    script = [str(ROOT / "examples" / "sharded.py"), "--nodes", "2", "--devices", "1", "--steps", "4", "--width", "32"]
    two_nodes([*script, "--out", str(tmp_path)], tmp_path, timeout=240)
    first, second = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for name, w in first["weights"].items():
        assert torch.equal(w, second["weights"][name]), name
    assert first["between"] > 0  # the machines' average went in codes
