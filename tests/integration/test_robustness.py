"""Robustness of the console scripts where several processes meet, or a server does not answer (issue 55):
Optuna drivers started together on a new storage, and a PostgreSQL tracking store that refuses or
never answers. Each command runs as its own process; its stderr is shown by every failed assertion."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from helpers import BIN, run_script

FAST = ["train.epochs=1", "train.progress=false", "tracking.log_model=false"]


def start(command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``command`` started, its stdout and stderr piped (read by ``communicate``)."""
    return subprocess.Popen(command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def said(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_two_drivers_started_together_share_a_new_storage_and_keep_to_n_trials(tmp_path: Path) -> None:
    """Item 3: the second driver used to lose the race to create Optuna's tables ("storage ... is
    invalid", exit 2), and two drivers that each asked a batch of n_jobs ran 4 trials for n_trials=3."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    args = [
        "-m", "search=accuracy_tpe", "hydra.sweeper.optuna.pruner=null", "hydra.sweeper.optuna.n_trials=3",
        "hydra.sweeper.optuna.n_jobs=2", f"hydra.sweeper.optuna.storage={storage}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", *FAST,
    ]  # fmt: skip
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    drivers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()  # each its own Hydra output folders
        command = [str(BIN / "dpsweep"), *args]
        drivers.append(start(command, tmp_path / name, env))
    outs = [(d, *d.communicate(timeout=600)) for d in drivers]
    for driver, out, err in outs:
        assert driver.returncode == 0, f"exit {driver.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    study = optuna.load_study(study_name="digits_accuracy_tpe", storage=storage)
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    assert states == ["COMPLETE"] * 3, "\n".join(f"{out}\n{err}" for _, out, err in outs)
    drawn = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(set(drawn)) == 3, drawn  # the two drivers' samplers are seeded apart


OPEN_AT = """
import sys, time
from dpsweep.launchers.optuna_sweeper import open_locked
at = float(sys.argv[2])
time.sleep(max(0.0, at - time.time()))  # every process at once, its imports done
open_locked(sys.argv[1])
"""


@pytest.mark.slow
def test_processes_opening_a_new_storage_at_once_all_find_it(tmp_path: Path) -> None:
    """Item 3, the storage alone: without the lock, one of three processes opening a new sqlite storage at
    once lost Optuna's table creation about half the time ("table trials already exists")."""
    urls = [f"sqlite:///{tmp_path / f'optuna{i}.db'}" for i in range(3)]
    at = str(time.time() + 10)  # after the slowest import on a loaded machine
    procs = [start([sys.executable, "-c", OPEN_AT, u, at]) for u in urls * 3]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err[-3000:]}"
    assert all(optuna.get_all_study_names(u) == [] for u in urls)  # each a storage, whole, with no study yet


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A loopback port whose server accepts connections and never answers (PostgreSQL's client then
    waits for the server's first message); its port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def closed_port() -> int:
    """A loopback port with nothing listening (a connection to it is refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


DEADLINE_S = 40.0  # well beyond the probe's 5 s and a command's start on a loaded machine; MLflow took minutes


def check_refused_fast(proc: subprocess.CompletedProcess[str], took_s: float, port: int, prog: str) -> None:
    assert proc.returncode == 2, said(proc)
    assert took_s < DEADLINE_S, said(proc)
    [line] = proc.stderr.strip().splitlines()  # one line, no traceback, no MLflow retry warnings
    assert line.startswith(f"{prog}: error: ") and f"127.0.0.1:{port}" in line, said(proc)
    assert "tracking" in line and "s3cret" not in proc.stdout + proc.stderr, said(proc)


@pytest.mark.slow
@pytest.mark.parametrize("server", ["refused", "silent"])
def test_an_unreachable_postgresql_store_is_refused_within_seconds(tmp_path: Path, server: str) -> None:
    """Item 5: MLflow retried an unreachable PostgreSQL server for minutes, then printed a traceback."""
    with silent_server() if server == "silent" else contextlib.nullcontext(closed_port()) as port:
        uri = f"postgresql://u:s3cret@127.0.0.1:{port}/db"
        start = time.monotonic()
        proc = run_script("dpsweep-runs", "reconcile", "--tracking-uri", uri, cwd=tmp_path, timeout=120)
        check_refused_fast(proc, time.monotonic() - start, port, "dpsweep-runs")
        assert "--tracking-uri=" in proc.stderr, said(proc)


@pytest.mark.slow
def test_a_run_on_a_silent_postgresql_store_is_refused_within_seconds(tmp_path: Path) -> None:
    """Item 5, for a training run (``dpsweep tracking.uri=...``): refused before any training."""
    with silent_server() as port:
        start = time.monotonic()
        proc = run_script(
            "dpsweep", f"tracking.uri=postgresql://u:s3cret@127.0.0.1:{port}/db", *FAST, cwd=tmp_path, timeout=120,
            env={"OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        check_refused_fast(proc, time.monotonic() - start, port, "dpsweep")
        assert "tracking.uri=" in proc.stderr and "epoch 1/1" not in proc.stdout, said(proc)
