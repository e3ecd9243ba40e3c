"""``dpsweep.analysis.report.publish.log_on_parent``: a report's files logged on its sweep's parent run in a
real sqlite store, and what it says where there is no sweep, no parent run, or a store that refuses them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from dpsweep.analysis.report import Report
from dpsweep.analysis.report.publish import ARTIFACT_DIR, ParentLog, log_on_parent
from dpsweep.cli import report


def _report(uri: str, sweep_id: str | None, parent_run_id: str | None) -> Report:
    return Report(uri, "demo", sweep_id, pd.DataFrame(), pd.DataFrame(), {}, parent_run_id=parent_run_id)


def test_the_files_go_on_the_parent_run_and_what_happened_is_returned(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("demo", artifact_location=(tmp_path / "mlruns").as_uri())
    parent = client.create_run(experiment).info.run_id
    paths = [tmp_path / "report.md", tmp_path / "pareto.png"]
    for path in paths:
        path.write_text(path.name)
    assert log_on_parent(_report(uri, "s1", parent), paths) == ParentLog("s1", parent, files=2)
    logged = {a.path for a in client.list_artifacts(parent, ARTIFACT_DIR)}
    assert logged == {f"{ARTIFACT_DIR}/report.md", f"{ARTIFACT_DIR}/pareto.png"}
    assert log_on_parent(_report(uri, None, None), paths) is None  # no sweep: nothing to log on
    assert log_on_parent(_report(uri, "s1", None), paths) == ParentLog("s1", None)
    refused = log_on_parent(_report(uri, "s1", "0" * 32), paths)  # a run the store does not hold
    assert refused is not None and refused.run_id == "0" * 32 and refused.files == 0
    assert refused.error is not None and "0" * 32 in refused.error


def test_dpsweep_report_says_what_happened_in_its_own_words(capsys: pytest.CaptureFixture[str]) -> None:
    """The lines ``dpsweep-report`` prints for each outcome, word for word as before the logging moved."""
    cases = [
        (None, ""),
        (ParentLog("s1", None), "dpsweep-report: sweep s1 has no parent run; the files are only on disk\n"),
        (ParentLog("s1", "r9", error="boom"), "dpsweep-report: warning: could not log the files on run r9: boom\n"),
        (ParentLog("s1", "r9", files=3), "dpsweep-report: logged 3 files on the parent run r9 under report/\n"),
    ]
    for done, said in cases:
        report._say_parent_log(done)
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", said)
