"""A test run leaves the checkout as it found it: what tests write goes to their own directories."""

import os
import shutil
import subprocess
import sys

from conftest import LAUNCHER_VARIABLES, ROOT

STRAY = """
from pathlib import Path


def test_in_its_own_directory():
    Path("gravac.png").write_bytes(b"")


def test_at_the_root():
    (Path(__file__).resolve().parents[1] / "gravac.png").write_bytes(b"")
"""


def test_a_test_that_writes_at_the_root_fails_the_run(tmp_path):
    # A checkout of its own: these tests' conftest beside a test that writes a plot where a run started from the root
    # would, and one that writes where it runs.
    checkout = tmp_path / "checkout"
    (checkout / "tests").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "conftest.py", checkout / "tests")
    (checkout / "tests" / "test_stray.py").write_text(STRAY)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}

    def pytest(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, "tests"]
        return subprocess.run(cmd, check=False, cwd=checkout, env=env, capture_output=True, text=True, timeout=120)

    kept = pytest("-k", "own_directory")
    assert kept.returncode == 0, kept.stdout[-2000:]
    assert sorted(os.listdir(checkout)) == ["tests"]
    strayed = pytest()
    assert strayed.returncode != 0 and "2 passed, 1 error" in strayed.stdout, strayed.stdout[-2000:]
    assert "the tests wrote ['gravac.png'] at the repository's root" in strayed.stdout
