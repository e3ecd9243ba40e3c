"""``dpsweep-report`` flags rows whose score is unstable across seeds (issue 56, item 9e): a non-private
baseline at B = 32 of 82.50 ± 8.25 was shown without a word. Runs are logged with the MLflow client into
this session's sqlite store; what the report says is checked against statistics of the logged scores."""

from __future__ import annotations

import io
import statistics

import pandas as pd
import pytest
from helpers import log_run
from mlflow.tracking import MlflowClient

from dpsweep.analysis import report
from dpsweep.analysis.report.table import SPREAD_LIMIT, config_labels
from dpsweep.cli.report import run

DP = {
    "dataset.name": "digits", "model.name": "cnn", "dp.enabled": "True", "train.batch_size": "32",
    "dp.noise_multiplier": "1.0", "dp.max_grad_norm": "1.0", "dp.delta": "1e-05", "dp.accountant": "rdp",
    "optimizer.lr": "0.05", "train.epochs": "2", "train.seed": "0",
}  # fmt: skip
OFF = {k: v for k, v in DP.items() if not k.startswith("dp.")} | {"dp.enabled": "False"}
SCORES = {  # σ ("off": the baseline) -> test accuracy of each seed
    "off": [0.90, 0.72, 0.88, 0.80],  # 82.50 ± 8.23: unstable
    "1.0": [0.80, 0.81, 0.805],  # stable
    "2.0": [0.50, 0.70],  # unstable
    "4.0": [0.30],  # one run: no spread
}


def _row(table: pd.DataFrame, sigma: str) -> pd.Series:
    if sigma == "off":
        return table[~table["private"]].iloc[0]
    return table[table["noise_multiplier"] == float(sigma)].iloc[0]


def test_rows_unstable_across_seeds_are_flagged_private_or_not_with_why(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, capsys: pytest.CaptureFixture[str]
) -> None:
    for sigma, scores in SCORES.items():
        for seed, score in enumerate(scores):
            params = (OFF if sigma == "off" else DP | {"dp.noise_multiplier": sigma}) | {"train.seed": str(seed)}
            log_run(
                client, experiment_name, params, {"test_accuracy": score} | ({} if sigma == "off" else {"epsilon": 3.0})
            )
    r = report.build_report(mlflow_uri, experiment_name)
    labels = config_labels(r.table)
    notes = "\n".join(r.notes())
    for sigma, scores in SCORES.items():
        row = _row(r.table, sigma)
        flagged = len(scores) > 1 and statistics.stdev(scores) > SPREAD_LIMIT * statistics.mean(scores)
        assert bool(row["unstable"]) == flagged == (sigma in ("off", "2.0")), sigma
        label = labels[row["config_id"]]
        if not flagged:
            assert f"{label}: unstable" not in notes, notes
            continue
        mean, std = statistics.mean(scores), statistics.stdev(scores)
        why = (
            f"{label}: unstable across seeds: the spread (± {100 * std:.2f}) is {std / mean:.0%} of the mean "
            f"({100 * mean:.2f}); a row is flagged above {SPREAD_LIMIT:.0%} (sample std over mean)"
        )
        assert why in notes, notes
        assert ("or a drop against it" in notes.split(why)[1].split("\n")[0]) == (sigma == "off"), notes
        for run_id in row["run_ids"]:
            assert run_id[:8] in notes.split(why)[1].split("\n")[0]
    for fmt in ("md", "html", "tex"):  # under the table in every format
        assert f"{labels[_row(r.table, 'off')['config_id']]}: unstable across seeds" in report.render(r, fmt)
    csv = pd.read_csv(io.StringIO(report.render(r, "csv")))
    assert sorted(csv["unstable"]) == sorted(bool(_row(r.table, s)["unstable"]) for s in SCORES)
    run(["--experiment", experiment_name, "--tracking-uri", mlflow_uri, "--format", "csv"])
    assert "unstable across seeds" in capsys.readouterr().err  # CSV: the notes on stderr


def test_a_table_without_unstable_rows_has_no_flag_column_in_csv(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """The CSV is as before where no row is flagged; the frame says False for every row."""
    for seed, score in enumerate(SCORES["1.0"]):
        log_run(client, experiment_name, DP | {"train.seed": str(seed)}, {"test_accuracy": score, "epsilon": 3.0})
    r = report.build_report(mlflow_uri, experiment_name)
    assert list(r.table["unstable"]) == [False]
    assert "unstable" not in pd.read_csv(io.StringIO(report.render(r, "csv"))).columns
