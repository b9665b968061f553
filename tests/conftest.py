import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
