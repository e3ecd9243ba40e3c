"""Killed drivers (issue 13, items 4 and 5): runs left RUNNING by a dead process are found and ended
KILLED with the reason, their checkpoints deleted; launcher=local jobs die with their driver; and a
re-run of the sweep leaves nothing RUNNING and no duplicate FINISHED run. Real processes, SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import dead_run, run_dpsweep, run_main

from dpsweep.cli import runs
from dpsweep.process.liveness import ProcessId
from dpsweep.tracking import HEARTBEAT_TAG, PROCESS_TAG, STALE_AFTER_S, why_dead
from dpsweep.tracking.store import open_client

BIN = Path(sys.executable).parent
FAST = ["train.progress=false", "tracking.experiment_name=faults", "tracking.log_model=false"]


def statuses(cwd: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """{run id: (status, tags)} of the experiment's runs, parents included."""
    db = cwd / "mlflow.db"
    if not db.exists():
        return {}
    client = open_client(f"sqlite:///{db}")  # under the store's lock: the driver may be creating it
    exp = client.get_experiment_by_name("faults")
    if exp is None:
        return {}
    return {r.info.run_id: (r.info.status, r.data.tags) for r in client.search_runs([exp.experiment_id])}


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def jobs_running(cwd: Path, n: int) -> bool:
    runs = statuses(cwd).values()
    return sum(s == "RUNNING" and t.get("sweep.role") != "parent" for s, t in runs) >= n


def second_job_started(cwd: Path) -> bool:
    """One job FINISHED and another RUNNING, in one read of the store (two reads could see the first
    job RUNNING, then FINISHED, before the second has started)."""
    jobs = [s for s, t in statuses(cwd).values() if t.get("sweep.role") != "parent"]
    return "FINISHED" in jobs and "RUNNING" in jobs


def job_logs(cwd: Path) -> str:
    """The last lines of each submitit job log under ``cwd`` (its stdout and stderr)."""
    logs = sorted(cwd.glob("multirun/**/.submitit/**/*_log.*"))
    return "\n".join(f"--- {log}:\n{log.read_text(errors='replace')[-3000:]}" for log in logs) or "(none)"


def test_process_identity_tells_live_from_dead() -> None:
    me = ProcessId.current()
    assert ProcessId.parse(me.token) == me and me.alive() is True
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = ProcessId.current().__class__(me.host, child.pid, None)
    child.wait()
    assert gone.alive() is False
    reused = ProcessId(me.host, os.getpid(), (me.start or 0) + 1)  # this pid, another start time
    assert reused.alive() is False
    elsewhere = {PROCESS_TAG: "other-host:123:456", HEARTBEAT_TAG: f"{time.time() - STALE_AFTER_S - 5:.0f}"}
    assert "no heartbeat" in (why_dead(elsewhere, time.time()) or "")
    assert why_dead(elsewhere | {HEARTBEAT_TAG: f"{time.time():.0f}"}, time.time()) is None
    assert why_dead({}, time.time()) is None  # a run of an older version: nothing to judge by


@pytest.mark.slow
def test_a_killed_inline_driver_leaves_nothing_running_after_reconcile_and_rerun(tmp_path: Path) -> None:
    grid = ["-m", "train.epochs=1,500", *FAST]  # the second job is long: it is in flight when killed
    log = (tmp_path / "driver.log").open("w")  # a file, not a pipe: the jobs inherit it and outlive the driver
    driver = subprocess.Popen([BIN / "dpsweep", *grid], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: second_job_started(tmp_path), 300, "the second job to start")
    finally:
        driver.kill()
        driver.wait(timeout=60)
    stuck = [rid for rid, (s, _) in statuses(tmp_path).items() if s == "RUNNING"]
    assert len(stuck) == 2, (statuses(tmp_path), (tmp_path / "driver.log").read_text()[-3000:])  # parent and job

    # the reconcile and the re-run in this process: what is under test is the killed driver's process
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = run_main(runs.main, "reconcile", "--experiment", "faults", "--tracking-uri", uri)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 dead run(s) ended KILLED" in done.stdout and "is no longer running" in done.stdout
    after = statuses(tmp_path)
    for rid in stuck:
        status, tags = after[rid]
        assert status == "KILLED" and tags["failure.kind"] == "dead" and "no longer running" in tags["error"]
    assert not list(tmp_path.glob("multirun/**/checkpoint/checkpoint.pt"))  # its RNG state is not left behind

    again = run_dpsweep(*grid[:1], "train.epochs=1,2", *FAST)
    assert again.returncode == 0, again.stdout + again.stderr
    final = statuses(tmp_path).values()
    assert not [s for s, _ in final if s == "RUNNING"]
    hashes = [t["config.hash"] for s, t in final if s == "FINISHED" and t.get("sweep.role") != "parent"]
    assert len(hashes) == len(set(hashes)) == 2  # epochs=1 once (skipped the second time), epochs=2 once


