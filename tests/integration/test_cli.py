"""The ``dpsweep`` command as users run it, against a real sqlite MLflow store: the console script as
its own process (the smoke test), and its error tables through the same Hydra app in this process."""

from __future__ import annotations

import re
import sqlite3
import subprocess
from pathlib import Path

import pytest
from helpers import run_dpsweep, run_script
from mlflow.tracking import MlflowClient

DATASETS = "cifar10, digits, flowers102, mnist, movielens, planted_ratings"  # the dataset group's options


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``dpsweep *args`` in this process, from ``cwd`` (each test's own directory)."""
    assert Path.cwd() == cwd
    return run_dpsweep(*args)


def run_statuses(db: Path) -> list[str]:
    if not db.exists():
        return []
    with sqlite3.connect(db) as con:
        return [row[0] for row in con.execute("select status from runs")]


@pytest.mark.slow
def test_sweep_runs_each_job_and_prints_accuracy_and_epsilon(tmp_path: Path) -> None:
    """The smoke test of the console script: a real process, its exit codes and its output."""
    proc = run_script(
        "dpsweep", "-m", "dp=off,dpsgd", "train.epochs=1", "train.progress=false", "tracking.experiment_name=cli",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("dpsweep: run")]
    assert len(lines) == 2, proc.stdout
    assert "non-private" in lines[0] and "test_accuracy=" in lines[0]
    assert "ε=" in lines[1] and "δ=1e-05" in lines[1] and "rdp" in lines[1]
    assert all(" seed=0  " in line for line in lines) and "dpsgd per example" in lines[1]  # issue 33, item 7
    # output piped, so no bars: one line per epoch with its figures, and the sweep's last line says what next
    epochs = [line for line in proc.stdout.splitlines() if "epoch 1/1  " in line]
    assert len(epochs) == 2 and "test_accuracy=" in epochs[1] and "ε=" in epochs[1], proc.stdout
    assert "train_loss=" in epochs[0] and "train_loss=" not in epochs[1]  # un-noised: not released with DP
    sweep_id = re.search(r"dpsweep: sweep (s[0-9a-f]{11}): 2 finished", proc.stdout)
    assert sweep_id is not None, proc.stdout
    experiment = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment_by_name("cli")
    assert experiment is not None
    experiment_id = experiment.experiment_id
    assert proc.stdout.rstrip().splitlines()[-1] == (
        f"dpsweep: next: dpsweep-report --experiment cli --sweep {sweep_id.group(1)}; "
        "browse the runs: dpsweep-ui --experiment cli, "
        f"which opens http://127.0.0.1:5000/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
        "&viewStateShareKey=dpsweep"
    )
    # dpsweep's own lines, not Hydra's ("Launching 1 jobs locally", "#0 : <internal overrides>")
    said = proc.stdout + proc.stderr
    assert "dpsweep: 2 jobs to run (sweep s" in said and "Launching" not in said and "#0 :" not in said, said
    assert all(line.startswith("dpsweep: ") for line in proc.stdout.splitlines()), proc.stdout  # no log prefix
    assert "sweep.parent_run_id" not in said and "sweep.id=" not in said, said
    progress = [line for line in proc.stdout.splitlines() if line.startswith("dpsweep: [")]
    assert progress[0].startswith("dpsweep: [1/2] done (") and "ETA" in progress[0], proc.stdout
    # default sqlite:///mlflow.db: the 2 jobs and the sweep's parent run
    assert run_statuses(tmp_path / "mlflow.db") == ["FINISHED", "FINISHED", "FINISHED"]
    # bad input: exit code 2 and one line (each kind of bad input is checked in this process below;
    # one that fails as the config composes, before the seconds of imports a training run needs)
    bad = run_script("dpsweep", "dataset=imagenet", "tracking.experiment_name=bad", cwd=tmp_path)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert bad.stderr.count("dpsweep: error: dataset='imagenet' is invalid: ") == 1, bad.stderr
    assert "Traceback" not in bad.stderr and len(run_statuses(tmp_path / "mlflow.db")) == 3


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["dp.noise_multiplier=0"], "dp.noise_multiplier=0.0 is invalid: a positive, finite noise multiplier"),
        (["dp.delta=0.01"], "dp.delta=0.01 is invalid: a δ below 1/N"),
        # an unreachable server: refused in seconds (MLflow's client retried for minutes; issue 39, item 13)
        (["tracking.uri=http://127.0.0.1:9"], "tracking.uri='http://127.0.0.1:9' is invalid: a reachable MLflow"),
        # finite in float64, infinite in float32: it trained at chance with an ε before (issue 39, item 12)
        (["dp.max_grad_norm=1e39"], "dp.max_grad_norm=1e+39 is invalid: a positive, finite clipping norm C of at most"),
        (["dataset=cifar10", "dataset.root=nowhere"], "cifar-10-batches-py"),
        (["task=gan", "task.n_critic=0"], "task.n_critic=0 is invalid: 1 or more critic steps per generator step"),
        (["task=gan", "dp.engine=opacus"], "dp.engine='opacus' is invalid: critic with task=gan"),
        (["dp.accountant=pld", "dp.noise_multiplier=0.03"], "dp.accountant='pld' is invalid: rdp for this run"),
        # without -m it trained on this machine (a login node) and was tagged slurm (issue 33, item 10)
        (
            ["launcher=slurm"],
            "launcher='slurm' is invalid: inline or local for a run on this machine; a scheduler "
            "takes sweeps: add -m to submit this run as a sweep of one job (dpsweep -m launcher=slurm",
        ),
        (["launcher=sge"], "launcher='sge' is invalid: inline or local"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line_and_no_run(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"dpsweep: error: {needle}" in proc.stderr or needle in proc.stderr, proc.stderr
    assert proc.stderr.count("dpsweep: error:") == 1
    assert "Traceback" not in proc.stderr
    assert "RUNNING" not in run_statuses(tmp_path / "mlflow.db")
    assert run_statuses(tmp_path / "mlflow.db") == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["dataset=imagenet"], f"dataset='imagenet' is invalid: one of {DATASETS}"),
        (
            ["train.bach_size=3"],
            "train.bach_size='3' is invalid: a key and value of the config schema (Key 'bach_size'",
        ),
        (
            ["train.batch_size=abc"],
            "train.batch_size='abc' is invalid: a key and value of the config schema (Value 'abc'",
        ),
    ],
)
def test_composition_errors_are_bad_input_naming_key_value_and_options(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    proc = run_cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"dpsweep: error: {needle}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert run_statuses(tmp_path / "mlflow.db") == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["datset=digits"],
            "datset='digits' is invalid: a key and value of the config schema (Key 'datset' not in "
            "'Config'); did you mean dataset",
        ),
        (["dataset=imagenet,digits"], f"dataset='imagenet' is invalid: one of {DATASETS}"),
        (
            ["train.bach_size=3,4"],
            "train.bach_size='3,4' is invalid: a key and value of the config schema (Key "
            "'bach_size' not in 'TrainConfig'); did you mean train.batch_size",
        ),
    ],
)
def test_a_sweeps_composition_errors_are_bad_input_as_a_single_runs(
    tmp_path: Path, args: list[str], needle: str
) -> None:
    """Issue 33, item 9: Hydra's raw error and exit 1 for -m before."""
    proc = run_cli(tmp_path, "-m", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("dpsweep: error:") == 1 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "RUNNING" not in run_statuses(tmp_path / "mlflow.db")


def test_help_names_the_tool_and_lists_each_groups_real_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dpsweep --help: what the tool is, and each config group with the options its directory holds
    (not the base_* schema nodes, which are not choices)."""
    import dpsweep.conf

    monkeypatch.chdir(tmp_path)
    done = run_dpsweep("--help")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("dpsweep: differentially private training runs and sweeps")
    assert "powered by Hydra" not in done.stdout and "base_" not in done.stdout
    groups = [d for d in Path(dpsweep.conf.__file__).parent.iterdir() if d.is_dir() and any(d.glob("*.yaml"))]
    assert len(groups) == 10
    for group in groups:
        options = ", ".join(sorted(p.stem for p in group.glob("*.yaml")))
        assert f"\n{group.name}: {options}\n" in done.stdout, group.name


def test_a_password_in_a_url_is_never_logged_or_printed(tmp_path: Path) -> None:
    """Issue 39, item 8: the password of sweep.storage (Optuna's database) and of tracking.uri (an MLflow
    server) appears in no param, tag, config.yaml or printed line; the user name and host stay."""
    from dpsweep.errors import InputError, redact

    storage = "postgresql://alice:s3cret@db.example:5432/optuna"
    proc = run_cli(tmp_path, "train.epochs=1", f"sweep.storage={storage}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    config_yaml = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text()
    logged = [*run.data.params.values(), *run.data.tags.values(), config_yaml, proc.stdout, proc.stderr]
    assert not [text for text in logged if "s3cret" in text]
    # the password is taken out of the URI at start-up (dpsweep.tracking.credentials), not only masked
    assert run.data.tags["sweep.storage"] == "postgresql://alice@db.example:5432/optuna"
    # issue 33, item 11: the run says what it trains before torch and the data load, and its piped lines
    # carry no Hydra log prefix ("[2026-11-26 12:04:36,908][dpsweep][INFO] - epoch 1/1 ...")
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("dpsweep: training digits/cnn B=64 epochs=1 seed=0, dpsgd per example (σ=1, C=1)")
    assert all(line.startswith("dpsweep: ") for line in lines) and "dpsweep: epoch 1/1  " in proc.stdout, lines
    uri = "http://bob:hunter2@mlflow.example:5000"
    assert redact(f"next: --tracking-uri {uri}") == "next: --tracking-uri http://bob:***@mlflow.example:5000"
    assert "hunter2" not in str(InputError("tracking.uri", uri, "a reachable server"))
    assert redact("sqlite:///mlflow.db and user@host:/path") == "sqlite:///mlflow.db and user@host:/path"
