"""``dpsweep-report --risk`` (issue 58, items 1 and 2): the ε interval, μ-GDP and the TPR at 1 % FPR of
each row, read from the metrics a DP run logs (epsilon_lower, mu_gdp, tpr_at_1pct), a dash for runs from
before them; and a private tuning's ε named with the analysis that gave it (tag tuning.analysis; runs
from before the tag: papernot_steinke). Runs are logged with the MLflow client into this session's
sqlite store; the cells are checked against the logged figures."""

from __future__ import annotations

import io
import math

import pandas as pd
import pytest
from helpers import log_run
from mlflow.tracking import MlflowClient

from dpsweep.analysis import report
from dpsweep.cli.report import run
from dpsweep.privacy.tuning import ANALYSES

DP = {
    "dataset.name": "digits", "model.name": "cnn", "dp.enabled": "True", "train.batch_size": "240",
    "dp.noise_multiplier": "1.1", "dp.max_grad_norm": "1.0", "dp.delta": "1e-05", "dp.accountant": "pld",
    "optimizer.lr": "0.05", "train.epochs": "60", "train.seed": "0",
}  # fmt: skip
OFF = {k: v for k, v in DP.items() if not k.startswith("dp.")} | {"dp.enabled": "False"}
# σ = 1.1: two seeds with the risk metrics (the MNIST preset's interval, issue 58); σ = 2: a run from before them
SEEDS = [
    {"test_accuracy": 0.80, "epsilon": 2.2955, "epsilon_lower": 2.2861, "mu_gdp": 0.581, "tpr_at_1pct": 0.0312},
    {"test_accuracy": 0.81, "epsilon": 2.2955, "epsilon_lower": 2.2854, "mu_gdp": 0.5834, "tpr_at_1pct": 0.0315},
]
OLD = {"test_accuracy": 0.7, "epsilon": 1.0}
HEADERS = ("ε interval", "μ", "TPR@1% (%)")


def _md_cells(text: str) -> dict[str, dict[str, str]]:
    """σ cell -> {header: cell} of a markdown table."""
    lines = [x for x in text.splitlines() if x.startswith("|")]
    rows = [[c.strip() for c in x.strip().strip("|").split("|")] for x in lines]
    header = rows[0]
    return {row[header.index("σ")]: dict(zip(header, row, strict=True)) for row in rows[2:]}


def _digits(value: float, places: int, up: bool) -> str:
    """``value`` to ``places`` decimals, rounded up or down (the test's own rounding)."""
    scaled = value * 10**places
    return f"{(math.ceil(scaled) if up else math.floor(scaled)) / 10**places:.{places}f}"


def test_risk_columns_show_the_logged_interval_mu_and_tpr_and_a_dash_for_older_runs(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, capsys: pytest.CaptureFixture[str]
) -> None:
    log_run(client, experiment_name, OFF, {"test_accuracy": 0.9})
    for seed, metrics in enumerate(SEEDS):
        log_run(client, experiment_name, DP | {"train.seed": str(seed)}, metrics)
    log_run(client, experiment_name, DP | {"dp.noise_multiplier": "2.0"}, OLD)
    built = report.build_report(mlflow_uri, experiment_name, risk=True)
    row = built.table[built.table["noise_multiplier"] == 1.1].iloc[0]
    # a row's figures are its runs' worst: the least lower end, the largest μ and TPR
    assert row["epsilon_lower"] == min(m["epsilon_lower"] for m in SEEDS)
    assert row["mu_gdp"] == max(m["mu_gdp"] for m in SEEDS)
    assert row["tpr_at_1pct"] == max(m["tpr_at_1pct"] for m in SEEDS)
    cells = _md_cells(report.render(built, "md"))
    lower, upper = min(m["epsilon_lower"] for m in SEEDS), SEEDS[0]["epsilon"]
    assert cells["1.1"]["ε interval"] == f"{_digits(lower, 3, up=False)} .. {_digits(upper, 3, up=True)}"
    assert cells["1.1"]["μ"] == _digits(max(m["mu_gdp"] for m in SEEDS), 3, up=True)  # 0.5834 -> 0.584: up
    assert cells["1.1"]["TPR@1% (%)"] == f"{100 * max(m['tpr_at_1pct'] for m in SEEDS):.2f}"
    for sigma in ("2", "—"):  # a run from before the metrics, and the non-private baseline
        assert [cells[sigma][h] for h in HEADERS] == ["—"] * 3, cells[sigma]
    assert any("ε interval: a sound lower bound" in n for n in built.notes())
    csv = pd.read_csv(io.StringIO(report.render(built, "csv")))
    private = csv[csv["noise_multiplier"] == 1.1].iloc[0]
    assert (private["epsilon_lower"], private["mu_gdp"]) == (lower, max(m["mu_gdp"] for m in SEEDS))
    assert csv[csv["noise_multiplier"] == 2.0]["tpr_at_1pct"].isna().all()
    tex = report.render(built, "tex")
    assert r"$\varepsilon$ interval" in tex and r"TPR@1\% (\%)" in tex
    # off by default: the table is as it was
    plain = report.build_report(mlflow_uri, experiment_name)
    assert not any(h in report.render(plain, "md") for h in HEADERS)
    assert "epsilon_lower" not in report.render(plain, "csv")
    run(["--experiment", experiment_name, "--tracking-uri", mlflow_uri, "--risk"])
    out = capsys.readouterr().out
    assert _md_cells(out)["1.1"]["ε interval"] == cells["1.1"]["ε interval"]


@pytest.mark.parametrize("analysis", ["mixture", None])  # None: a run from before the tag
def test_a_private_tunings_epsilon_names_the_analysis_that_gave_it(
    mlflow_uri: str, experiment_name: str, client: MlflowClient, analysis: str | None
) -> None:
    tags = {"tuning.released": "true", "tuning.accountant": "rdp"}
    tags |= {"tuning.analysis": analysis} if analysis else {}
    metrics = SEEDS[0] | {"epsilon": 4.1, "epsilon_single_run": 3.0, "epsilon_tuning": 4.1}
    log_run(client, experiment_name, DP | {"train.seed": "7"}, metrics, tags)
    built = report.build_report(mlflow_uri, experiment_name, risk=True)
    named = analysis or "papernot_steinke"
    expected = f"by the {named} analysis ({ANALYSES[named]})"
    assert list(built.table["tuning_analysis"]) == [named]
    assert expected in "\n".join(built.notes())
    assert expected.replace("&", r"\&").replace("_", r"\_") in report.render(built, "tex")  # the caption
    # a trial's certainty figures are one run's, not the procedure's: not shown beside the procedure's ε
    assert [_md_cells(report.render(built, "md"))["1.1"][h] for h in HEADERS] == ["—"] * 3
