import os
from pathlib import Path

import pytest
import torch.distributed as dist

#: The checkout's root, which a test run must leave as it found it.
ROOT = Path(__file__).resolve().parents[1]
#: What the tools write at the root by themselves: pytest's cache, and the linters' caches when they run beside it.
TOOL_CACHES = frozenset({".pytest_cache", ".mypy_cache", ".ruff_cache", "__pycache__"})

#: Variables Lightning's launcher sets in the process that runs an in-process Trainer. Left behind, they make a
#: later child process believe an external launcher started it, so it waits for ranks nobody launches.
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _no_leftover_process_group_or_launcher_environment():
    environment = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture(autouse=True)
def _in_a_scratch_directory(tmp_path, monkeypatch):
    """Each test runs in its own directory: what Lightning writes by default (``checkpoints/``, the run summary's
    ``gravac.png``) lands there, never in the checkout. Spawned ranks start in it too."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session", autouse=True)
def _the_checkout_root_gains_no_file():
    """A test that writes at the root (a subprocess started there, a fixture that runs before the scratch directory
    exists) fails the run, where its file would otherwise be committed with the next change."""
    before = set(os.listdir(ROOT))
    yield
    added = sorted(set(os.listdir(ROOT)) - before - TOOL_CACHES)
    assert not added, f"the tests wrote {added} at the repository's root ({ROOT}): write under tmp_path instead"
