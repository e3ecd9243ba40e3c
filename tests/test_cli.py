"""The ``dpsweep`` command as users run it: a real subprocess, a real sqlite MLflow store."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

DPSWEEP = str(Path(sys.executable).with_name("dpsweep"))


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([DPSWEEP, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=env, check=False)


def run_statuses(db: Path) -> list[str]:
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        return [row[0] for row in con.execute("select status from runs")]


def test_sweep_runs_each_job_and_prints_accuracy_and_epsilon(tmp_path: Path) -> None:
    proc = run_cli(
        tmp_path,
        "-m",
        "dp=off,dpsgd",
        "train.epochs=1",
        "train.progress=false",
        "tracking.experiment_name=cli",
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("dpsweep: run")]
    assert len(lines) == 2
    assert "non-private" in lines[0] and "test_accuracy=" in lines[0]
    assert "ε=" in lines[1] and "δ=1e-05" in lines[1] and "rdp" in lines[1]
    # default sqlite:///mlflow.db: the 2 jobs and the sweep's parent run
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED", "FINISHED", "FINISHED"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["dp.noise_multiplier=0"], "dp.noise_multiplier=0.0 is invalid: a positive, finite noise multiplier"),
        (["dp.delta=0.01"], "dp.delta=0.01 is invalid: below 1/N"),
        (["dataset=cifar10", "dataset.root=nowhere"], "cifar-10-batches-py"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line_and_no_run(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2
    assert f"dpsweep: error: {needle}" in proc.stderr or needle in proc.stderr
    assert proc.stderr.count("dpsweep: error:") == 1
    assert "Traceback" not in proc.stderr
    assert "RUNNING" not in run_statuses(tmp_path / "mlflow.db")
    assert run_statuses(tmp_path / "mlflow.db") == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["dataset=imagenet"], "Could not find 'dataset/imagenet'"), (["train.bach_size=3"], "bach_size")],
)
def test_composition_errors_exit_nonzero_with_hydras_message(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = run_cli(tmp_path, *args)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert run_statuses(tmp_path / "mlflow.db") == []
