"""Run a function on N local ranks with real torch.distributed (gloo), the way torchrun would.

Each rank is a fresh spawned interpreter with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` set, so a
Lightning ``Trainer`` inside it sees an external launcher and does not re-execute pytest. Results are saved
before the worker ends with ``os._exit``: gloo sometimes aborts at interpreter exit after a clean run, and
that must not read as a failure of the code under test. For the same reason ``fn`` must not destroy the process
group: tearing down DDP's reducer after its group is gone can hang, and ``os._exit`` makes teardown moot.
"""

import faulthandler
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, out: str, timeout: float, kwargs: dict
) -> None:
    # If this rank hangs, its stacks land in a file the parent reports, instead of a bare timeout.
    stacks = open(Path(out, f"{rank}.stacks"), "w")
    faulthandler.dump_traceback_later(max(1.0, timeout - 5), file=stacks)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, **kwargs)
        torch.save(result, Path(out, f"{rank}.pt"))
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_distributed(
    fn: Callable[..., Any], world_size: int = 2, timeout: float = 300, allow_missing: bool = False, **kwargs: Any
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` ranks and return the results by rank.

    ``timeout`` bounds the whole run, all ranks together.

    With ``allow_missing`` a rank that ends without a result or hangs (one a test kills or stalls on purpose) gives
    ``None``; it is killed at ``timeout``.

    Raises:
        RuntimeError: with every failing rank's traceback, or if a rank has not finished within ``timeout`` (its
            stacks), or exited without a result; the last two unless ``allow_missing``.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, port, out, timeout, kwargs)) for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = {r: Path(out, f"{r}.err").read_text() for r in range(world_size) if Path(out, f"{r}.err").exists()}
        if errors:
            raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors.items()))
        if hung and not allow_missing:
            stacks = "".join(f"--- rank {r} ---\n{Path(out, f'{r}.stacks').read_text()}" for r in hung)
            raise RuntimeError(f"ranks {hung} did not finish within {timeout}s:\n{stacks}")
        missing = [r for r in range(world_size) if not Path(out, f"{r}.pt").exists()]
        if missing and not allow_missing:
            raise RuntimeError(f"ranks {missing} exited without a result")
        return [
            None if r in missing else torch.load(Path(out, f"{r}.pt"), weights_only=False) for r in range(world_size)
        ]