@pytest.mark.slow
def test_local_jobs_die_with_their_driver_and_a_rerun_makes_no_duplicate(tmp_path: Path) -> None:
    grid = ["-m", "launcher=local", "launcher.max_parallel=1", "train.epochs=500", *FAST]
    log = (tmp_path / "driver.log").open("w")  # a file, not a pipe: the jobs inherit it and outlive the driver
    driver = subprocess.Popen([BIN / "dpsweep", *grid], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: jobs_running(tmp_path, 1), 300, "the local job to start its run")
        job = next(t for s, t in statuses(tmp_path).values() if s == "RUNNING" and t.get("sweep.role") != "parent")
    finally:
        driver.kill()
        driver.wait(timeout=60)
    process = ProcessId.parse(job[PROCESS_TAG])
    assert process is not None
    try:  # its watch sends SIGTERM within a second, and again every 30 s (liveness.DRIVER_RESEND_S)
        wait_for(lambda: process.alive() is False, 60, "the job to end with its driver")
    except AssertionError as err:
        raise AssertionError(f"{err}; the job's logs:\n{job_logs(tmp_path)}") from None
    wait_for(
        lambda: any(s == "KILLED" and t.get("sweep.role") != "parent" for s, t in statuses(tmp_path).values()),
        30, "the job's run to end KILLED",
    )  # fmt: skip
    # the re-run in this process, its job inline: the sweep closes dead runs before it launches anything
    again = run_dpsweep("-m", "train.epochs=1", *FAST)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "ended run" in again.stdout  # the parent left RUNNING by the killed driver, closed first
    assert not [s for s, _ in statuses(tmp_path).values() if s == "RUNNING"]


def test_a_dead_runs_checkpoint_is_deleted_with_it(tmp_path: Path) -> None:
    """Issue 39, item 5: train.checkpoint_dir is logged as a tag (a setting), and reconcile looked for it
    among the params: the dead run's checkpoint, which holds the RNG state of its noise, stayed behind."""
    import torch

    from dpsweep.run import checkpoint
    from dpsweep.tracking.dead_runs import reconcile

    ckpt = tmp_path / "ckpt"
    uri, client, run_id = dead_run(tmp_path, {"train.checkpoint_dir": str(ckpt)})
    model = torch.nn.Linear(2, 2)
    state = checkpoint.TrainingState("h", run_id, 1, 1)
    checkpoint.save(ckpt, state, model, torch.optim.SGD(model.parameters(), lr=0.1), None)
    [dead] = reconcile(uri, "dead")
    assert dead.run_id == run_id and dead.checkpoint_removed == str(ckpt / checkpoint.FILENAME)
    assert not (ckpt / checkpoint.FILENAME).exists()
    assert client.get_run(run_id).info.status == "KILLED"


def test_a_zombie_is_not_alive() -> None:
    """Issue 39, item 4: a process that has exited but is not reaped (a killed driver whose parent has
    not waited for it) still answers kill(pid, 0); its jobs, runs and configs must not count it live."""
    from dpsweep.process.liveness import exited, pid_namespace, start_ticks

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    token = ProcessId(ProcessId.current().host, child.pid, None, pid_namespace())
    deadline = time.monotonic() + 30
    while not exited(child.pid) and time.monotonic() < deadline:  # not reaped: it stays a zombie
        time.sleep(0.01)
    try:
        assert exited(child.pid) and start_ticks(child.pid) is not None  # a zombie, still in /proc
        assert ProcessId(token.host, child.pid, start_ticks(child.pid), token.namespace).alive() is False
    finally:
        child.wait()


