"""``dpsweep-report`` of task=recommender runs (issue 56, item 9): a ``method`` column that tells DPALS
from DPAM (both ``recommender`` rows), each method's private row against its own non-private row, and a
calibrated σ shown in 4 significant digits, rounded up, in the table and the rows' labels.

Four real runs on the planted ratings set (one round each, a small set) are trained once for the module
into their own store: ALS and DPAM without DP, and DPALS and DPAM with σ calibrated for ε <= 3.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass

import pandas as pd
import pytest
from helpers import markdown_rows, row_of_run, trained_store
from mlflow.tracking import MlflowClient

from dpsweep.analysis import report
from dpsweep.analysis.report.table import config_labels

TRAINED = pytest.mark.xdist_group("report_methods")  # one worker trains the module's runs
EXPERIMENT = "methods"
COMMON = [
    "task=recommender", "dataset.num_users=400", "dataset.held_out_users=60", "dataset.items=150",
    "dataset.mean_ratings=15", "train.epochs=1", "train.progress=false", "tracking.log_model=false",
]  # fmt: skip
DPAM = ["task.method=dpam", "dp.mechanism=dpsgd", "train.batch_size=100", "dp.max_grad_norm=0.1"]
RUNS = {  # (method, private) -> overrides
    ("als", False): ["dp=off", "train.batch_size=400"],
    ("als", True): ["dp.target_epsilon=3", "train.batch_size=400"],
    ("dpam", False): ["dp=off", *DPAM],
    ("dpam", True): ["dp.target_epsilon=3", *DPAM],
}


@dataclass(frozen=True)
class Store:
    uri: str
    run_ids: dict[tuple[str, bool], str]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    cwd = tmp_path_factory.mktemp("report-methods")
    uri, ids = trained_store(cwd, EXPERIMENT, COMMON, RUNS)
    return Store(uri, ids)


def _params(uri: str, run_id: str) -> dict[str, str]:
    return MlflowClient(uri).get_run(run_id).data.params


@pytest.mark.slow
@TRAINED
def test_each_row_shows_its_method_and_is_compared_with_the_same_methods_baseline(store: Store) -> None:
    r = report.build_report(store.uri, EXPERIMENT)
    assert len(r.table) == 4
    by_config = r.table.set_index("config_id")
    for (method, private), run_id in store.run_ids.items():
        row = row_of_run(r.table, run_id)
        assert row["method"] == _params(store.uri, run_id)["task.method"] == method
        if private:  # DPALS against non-private ALS, DPAM against non-private DPAM
            assert by_config.loc[row["baseline_config_id"], "method"] == method
    md = markdown_rows(report.render(r, "md"))
    assert sorted((c["method"], c["accountant"] != "non-private") for c in md) == sorted(store.run_ids)
    assert all(c["model"] == "recommender" for c in md)
    csv = pd.read_csv(io.StringIO(report.render(r, "csv")))
    assert sorted(csv["method"]) == sorted(m for m, _ in store.run_ids)
    assert "method" in report.render(r, "tex") and "<th>method</th>" in report.render(r, "html")


@pytest.mark.slow
@TRAINED
def test_a_calibrated_sigma_shows_four_digits_rounded_up_in_the_table_and_the_labels(store: Store) -> None:
    r = report.build_report(store.uri, EXPERIMENT)
    md = markdown_rows(report.render(r, "md"))  # in the table's order
    labels = config_labels(r.table)
    for method in ("als", "dpam"):
        run_id = store.run_ids[(method, True)]
        sigma = float(_params(store.uri, run_id)["dp.noise_multiplier"])  # calibrated: a float's digits
        assert len(repr(sigma)) > 6
        row = row_of_run(r.table, run_id)
        cell = md[int(row.name)]["σ"]
        assert len(cell.replace(".", "").lstrip("0")) <= 4, cell
        assert sigma <= float(cell) <= sigma * 1.001, (sigma, cell)
        shown = re.search(r"σ=(\S+)", str(labels[row["config_id"]]))
        assert shown is not None and shown.group(1) == cell, labels  # the same σ in the labels of notes and plots
    back = pd.read_csv(io.StringIO(report.render(r, "csv")), float_precision="round_trip")
    logged = [float(_params(store.uri, store.run_ids[(m, True)])["dp.noise_multiplier"]) for m in ("als", "dpam")]
    assert sorted(back[back["private"]]["noise_multiplier"]) == sorted(logged)  # CSV: the numbers whole
