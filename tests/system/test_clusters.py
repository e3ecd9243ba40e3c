"""Sweeps through real schedulers: a single-node Slurm and a single-node Grid Engine cluster on this
machine, on loopback, brought up by launchers/scripts/{slurm,sge}_up.sh (Debian packages; needs root).

    sudo launchers/scripts/slurm_up.sh && sudo launchers/scripts/sge_up.sh
    .venv/bin/pytest tests/system/test_clusters.py

Each sweep's driver is the test's own process (``helpers.run_dpsweep``); its jobs are the scheduler's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import submitit
import torch
from helpers import child_runs, process_running, run_dpsweep, service
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from dpsweep.privacy import schedule
from dpsweep.run import checkpoint

SGE_ENV = {"SGE_ROOT": "/var/lib/gridengine", "SGE_CELL": "default"}
pytestmark = pytest.mark.cluster
# One worker runs each scheduler's tests in turn: they share its 2-slot node. Slurm's and Grid
# Engine's are separate clusters, so their tests may run at the same time.
SLURM = pytest.mark.xdist_group("slurm")
SGE = pytest.mark.xdist_group("sge")
QUICK = ["train.epochs=1", "train.progress=false", "tracking.log_model=false"]
# Three jobs, two at a time (launcher.max_parallel=2): a throttle that let a third run would show
GRID = ["dp.noise_multiplier=0.8,1.2,1.6", *QUICK]


@pytest.fixture(scope="session")
def slurm() -> Iterator[None]:
    """The Slurm cluster, up for this worker's session; stopped after it unless it was up before."""
    # munged too (slurm_down.sh --all), unless it ran before (a site's own Slurm then leaves it alone)
    down = ("slurm_down.sh",) if process_running("munged") else ("slurm_down.sh", "--all")
    with service("slurm_up.sh", down, lambda: process_running("slurmctld")):
        yield


@pytest.fixture(scope="session")
def sge() -> Iterator[None]:
    """The Grid Engine cluster, likewise."""
    with service("sge_up.sh", ("sge_down.sh",), lambda: process_running("sge_qmaster")):
        yield


def sweep(*args: str, during: Callable[[threading.Event], None] | None = None) -> subprocess.CompletedProcess[str]:
    """``dpsweep -m *args`` from the test's directory. The driver is this process (the jobs are the
    scheduler's); ``during`` runs meanwhile in a thread, and the event it is given is set when the
    sweep is over. What ``during`` raises is raised once the sweep is over."""
    over = threading.Event()
    raised: list[BaseException] = []

    def watch() -> None:
        assert during is not None
        try:
            during(over)
        except BaseException as err:
            raised.append(err)

    watcher = threading.Thread(target=watch, daemon=True)
    if during is not None:
        watcher.start()
    try:
        return run_dpsweep("-m", *args, env=SGE_ENV)
    finally:
        over.set()
        if during is not None:
            watcher.join(timeout=120)
        if raised:
            raise raised[0]


def finished_runs(cwd: Path) -> list[Run]:
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dpsweep")
    if exp is None:
        return []
    return [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("sweep.role") != "parent"]


def _assert_three_finished(cwd: Path, proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": 3 finished, 0 skipped, 0 failed" in proc.stdout
    runs = finished_runs(cwd)
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}
    got = sorted((float(r.data.params["dp.noise_multiplier"]), int(r.data.params["train.seed"])) for r in runs)
    assert got == [(0.8, 0), (1.2, 0), (1.6, 0)]
    for r in runs:
        assert {"test_accuracy", "epsilon", "epsilon_rdp", "epsilon_prv", "system/memory/iteration_peak_mib"} <= set(
            r.data.metrics
        )
        sigma = float(r.data.params["dp.noise_multiplier"])
        planned = schedule.epsilon(schedule.poisson_schedule(1437, 64), sigma, 1e-5, epochs=1).epsilon
        assert r.data.metrics["epsilon_rdp"] == planned
    # launcher.max_parallel=2: never three runs at once (the scheduler's own view of two at a time is
    # checked by the tests: a loaded machine can start a job's run after the other's has ended)
    assert _most_at_once(runs) <= 2


def _most_at_once(runs: list[Run]) -> int:
    """The largest number of runs whose [start, end] intervals overlap at one instant."""
    events = sorted([(r.info.start_time, 1) for r in runs] + [(r.info.end_time, -1) for r in runs])
    running = most = 0
    for _, change in events:  # at equal times an end (-1) sorts before a start (+1)
        running += change
        most = max(most, running)
    return most


