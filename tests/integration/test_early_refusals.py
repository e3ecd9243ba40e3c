"""Bad input refused before anything starts (issue 56, items 6 and 8): the ``dpsweep`` console script as its
own process, from an empty directory. A bad value is one line on stderr and exit code 2, with no line on
stdout before it, and no ``outputs/``, ``multirun/`` or ``mlflow.db`` left behind (before: the run printed
its start line, refused half a minute later, and left ``outputs/``; a refused sweep made a 950 KB
``mlflow.db``). A misspelt key is answered with the nearest full key, a comma list without ``-m`` with a
hint, and ``dpsweep-plan`` answers with the very same lines as ``dpsweep``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_script

LEFT_BEHIND = ("outputs", "multirun", "mlflow.db")  # what Hydra and the tracking store create


def said(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def refused(tmp_path: Path, command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``command *args`` from the empty ``tmp_path``: exit code 2, one line on stderr, nothing left there."""
    proc = run_script(command, *args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, said(proc)
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, said(proc)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(LEFT_BEHIND))
    assert left == [], f"left behind: {left}\n{said(proc)}"
    return proc


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train.epochs=0"], "train.epochs=0 is invalid: a positive integer"),
        (["dp.noise_multiplier=-1"], "dp.noise_multiplier=-1.0 is invalid: a positive, finite noise multiplier"),
        (["-m", "train.epochs=1,0"], "job train.epochs=0: train.epochs=0 is invalid: a positive integer"),
        (["-m", "launcher=local", "launcher.cpus_per_job=0"], "launcher.cpus_per_job=0 is invalid: 1 or more CPUs"),
        (
            ["-m", "experiment=demo", "search=accuracy_tpe"],
            "give either grid axes (hydra.sweeper.params) or an Optuna search (hydra.sweeper.optuna), not both",
        ),
        (["-m", "search=accuracy_tpe", "sweep.private_tuning=true"], "sweep.private_tuning=true with an Optuna search"),
        # what the mechanism and engine declare, asked before any line too
        (["dp.mechanism=dpftrl", "train.devices=2"], "train.devices=2 is invalid: 1 with dp.mechanism=dpftrl"),
        (
            ["-m", "dp.engine=opacus,fused", "dp.clipping=adaptive"],
            "job dp.engine=fused dp.clipping=adaptive: dp.clipping='adaptive' is invalid: fixed with dp.engine=fused",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_bad_value_is_refused_before_any_line_or_file(tmp_path: Path, args: list[str], message: str) -> None:
    proc = refused(tmp_path, "dpsweep", *args)
    assert proc.stderr.startswith(f"dpsweep: error: {message}"), said(proc)
    assert proc.stdout == "", said(proc)  # no "dpsweep: training ... epochs=0" before the refusal


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # the plan's checks need the training set's size: after the first line, before any file
        (["train.batch_size=5000"], "train.batch_size=5000 is invalid: at most the training-set size N=1437"),
        (["-m", "train.batch_size=64,5000"], "job train.batch_size=5000: train.batch_size=5000 is invalid: at most"),
        (["-m", "train.seed=0,1", "dp.delta=0.5"], "job train.seed=0 dp.delta=0.5: dp.delta=0.5 is invalid: a δ below"),
        (
            ["-m", "experiment=demo", "sweep.private_tuning=true"],
            "dp.enabled=False is invalid: true in every job of a private tuning",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_plan_that_cannot_run_is_refused_before_any_file(tmp_path: Path, args: list[str], message: str) -> None:
    proc = refused(tmp_path, "dpsweep", *args)
    assert proc.stderr.startswith(f"dpsweep: error: {message}"), said(proc)
    assert len(proc.stdout.splitlines()) <= 1, said(proc)  # the first line at most


MISSPELT = [
    # the nearest full key first, not difflib's nearest leaf names (dp.unit, dp.compile, dp.mechanism)
    (["dp.noise=1"], "dp.noise='1' is invalid: a key and value of the config schema (Key 'noise' not in 'DPConfig'); "
     "did you mean dp.noise_multiplier, dp.clip_count_noise?"),
    # each key once (the group dataset and the key dataset were both offered)
    (["datset=digits"], "datset='digits' is invalid: a key and value of the config schema (Key 'datset' not in "
     "'Config'); did you mean dataset?"),
    # a key added with + is checked against the schema (dpsweep.config.schema) with the same nearest keys
    (["+dp.noise=1"], "dp.noise=1 is invalid: a key of the dpsweep config (this one is not in its schema); "
     "did you mean dp.noise_multiplier, dp.clip_count_noise?"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), MISSPELT, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_misspelt_key_is_answered_with_the_nearest_full_key(tmp_path: Path, args: list[str], message: str) -> None:
    proc = refused(tmp_path, "dpsweep", *args)
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("dpsweep: error: ") and line.endswith(message), said(proc)


def test_a_comma_list_without_m_asks_for_m(tmp_path: Path) -> None:
    proc = refused(tmp_path, "dpsweep", "dp.noise_multiplier=1,2", "train.epochs=1")
    assert proc.stderr.startswith("dpsweep: error: dp.noise_multiplier='1,2' is invalid: one value for a single run: "
                                  "did you mean `-m`? (a comma list is a sweep: dpsweep -m dp.noise_multiplier=1,2 "
                                  "train.epochs=1; "), said(proc)  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [["dp.noise=1"], ["datset=digits"], ["dataset=imagenet"], ["train.batch_size=abc"], ["-m", "train.bach_size=3,4"]],
    ids=" ".join,
)
def test_dpsweep_plan_says_what_dpsweep_says(tmp_path: Path, args: list[str]) -> None:
    """One translation of Hydra's errors for both commands (Hydra's raw two lines from dpsweep-plan before)."""
    run = refused(tmp_path, "dpsweep", *args)
    plan = refused(tmp_path, "dpsweep-plan", *args)
    assert plan.stderr.replace("dpsweep-plan: error: ", "dpsweep: error: ", 1) == run.stderr, said(plan) + said(run)


@pytest.mark.parametrize(
    "args", [["train.epochs=0"], ["train.batch_size=5000"], ["-m", "train.batch_size=64,5000"]], ids=" ".join
)
def test_a_refusal_imports_no_torch(tmp_path: Path, args: list[str]) -> None:
    """The checks need neither torch nor MLflow in the command's own process (its tracking process may
    be importing MLflow meanwhile): before, the run imported torch, then refused."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    command = [sys.executable, "-X", "importtime", "-m", "dpsweep.cli.train", *args]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300, check=False)
    imported = {line.rpartition("|")[2].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    told = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    assert proc.returncode == 2 and told.startswith("dpsweep: error: "), f"exit {proc.returncode}\n{told[-3000:]}"
    assert "hydra" in imported and {"torch", "mlflow"} & imported == set(), told[-3000:]


@pytest.mark.parametrize(
    ("args", "made"),
    [
        # Hydra's resolver of the job's own config: only the app has it; the early checks leave it to the app
        (["train.checkpoint_dir=${hydra:runtime.output_dir}/ck"], "outputs"),
        pytest.param(  # Hydra's other spelling of -m: a sweep (slow: about 13 s, two jobs)
            ["hydra.mode=MULTIRUN", "train.seed=0,1"], "multirun", marks=pytest.mark.slow
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_what_hydra_runs_the_early_checks_do_not_refuse(tmp_path: Path, args: list[str], made: str) -> None:
    proc = run_script("dpsweep", *args, "train.epochs=1", "dp=off", "tracking.log_model=false", cwd=tmp_path,
                      timeout=600)  # fmt: skip
    assert proc.returncode == 0, said(proc)
    assert (tmp_path / made).is_dir(), said(proc)
    runs = [line for line in proc.stdout.splitlines() if line.startswith("dpsweep: run ")]
    assert len(runs) == (2 if made == "multirun" else 1), said(proc)
