"""Issue 58, items 1 and 2, a run's figures: every DP run ends with the sound interval around its PLD ε, its
μ-GDP and a membership-inference attacker's risk (dpsweep.privacy.certainty), logged at its last epoch, kept
on its TrainResult, in its privacy_ledger.json and, the interval, on its result line. Real runs on digits,
tracked into a sqlite store; the figures are checked against the certainty module's on the plan's ledger."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from helpers import Composer, runs_of, train_interrupted
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from dpsweep.cli.lines import summary_line
from dpsweep.config import to_config
from dpsweep.data.facts import DatasetFacts
from dpsweep.plan import prepare
from dpsweep.privacy import certainty, ledger
from dpsweep.run.runner import TrainResult, train
from dpsweep.tasks.classifier.task import ClassifierRun

FIGURES = ("epsilon_lower", "mu_gdp", "gdp_delta_allowance", "tpr_at_1pct", "tpr_at_10pct", "mia_advantage")
STEPS_PER_EPOCH = 23  # digits: ceil(1437 / 64)


def _planned(cfg: DictConfig) -> ledger.Ledger:
    """The ledger the plan of a digits run (N = 1437, B = 64) assumes for all its epochs: its σ and q, every step."""
    config = to_config(cfg)
    privacy = prepare(config, DatasetFacts(1437, (1, 28, 28), 10)).privacy
    assert privacy is not None and privacy.sample_rate is not None
    steps = config.train.epochs * STEPS_PER_EPOCH
    return ledger.Ledger((ledger.dpsgd(privacy.noise_multiplier, privacy.sample_rate, steps),))


def test_a_dp_run_logs_its_epsilon_interval_mu_and_attack_risk_and_its_line_shows_the_interval(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, tmp_path: Path
) -> None:
    cfg = make_cfg("train.epochs=1")
    result = train(cfg)
    [run] = runs_of(client, experiment_name)
    m = run.data.metrics
    assert set(FIGURES) <= set(m), sorted(m)
    for name in FIGURES:  # once, at the run's end: step = the final epoch
        assert [x.step for x in client.get_metric_history(run.info.run_id, name)] == [1], name
    upper = m["epsilon_pld"]
    assert 0 < m["epsilon_lower"] <= upper == result.epsilon and (upper - m["epsilon_lower"]) / upper < 0.01
    assert 0 < m["mu_gdp"] < math.inf and 0 < m["gdp_delta_allowance"] < 1e-9
    assert 0.01 < m["tpr_at_1pct"] < m["tpr_at_10pct"] < 1 and 0 < m["mia_advantage"] < 1
    # the same figures as the certainty module's on the ledger the plan assumes (one epoch)
    planned = _planned(cfg)
    found = certainty.profile(planned)
    assert m["epsilon_lower"] == certainty.epsilon_interval(planned, 1e-5).lower == result.epsilon_lower
    assert m["mu_gdp"] == certainty.mu_gdp(planned, found=found) == result.mu_gdp
    risk = certainty.attack_risk(planned, found=found)
    assert result.attack_risk == risk and m["tpr_at_1pct"] == risk["tpr_at_1pct"]
    assert m["mia_advantage"] == risk["advantage"] and result.gdp_delta_allowance == m["gdp_delta_allowance"]
    assert run.data.tags["epsilon_interval.accountant"] == "pld"

    line = summary_line(to_config(cfg), result)
    lower = math.floor(m["epsilon_lower"] * 1000) / 1000
    assert f"ε={upper:.3f} ∈ [{lower:.3f}, {upper:.3f}] (pld, δ=1e-05, " in line, line
    assert "width" not in line, line  # narrower than 1 %: no width

    path = Path(client.download_artifacts(run.info.run_id, "privacy_ledger.json", str(tmp_path)))
    record = json.loads(path.read_text())["certainty"]
    assert record["epsilon_interval"] == {"lower": m["epsilon_lower"], "upper": upper, "accountant": "pld"}
    assert record["mu_gdp"] == m["mu_gdp"] and record["attack_risk"] == risk


def test_under_another_accountant_the_interval_is_the_plds_beside_its_figure(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    cfg = make_cfg("train.epochs=1", "dp.accountant=rdp")
    result = train(cfg)
    [run] = runs_of(client, experiment_name)
    assert run.data.tags["epsilon_interval.accountant"] == "pld"
    assert result.epsilon == result.epsilons["rdp"]
    assert run.data.metrics["epsilon_lower"] <= result.epsilons["pld"] <= result.epsilon
    line = summary_line(to_config(cfg), result)
    pld = result.epsilons["pld"]
    assert f"ε={result.epsilon:.3f} (rdp, δ=1e-05, " in line, line  # the RDP ε is no end of the interval
    assert f"; pld {pld:.3f} ∈ [" in line and f", {pld:.3f}], prv " in line, line


def test_a_resumed_runs_figures_cover_its_whole_ledger(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, tmp_path: Path
) -> None:
    """Interrupted in its second epoch and resumed: the figures are those of both epochs' steps."""
    cfg = make_cfg(f"train.checkpoint_dir={tmp_path / 'ckpt'}")  # FAST: two epochs
    train_interrupted(cfg, ClassifierRun, 2)
    resumed = train(cfg)
    [run] = runs_of(client, experiment_name)
    assert run.info.run_id == resumed.run_id and run.data.tags["resume.count"] == "1"
    whole = _planned(cfg)
    assert run.data.metrics["mu_gdp"] == certainty.mu_gdp(whole) == resumed.mu_gdp
    assert run.data.metrics["epsilon_lower"] == certainty.epsilon_interval(whole, 1e-5).lower
    assert resumed.attack_risk == certainty.attack_risk(whole)


def test_the_result_line_prints_the_intervals_width_where_it_exceeds_one_percent(make_cfg: Composer) -> None:
    """The lower end from a coarse grid (issue 58: "print the width where it exceeds 1 %"); the line's lower
    end is rounded down, so that the interval shown still holds the true ε."""
    config = to_config(make_cfg())
    wide = TrainResult("0" * 32, 0.9, math.nan, 1437, 46, epsilon=2.0, epsilons={"pld": 2.0}, epsilon_lower=1.94379)
    assert "ε=2.000 ∈ [1.943, 2.000] width 2.8 % (pld, " in summary_line(config, wide)
    narrow = dataclasses.replace(wide, epsilon_lower=1.99)
    assert "ε=2.000 ∈ [1.990, 2.000] (pld, " in summary_line(config, narrow)


def test_a_run_calibrated_to_an_attack_risk_says_so_and_stays_within_it(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, tmp_path: Path
) -> None:
    """``dp.target_tpr_at_1pct``: the start line and the run's tags say what σ was calibrated to, and the
    run's logged TPR at 1 % FPR is within the target."""
    from dpsweep.cli.lines import start_line

    cfg = make_cfg("train.epochs=1", "dp.target_tpr_at_1pct=0.1")
    assert "σ for TPR@1%<=0.1" in start_line(cfg, str(tmp_path))
    result = train(cfg)
    [run] = runs_of(client, experiment_name)
    assert run.data.tags["dp.noise_multiplier_calibrated_to"] == "TPR at 1 % FPR <= 0.1"
    assert float(run.data.tags["dp.noise_multiplier_calibrated"]) == result.noise_multiplier != 1.0
    assert 0.09 < run.data.metrics["tpr_at_1pct"] <= 0.1
