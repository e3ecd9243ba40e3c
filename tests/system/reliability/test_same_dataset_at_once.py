"""Parallel jobs logging the same dataset inputs at once (issue 39, item 1; about one run in two failed
before the fix, 40 datasets x 8 jobs): MLflow's store checks for
a dataset and then inserts it, so two jobs of one experiment could both insert ``digits-train`` and
one failed with ``UNIQUE constraint failed: datasets.experiment_id, datasets.name, datasets.digest``.
No job may fail because another logged the same thing first."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import at_once
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow

JOBS = 8
DIGESTS = 40  # datasets each job logs, the same ones in the same order: many chances to collide


def _job(uri: str, run_id: str, barrier: str, job: int, out_dir: str) -> None:
    """Log DIGESTS dataset inputs to ``run_id`` through dpsweep's store, every process at the same moment."""
    import time
    import traceback

    from dpsweep.tracking import store

    try:
        (Path(barrier) / str(job)).touch()
        while len(list(Path(barrier).iterdir())) < JOBS:
            time.sleep(0.001)
        for d in range(DIGESTS):
            public = {"name": "digits", "image_size": "28", "n_train": "1437", "n_test": "360"}
            store.log_dataset_splits(uri, run_id, public, f"{d:012x}", ["train", "test"])
    except BaseException:
        Path(out_dir, f"{job}.err").write_text(traceback.format_exc())
        raise


def test_jobs_logging_the_same_dataset_at_once_all_succeed(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("same-dataset")
    run_ids = [client.create_run(exp).info.run_id for _ in range(JOBS)]
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    at_once(_job, [(uri, run_ids[i], str(barrier), i, str(tmp_path)) for i in range(JOBS)], tmp_path)
    for run_id in run_ids:  # every job's run has every input, each dataset stored once per experiment
        run_inputs = client.get_run(run_id).inputs
        assert run_inputs is not None
        inputs = run_inputs.dataset_inputs
        assert len(inputs) == 2 * DIGESTS
        assert {(i.dataset.name, i.dataset.digest) for i in inputs} == {
            (f"digits-{s}", f"{d:012x}") for d in range(DIGESTS) for s in ("train", "test")
        }
