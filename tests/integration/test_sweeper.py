"""The dpsweep sweeper through the dpsweep app: failures are data, bad input stops a sweep early.

Sweeps run the app in this process (``helpers.run_dpsweep``: the same Hydra app, exit code and
output as the console script); killed jobs and launcher=local job processes are real processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import submitit
from helpers import BIN, REPO, run_dpsweep
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

FAST = ["train.epochs=1", "train.progress=false", "tracking.log_model=false"]  # no model: saving it takes seconds


def dpsweep(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``dpsweep *args`` in this process, from ``cwd`` (each test's own directory)."""
    assert Path.cwd() == cwd
    return run_dpsweep(*args, env=env)


def statuses(cwd: Path, experiment: str = "dpsweep") -> dict[str, str]:
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    return {r.info.run_id: r.info.status for r in client.search_runs([exp.experiment_id]) if not is_parent(r)}


def is_parent(run: Run) -> bool:
    return run.data.tags.get("sweep.role") == "parent"


def summary(proc: subprocess.CompletedProcess[str]) -> str:
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("dpsweep: sweep ")]
    return line


@pytest.mark.slow
def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    proc = dpsweep(tmp_path, "-m", "dataset=mnist,digits", *FAST)  # no MNIST files under ./data
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ": 1 finished, 0 skipped, 1 failed" in summary(proc)
    assert "dataset.root=" in proc.stderr + proc.stdout and "none found under" in proc.stderr + proc.stdout
    assert list(statuses(tmp_path).values()) == ["FINISHED"]  # the digits job ran after the failure
    progress = [x for x in proc.stdout.splitlines() if x.startswith("dpsweep: [")]  # inline: count and times
    assert progress[0].startswith("dpsweep: [1/2] dataset=mnist ") and ": failed (" in progress[0], proc.stdout
    assert "elapsed, ETA " in progress[0] and progress[1].startswith("dpsweep: [2/2] done ("), proc.stdout


