"""dpsweep.process.shutdown: a command ends with the interpreter's shutdown steps but not its teardown."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import atexit, ctypes, sys, threading, time
from pathlib import Path
from dpsweep.process.shutdown import run_then_exit

out = Path(sys.argv[1])

class Teardown:  # freed only by the interpreter's teardown, which a command's process skips
    def __del__(self) -> None:
        (out / "teardown").write_text("ran")

KEPT = Teardown()

def main() -> int:
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    def late() -> None:
        time.sleep(0.3)
        (out / "thread").write_text("joined")
    threading.Thread(target=late).start()  # not a daemon: joined before the process ends
    sys.stdout.write("from Python, no newline;")  # buffered: stdout is a pipe
    ctypes.CDLL(None).printf(b"from C, no newline")  # buffered in C's stdio
    if sys.argv[2] == "message":
        raise SystemExit("a message instead of a code")
    return int(sys.argv[2])

run_then_exit(main)
"""


@pytest.mark.parametrize(("how", "code"), [("0", 0), ("3", 3), ("message", 1)])
def test_a_command_exits_with_its_code_after_threads_atexit_and_flushes_but_no_teardown(
    tmp_path: Path, how: str, code: int
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), how], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == code, done.stderr
    assert done.stdout == "from Python, no newline;from C, no newline", done.stderr
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "joined"
    assert not (tmp_path / "teardown").exists()  # the teardown was skipped
    assert done.stderr == ("a message instead of a code\n" if how == "message" else "")


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