class PeakRunning:
    """A ``during`` hook: the most jobs the scheduler showed running at once, polled every 0.2 s
    (each job is RUNNING for its whole process, imports included: seconds)."""

    def __init__(self, argv: list[str], header_lines: int = 0) -> None:
        self.argv, self.header_lines, self.peak = argv, header_lines, 0

    def __call__(self, over: threading.Event) -> None:
        while not over.is_set():
            listed = subprocess.run(
                self.argv, capture_output=True, text=True, timeout=30, check=True, env=os.environ | SGE_ENV
            )
            self.peak = max(self.peak, len(listed.stdout.splitlines()[self.header_lines :]))
            over.wait(0.2)


@SLURM
def test_slurm_sweep_is_a_job_array(tmp_path: Path, slurm: None) -> None:
    running = PeakRunning(["squeue", "--noheader", "--array", "--states=RUNNING", "--format=%i"])
    _assert_three_finished(tmp_path, sweep("launcher=slurm", "launcher.max_parallel=2", *GRID, during=running))
    assert running.peak == 2  # two at a time, never three
    submission = next((tmp_path / "multirun").rglob("*_submission.sh")).read_text()
    assert "#SBATCH --array=0-2%2" in submission and "#SBATCH --mem=4GB" in submission
    assert "-u -m dpsweep.launchers.job -u -m submitit.core._submit " in submission  # no teardown per job


