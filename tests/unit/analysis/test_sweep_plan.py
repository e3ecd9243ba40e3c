"""``dpsweep.analysis.sweep_plan``: a sweep's jobs planned before it runs, called with typed configs (what
``dpsweep-plan`` composes from its command line): the run plans, why ``dpsweep -m`` would skip each job
(from a real sqlite store) and each DP job's attack risk, once per distinct ledger."""

from __future__ import annotations

from pathlib import Path

from helpers import Composer
from mlflow.tracking import MlflowClient

from dpsweep.analysis.sweep_plan import plan_jobs, risk_figures, skip_reasons, store_readable
from dpsweep.config import to_config
from dpsweep.privacy import certainty

# job 1 repeats job 0; job 3 trains without DP
SWEEP = (("dp.noise_multiplier=0.8",), ("dp.noise_multiplier=0.8",), ("dp.noise_multiplier=1.6",), ("dp=off",))


def test_jobs_are_planned_marked_and_priced(make_cfg: Composer, mlflow_uri: str, experiment_name: str) -> None:
    plans, notes = plan_jobs([to_config(make_cfg(*job)) for job in SWEEP])
    assert [p.config.dp.enabled for p in plans] == [True, True, True, False] and notes == []
    told: list[str] = []
    assert skip_reasons(plans, note=told.append) == [None, "same config as job 0", None, None] and not told
    client = MlflowClient(mlflow_uri)
    run = client.create_run(client.create_experiment(experiment_name)).info.run_id
    client.set_tag(run, "config.hash", plans[2].config_hash)
    client.set_terminated(run, "FINISHED")
    reasons = skip_reasons(plans, note=told.append)
    assert reasons[:2] == [None, "same config as job 0"] and reasons[2] is not None and reasons[3] is None
    assert "FINISHED" in reasons[2] and not told
    risks = risk_figures(plans)
    assert risks[3] is None and risks[0] is risks[1] and risks[0] != risks[2]  # one computation per ledger
    assert plans[0].privacy is not None and risks[0] is not None
    assert risks[0].mu_gdp == certainty.mu_gdp(plans[0].privacy.ledger)


def test_an_unreadable_store_is_told_and_a_missing_one_is_not_created(make_cfg: Composer, tmp_path: Path) -> None:
    missing, garbage = tmp_path / "none.db", tmp_path / "garbage.db"
    garbage.write_text("not a database")
    assert not store_readable(f"sqlite:///{missing}") and store_readable(f"sqlite:///{garbage}")
    assert store_readable("http://127.0.0.1:5000")
    for db in (missing, garbage):
        plans, _ = plan_jobs([to_config(make_cfg("dp.noise_multiplier=0.8", f"tracking.uri=sqlite:///{db}"))])
        told: list[str] = []
        assert skip_reasons(plans, note=told.append) == [None]
        assert told == ([] if db == missing else [f"could not read sqlite:///{db} (DatabaseError); FINISHED configs "
                                                  "are not marked"])  # fmt: skip
    assert not missing.exists()
