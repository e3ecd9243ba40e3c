"""Concurrent first use of a new sqlite MLflow store (issue 13, item 7): 16 processes that open a fresh
``mlflow.db`` at the same moment each record one FINISHED run, and the store stays usable."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow

RUNS = 16

# One real run through dpsweep's tracking layer, as a job's process opens it (its own interpreter).
JOB = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dpsweep.config import TrackingConfig
    from dpsweep.tracking import tracked_run
    barrier, job, n = Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    (barrier / job).touch()
    while len(list(barrier.iterdir())) < n:  # every process opens the store at the same moment
        time.sleep(0.001)
    with tracked_run(TrackingConfig(uri=sys.argv[1], experiment_name="concurrent"), {"job": job}) as run:
        run.log_metrics({"test_accuracy": 0.5}, step=1)
    """
)


def test_sixteen_first_runs_at_once_are_all_recorded(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    command = [sys.executable, "-c", JOB, uri, str(barrier)]
    procs = [subprocess.Popen([*command, str(i), str(RUNS)], stderr=subprocess.PIPE, text=True) for i in range(RUNS)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    failed = [(p.returncode, err) for p, err in zip(procs, errors, strict=True) if p.returncode != 0]
    assert failed == [], "\n".join(err[-2000:] for _, err in failed)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("concurrent")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.data.tags["job"] for r in runs) == sorted(str(i) for i in range(RUNS))
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert {r.data.metrics["test_accuracy"] for r in runs} == {0.5}
