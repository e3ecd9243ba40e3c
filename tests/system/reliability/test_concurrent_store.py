"""Concurrent first use of a new sqlite MLflow store (issue 13, item 7): 16 processes that open a fresh
``mlflow.db`` at the same moment each record one FINISHED run, and the store stays usable."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import at_once
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow

RUNS = 16


def _job(uri: str, barrier: str, job: int, n: int, out_dir: str) -> None:
    """One real run through dpsweep's tracking layer, as a job's process opens it: its own process
    (forked from a server that imported dpsweep.tracking once), the store opened only after every
    process is ready. A failure leaves its traceback in ``out_dir/<job>.err``."""
    import time
    import traceback

    from dpsweep.config import TrackingConfig
    from dpsweep.tracking import tracked_run

    try:
        (Path(barrier) / str(job)).touch()
        while len(list(Path(barrier).iterdir())) < n:  # every process opens the store at the same moment
            time.sleep(0.001)
        with tracked_run(TrackingConfig(uri=uri, experiment_name="concurrent"), {"job": str(job)}) as run:
            run.log_metrics({"test_accuracy": 0.5}, step=1)
    except BaseException:
        Path(out_dir, f"{job}.err").write_text(traceback.format_exc())
        raise


def test_sixteen_first_runs_at_once_are_all_recorded(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    # Processes forked from a forkserver that imported dpsweep's tracking layer once (each would
    # otherwise spend seconds importing MLflow): still 16 processes, each opening the store itself.
    pids = at_once(_job, [(uri, str(barrier), i, RUNS, str(tmp_path)) for i in range(RUNS)], tmp_path)
    assert len(set(pids)) == RUNS  # one process each
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("concurrent")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.tags["job"] for r in runs) == sorted(str(i) for i in range(RUNS))
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert {r.data.metrics["test_accuracy"] for r in runs} == {0.5}
