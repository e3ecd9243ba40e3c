"""A command's process ends as Python ends it (threads joined, atexit handlers run, streams flushed), with
what the run left in reference cycles finalised, and the objects still alive then frozen, so that the
interpreter's teardown skips its full collections (1.4 of a default run's 9.5 CPU-s, issue 57): an
object a module still holds at the exit is then not finalised (``dpsweep.process.shutdown``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import atexit, gc, sys, threading, time
from pathlib import Path
from dpsweep.process.shutdown import run_then_exit

out = Path(sys.argv[1])

class Held:  # still held by this module at the exit: not finalised, as Python never promised
    def __del__(self) -> None:
        (out / "held").write_text("finalised")

HELD = Held()

class Cyclic:  # garbage in a reference cycle: only a collection finalises it
    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        (out / "cycle").write_text("finalised")

def main() -> int:
    gc.disable()  # no collection of its own before the exit's
    Cyclic()
    atexit.register(lambda: (out / "atexit").write_text(f"frozen={gc.get_freeze_count() > 0}"))
    def late() -> None:
        time.sleep(0.2)
        (out / "thread").write_text("joined")
    threading.Thread(target=late).start()  # not a daemon: joined before the process ends
    sys.stdout.write("no newline;")  # buffered: stdout is a pipe
    if sys.argv[2] == "message":
        raise SystemExit("a message instead of a code")
    return int(sys.argv[2])

run_then_exit(main)
"""


@pytest.mark.parametrize(("how", "code"), [("0", 0), ("3", 3), ("message", 1)])
def test_a_commands_exit_collects_then_freezes(tmp_path: Path, how: str, code: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path), how], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == code, done.stderr
    assert done.stdout == "no newline;", done.stderr
    assert done.stderr == ("a message instead of a code\n" if how == "message" else "")
    ran = {path.name: path.read_text() for path in tmp_path.iterdir()}
    assert ran == {"atexit": "frozen=True", "thread": "joined", "cycle": "finalised"}  # not "held"