def test_a_process_in_another_pid_namespace_of_this_host_is_judged_by_its_heartbeat() -> None:
    """Issue 39, item 11: a container sharing the host's name (--network host) has its own pids. A real
    process in a new PID namespace (unshare, as a container runtime makes one) is not declared dead."""
    script = "from dpsweep.process.liveness import ProcessId; print(ProcessId.current().token, flush=True); input()"
    try:
        inside = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    except FileNotFoundError:
        pytest.skip("no unshare(1) here: util-linux is needed to make a PID namespace")
    try:
        assert inside.stdout is not None
        line = inside.stdout.readline().strip()
        if not line:
            pytest.skip(f"unshare could not make a PID namespace here: {inside.stderr.read() if inside.stderr else ''}")
        container = ProcessId.parse(line)
        assert container is not None and container.pid == 1 and container.namespace != ProcessId.current().namespace
        assert container.alive() is None  # not False: pid 1 here is another process; ask the heartbeat
        assert why_dead({PROCESS_TAG: line, HEARTBEAT_TAG: f"{time.time():.0f}"}, time.time()) is None
        old = ProcessId(container.host, container.pid, container.start)  # a token of an older version
        assert ProcessId.parse(old.token) == old and ProcessId.parse(line) == container
    finally:
        inside.kill()
        inside.wait()


@pytest.mark.slow
def test_a_local_job_still_starting_when_its_driver_is_terminated_does_not_train(tmp_path: Path) -> None:
    """Issue 39, item 3: SIGTERM to the driver one second after ``[1/2]``, while the second job is
    starting (submitit's job process bypasses a SIGTERM then). The job must end without training."""
    grid = ["-m", "launcher=local", "launcher.max_parallel=1", "train.epochs=1,300", *FAST]
    log_path = tmp_path / "driver.log"
    log = log_path.open("w")  # a file, not a pipe: the jobs inherit it and outlive the driver
    driver = subprocess.Popen([BIN / "dpsweep", *grid], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "[1/2]" in log_path.read_text(), 300, "the first job to end")
        time.sleep(1)
        jobs = psutil.Process(driver.pid).children(recursive=True)
        driver.terminate()
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert jobs, log_path.read_text()
    _, alive = psutil.wait_procs(jobs, timeout=90)  # 13 s on the 2-core VM: its start-up
    assert not alive, f"{alive} still running:\n{log_path.read_text()}"
    runs = [(s, t) for s, t in statuses(tmp_path).values() if t.get("sweep.role") != "parent"]
    assert not [s for s, _ in runs if s == "RUNNING"], log_path.read_text()
    assert len([s for s, _ in runs if s == "FINISHED"]) == 1, (runs, log_path.read_text())  # the first job only


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_single_run_killed_by_sigkill_is_closed_or_resumed_by_the_next_run_of_its_config(
    tmp_path: Path, checkpointed: bool
) -> None:
    """Issue 55, item 7: a single run (no -m) killed with SIGKILL stayed RUNNING until a sweep, a report or
    reconcile closed it, even when the same config ran again. Now a run of a config closes that config's
    dead runs first; the one its checkpoint resumes it continues instead."""
    args = ["train.epochs=6", *FAST, *([f"train.checkpoint_dir={tmp_path / 'ckpt'}"] if checkpointed else [])]
    log = (tmp_path / "run.log").open("w")
    run = subprocess.Popen([BIN / "dpsweep", *args], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:  # killed in its second epoch, after the first epoch's checkpoint
        wait_for(lambda: "epoch 1/6" in (tmp_path / "run.log").read_text(), 300, "the run's first epoch")
    finally:
        run.kill()
        run.wait(timeout=60)
    [(killed, (status, _))] = statuses(tmp_path).items()
    assert status == "RUNNING", (tmp_path / "run.log").read_text()
    proc = subprocess.run([BIN / "dpsweep", *args], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = statuses(tmp_path)
    assert not [rid for rid, (s, _) in after.items() if s == "RUNNING"]
    if checkpointed:  # resumed: the same MLflow run, finished
        assert list(after) == [killed] and after[killed][0] == "FINISHED"
    else:  # closed KILLED as dead, and the new run finished beside it
        assert after[killed][0] == "KILLED" and after[killed][1]["failure.kind"] == "dead"
        assert sorted(s for s, _ in after.values()) == ["FINISHED", "KILLED"]
