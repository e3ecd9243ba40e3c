"""A toy engine from test files alone (issue 57, done-when): an engine registered here with its step builder
(``Engine.steps``), a mechanism that declares it and the classifier taking it; a short digits run trains
through the builder and logs the ε of what ran, with no line of dpsweep naming the engine."""

from __future__ import annotations

from typing import ClassVar

import pytest
from helpers import Composer
from mlflow.tracking import MlflowClient

from dpsweep.config import ClassifierTaskConfig, to_config
from dpsweep.data.facts import DatasetFacts
from dpsweep.mechanisms import MECHANISMS
from dpsweep.mechanisms.base import EngineTable
from dpsweep.mechanisms.dpsgd import DPSGD
from dpsweep.mechanisms.engines import ENGINES, Engine
from dpsweep.plan import prepare
from dpsweep.run.runner import train
from dpsweep.tasks import Checkpointed
from dpsweep.tasks.classifier.task import ClassifierRun

DIGITS = DatasetFacts(1437, (1, 28, 28), 10)
BUILT: list[str] = []  # the runs whose step the toy builder built


def toy_step(run: ClassifierRun) -> Checkpointed:
    """The toy engine's classifier step: DP-SGD's Poisson loader and noise (so that DP-SGD's ledger is sound),
    recorded as built here."""
    BUILT.append(run.cfg.tracking.run_name or "")
    return run.start_loader()


class ToySGD(DPSGD):
    """DP-SGD, its example-level steps taken by the toy engine."""

    engines_at: ClassVar[EngineTable] = {"example": ("toy",)}


@pytest.fixture()
def toy_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ENGINES._entries, "toy", Engine("toy", "a toy engine", units=("example",), steps=toy_step))
    monkeypatch.setitem(MECHANISMS._entries, "toysgd", ToySGD())
    monkeypatch.setattr(ClassifierTaskConfig, "engines", (*ClassifierTaskConfig.engines, "toy"))
    BUILT.clear()


@pytest.mark.usefixtures("toy_engine")
def test_a_toy_engine_registered_from_a_test_trains_a_run_end_to_end(make_cfg: Composer, client: MlflowClient) -> None:
    overrides = ["dp.mechanism=toysgd", "train.epochs=1", "dp.noise_multiplier=1.5", "tracking.run_name=toy"]
    ran = train(make_cfg(*overrides))
    assert BUILT == ["toy"]  # its builder built the run's step: not Opacus's by default
    run = client.get_run(ran.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["dp.engine"] == "toy"
    plan = prepare(to_config(make_cfg(*overrides)), DIGITS)
    assert plan.privacy is not None and ran.steps == plan.steps
    assert run.data.metrics["epsilon"] == pytest.approx(plan.privacy.epsilon, rel=1e-9)
    assert 0 <= run.data.metrics["test_accuracy"] <= 1
