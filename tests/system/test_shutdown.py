"""dpsweep.process.shutdown: an interrupted command says so in one line; a sweep job runs submitit's runner."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

INTERRUPTED = """
import sys
from dpsweep.process.shutdown import Terminated, run_then_exit

def main() -> int:
    raise KeyboardInterrupt if sys.argv[1] == "int" else Terminated(15)

run_then_exit(main, "dpsweep")
"""


@pytest.mark.parametrize(("how", "code", "line"), [("int", 130, "Ctrl-C"), ("term", 143, "SIGTERM")])
def test_an_interrupted_command_says_so_in_one_line_and_exits_with_the_signals_code(
    how: str, code: int, line: str
) -> None:
    """Issue 33, item 9: a 60-line traceback before."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED, how], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stderr == (
        f"dpsweep: interrupted ({line}); a run in progress was ended KILLED, keeping what it had logged\n"
    )


def test_a_sweep_job_runs_submitits_runner_and_refuses_other_arguments(tmp_path: Path) -> None:
    """dpsweep.launchers.job takes exactly what submitit appends to its python command."""
    from dpsweep.launchers.hydra_launchers import JOB_PYTHON
    from dpsweep.launchers.job import main

    assert JOB_PYTHON.endswith(" -u -m dpsweep.launchers.job")
    with pytest.raises(SystemExit, match=r"usage: python -u -m dpsweep.launchers.job -u -m submitit.core._submit"):
        main(["-m", "something.else", str(tmp_path)])
    done = subprocess.run(  # submitit's runner itself: a folder without a job is its own error
        [*shlex.split(JOB_PYTHON), "-u", "-m", "submitit.core._submit", str(tmp_path / "none")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "submitit" in done.stderr, done.stderr
