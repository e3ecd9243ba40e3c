"""Sweeps through real schedulers: a single-node Slurm and a single-node Grid Engine cluster on this
machine, on loopback, brought up by launchers/scripts/{slurm,sge}_up.sh (Debian packages; needs root).

    sudo launchers/scripts/slurm_up.sh && sudo launchers/scripts/sge_up.sh && .venv/bin/pytest tests/test_clusters.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from dpsweep import checkpoint, privacy

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "launchers" / "scripts"
BIN = Path(sys.executable).parent
SGE_ENV = {"SGE_ROOT": "/var/lib/gridengine", "SGE_CELL": "default"}
pytestmark = pytest.mark.cluster
# One worker runs each scheduler's tests in turn: they share its 2-slot node. Slurm's and Grid
# Engine's are separate clusters, so their tests may run at the same time.
SLURM = pytest.mark.xdist_group("slurm")
SGE = pytest.mark.xdist_group("sge")
GRID = [
    "dp.noise_multiplier=0.8,1.6",
    "train.seed=0,1",
    "train.epochs=1",
    "train.progress=false",
    "tracking.log_model=false",
]


def _bring_up(script: str) -> None:
    proc = subprocess.run(["bash", str(SCRIPTS / script)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="session")
def slurm() -> Iterator[None]:
    _bring_up("slurm_up.sh")
    yield


@pytest.fixture(scope="session")
def sge() -> Iterator[None]:
    _bring_up("sge_up.sh")
    yield


def dpsweep(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "dpsweep"), "-m", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **SGE_ENV, **(env or {})},
    )  # fmt: skip


def finished_runs(cwd: Path) -> list[Run]:
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dpsweep")
    if exp is None:
        return []
    return [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("sweep.role") != "parent"]


def _assert_four_finished(cwd: Path, proc: subprocess.Popen[str]) -> None:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out + err
    assert ": 4 finished, 0 skipped, 0 failed" in out
    runs = finished_runs(cwd)
    assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}
    got = sorted((float(r.data.params["dp.noise_multiplier"]), int(r.data.params["train.seed"])) for r in runs)
    assert got == [(0.8, 0), (0.8, 1), (1.6, 0), (1.6, 1)]
    for r in runs:
        assert {"test_accuracy", "epsilon", "epsilon_rdp", "epsilon_prv", "memory.iteration_peak_bytes"} <= set(
            r.data.metrics
        )
        sigma = float(r.data.params["dp.noise_multiplier"])
        planned = privacy.epsilon(privacy.poisson_schedule(1437, 64), sigma, 1e-5, epochs=1).epsilon
        assert r.data.metrics["epsilon_rdp"] == planned
    # launcher.max_parallel=2 on a node with (at least) 2 slots: two jobs at a time, never three
    assert _most_at_once(runs) == 2


def _most_at_once(runs: list[Run]) -> int:
    """The largest number of runs whose [start, end] intervals overlap at one instant."""
    events = sorted([(r.info.start_time, 1) for r in runs] + [(r.info.end_time, -1) for r in runs])
    running = most = 0
    for _, change in events:  # at equal times an end (-1) sorts before a start (+1)
        running += change
        most = max(most, running)
    return most


@SLURM
def test_slurm_sweep_is_a_job_array(tmp_path: Path, slurm: None) -> None:
    _assert_four_finished(tmp_path, dpsweep(tmp_path, "launcher=slurm", "launcher.max_parallel=2", *GRID))
    submission = next((tmp_path / "multirun").rglob("*_submission.sh")).read_text()
    assert "#SBATCH --array=0-3%2" in submission and "#SBATCH --mem=4GB" in submission


@SGE
def test_sge_sweep_is_an_array_job(tmp_path: Path, sge: None) -> None:
    _assert_four_finished(tmp_path, dpsweep(tmp_path, "launcher=sge", "launcher.max_parallel=2", *GRID))
    submission = next((tmp_path / "multirun").rglob("*_submission.sh")).read_text()
    assert "#$ -t 1-4" in submission and "#$ -tc 2" in submission


def _saved_epoch(folder: Path) -> int:
    for path in folder.rglob(checkpoint.FILENAME):
        try:
            return int(torch.load(path, weights_only=False)["training_state"]["epoch"])
        except (EOFError, RuntimeError, KeyError):
            return 0
    return 0


@SLURM
def test_slurm_requeue_resumes_with_the_same_epsilon(tmp_path: Path, slurm: None) -> None:
    epochs = 12  # long enough (5 s or more after its second epoch) to be requeued mid-training
    sweep_dir = tmp_path / "sweep"
    proc = dpsweep(
        tmp_path,
        "launcher=slurm",
        f"train.epochs={epochs}",
        "train.progress=false",
        "tracking.log_model=false",
        f"hydra.sweep.dir={sweep_dir}",
    )
    deadline = time.monotonic() + 600
    while _saved_epoch(sweep_dir) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    [job_folder] = [p for p in (sweep_dir / ".submitit").iterdir() if p.is_dir()]
    job_id = job_folder.name  # <array job>_<index>
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)  # preempt it
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out + err
    [run] = finished_runs(tmp_path)
    assert run.info.status == "FINISHED" and int(run.data.tags["resume.count"]) >= 1
    planned = privacy.epsilon(privacy.poisson_schedule(1437, 64), 1.0, 1e-5, epochs=epochs).epsilon
    assert run.data.metrics["epsilon_rdp"] == planned  # the ε of an uninterrupted run of this config
    steps = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run.info.run_id, "epsilon")
    assert sorted({m.step for m in steps}) == list(range(1, epochs + 1))


@SLURM
def test_slurm_scancel_is_recorded_and_the_sweep_goes_on(tmp_path: Path, slurm: None) -> None:
    """Without accounting (sacct disabled) job states come from squeue; a cancelled job must not hang the sweep."""
    sweep_dir = tmp_path / "sweep"
    proc = dpsweep(
        tmp_path,
        "launcher=slurm",
        "train.epochs=1,200",
        "train.progress=false",
        "tracking.log_model=false",
        f"hydra.sweep.dir={sweep_dir}",
    )
    deadline = time.monotonic() + 600
    while _saved_epoch(sweep_dir / "1") < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)  # job 1 (200 epochs; its own output dir) has saved a checkpoint: its run exists
    folders = sorted(p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir())
    long_job = next(f for f in folders if f.endswith("_1"))  # the array index of train.epochs=200
    subprocess.run(["scancel", long_job], check=True, timeout=60)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, out + err
    assert ": 1 finished, 0 skipped, 1 failed" in out
    statuses = sorted(r.info.status for r in finished_runs(tmp_path))
    assert statuses == ["FINISHED", "KILLED"]


@SLURM
def test_optuna_study_through_slurm(tmp_path: Path, slurm: None) -> None:
    proc = dpsweep(tmp_path, "search=grid", "launcher=slurm", "hydra.sweeper.optuna.n_trials=2", *GRID[2:])
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out + err
    assert "dpsweep: study digits_grid: 2 trials (2 complete)" in out
    runs = finished_runs(tmp_path)
    assert sorted(r.data.tags["optuna.trial"] for r in runs) == ["0", "1"]
    assert all(r.info.status == "FINISHED" and r.data.tags["optuna.study"] == "digits_grid" for r in runs)
    assert next((tmp_path / "multirun").rglob("*_submission.sh")).read_text().count("#SBATCH --array=0-1%") == 1
