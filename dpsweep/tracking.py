"""MLflow tracking: one run per training job that always ends FINISHED, FAILED or KILLED.

    with tracked_run(TrackingConfig(), tags={"dataset.name": "digits"}) as run:
        run.log_params({"train.batch_size": 64})
        run.log_metrics({"test_accuracy": 0.93}, step=1)

A run that raises ends FAILED with the error in the tags ``error`` and ``error.type`` and the
traceback as the artifact ``error.txt``; an interrupted one (Ctrl-C, SystemExit) ends KILLED.
Out-of-memory failures are tagged ``failure.kind=oom``, since they are data for memory models.
"""

from __future__ import annotations

import platform
import subprocess
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
import opacus
import torch
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dpsweep.config import TrackingConfig

MAX_TAG_CHARS = 5000  # MLflow's limit on tag values is 8000 characters
MAX_PARAM_CHARS = 6000  # MLflow's limit on param values


class Tracker:
    """Logs to one MLflow run by id (no global 'active run' state)."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        now = _now_ms()
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        items = [RunTag(k, str(v)[:MAX_TAG_CHARS]) for k, v in tags.items()]
        if items:
            self.client.log_batch(self.run_id, tags=items)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def experiment_id(client: MlflowClient, name: str) -> str:
    """Id of the experiment ``name``, created if missing (safe when several jobs race)."""
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name))
    except MlflowException:  # another job created it first
        again = client.get_experiment_by_name(name)
        if again is None:
            raise
        return str(again.experiment_id)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError | MemoryError) or "out of memory" in str(err).lower()


@contextmanager
def tracked_run(cfg: TrackingConfig, tags: Mapping[str, Any] | None = None) -> Iterator[Tracker]:
    """Start an MLflow run; end it FINISHED, FAILED (error recorded) or KILLED, whatever happens."""
    mlflow.set_tracking_uri(cfg.uri)
    client = MlflowClient(cfg.uri)
    exp = experiment_id(client, cfg.experiment_name)
    run = client.create_run(exp, run_name=cfg.run_name, tags={k: str(v) for k, v in (tags or {}).items()})
    tracker = Tracker(client, run.info.run_id)
    status = "FAILED"
    try:
        yield tracker
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit) as err:
        status = "KILLED"
        _record_failure(tracker, err, kind="interrupted")
        raise
    except BaseException as err:
        _record_failure(tracker, err, kind="oom" if _is_oom(err) else "exception")
        raise
    finally:
        client.set_terminated(run.info.run_id, status)


def _record_failure(tracker: Tracker, err: BaseException, kind: str) -> None:
    try:
        tracker.set_tags(
            {"error": f"{type(err).__name__}: {err}", "error.type": type(err).__name__, "failure.kind": kind}
        )
        tracker.log_text("".join(traceback.format_exception(err)), "error.txt")
    except Exception:  # recording must never hide the original error or keep the run RUNNING
        pass


def git_commit() -> str:
    """Commit of the dpsweep source tree, with ``-dirty`` if it has uncommitted changes."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def environment_tags(device: torch.device) -> dict[str, str]:
    return {
        "git.commit": git_commit(),
        "torch.version": torch.__version__,
        "opacus.version": opacus.__version__,
        "device.name": device_name(device),
    }
