import os

import pytest
import torch.distributed as dist

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
