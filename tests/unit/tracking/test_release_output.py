"""Private tuning's release prints nothing of MLflow's own (issue 56, item 7): reading the released trial's
``privacy_ledger.json`` back is one download through MLflow's artifact repository, which draws a tqdm bar
("Downloading artifacts") on stderr unless ``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR`` is false. dpsweep turns it
off for its own download alone: the user's setting of the variable is as it was afterwards.

A real sqlite store in ``tmp_path``, with two FINISHED trials of one sweep, each with a ledger.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import fresh_store
from mlflow.tracking import MlflowClient

from dpsweep.tracking import PRIVACY_LEDGER
from dpsweep.tracking.sweeps import release_best

PROCEDURE = {
    "epsilon": 2.5, "accountant": "rdp", "distribution": "poisson", "mean_trials": 3.0,
    "selection": "the best", "reference": "Papernot & Steinke 2022",
}  # fmt: skip


def _sweep_of_two(tmp_path: Path) -> tuple[str, str]:
    """Two FINISHED trials of sweep ``s1`` (test_accuracy 0.8 and 0.9), each with its ledger; the store's URI and
    the better trial's run id."""
    uri, _ = fresh_store(tmp_path, "tuned")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tuned")
    assert exp is not None
    run_ids = []
    for accuracy in (0.8, 0.9):
        run = client.create_run(exp.experiment_id, tags={"sweep.id": "s1"})
        client.log_metric(run.info.run_id, "test_accuracy", accuracy, step=1)
        client.log_metric(run.info.run_id, "epsilon", 1.0, step=1)
        client.log_metric(run.info.run_id, "epsilon_rdp", 1.0, step=1)
        client.log_text(run.info.run_id, json.dumps({"epsilon": {"rdp": 1.0}, "events": []}), PRIVACY_LEDGER)
        client.set_terminated(run.info.run_id, "FINISHED")
        run_ids.append(run.info.run_id)
    return uri, run_ids[1]


@pytest.mark.parametrize("user_setting", [None, "true"])
def test_the_release_draws_no_download_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, user_setting: str | None
) -> None:
    if user_setting is None:
        monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", user_setting)
    uri, best = _sweep_of_two(tmp_path)
    capfd.readouterr()
    released, finished = release_best(uri, "tuned", "s1", "test_accuracy", PROCEDURE)
    out, err = capfd.readouterr()
    assert (released, finished) == (best, 2)
    assert "Downloading artifacts" not in out + err and "it/s" not in out + err, out + err
    assert out + err == "", out + err  # nothing at all: the release's lines are the sweeper's
    path = MlflowClient(uri).download_artifacts(best, PRIVACY_LEDGER, str(tmp_path))
    ledger = json.loads(Path(path).read_text())
    assert ledger["events"][-1]["name"] == "tuning"  # the ledger was read back and rewritten
    assert os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR") == user_setting  # the user's, as it was
