"""The mechanism seam (issue 32): a mechanism defined here alone, in this test file, registers itself
and is planned, priced by ``dpsweep-epsilon``, trained and reported, with no other file changed.

The toy: full-batch DP gradient descent. Every step sums the clipped per-example gradients of the
whole training set and adds N(0, σ²C²); one step per epoch; nothing is sampled. Each step is a
Gaussian mechanism of sensitivity C (add or remove one example), so the run is ``epochs`` Gaussian
mechanisms of noise multiplier σ, composed (Abadi et al. 2016, without the sampling; Mironov 2017 for
their RDP). Its ε is checked against dp-accounting's own accountants on the same events.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from helpers import Composer, runs_of
from mlflow.tracking import MlflowClient
from torch import Tensor

from dpsweep.analysis.report import build_report, render
from dpsweep.cli import epsilon
from dpsweep.config import to_config
from dpsweep.data import users
from dpsweep.data.facts import DatasetFacts
from dpsweep.mechanisms import MECHANISMS, Mechanism, Setting
from dpsweep.mechanisms.base import EngineTable
from dpsweep.mechanisms.functional import FixedOrderBatches, OwnRule, OwnRun, OwnSetup
from dpsweep.models.optimizers import build_optimizer
from dpsweep.plan import prepare
from dpsweep.privacy import ledger
from dpsweep.privacy.ledger import Ledger
from dpsweep.run.runner import train

NAME = "fullbatch_test"
DIGITS = DatasetFacts(1437, (1, 28, 28), 10)


class FullBatchRule(OwnRule):
    """Every unit in one batch per epoch; the noisy clipped sum over N."""

    def setup(self, run: OwnRun) -> OwnSetup:
        x, y, unit = run.data
        whole = FixedOrderBatches(x, y, unit, len(y), 1, run.cfg.train.seed, run.device)
        generator = torch.Generator().manual_seed(run.cfg.train.seed)
        return OwnSetup(build_optimizer(run.cfg.optimizer, run.model), generator, whole, float(len(y)))

    def gradient(self, run: OwnRun, batch: users.UserBatch, expected_units: float) -> dict[str, Tensor]:
        x, y, segment = batch
        n, c = users.segment_count(segment), run.cfg.dp.max_grad_norm
        return users.user_level_gradient(run.model, run.loss_fn, x, y, segment, n, c, run.sigma, expected_units)


class FullBatchGaussian(Mechanism):
    label = "Full-batch DP-GD"
    neighbours = "add_or_remove_one"
    sampled = False
    note = "the whole training set every step, no sampling and no amplification"
    engines_at: ClassVar[EngineTable] = {"example": ("own_steps",)}  # its steps: an OwnRule

    def steps(self, s: Setting) -> int:
        return s.steps if s.steps is not None else s.epochs or 0

    def ledger(self, s: Setting, noise_multiplier: float) -> Ledger:
        event = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(noise_multiplier), self.steps(s))
        params = {"noise_multiplier": noise_multiplier, "steps": self.steps(s)}
        return s.extra + Ledger((ledger.Entry(NAME, event, params, self.note),))

    def own_steps(self) -> Any:
        return FullBatchRule()


@pytest.fixture(scope="module", autouse=True)
def registered() -> Iterator[None]:
    """The toy registered for this module's tests only (other modules list the registry's names)."""
    if NAME not in MECHANISMS:
        MECHANISMS.register(NAME)(FullBatchGaussian())
    yield
    MECHANISMS._entries.pop(NAME, None)


def reference_epsilon(sigma: float, steps: int, delta: float) -> float:
    """dp-accounting's PLD accountant (the default dp.accountant's) on the same composed Gaussian mechanisms."""
    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_event.GaussianDpEvent(sigma), steps)
    return float(accountant.get_epsilon(delta))


def test_the_toy_is_planned_and_calibrated_by_its_own_ledger(make_cfg: Composer) -> None:
    plan = prepare(to_config(make_cfg(f"dp.mechanism={NAME}", "dp.noise_multiplier=20", "train.epochs=5")), DIGITS)
    assert plan.privacy is not None and plan.privacy.sample_rate is None and plan.privacy.steps == 5
    assert plan.privacy.epsilon == pytest.approx(reference_epsilon(20.0, 5, 1e-5), rel=1e-3)
    calibrated = prepare(to_config(make_cfg(f"dp.mechanism={NAME}", "dp.target_epsilon=2", "train.epochs=5")), DIGITS)
    assert calibrated.privacy is not None and calibrated.privacy.calibrated
    sigma = calibrated.privacy.noise_multiplier
    assert calibrated.privacy.epsilon <= 2 < reference_epsilon(0.99 * sigma, 5, 1e-5)


def test_the_toy_is_priced_by_dpsweep_epsilon(capsys: pytest.CaptureFixture[str]) -> None:
    out = epsilon.run(["--mechanism", NAME, "-s", "1437", "-b", "64", "-n", "20", "-e", "5", "--json"])
    assert out["mechanism"] == NAME and out["steps"] == 5 and out["sample_rate"] is None
    assert out["epsilon"] == pytest.approx(reference_epsilon(20.0, 5, 1e-5), rel=1e-3)
    assert out["neighbours"] == "add_or_remove_one"
    capsys.readouterr()
    epsilon.run(["--mechanism", NAME, "-s", "1437", "-b", "64", "-n", "20", "-e", "5"])
    assert capsys.readouterr().out.startswith("Full-batch DP-GD with noise multiplier σ = 20")


def test_the_toy_trains_logs_its_ledger_and_is_reported(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    result = train(make_cfg(f"dp.mechanism={NAME}", "dp.noise_multiplier=20", "train.epochs=3", "optimizer.lr=0.5"))
    assert result.steps == 3 and result.epsilon == pytest.approx(reference_epsilon(20.0, 3, 1e-5), rel=1e-3)
    [run] = runs_of(client, experiment_name)
    assert run.data.tags["dp.mechanism"] == NAME and run.data.tags["dp.neighbours"] == "add_or_remove_one"
    assert run.info.status == "FINISHED" and 0 <= float(run.data.metrics["test_accuracy"]) <= 1
    record = json.loads(Path(client.download_artifacts(run.info.run_id, "privacy_ledger.json")).read_text())
    assert [e["name"] for e in record["events"]] == [NAME] and record["neighbours"] == "add_or_remove_one"
    report = build_report(client.tracking_uri, experiment_name)
    [row] = report.table.to_dict("records")
    assert row["mechanism"] == NAME
    text = render(report, "md")
    assert "Full-batch DP-GD, the whole training set every step, no sampling and no amplification" in text
