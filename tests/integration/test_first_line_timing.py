"""The first line of a run and of a sweep comes within seconds of the command's start (issue 56, item 7):
the ``dpsweep`` console script as its own process, its first stdout line awaited under a time bound, then
the process group ended (nothing trains to the end).

A sweep composes and checks its jobs and prints them (``dpsweep: a sweep of 2 jobs over train.seed ...``)
before MLflow, torch and the store: it printed nothing for 12 s on an idle 2-core VM before, 18 to 27 s
under load. A run's start line came in about 2 s already; the bound guards it. The bound is the issue's
2 s with room for CI on 2 busy cores (both lines take 0.8 and 1.5 s with a load average of 9 there).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import BIN

FIRST_LINE_S = 8.0  # the 2 s, with room for 2 busy cores; a sweep took 12 s before, idle


def first_line(cwd: Path, *args: str) -> tuple[float, str, str]:
    """Seconds from the start of ``dpsweep *args`` to its first stdout line (inf: none within the bound), the
    line, and what the command had written to stderr by then (the process group is ended after the line)."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(
        [str(BIN / "dpsweep"), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline() if proc.stdout else ""), daemon=True).start()
    try:
        line = lines.get(timeout=FIRST_LINE_S)
        seconds = time.monotonic() - start
    except queue.Empty:
        line, seconds = "", float("inf")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run or sweep itself is not under test
        _, err = proc.communicate(timeout=60)
    return seconds, line.strip(), err


@pytest.mark.parametrize(
    ("args", "starts"),
    [
        (["-m", "train.seed=0,1", "train.epochs=1"], "dpsweep: a sweep of 2 jobs over train.seed (launcher=inline)"),
        (["-m", "launcher=local", "dp.noise_multiplier=0.8,1.2"], "dpsweep: a sweep of 2 jobs over dp.noise"),
        (["-m", "search=accuracy_tpe"], "dpsweep: an Optuna study digits_accuracy_tpe of 12 trials (launcher=inline)"),
        (["train.epochs=1"], "dpsweep: training digits/cnn B=64 epochs=1 seed=0"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_the_first_line_comes_within_seconds(tmp_path: Path, args: list[str], starts: str) -> None:
    seconds, line, err = first_line(tmp_path, *args)
    assert seconds < FIRST_LINE_S, f"no line on stdout within {FIRST_LINE_S} s; stderr:\n{err[-3000:]}"
    assert line.startswith(starts), f"{line}\nstderr:\n{err[-3000:]}"
