"""``sweep.tuning_analysis``: the key that chooses the analysis of a private tuning's ε, checked, passed to
:func:`dpsweep.privacy.tuning.procedure` by the plan, printed by ``dpsweep-plan``, and tagged on the released
trial and the parent by the release, whose single-run certainty figures become NaN (issue 58, item 4).

A real sqlite store in ``tmp_path`` for the release."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import fresh_store, log_run, run_main
from hydra import compose, initialize_config_module
from mlflow.tracking import MlflowClient

from dpsweep.cli.plan import main
from dpsweep.config import ConfigError, to_config, validate
from dpsweep.data.facts import DatasetFacts
from dpsweep.plan import prepare, tuning_procedure
from dpsweep.privacy import tuning
from dpsweep.tracking import PRIVACY_LEDGER
from dpsweep.tracking.sweeps import release_best

DIGITS = DatasetFacts(1437, (1, 28, 28), 10)
GRID = ["sweep.private_tuning=true", "sweep.tuning_mean_trials=4", "train.epochs=2"]


def test_an_unknown_analysis_is_refused_naming_the_key_and_the_analyses() -> None:
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        cfg = to_config(compose("config", overrides=["sweep.tuning_analysis=koskela"]))
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    text = str(err.value)
    assert err.value.key == "sweep.tuning_analysis" and "koskela" in text
    assert all(name in text for name in tuning.ANALYSES), text


def test_the_mixture_prices_candidates_of_different_cost_below_papernot_steinke() -> None:
    costs = {}
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        for analysis in tuning.ANALYSES:
            typed = [
                to_config(compose("config", overrides=[*GRID, f"dp.noise_multiplier={sigma}",
                                                       f"sweep.tuning_analysis={analysis}"]))
                for sigma in (0.8, 1.6)
            ]  # fmt: skip
            costs[analysis] = tuning_procedure([prepare(cfg, DIGITS) for cfg in typed], typed[0].sweep)
    assert costs["mixture"].analysis == "mixture" and costs["papernot_steinke"].analysis == "papernot_steinke"
    assert costs["mixture"].epsilon < costs["papernot_steinke"].epsilon
    assert costs["mixture"].single_run_epsilon == costs["papernot_steinke"].single_run_epsilon


@pytest.mark.parametrize("analysis", list(tuning.ANALYSES))
def test_dpsweep_plan_prints_the_analysis_and_its_reference(analysis: str) -> None:
    done = run_main(main, *GRID, "dp.noise_multiplier=0.8,1.6", f"sweep.tuning_analysis={analysis}")
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("private tuning:"))
    assert f"analysis: sweep.tuning_analysis={analysis}, {tuning.ANALYSES[analysis]}" in line, line


def test_crossing_costs_are_refused_by_papernot_steinke_and_priced_by_the_mixture() -> None:
    crossing = [*GRID, "train.batch_size=16,512"]
    refused = run_main(main, *crossing)
    assert refused.returncode == 2 and "sweep.private_tuning=True is invalid" in refused.stderr
    priced = run_main(main, *crossing, "sweep.tuning_analysis=mixture")
    assert priced.returncode == 0 and "sweep.tuning_analysis=mixture" in priced.stdout, priced.stderr


FIGURES = {"epsilon_lower": 0.9, "mu_gdp": 0.3, "gdp_delta_allowance": 2e-12, "tpr_at_1pct": 0.02,
           "tpr_at_10pct": 0.15, "mia_advantage": 0.1}  # fmt: skip


def test_the_release_tags_the_analysis_and_voids_the_single_runs_certainty(tmp_path: Path) -> None:
    uri, _ = fresh_store(tmp_path, "tuned")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tuned")
    assert exp is not None
    parent = client.create_run(exp.experiment_id, tags={"sweep.role": "parent"}).info.run_id
    run_ids = []
    for accuracy, figures in ((0.8, FIGURES), (0.9, FIGURES), (0.95, {})):  # the last: a run from before them
        metrics = {"test_accuracy": accuracy, "epsilon": 1.0, "epsilon_rdp": 1.0, **figures}
        run_id = log_run(client, "tuned", {}, metrics, {"sweep.id": "s1", "sweep.parent_run_id": parent})
        client.log_text(run_id, json.dumps({"epsilon": {"rdp": 1.0}, "events": []}), PRIVACY_LEDGER)
        run_ids.append(run_id)
    procedure = {"epsilon": 2.5, "accountant": "rdp", "distribution": "poisson", "mean_trials": 3.0,
                 "selection": "the best", "reference": tuning.ANALYSES["mixture"], "analysis": "mixture"}  # fmt: skip
    best, _ = release_best(uri, "tuned", "s1", "test_accuracy", procedure)
    assert best == run_ids[2]
    released = client.get_run(run_ids[2]).data
    assert (
        released.tags["tuning.analysis"] == "mixture"
        and client.get_run(parent).data.tags["tuning.analysis"] == "mixture"
    )
    assert not set(FIGURES) & set(released.metrics)  # a run from before the figures gains none
    assert client.get_run(run_ids[0]).data.tags["tuning.analysis"] == "mixture"
    # the same sweep with the better trial one that logged the figures: each becomes NaN on it alone
    client.log_metric(run_ids[1], "test_accuracy", 0.99, step=2)
    best, _ = release_best(uri, "tuned", "s1", "test_accuracy", {**procedure, "analysis": "papernot_steinke"})
    assert best == run_ids[1]
    metrics = client.get_run(run_ids[1]).data.metrics
    assert all(math.isnan(metrics[name]) for name in FIGURES), metrics
    assert client.get_run(run_ids[0]).data.metrics["mu_gdp"] == FIGURES["mu_gdp"]  # a trial not released keeps its own
    assert client.get_run(run_ids[1]).data.tags["tuning.analysis"] == "papernot_steinke"
