"""Tracking against a real MLflow sqlite store: runs always end FINISHED, FAILED or KILLED."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from helpers import runs_of
from mlflow.system_metrics.metrics.base_metrics_monitor import BaseMetricsMonitor
from mlflow.tracking import MlflowClient

from dpsweep.config import TrackingConfig
from dpsweep.process.liveness import ProcessId, start_ticks
from dpsweep.tracking import PROCESS_TAG, Claimed, tracked_run
from dpsweep.tracking.environment import environment_tags, git_commit
from dpsweep.tracking.monitors import system_metrics_monitor
from dpsweep.tracking.store import experiment_id, open_client


def _cfg(uri: str, name: str) -> TrackingConfig:
    return TrackingConfig(uri=uri, experiment_name=name)


def test_finished_run_keeps_params_metrics_tags_and_text(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    with tracked_run(_cfg(mlflow_uri, experiment_name), tags={"k": 1}) as run:
        run.log_params({f"p{i}": i for i in range(150)})  # more than one 100-param batch
        run.log_metrics({"acc": 0.5}, step=1)
        run.log_metrics({"acc": 0.75}, step=2)
        run.log_text("a: 1\n", "config.yaml")
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FINISHED"
    assert len(r.data.params) == 150 and r.data.tags["k"] == "1"
    assert [m.value for m in client.get_metric_history(r.info.run_id, "acc")] == [0.5, 0.75]
    assert [a.path for a in client.list_artifacts(r.info.run_id)] == ["config.yaml"]


def test_raising_run_ends_failed_with_the_error(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    with pytest.raises(RuntimeError, match="boom"), tracked_run(_cfg(mlflow_uri, experiment_name)) as run:
        run.log_metrics({"acc": 0.5}, step=1)
        raise RuntimeError("boom")
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FAILED"
    assert r.data.tags["error"] == "RuntimeError: boom" and r.data.tags["failure.kind"] == "exception"
    assert r.data.metrics["acc"] == 0.5  # what was logged before the failure is kept
    assert "error.txt" in [a.path for a in client.list_artifacts(r.info.run_id)]


def test_out_of_memory_is_tagged_as_such(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    with pytest.raises(torch.OutOfMemoryError), tracked_run(_cfg(mlflow_uri, experiment_name)):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FAILED" and r.data.tags["failure.kind"] == "oom"


def test_interrupted_run_ends_killed(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    with pytest.raises(KeyboardInterrupt), tracked_run(_cfg(mlflow_uri, experiment_name)):
        raise KeyboardInterrupt
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "KILLED" and r.data.tags["failure.kind"] == "interrupted"


def test_experiment_is_created_once(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    first = experiment_id(client, experiment_name)
    assert experiment_id(client, experiment_name) == first


def test_environment_tags_name_versions_and_commit() -> None:
    tags = environment_tags(torch.device("cpu"))
    assert tags["torch.version"] == torch.__version__
    assert tags["device.name"].startswith("cpu")
    commit = git_commit()
    assert tags["git.commit"] == commit
    assert commit == "unknown" or len(commit.split("-")[0]) == 40


def test_a_finished_run_is_never_reopened(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    # another process finished it between this one finding its checkpoint and reopening it
    with tracked_run(_cfg(mlflow_uri, experiment_name)) as run:
        run.log_metrics({"acc": 0.75}, step=1)
    reopen = tracked_run(_cfg(mlflow_uri, experiment_name), resume_run_id=run.run_id)
    with pytest.raises(Claimed, match=f"already FINISHED as run {run.run_id}"), reopen:
        pytest.fail("the finished run was reopened")
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FINISHED" and r.data.metrics["acc"] == 0.75 and "error" not in r.data.tags


def test_a_run_another_live_process_runs_is_not_taken_over(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a live process of this host
    try:
        with tracked_run(_cfg(mlflow_uri, experiment_name)) as run:
            client.set_tag(
                run.run_id, PROCESS_TAG, ProcessId(socket.gethostname(), other.pid, start_ticks(other.pid)).token
            )
            take_over = tracked_run(_cfg(mlflow_uri, experiment_name), resume_run_id=run.run_id)
            with pytest.raises(Claimed, match=f"already RUNNING as run {run.run_id}"), take_over:
                pytest.fail("a live process's run was taken over")
            client.set_tag(run.run_id, PROCESS_TAG, ProcessId.current().token)
    finally:
        other.kill()
        other.wait()
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FINISHED"


class CardReading(BaseMetricsMonitor):
    """One card's readings under the names MLflow's GPUMonitor gives them (this machine has no GPU; the
    real reading is checked on a card by benchmarks/system_metrics_gpu.py)."""

    READINGS: ClassVar[dict[str, float]] = {
        "gpu_0_memory_usage_megabytes": 4779.3, "gpu_0_memory_usage_percentage": 3.3,
        "gpu_0_utilization_percentage": 41.0, "gpu_0_power_usage_watts": 180.0,
    }  # fmt: skip

    def collect_metrics(self) -> None:
        for name, value in self.READINGS.items():
            self._metrics[name].append(value)

    def aggregate_metrics(self) -> dict[str, float]:
        return {name: sum(values) / len(values) for name, values in self._metrics.items()}


@pytest.mark.parametrize("private", [True, False])
def test_a_private_run_logs_every_system_metric_but_gpu_memory(client: MlflowClient, private: bool) -> None:
    """Through MLflow's own monitor loop, aggregation and batch logger into the store: a DP run's
    system metrics leave out the GPU memory (it follows the Poisson batch sizes) and keep the rest."""
    run = client.create_run(client.create_experiment(f"system_metrics_{private}"))
    monitor = system_metrics_monitor(run.info.run_id, client.tracking_uri, 0.05, withhold_gpu_memory=private)
    monitor.monitors.append(CardReading())
    monitor.start()
    time.sleep(0.5)
    monitor.finish()
    logged = client.get_run(run.info.run_id).data.metrics
    assert {"system/cpu_utilization_percentage", "system/gpu_0_utilization_percentage",
            "system/gpu_0_power_usage_watts"} <= set(logged), logged  # fmt: skip
    gpu_memory = {k for k in logged if k.startswith("system/gpu_0_memory")}
    expected = set() if private else {"system/gpu_0_memory_usage_megabytes", "system/gpu_0_memory_usage_percentage"}
    assert gpu_memory == expected, logged


@pytest.mark.slow
def test_a_store_creation_killed_part_way_leaves_no_broken_database(tmp_path: Path) -> None:
    """A process killed while MLflow builds a new sqlite store (a refused sweep's exit that stops
    waiting on a loaded machine, a Ctrl-C) leaves no half-migrated ``mlflow.db``: the next opening
    makes a whole one, not "table ... already exists"."""
    db = tmp_path / "mlflow.db"
    code = f"from dpsweep.tracking.store import open_client; open_client({f'sqlite:///{db}'!r})"
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".mlflow.db.*.new")):  # MLflow has begun: tables, then its migrations
        assert child.poll() is None, f"ended with {child.returncode} before building: {child.stderr.read()}"
        assert time.monotonic() < deadline, "no store was being built after 120 s"
        time.sleep(0.01)
    time.sleep(0.3)
    child.kill()
    _, stderr = child.communicate()
    assert child.returncode == -signal.SIGKILL, f"it finished before the kill: {stderr}"
    assert not db.exists()
    client = open_client(f"sqlite:///{db}")
    assert [e.name for e in client.search_experiments()] == ["Default"]
    assert not list(tmp_path.glob(".mlflow.db.*")), "the killed build's file is left behind"


def test_a_finished_sweeps_runs_left_running_are_closed_killed_and_no_other_run_is_touched(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    from dpsweep.tracking.sweeps import close_orphaned_runs

    exp = experiment_id(client, experiment_name)

    def run(sweep: str, role: str | None = None, end: str | None = None) -> str:
        tags = {"sweep.id": sweep} | ({"sweep.role": role} if role else {})
        run_id = client.create_run(exp, tags=tags).info.run_id
        if end:
            client.set_terminated(run_id, end)
        return run_id

    orphans = [run("s1"), run("s1")]
    done, failed, parent = run("s1", end="FINISHED"), run("s1", end="FAILED"), run("s1", role="parent")
    other = run("s2")
    assert close_orphaned_runs(mlflow_uri, experiment_name, "s1") == sorted(orphans)
    for run_id in orphans:
        r = client.get_run(run_id)
        assert r.info.status == "KILLED" and r.data.tags["failure.kind"] == "killed"
        assert "without closing its run" in r.data.tags["error"]
    expected = {done: "FINISHED", failed: "FAILED", parent: "RUNNING", other: "RUNNING"}
    assert {run_id: client.get_run(run_id).info.status for run_id in expected} == expected
    assert "failure.kind" not in client.get_run(done).data.tags
    assert close_orphaned_runs(mlflow_uri, experiment_name, "s1") == []  # a second call finds none
