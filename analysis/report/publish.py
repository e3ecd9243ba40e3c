"""A report's files logged on its sweep's parent run, so that the MLflow UI shows them beside the sweep.

    from dpsweep.analysis.report import publish
    logged = publish.log_on_parent(built, paths)     # None: no sweep; else the parent run, and what happened

``dpsweep-report`` does this after writing the files unless ``--no-log``; it says what happened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dpsweep.analysis.report.build import Report

ARTIFACT_DIR = "report"  # where the files go on the sweep's parent run


@dataclass(frozen=True)
class ParentLog:
    """What :func:`log_on_parent` did for the sweep ``sweep_id``: ``run_id`` is its parent run (None where
    the sweep has none: the files stay on disk only); ``files`` how many were logged under
    :data:`ARTIFACT_DIR`; ``error`` why they could not be (None when they were)."""

    sweep_id: str
    run_id: str | None
    files: int = 0
    error: str | None = None


def log_on_parent(built: Report, paths: Sequence[Path]) -> ParentLog | None:
    """Log ``paths`` as artifacts under :data:`ARTIFACT_DIR` on the parent run of the report's sweep;
    None when the report is of no sweep. A store that refuses them (MLflow's error, or the file
    system's) is reported in the result, not raised: the files are on disk all the same."""
    if built.sweep_id is None:
        return None
    if built.parent_run_id is None:
        return ParentLog(built.sweep_id, None)
    client = MlflowClient(built.uri)
    try:
        for path in paths:
            client.log_artifact(built.parent_run_id, str(path), artifact_path=ARTIFACT_DIR)
    except (MlflowException, OSError) as err:
        return ParentLog(built.sweep_id, built.parent_run_id, error=str(err))
    return ParentLog(built.sweep_id, built.parent_run_id, files=len(paths))
