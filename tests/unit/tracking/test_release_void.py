"""A private tuning's release states only what holds for the procedure: the released trial's ledger keeps no
single-run certainty figures (its interval, μ and attack risk are one trial's), and a procedure one of whose
trials failed its sampling check is not for release (issue 58). A real sqlite store in ``tmp_path``."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import fresh_store, log_run
from mlflow.tracking import MlflowClient

from dpsweep.tracking import PRIVACY_LEDGER
from dpsweep.tracking.sweeps import VOID_TAG, release_best, void_of

PROCEDURE = {
    "epsilon": 2.5, "accountant": "rdp", "distribution": "poisson", "mean_trials": 3.0,
    "selection": "the best", "reference": "Papernot & Steinke 2022",
}  # fmt: skip
CERTAINTY = {"epsilon_interval": {"lower": 0.9, "upper": 1.0, "accountant": "pld"}, "mu_gdp": 0.3}


def _sweep(tmp_path: Path, refused: bool) -> tuple[str, str, str]:
    """A parent and two FINISHED trials of sweep ``s1`` (test_accuracy 0.8 and 0.9) with their certainty; the
    worse one's sampling check refused where ``refused``. The store's URI, the parent's and the better trial's id."""
    uri, _ = fresh_store(tmp_path, "tuned")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tuned")
    assert exp is not None
    parent = client.create_run(exp.experiment_id, tags={"sweep.role": "parent"}).info.run_id
    ids = []
    for accuracy in (0.8, 0.9):
        tags = {"sweep.id": "s1", "mlflow.parentRunId": parent, "epsilon_interval.accountant": "pld"}
        if refused and accuracy == 0.8:
            tags |= {"sampling.check": "refused", "sampling.refused": "count test p=1e-9"}
        metrics = {"test_accuracy": accuracy, "epsilon": 1.0, "epsilon_rdp": 1.0, "mu_gdp": 0.3}
        run_id = log_run(client, "tuned", {}, metrics, tags)
        record = {"epsilon": {"rdp": 1.0}, "events": [], "certainty": CERTAINTY}
        client.log_text(run_id, json.dumps(record), PRIVACY_LEDGER)
        ids.append(run_id)
    return uri, parent, ids[1]


def _released(uri: str, run_id: str, tmp_path: Path) -> tuple[dict[str, str], dict[str, object]]:
    client = MlflowClient(uri)
    record = json.loads(Path(client.download_artifacts(run_id, PRIVACY_LEDGER, str(tmp_path))).read_text())
    return client.get_run(run_id).data.tags, record


def test_the_released_ledger_keeps_no_single_run_certainty(tmp_path: Path) -> None:
    uri, parent, best = _sweep(tmp_path, refused=False)
    assert release_best(uri, "tuned", "s1", "test_accuracy", PROCEDURE) == (best, 2)
    tags, record = _released(uri, best, tmp_path)
    assert "certainty" not in record and record["epsilon"] == {"rdp": 2.5}
    assert "epsilon_interval.accountant" not in tags
    assert VOID_TAG not in tags and void_of(uri, parent) is None


def test_a_trial_refused_by_its_sampling_check_voids_the_procedure(tmp_path: Path) -> None:
    uri, parent, best = _sweep(tmp_path, refused=True)
    assert release_best(uri, "tuned", "s1", "test_accuracy", PROCEDURE) == (best, 2)
    tags, _ = _released(uri, best, tmp_path)
    assert tags["dp.release"] == "not-for-release" and "sampling check" in tags[VOID_TAG]
    parent_tags = MlflowClient(uri).get_run(parent).data.tags
    assert parent_tags["dp.release"] == "not-for-release"
    assert void_of(uri, parent) == tags[VOID_TAG]
