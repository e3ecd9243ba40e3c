"""Issue 57's "done when": a toy engine, a toy task (audited, with no audit line in it) and a toy launcher,
each registered from a test file alone (``tests/toys/``), run end to end.

Each toy module runs in a fresh interpreter: what it registers (a TaskConfig subclass, a mechanism, a
Hydra plugin) lives as long as the process that imported it, and a sweep later in the same test worker
pickles its jobs for other processes, which cannot import a test module. ``tests/toys/`` is not
collected by a plain ``pytest`` run (its files are not named ``test_*``), only by these tests.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO


@pytest.mark.parametrize("toy", ["toy_engine", "toy_task", "toy_launcher"])
def test_a_toy_registered_from_a_test_file_alone_runs_end_to_end(toy: str) -> None:
    args = [sys.executable, "-m", "pytest", f"tests/toys/{toy}.py", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    said = f"{done.stdout[-8000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, said
    assert " passed" in done.stdout and " skipped" not in done.stdout and " failed" not in done.stdout, said
