"""Two identical sweeps at once (issue 13, item 8): each config is trained once (a job claims its config
under the store's lock), and a report names repeats of one config instead of pooling them as seeds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from dpsweep.analysis.report import build_report

BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_two_identical_sweeps_started_together_train_each_config_once(tmp_path: Path) -> None:
    args = [
        str(BIN / "dpsweep"),
        "-m",
        "train.epochs=1,2,3",
        "train.progress=false",
        "tracking.experiment_name=twin",
        "tracking.log_model=false",
    ]
    logs = [(tmp_path / f"sweep{i}.log").open("w") for i in range(2)]
    sweeps = [subprocess.Popen(args, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    codes = [p.wait(timeout=600) for p in sweeps]
    output = "\n".join((tmp_path / f"sweep{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], output[-4000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("twin")
    assert exp is not None
    jobs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("sweep.role") != "parent"]
    finished = [r.data.tags["config.hash"] for r in jobs if r.info.status == "FINISHED"]
    assert len(finished) == len(set(finished)) == 3, output[-4000:]  # each config once, no duplicate
    assert {r.info.status for r in jobs} == {"FINISHED"}
    skipped = [line for line in output.splitlines() if line.startswith("dpsweep: skip")]
    assert len(skipped) == 3, output[-4000:]  # every config one sweep ran is one the other skipped
    assert all("running now as run" in line or "already" in line for line in skipped), skipped


def test_a_report_names_repeats_of_a_config_instead_of_pooling_them(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("repeats")
    params = {"dataset.name": "digits", "model.name": "cnn", "dp.enabled": "True", "train.seed": "0",
              "dp.noise_multiplier": "1.0", "dp.delta": "1e-05", "dp.accountant": "rdp"}  # fmt: skip
    ids = []
    for accuracy in (0.5, 0.7):  # the same config twice: one repeated, not two seeds
        run = client.create_run(exp, tags={"config.hash": "abc123"})
        for key, value in params.items():
            client.log_param(run.info.run_id, key, value)
        client.log_metric(run.info.run_id, "test_accuracy", accuracy)
        client.log_metric(run.info.run_id, "epsilon", 3.0)
        client.set_terminated(run.info.run_id, "FINISHED")
        ids.append(run.info.run_id)
    report = build_report(uri, "repeats")
    assert report.counts["finished"] == 1 and report.counts["duplicate"] == 1
    [row] = report.table.to_dict("records")
    assert row["runs"] == 1 and row["test_accuracy_mean"] == pytest.approx(0.7)  # the newest run, not a mean of 2
    assert any("repeat the config of run" in w and ids[0][:8] in w for w in report.warnings), report.warnings
