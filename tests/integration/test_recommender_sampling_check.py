"""The recommender's DPAM run Poisson-samples users at each step and has no private step to wrap: the
runner checks the users of each step it counted (``DPAMRun.sampled_units``) against Binomial(U, q) of its
ledger, as every Poisson-sampled private run's batches (issue 58, item 3)."""

from __future__ import annotations

import pytest
from helpers import Composer
from mlflow.tracking import MlflowClient

from dpsweep.run.runner import train

DPAM = ["task=recommender", "dataset.num_users=400", "dataset.held_out_users=60", "dataset.items=150",
        "dataset.mean_ratings=15", "train.batch_size=50", "task.method=dpam", "dp.mechanism=dpsgd",
        "dp.noise_multiplier=1", "train.epochs=2"]  # fmt: skip


@pytest.mark.parametrize("method", ["dpam", "sgd"])  # and the joint DP-SGD baseline, which samples alike
def test_a_dpam_run_checks_its_sampled_users_and_passes(
    make_cfg: Composer, client: MlflowClient, capfd: pytest.CaptureFixture[str], method: str
) -> None:
    run = client.get_run(train(make_cfg(*DPAM, f"task.method={method}")).run_id)
    assert run.data.tags["sampling.check"] == "passed", run.data.tags.get("sampling.check")
    assert run.data.tags["sampling.test"] in ("count", "dispersion")
    assert run.data.metrics["sampling_p_value"] > 1e-3, run.data.metrics
    assert "sampling_statistic" in run.data.metrics
    assert "sampling.refused" not in run.data.tags
    assert "sampling refused" not in capfd.readouterr().err
