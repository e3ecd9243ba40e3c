"""A launcher=local job ends once its driver is gone, even where the first SIGTERM its watch sends is
lost (``dpsweep.process.liveness.die_with_driver``). CI once saw a job train on for 11 minutes after
its driver was killed; a SIGTERM sent by hand then ended it at once.

Each job here is a process of its own (the watch sends SIGTERM to its own process), started with a
driver that the test then kills; its output is shown when a test fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpsweep.process.liveness import ENV_DRIVER, ProcessId, pid_namespace, start_ticks

JOB_TIMEOUT_S = 60  # a job is killed then; one that is not interrupted sleeps TRAINS_ON_S, then exits 3
TRAINS_ON_S = 20


@pytest.fixture
def driver() -> Iterator[subprocess.Popen[bytes]]:
    """A driver process of this host: the test kills it."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def token(proc: subprocess.Popen[bytes]) -> str:
    """``proc``'s identity, as launcher=local puts the driver's in its jobs' environment."""
    return ProcessId(ProcessId.current().host, proc.pid, start_ticks(proc.pid), pid_namespace()).token


TRAINS_ON = f"""
try:  # the job's training: exit 0 once interrupted, 3 if it trains on to the end
    time.sleep({TRAINS_ON_S})
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(0)
sys.exit(3)
"""


def start_job(script: str, driver: subprocess.Popen[bytes], tmp_path: Path, then: str = "") -> subprocess.Popen[str]:
    """``script`` (then ``then``) as a job of ``driver``; it prints ``ready`` once its driver may be killed."""
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script) + then)
    env = os.environ | {ENV_DRIVER: token(driver), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(path)], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip


def kill_when_ready(job: subprocess.Popen[str], driver: subprocess.Popen[bytes]) -> str:
    """Kill the driver once the job says it is ready; the job's whole output once it has ended (killed
    after JOB_TIMEOUT_S)."""
    assert job.stdout is not None
    deadline = threading.Timer(JOB_TIMEOUT_S, job.kill)
    deadline.start()
    try:
        seen = ""
        for line in job.stdout:
            seen += line
            if line.strip() == "ready":
                break
        else:
            job.wait()
            raise AssertionError(f"the job ended before it was ready (exit {job.returncode}):\n{seen}")
        driver.kill()
        driver.wait()
        rest, _ = job.communicate()
    finally:
        deadline.cancel()
    return seen + rest


def test_a_job_whose_first_sigterm_is_lost_in_a_finalizer_still_ends(
    driver: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """CPython drops the exception a signal handler raises while the main thread runs a finalizer
    ("Exception ignored in ..."): the run's handler raised its interrupt there, and the job would
    train on. The watch sends SIGTERM again, and the next one interrupts the training."""
    job = start_job(
        f"""
        import signal, sys, threading, time
        from dpsweep.process.liveness import die_with_driver

        def interrupt(signum, frame):  # as dpsweep.tracking.terminate_as_interrupt's
            raise KeyboardInterrupt(f"signal {{signum}}")

        class Finalized:
            def __del__(self):  # the first SIGTERM interrupts this sleep: its interrupt is dropped
                print("ready", flush=True)
                time.sleep({TRAINS_ON_S})

        signal.signal(signal.SIGTERM, interrupt)
        assert die_with_driver(poll_s=0.05, resend_s=0.5)
        Finalized()  # freed at once: its __del__ runs in the main thread
        print("training", flush=True)
        """,
        driver,
        tmp_path,
        then=TRAINS_ON,
    )
    started = time.monotonic()
    out = kill_when_ready(job, driver)
    assert "Exception ignored in" in out and "KeyboardInterrupt: signal 15" in out, out  # the first one was lost
    assert job.returncode == 0 and "training\ninterrupted" in out, out
    assert time.monotonic() - started < TRAINS_ON_S, out


def test_an_error_of_the_watch_does_not_end_it(driver: subprocess.Popen[bytes], tmp_path: Path) -> None:
    """An error asking whether the driver runs (a race with /proc) is said on stderr; the watch goes on."""
    job = start_job(
        """
        import signal, sys, time
        from dpsweep.process import liveness

        calls = []
        alive = liveness.ProcessId.alive

        def flaky(self):
            calls.append(1)
            if len(calls) == 2:  # the watch's first question (die_with_driver asks first)
                raise ValueError("substring not found")
            return alive(self)

        def interrupt(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        liveness.ProcessId.alive = flaky
        signal.signal(signal.SIGTERM, interrupt)
        assert liveness.die_with_driver(poll_s=0.05, resend_s=0.5)
        asked = time.monotonic()
        while len(calls) < 3 and time.monotonic() < asked + 5:  # the watch asked again (it goes on)
            time.sleep(0.01)
        print("ready", flush=True)
        """,
        driver,
        tmp_path,
        then=TRAINS_ON,
    )
    out = kill_when_ready(job, driver)
    assert "could not tell whether the sweep's driver" in out and "substring not found" in out, out
    assert job.returncode == 0 and out.rstrip().endswith("interrupted"), out


def test_a_packed_job_passes_the_sigterm_on_to_its_trials(driver: subprocess.Popen[bytes], tmp_path: Path) -> None:
    """A packed job (launchers/packing.py) installs the handler that passes SIGTERM on to its trials
    after it starts them; before, submitit's handler drops it (here: a handler that does nothing).
    Its watch starts after that handler is installed, so the job's trials end with its driver; the job
    then ends as a job of one trial does, without a result (Terminated)."""
    job = start_job(
        f"""
        import os, signal, sys, time
        from dpsweep.launchers.packing import PackedTrials
        from dpsweep.process.liveness import ProcessId

        def trial(overrides, *rest):
            time.sleep({TRAINS_ON_S})

        signal.signal(signal.SIGTERM, lambda signum, frame: print("bypassed", flush=True))  # submitit's
        print("ready", flush=True)
        while ProcessId.parse(os.environ["DPSWEEP_DRIVER"]).alive():  # packed once the driver is gone
            time.sleep(0.01)
        started = time.monotonic()
        try:
            PackedTrials(trial, {str(tmp_path)!r})([(["a=1"], "hydra.sweep.dir", 0, "j0", {{}})])
        except KeyboardInterrupt as ended:
            print(type(ended).__name__, f"{{time.monotonic() - started:.1f}} s", flush=True)
        """,
        driver,
        tmp_path,
    )
    out = kill_when_ready(job, driver)
    assert job.returncode == 0 and "Terminated" in out and "bypassed" not in out, out
    seconds = float(out.rstrip().split()[-2])
    assert seconds < TRAINS_ON_S / 2, out


def test_the_trials_of_one_job_share_one_watch(driver: subprocess.Popen[bytes], tmp_path: Path) -> None:
    """launcher.trials_per_job runs several trials in one process, each calling ``die_with_driver``: one
    watch thread for them all, so that the driver's death sends one SIGTERM per resend, not one per trial."""
    job = start_job(
        """
        import threading
        from dpsweep.process.liveness import die_with_driver
        started = [die_with_driver() for _ in range(3)]
        watches = [t for t in threading.enumerate() if t.name == "dpsweep-driver-watch"]
        print(started, len(watches), flush=True)
        """,
        driver,
        tmp_path,
    )
    out, _ = job.communicate(timeout=JOB_TIMEOUT_S)
    assert job.returncode == 0 and out.strip() == "[True, True, True] 1", out
