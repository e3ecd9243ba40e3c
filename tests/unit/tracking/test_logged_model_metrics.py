"""A run's model carries its objective and ε, each with its dataset split, and a name that says what it is
(issue 56, item 3), against a real MLflow sqlite store."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import runs_of
from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from dpsweep.config import TrackingConfig
from dpsweep.tracking import tracked_run
from dpsweep.tracking.store import log_model

PRIVATE = {"task.name": "classifier", "dataset.name": "digits", "model.name": "cnn", "dp.enabled": True,
           "dp.mechanism": "dpsgd"}  # fmt: skip
EXAMPLE = np.zeros((1, 4), dtype=np.float32)
PROCEDURE = {"epsilon": 2.5, "accountant": "rdp", "distribution": "poisson", "mean_trials": 3.0,
             "selection": "the best", "reference": "Papernot & Steinke 2022"}  # fmt: skip


def _cfg(uri: str, experiment: str) -> TrackingConfig:
    """Without warming the model's imports in the tracking process (``log_model=False``: it warms them in a
    thread as the run begins), which would race the import of torch that unpickling this test's model
    starts there at once; a real run logs its model after training."""
    return TrackingConfig(uri, experiment, log_model=False)


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _linked(client: MlflowClient, model_id: str) -> dict[str, tuple[float, str | None]]:
    """The model's metrics: key -> (value, the name of the dataset it is of)."""
    return {m.key: (m.value, m.dataset_name) for m in client.get_logged_model(model_id).metrics or []}


def test_a_private_runs_model_is_named_and_carries_the_objective_and_every_epsilon(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    with tracked_run(_cfg(mlflow_uri, experiment_name)) as run:
        run.log_params(PRIVATE)
        run.log_dataset_splits({"name": "digits"}, {"train": 1437, "test": 360})
        run.log_metrics({"test_accuracy": 0.5, "epsilon": 1.2, "system/memory/peak_mib": 1.0}, step=1)
        run.log_metrics({"test_accuracy": 0.75, "epsilon": 1.83456}, step=2)
        run.log_model(_module(), EXAMPLE)
        # logged after the model: linked when the run ends
        run.log_metrics({"epsilon_pld": 1.83456, "epsilon_rdp": 2.3, "epsilon_prv": float("nan")}, step=2)
    [r] = runs_of(client, experiment_name)
    [output] = r.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert model.name == "digits-cnn-dpsgd-eps1_84" == r.data.tags["model.name"]  # ε 1.83456, rounded up
    assert _linked(client, model.model_id) == {
        "test_accuracy": (0.75, "digits-test"),  # the last epoch's, of the test split
        "epsilon": (1.83456, "digits-train"),  # ε: a guarantee about the training split
        "epsilon_pld": (1.83456, "digits-train"),
        "epsilon_rdp": (2.3, "digits-train"),
    }  # not system/memory/…, not the NaN ε
    import mlflow.artifacts

    mlflow.set_tracking_uri(mlflow_uri)  # runs:/<run_id>/<model.name> resolves to it
    files = mlflow.artifacts.list_artifacts(f"runs:/{r.info.run_id}/{model.name}")
    assert "MLmodel" in {f.path.rsplit("/", 1)[-1] for f in files}


def test_a_resumed_run_keeps_its_one_model_and_links_its_final_metrics(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    cfg = _cfg(mlflow_uri, experiment_name)
    with pytest.raises(KeyboardInterrupt), tracked_run(cfg) as run:  # its job logged the model, then was requeued
        run.log_params({"task.name": "classifier", "dataset.name": "digits", "model.name": "cnn", "dp.enabled": False})
        run.log_metrics({"test_accuracy": 0.5}, step=1)
        run.log_model(_module(), EXAMPLE)
        raise KeyboardInterrupt
    with tracked_run(cfg, resume_run_id=run.run_id) as resumed:
        resumed.log_model(_module(), EXAMPLE)
        resumed.log_metrics({"test_accuracy": 0.9}, step=2)
    [r] = runs_of(client, experiment_name)
    [model] = client.search_logged_models([r.info.experiment_id])
    assert r.info.status == "FINISHED" and model.name == "digits-cnn-nonprivate"
    assert _linked(client, model.model_id)["test_accuracy"][0] == 0.9  # the last value, once the run finished


def test_a_private_tuning_trials_model_gets_its_epsilon_only_once_released(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    from dpsweep.tracking.logged_models import link_model_metrics

    experiment = client.create_experiment(experiment_name)
    run_id = client.create_run(experiment, tags={"sweep.private_tuning": "True"}).info.run_id
    for key, value in PRIVATE.items():
        client.log_param(run_id, key, str(value))
    client.log_metric(run_id, "test_accuracy", 0.8, step=1)
    client.log_metric(run_id, "epsilon", 1.0, step=1)  # the trial's own, less than the tuning's
    module = _module()
    log_model(mlflow_uri, run_id, module, EXAMPLE, module(torch.as_tensor(EXAMPLE)).detach().numpy(), None, "2")
    [model] = client.search_logged_models([experiment])
    assert model.name == "digits-cnn-dpsgd-tuning"  # no ε: the trial's own would understate the model's
    assert set(_linked(client, model.model_id)) == {"test_accuracy"}
    client.log_metric(run_id, "epsilon", 3.5, step=1)  # the release logs the whole tuning's ε
    client.set_tag(run_id, "tuning.released", "true")
    link_model_metrics(client, run_id)
    assert _linked(client, model.model_id)["epsilon"] == (3.5, None)  # (this run logged no dataset)


def test_a_private_tunings_released_model_carries_the_whole_tunings_epsilon(tmp_path: Path) -> None:
    from dpsweep.tracking import PRIVACY_LEDGER, release_best
    from dpsweep.tracking.store import end_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("tuned", artifact_location=(tmp_path / "mlruns").as_uri())
    for accuracy in (0.8, 0.9):  # two trials of sweep s1, each with its model
        run_id = client.create_run(experiment, tags={"sweep.id": "s1", "sweep.private_tuning": "True"}).info.run_id
        client.log_batch(run_id, params=[Param(k, str(v)) for k, v in PRIVATE.items()])
        for key, value in {"test_accuracy": accuracy, "epsilon": 1.0, "epsilon_rdp": 1.0}.items():
            client.log_metric(run_id, key, value, step=1)
        client.log_text(run_id, json.dumps({"epsilon": {"rdp": 1.0}, "events": []}), PRIVACY_LEDGER)
        module = _module()
        log_model(uri, run_id, module, EXAMPLE, module(torch.as_tensor(EXAMPLE)).detach().numpy(), None, "2")
        end_run(uri, run_id, "FINISHED")
    released, _ = release_best(uri, "tuned", "s1", "test_accuracy", PROCEDURE)
    [model] = client.search_logged_models([experiment])  # the other trial's is deleted by the release
    assert model.source_run_id == released and model.name == "digits-cnn-dpsgd-tuning"
    linked = _linked(client, model.model_id)
    assert linked["epsilon"][0] == linked["epsilon_tuning"][0] == PROCEDURE["epsilon"], linked  # the tuning's ε
    assert linked["epsilon_single_run"][0] == 1.0 and linked["test_accuracy"][0] == 0.9, linked
    assert "epsilon_pld" not in linked  # NaN: not computed for the procedure