@pytest.mark.slow
def test_jobs_carry_the_sweep_id(tmp_path: Path) -> None:
    proc = dpsweep(tmp_path, "-m", "dp.noise_multiplier=1.0,2.0", *FAST)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sweep_id = summary(proc).split()[2].rstrip(":")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    everything = client.search_runs([client.get_experiment_by_name("dpsweep").experiment_id])
    [parent] = [r for r in everything if is_parent(r)]
    runs = [r for r in everything if not is_parent(r)]
    assert len(runs) == 2 and {r.data.tags["sweep.id"] for r in runs} == {sweep_id}
    assert {r.data.tags["mlflow.parentRunId"] for r in runs} == {parent.info.run_id}  # a tree in the MLflow UI
    assert parent.data.tags["sweep.id"] == sweep_id and parent.info.status == "FINISHED"
    assert parent.data.params["sweep.n_configs"] == "2" and parent.data.metrics["sweep.finished"] == 2
    # accuracy and ε first: one table of the jobs on the parent run
    with open(client.download_artifacts(parent.info.run_id, "results.json")) as f:
        logged = json.load(f)
    assert logged["columns"][:4] == ["run", "test_accuracy", "epsilon", "status"]
    rows = [dict(zip(logged["columns"], row, strict=True)) for row in logged["data"]]
    assert sorted(r["dp.noise_multiplier"] for r in rows) == ["1.0", "2.0"]  # what differs between the jobs
    by_name = {r.info.run_name: r for r in runs}
    for row in rows:
        assert row["test_accuracy"] == pytest.approx(by_name[row["run"]].data.metrics["test_accuracy"], rel=1e-9)
        assert row["epsilon"] == pytest.approx(by_name[row["run"]].data.metrics["epsilon"], rel=1e-9)
        assert row["status"] == "FINISHED"  # (log_table keeps 10 significant digits)
    # the experiment opens as model training in MLflow 3's UI, not on its GenAI traces page
    assert client.get_experiment_by_name("dpsweep").tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["dp.noise_multiplier=1.0,0"], {}, "job dp.noise_multiplier=0 "),
        (["train.batch_size=64,5000"], {}, "train.batch_size=5000 is invalid: at most the training-set size N=1437"),
        (
            ["launcher=slurm", "launcher.mem_gb=0"],
            {},
            "launcher.mem_gb=0 is invalid: a positive amount of memory in GiB",
        ),
        (
            ["launcher=sge", "launcher.timeout_min=-5"],
            {},
            "launcher.timeout_min=-5 is invalid: a positive time in minutes",
        ),
        (["launcher=slurm"], {"PATH": "/nonexistent"}, "launcher=slurm needs 'sbatch' on PATH"),
        (["launcher=sge"], {"PATH": "/nonexistent"}, "launcher=sge needs 'qsub' on PATH"),
        (
            ["launcher=local", "tracking.uri=http://127.0.0.1:9"],
            {},
            "tracking.uri=http://127.0.0.1:9: no MLflow server answers",
        ),
        (["tracking.uri=sqlite:////nonexistent/dir/mlflow.db"], {}, "does not exist or is not writable"),
        (
            ["launcher=local", "launcher.trials_per_device=0"],
            {},
            "launcher.trials_per_device='0' is invalid: a whole number of trials, 1 or more, or auto",
        ),
        (
            ["launcher=local", "launcher.trials_per_device=auto"],
            {},
            "launcher.trials_per_device='auto' is invalid: a number of trials, or auto with train.memory_model",
        ),
        (["launcher.trials_per_device=2"], {}, "launcher.trials_per_device='2' is invalid: 1 with launcher=inline"),
        (
            ["launcher=local", "launcher.trials_per_device=2", "launcher.gpus_per_job=2"],
            {},
            "launcher.gpus_per_job=2 is invalid: 0 or 1 with launcher.trials_per_device=2",
        ),
        (
            ["launcher=local", "dp.grad_sample_mode=fused", "dp.pad_to=32"],
            {},
            "dp.pad_to=32 is invalid: an integer at least train.batch_size=64",
        ),
    ],
)
def test_bad_sweeps_stop_before_any_job(tmp_path: Path, args: list[str], env: dict[str, str], needle: str) -> None:
    proc = dpsweep(tmp_path, "-m", *args, *FAST, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"dpsweep: error: {needle}" in proc.stderr or needle in proc.stderr
    assert "Launching" not in proc.stdout + proc.stderr and "#0 :" not in proc.stdout + proc.stderr
    assert statuses(tmp_path) == {}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["launcher=pbs"], "dpsweep: error: launcher='pbs' is invalid: one of inline, local, sge, slurm"),
        (["launcher.timeout_min=2h"], "launcher.timeout_min"),
    ],
)
def test_unknown_launcher_and_wrong_units_fail_at_composition(tmp_path: Path, args: list[str], needle: str) -> None:
    """Bad input (exit 2) with the single run's messages (issue 33, item 9: Hydra's own and exit 1 before)."""
    proc = dpsweep(tmp_path, "-m", *args, *FAST)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stdout + proc.stderr
    assert statuses(tmp_path) == {}