@SLURM
def test_slurm_run_across_two_devices_is_one_job_of_two_tasks(tmp_path: Path, slurm: None) -> None:
    """train.devices=2 on Slurm: one job with a task a rank (gloo on this CPU node), one MLflow run by
    rank 0, one process's ε, and the model the same seed trains under torchrun on one machine."""
    proc = sweep("launcher=slurm", "train.devices=2", *QUICK)
    assert proc.returncode == 0 and ": 1 finished, 0 skipped, 0 failed" in proc.stdout, proc.stdout + proc.stderr
    (run,) = finished_runs(tmp_path)
    assert run.info.status == "FINISHED" and run.data.params["train.devices"] == "2"
    planned = schedule.epsilon(schedule.poisson_schedule(1437, 64), 1.0, 1e-5, epochs=1).epsilon
    assert run.data.metrics["epsilon_rdp"] == planned
    folder = next((tmp_path / "multirun").rglob("*_submission.sh")).parent
    submission = next(folder.glob("*_submission.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=2" in submission and "#SBATCH --mem=8GB" in submission, submission
    assert len(list(folder.glob("*_result.pkl"))) == 2  # a result from each task: both ranks ran
    here = run_dpsweep("train.devices=2", *QUICK, "tracking.experiment_name=here")
    assert here.returncode == 0, here.stderr
    (torchrun,) = child_runs(tmp_path, "here")
    assert run.data.metrics["test_accuracy"] == torchrun.data.metrics["test_accuracy"]


@SLURM
@pytest.mark.parametrize("key", ["train.devices", "train.nodes"])
def test_a_slurm_sweep_of_several_rank_shapes_exits_2_before_any_job(tmp_path: Path, slurm: None, key: str) -> None:
    """On Slurm a job's tasks are a run's ranks: one train.devices and one train.nodes a sweep there, checked
    before any job is submitted (Slurm's tools on PATH, as preflight wants them first)."""
    proc = sweep("launcher=slurm", f"{key}=1,2", *QUICK)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{key}=1,2 is invalid: one value in a sweep on Slurm" in proc.stderr, proc.stderr
    assert finished_runs(tmp_path) == [] and not list(tmp_path.glob("multirun/*/*/.submitit")), proc.stdout


@SLURM
def test_slurm_run_across_two_nodes_is_one_job_of_a_task_on_each_node(tmp_path: Path, slurm: None) -> None:
    """train.nodes=2 on the test cluster's partition nodes2 (two slurmd on this machine, each a node of
    its own): one job of two nodes, one task a node, each task a rank (Slurm node 0 and node 1), rank 0
    on the first node; one MLflow run with one process's ε and the model that 2 ranks on one node train."""
    shared = "dp.stream_seed=3"  # two nodes and two devices: other configs, the same draws (dpsweep.privacy.streams)
    proc = sweep("launcher=slurm", "launcher.partition=nodes2", "train.nodes=2", *QUICK, shared)
    assert proc.returncode == 0 and ": 1 finished, 0 skipped, 0 failed" in proc.stdout, proc.stdout + proc.stderr
    (run,) = finished_runs(tmp_path)
    assert run.data.params["train.nodes"] == "2" and "train.devices" not in run.data.params
    planned = schedule.epsilon(schedule.poisson_schedule(1437, 64), 1.0, 1e-5, epochs=1).epsilon
    assert run.data.metrics["epsilon_rdp"] == planned
    folder = next((tmp_path / "multirun").rglob("*_submission.sh")).parent
    submission = next(folder.glob("*_submission.sh")).read_text()
    assert "#SBATCH --nodes=2" in submission and "#SBATCH --ntasks-per-node=1" in submission, submission
    logs = "".join(p.read_text() for p in sorted(folder.glob("*_log.*")))  # submitit's JobEnvironment, per task
    assert "node=0(2), global_rank=0(2)" in logs and "node=1(2), global_rank=1(2)" in logs, logs
    here = run_dpsweep("train.devices=2", *QUICK, shared, "tracking.experiment_name=here")
    assert here.returncode == 0, here.stderr
    (torchrun,) = child_runs(tmp_path, "here")
    assert run.data.metrics["test_accuracy"] == torchrun.data.metrics["test_accuracy"]


def _kill_task(cwd: Path, task: str, after: str) -> Callable[[threading.Event], None]:
    """A ``during`` for :func:`sweep` that SIGKILLs the job's Slurm task ``task`` once rank 0 printed ``after``."""

    def kill(over: threading.Event) -> None:
        while not over.wait(0.5):
            logs = list(cwd.glob("multirun/*/*/.submitit/*/*_0_log.out"))
            if logs and after in logs[0].read_text():
                for proc in psutil.process_iter():
                    with contextlib.suppress(psutil.Error):
                        if (
                            "dpsweep.launchers.job" in " ".join(proc.cmdline())
                            and proc.environ().get("SLURM_PROCID") == task
                        ):
                            proc.send_signal(signal.SIGKILL)
                            return
        raise AssertionError(f"task {task} was not found running after {after!r}")

    return kill


@SLURM
def test_a_slurm_task_killed_ends_its_run_failed_and_the_sweep_reports_it(tmp_path: Path, slurm: None) -> None:
    """Rank 1's task SIGKILLed mid-run: rank 0 fails on the closed connection and ends the run FAILED; the
    driver does not wait for the dead task's result for ever (each task is watched through squeue) and
    reports the job failed; nothing is left in the queue."""
    args = ["launcher=slurm", "train.devices=2", "train.epochs=6", "train.progress=false", "tracking.log_model=false"]
    proc = sweep(*args, during=_kill_task(tmp_path, "1", after="epoch 2/6"))
    assert proc.returncode == 1 and ": 0 finished, 0 skipped, 1 failed" in proc.stdout, proc.stdout + proc.stderr
    assert "(task: 1)" in proc.stdout + proc.stderr  # the task without a result, named
    (run,) = finished_runs(tmp_path)
    assert run.info.status == "FAILED", (run.info.status, run.data.tags)
    queue = subprocess.run(["squeue", "--noheader"], capture_output=True, text=True, check=True)
    assert queue.stdout.strip() == "", queue.stdout


@SGE
def test_sge_sweep_is_an_array_job(tmp_path: Path, sge: None) -> None:
    running = PeakRunning(["qstat", "-s", "r", "-u", "*"], header_lines=2)  # one line per running task
    _assert_three_finished(tmp_path, sweep("launcher=sge", "launcher.max_parallel=2", *GRID, during=running))
    assert running.peak == 2  # two at a time, never three
    submission = next((tmp_path / "multirun").rglob("*_submission.sh")).read_text()
    assert "#$ -t 1-3" in submission and "#$ -tc 2" in submission
    assert "-u -m dpsweep.launchers.job -u -m submitit.core._submit " in submission  # no teardown per job


PACKED = ["launcher.trials_per_device=2", "launcher.max_parallel=1", "dp.noise_multiplier=0.8,1.2", "train.seed=0,1",
          *QUICK]  # fmt: skip


def _assert_packed(cwd: Path, proc: subprocess.CompletedProcess[str]) -> str:
    """Four trials in two jobs of two (one device each): each its own process and FINISHED run; the
    jobs' submission script, returned, asks for two trials' cores and memory."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dpsweep: 4 trials in 2 jobs of up to 2 trials" in proc.stdout, proc.stdout
    assert ": 4 finished, 0 skipped, 0 failed" in proc.stdout, proc.stdout
    runs = finished_runs(cwd)
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 4
    assert {r.data.tags["device.sharing"] for r in runs} == {"time-slicing, 2 trials"}
    assert len({r.data.tags["job.pid"] for r in runs}) == 4
    pairs = sorted((float(r.data.params["dp.noise_multiplier"]), int(r.data.params["train.seed"])) for r in runs)
    assert pairs == [(0.8, 0), (0.8, 1), (1.2, 0), (1.2, 1)]
    return next((cwd / "multirun").rglob("*_submission.sh")).read_text()


@SLURM
def test_slurm_packed_sweep_runs_two_trials_per_job(tmp_path: Path, slurm: None) -> None:
    submission = _assert_packed(tmp_path, sweep("launcher=slurm", *PACKED))
    assert "#SBATCH --array=0-1%1" in submission, submission
    assert "#SBATCH --cpus-per-task=2" in submission and "#SBATCH --mem=8GB" in submission, submission


@SGE
def test_sge_packed_sweep_runs_two_trials_per_job(tmp_path: Path, sge: None) -> None:
    submission = _assert_packed(tmp_path, sweep("launcher=sge", *PACKED))
    assert "#$ -t 1-2" in submission and "#$ -tc 1" in submission, submission
    assert "#$ -pe smp 2" in submission and "mem_free=4096M" in submission, submission  # 8 GiB over 2 slots


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
    requeued: list[str] = []

    def requeue(over: threading.Event) -> None:
        deadline = time.monotonic() + 600
        while _saved_epoch(sweep_dir) < 2 and not over.is_set() and time.monotonic() < deadline:
            over.wait(0.5)
        if over.is_set():
            return  # the sweep ended before the job's second epoch was seen: failed below
        [job_folder] = [p for p in (sweep_dir / ".submitit").iterdir() if p.is_dir()]
        job_id = job_folder.name  # <array job>_<index>
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)  # preempt it
        requeued.append(job_id)

    proc = sweep(
        "launcher=slurm",
        f"train.epochs={epochs}",
        "train.progress=false",
        "tracking.log_model=false",
        f"hydra.sweep.dir={sweep_dir}",
        during=requeue,
    )
    assert requeued, f"the job was not requeued mid-training:\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [run] = finished_runs(tmp_path)
    assert run.info.status == "FINISHED" and int(run.data.tags["resume.count"]) >= 1
    planned = schedule.epsilon(schedule.poisson_schedule(1437, 64), 1.0, 1e-5, epochs=epochs).epsilon
    assert run.data.metrics["epsilon_rdp"] == planned  # the ε of an uninterrupted run of this config
    steps = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run.info.run_id, "epsilon")
    assert sorted({m.step for m in steps}) == list(range(1, epochs + 1))


def _packed_job_half_done(sweep_dir: Path, over: threading.Event, epoch: int) -> str | None:
    """The Slurm id of the sweep's one packed job once one of its trials has returned and the other has
    saved epoch ``epoch``; None if the sweep ended first (or 600 s passed)."""
    deadline = time.monotonic() + 600
    submitit_dir = sweep_dir / ".submitit"
    while not over.is_set() and time.monotonic() < deadline:
        returned = list(submitit_dir.rglob("trial-*.result")) if submitit_dir.is_dir() else []
        if returned and _saved_epoch(sweep_dir) >= epoch:
            [job_folder] = [p for p in submitit_dir.iterdir() if p.is_dir() and p.name != "packed"]
            return job_folder.name
        over.wait(0.5)
    return None


@SLURM
def test_a_requeued_packed_job_keeps_its_returned_trial_and_resumes_the_other(tmp_path: Path, slurm: None) -> None:
    """A job of two trials (1 and 12 epochs) requeued once the first has returned and the second has saved
    its second epoch: the first is not run again (its result kept), the second resumes with the ε of an
    uninterrupted run."""
    epochs = 12
    sweep_dir = tmp_path / "sweep"
    requeued: list[str] = []

    def requeue(over: threading.Event) -> None:
        job = _packed_job_half_done(sweep_dir, over, epoch=2)
        if job is not None:  # (else: failed below)
            subprocess.run(["scontrol", "requeue", job], check=True, timeout=60)  # preempt it
            requeued.append(job)

    proc = sweep(
        "launcher=slurm", "launcher.trials_per_device=2", f"train.epochs=1,{epochs}", "train.progress=false",
        "tracking.log_model=false", f"hydra.sweep.dir={sweep_dir}", during=requeue,
    )  # fmt: skip
    assert requeued, f"the job was not requeued mid-training:\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ": 2 finished, 0 skipped, 0 failed" in proc.stdout, proc.stdout
    runs = {int(r.data.params["train.epochs"]): r for r in finished_runs(tmp_path)}
    assert sorted(runs) == [1, epochs] and {r.info.status for r in runs.values()} == {"FINISHED"}
    assert "resume.count" not in runs[1].data.tags  # returned before the requeue: not started again
    assert int(runs[epochs].data.tags["resume.count"]) >= 1
    planned = schedule.epsilon(schedule.poisson_schedule(1437, 64), 1.0, 1e-5, epochs=epochs).epsilon
    assert runs[epochs].data.metrics["epsilon_rdp"] == planned  # the ε of an uninterrupted run of this config


@SLURM
def test_a_cancelled_packed_job_reports_its_returned_trial_finished(tmp_path: Path, slurm: None) -> None:
    """scancel of a job of two trials (1 and 200 epochs) once the first has returned: the job ends without a
    result, as a job of one trial does, and the driver reads the first trial's own (FINISHED); the other
    fails, its run KILLED."""
    sweep_dir = tmp_path / "sweep"

    def cancel(over: threading.Event) -> None:
        job = _packed_job_half_done(sweep_dir, over, epoch=1)
        if job is not None:  # (else: failed below)
            subprocess.run(["scancel", job], check=True, timeout=60)

    proc = sweep(
        "launcher=slurm", "launcher.trials_per_device=2", "train.epochs=1,200", "train.progress=false",
        "tracking.log_model=false", f"hydra.sweep.dir={sweep_dir}", during=cancel,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ": 1 finished, 0 skipped, 1 failed" in proc.stdout, proc.stdout + proc.stderr
    runs = {int(r.data.params["train.epochs"]): r for r in finished_runs(tmp_path)}
    assert runs[1].info.status == "FINISHED" and runs[200].info.status == "KILLED", runs


@SLURM
def test_slurm_scancel_is_recorded_and_the_sweep_goes_on(
    tmp_path: Path, slurm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without accounting (sacct disabled) job states come from squeue; a cancelled job must not hang the sweep."""
    # submitit waits 15 s for the result file of a job that ended without one, for network file
    # systems that show it late (its own tests set 0); this node's is local, and the job left none
    monkeypatch.setattr(submitit.core.core.Job, "_results_timeout_s", 1)
    sweep_dir = tmp_path / "sweep"

    def cancel_the_long_job(over: threading.Event) -> None:
        deadline = time.monotonic() + 600
        while _saved_epoch(sweep_dir / "1") < 1 and not over.is_set() and time.monotonic() < deadline:
            over.wait(0.5)  # job 1 (200 epochs; its own output dir) has saved a checkpoint: its run exists
        folders = sorted(p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir())
        long_job = next(f for f in folders if f.endswith("_1"))  # the array index of train.epochs=200
        subprocess.run(["scancel", long_job], check=True, timeout=60)

    proc = sweep(
        "launcher=slurm",
        "train.epochs=1,200",
        "train.progress=false",
        "tracking.log_model=false",
        f"hydra.sweep.dir={sweep_dir}",
        during=cancel_the_long_job,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ": 1 finished, 0 skipped, 1 failed" in proc.stdout
    statuses = sorted(r.info.status for r in finished_runs(tmp_path))
    assert statuses == ["FINISHED", "KILLED"]


@SLURM
def test_optuna_study_through_slurm(tmp_path: Path, slurm: None) -> None:
    proc = sweep("search=grid", "launcher=slurm", "hydra.sweeper.optuna.n_trials=2", *QUICK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dpsweep: study digits_grid: 2 trials (2 complete)" in proc.stdout
    runs = finished_runs(tmp_path)
    assert sorted(r.data.tags["optuna.trial"] for r in runs) == ["0", "1"]
    assert all(r.info.status == "FINISHED" and r.data.tags["optuna.study"] == "digits_grid" for r in runs)
    assert next((tmp_path / "multirun").rglob("*_submission.sh")).read_text().count("#SBATCH --array=0-1%") == 1