@pytest.mark.slow
def test_local_jobs_run_in_their_own_processes_and_a_killed_one_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # submitit waits 15 s for the result file of a job that ended without one, for network file
    # systems that show it late (its own tests set 0); this one is local, and the job left none
    monkeypatch.setattr(submitit.core.core.Job, "_results_timeout_s", 1)
    sweep_dir = tmp_path / "sweep"
    victims: list[int] = []
    sweep_over = threading.Event()

    def kill_the_long_job() -> None:
        """Job 1 (400 epochs) has checkpointed, so its run exists; job 0 (1 epoch) has ended, so the
        one job process left is job 1's (files and processes only: no reads of the MLflow store)."""
        pids: list[int] = []
        jobs = ["pgrep", "-f", f"submitit.core._submit {sweep_dir}"]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not sweep_over.is_set():
            found = subprocess.run(jobs, capture_output=True, text=True)
            pids = [int(x) for x in found.stdout.split()]
            if len(pids) == 1 and list((sweep_dir / "1").rglob("checkpoint.pt")):
                time.sleep(3)  # job 1 trains on, seconds after job 0 ended
                os.kill(pids[0], signal.SIGKILL)  # what the OOM killer does: no Python cleanup at all
                victims.append(pids[0])
                return
            sweep_over.wait(0.5)
        for pid in pids:  # the long job never ran alone: end the jobs, so that the sweep ends and fails below
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # The driver is this process (its jobs are processes of their own); a thread kills the long job.
    killer = threading.Thread(target=kill_the_long_job, daemon=True)
    killer.start()
    proc = dpsweep(tmp_path, "-m", "launcher=local", "launcher.max_parallel=2", "train.epochs=1,400",
                   "train.progress=false", f"hydra.sweep.dir={sweep_dir}")  # fmt: skip
    sweep_over.set()
    killer.join(timeout=60)
    out = proc.stdout
    assert len(victims) == 1, f"the long job never ran alone:\n{out}\n{proc.stderr}"
    assert proc.returncode == 1, out + proc.stderr
    # each job's line as it ends, in the driver's terminal: the first when it ended, not with the second
    first, second = (x for x in out.splitlines() if x.startswith(("dpsweep: [1/2]", "dpsweep: [2/2]")))
    assert first.startswith("dpsweep: [1/2] run ") and "test_accuracy=" in first and "ETA" in first, out
    assert second.startswith("dpsweep: [2/2] ") and ": failed (" in second and "ETA" not in second, out

    def elapsed_s(line: str) -> int:
        text = line.rsplit("(", 1)[1].split(" elapsed")[0]
        minutes, _, seconds = text.rstrip("s").rpartition("m")
        return int(minutes or 0) * 60 + int(seconds)

    assert elapsed_s(first) + 2 <= elapsed_s(second), out
    line = next(x for x in out.splitlines() if x.startswith("dpsweep: sweep "))
    assert ": 1 finished, 0 skipped, 1 failed" in line and "killed runs: " in line
    assert sorted(statuses(tmp_path).values()) == ["FINISHED", "KILLED"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    killed = [
        r
        for r in client.search_runs([client.get_experiment_by_name("dpsweep").experiment_id])
        if r.info.status == "KILLED"
    ]
    assert killed[0].data.tags["failure.kind"] == "killed"
    assert len(list((sweep_dir / ".submitit").iterdir())) >= 2  # one submitit folder per job process


def _child_runs(cwd: Path) -> list[Run]:
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dpsweep")
    return [r for r in client.search_runs([exp.experiment_id]) if not is_parent(r)]


@pytest.mark.slow
def test_an_interrupted_sweep_rerun_completes_without_duplicates(tmp_path: Path) -> None:
    grid = ["dp.noise_multiplier=0.7,0.9,1.1", "train.epochs=2", "train.progress=false"]  # ~2.5 s a job
    args = [str(BIN / "dpsweep"), "-m", *grid]
    first = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert first.stdout is not None
    done = 0
    for line in first.stdout:  # each finished job prints one "dpsweep: run" line
        done += line.startswith("dpsweep: run ")
        if done == 2:
            break
    os.kill(first.pid, signal.SIGTERM)  # kill the sweep midway (k = 2 jobs done)
    out, err = first.communicate(timeout=120)
    done_before = list(statuses(tmp_path).values()).count("FINISHED")
    assert done_before == 2, out + err  # the third job was under way: the sweep stopped midway

    again = dpsweep(tmp_path, "-m", *grid)
    assert again.returncode == 0, again.stdout + again.stderr
    skips = [x for x in again.stdout.splitlines() if x.startswith("dpsweep: skip ")]
    assert len(skips) == done_before and all("already FINISHED as run" in x for x in skips)
    finished = [r for r in _child_runs(tmp_path) if r.info.status == "FINISHED"]
    hashes = [r.data.tags["config.hash"] for r in finished]
    assert len(hashes) == 3 and len(set(hashes)) == 3  # every config once, no duplicate FINISHED runs
    assert "1 finished, 2 skipped, 0 failed" in summary(again)


@pytest.mark.slow
def test_force_reruns_finished_configs(tmp_path: Path) -> None:
    first = dpsweep(tmp_path, "-m", "train.seed=0", *FAST)
    assert first.returncode == 0, first.stdout + first.stderr
    noop = dpsweep(tmp_path, "-m", "train.seed=0", *FAST)  # everything FINISHED: nothing runs, no empty parent
    assert noop.returncode == 0 and ": 0 finished, 1 skipped, 0 failed (nothing to run" in noop.stdout, noop.stdout
    again = dpsweep(tmp_path, "-m", "train.seed=0", "sweep.force=true", *FAST)
    assert again.returncode == 0 and ": 1 finished, 0 skipped" in summary(again), again.stdout + again.stderr
    assert [r.info.status for r in _child_runs(tmp_path)] == ["FINISHED", "FINISHED"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dpsweep")
    assert exp is not None
    assert sum(is_parent(r) for r in client.search_runs([exp.experiment_id])) == 2  # the two sweeps that ran


def test_failure_policy_stops_a_mostly_failing_sweep(tmp_path: Path) -> None:
    proc = dpsweep(tmp_path, "-m", "dataset=mnist", "train.seed=0,1,2,3,4,5", *FAST)  # no MNIST files: all fail
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "dpsweep: stopping: 4 of 4 jobs failed (100% > sweep.max_failure_rate=50%); 2 jobs not launched" in proc.stdout
    )
    assert ": 0 finished, 0 skipped, 4 failed" in summary(proc)


def test_the_failure_policy_waits_for_min_jobs_then_names_the_rate() -> None:
    """One policy for grids and studies (dpsweep.launchers.session): from sweep.min_jobs_for_failure_rate ended
    jobs on, more than sweep.max_failure_rate failed stops the sweep."""
    from dpsweep.config import Config
    from dpsweep.launchers.session import SweepSession

    session = SweepSession(Config(), "s0")  # max_failure_rate=0.5, min_jobs_for_failure_rate=4
    assert session.failure_rate(3, 3, "jobs") is None  # too few ended to judge
    assert session.failure_rate(2, 4, "jobs") is None  # 50% is not above 50%
    assert session.failure_rate(3, 4, "trials") == "3 of 4 trials failed (75% > sweep.max_failure_rate=50%)"


@pytest.mark.slow
def test_memory_model_problems_stop_a_sweep_before_any_job(tmp_path: Path) -> None:
    import pandas as pd

    from dpsweep.analysis import memory_model

    probes = pd.read_csv(REPO / "analysis" / "data" / "cpu_probes_digits.csv")
    memory_model.save_models(tmp_path / "cpu.json", memory_model.fit_all(probes, "cnn"), meta={})
    memory_model.save_models(tmp_path / "gpu.json", memory_model.fit_all(probes.assign(backend="cuda"), "cnn"), meta={})
    cases = [
        (["train.memory_model=cpu.json", "launcher.gpu_memory=1KiB"], "room for at least one example"),
        (["train.memory_model=gpu.json", "launcher.gpu_memory=1GiB"], "the fit of cnn is of cuda probes"),
        (["train.memory_model=cpu.json"], "launcher.gpu_memory=None is invalid: the GPU memory with units"),
    ]
    for args, needle in cases:
        proc = dpsweep(tmp_path, "-m", "dp.noise_multiplier=1.0,2.0", "train.device=cpu", *args, *FAST)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)
        assert "#0 :" not in proc.stdout + proc.stderr
    assert statuses(tmp_path) == {}
