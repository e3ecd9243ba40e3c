"""Tracking in the run's own process (dpsweep.tracking), on MLflow's asynchronous logging, against a
real sqlite store: a run's status says whether everything it logged was stored; dpsweep's own errors
reach the caller as themselves, MLflow's as MLflow's."""

from __future__ import annotations

import pickle
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import runs_of
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from opacus import PrivacyEngine

from dpsweep.config import ConfigError, TrackingConfig
from dpsweep.models.classifiers import OpacusCNN, released_copy
from dpsweep.tracking import Claim, Claimed, open_store, tracked_run


def test_a_tracked_run_stores_everything_before_it_ends(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    with tracked_run(TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name), tags={"k": 1}) as run:
        run.log_params({f"p{i}": i for i in range(150)})  # two of MLflow's batches (100 params at most)
        for step in range(1, 4):
            run.log_metrics({"acc": step / 4}, step=step)
        run.log_text("a: 1\n", "config.yaml")
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FINISHED" and len(r.data.params) == 150 and r.data.tags["k"] == "1"
    assert [m.value for m in client.get_metric_history(r.info.run_id, "acc")] == [0.25, 0.5, 0.75]
    assert [a.path for a in client.list_artifacts(r.info.run_id)] == ["config.yaml"]


def test_a_logging_call_that_failed_ends_the_run_failed_with_mlflows_error(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    """MLflow refuses to change a logged param: the write fails in MLflow's logging thread, and the
    run, which would otherwise have ended FINISHED with a record it did not write, ends FAILED with
    MLflow's own error (the write made again at the flush raises it)."""
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    with pytest.raises(MlflowException, match="Changing param values is not allowed"), tracked_run(tracking) as run:
        run.log_params({"lr": 0.1})
        run.log_params({"lr": 0.2})
        run.log_metrics({"after": 1.0})
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "FAILED" and r.data.params["lr"] == "0.1"
    assert "Changing param values" in r.data.tags["error"] and r.data.tags["failure.kind"] == "exception"
    assert r.data.metrics["after"] == 1.0  # the writes after the failed one were stored


def test_writes_are_stored_in_the_order_logged(mlflow_uri: str, experiment_name: str, client: MlflowClient) -> None:
    """MLflow's asynchronous logging writes from a pool of threads, in any order unless it has one: a
    tag set again and again keeps its last value."""
    with tracked_run(TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)) as run:
        for i in range(40):
            run.set_tags({"stage": i})
    assert client.get_run(run.run_id).data.tags["stage"] == "39"


def test_dpsweeps_own_errors_surface_as_themselves(tmp_path: Path, mlflow_uri: str, experiment_name: str) -> None:
    not_a_db = tmp_path / "notes.db"
    not_a_db.write_text("not a database")
    with pytest.raises(ConfigError, match=r"tracking\.uri=.*notes\.db.*is not one") as bad:
        open_store(f"sqlite:///{not_a_db}")
    assert bad.value.key == "tracking.uri"
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    with tracked_run(tracking, tags={"config.hash": "h1"}, claim=Claim("h1")) as held:
        pass
    with pytest.raises(Claimed) as claimed, tracked_run(tracking, tags={"config.hash": "h1"}, claim=Claim("h1")):
        pass
    assert (claimed.value.run_id, claimed.value.status) == (held.run_id, "FINISHED")


def test_an_interrupted_run_keeps_what_it_logged_and_ends_killed(
    mlflow_uri: str, experiment_name: str, client: MlflowClient
) -> None:
    tracking = TrackingConfig(uri=mlflow_uri, experiment_name=experiment_name)
    with pytest.raises(KeyboardInterrupt), tracked_run(tracking) as run:
        run.log_metrics({"acc": 0.5}, step=1)
        raise KeyboardInterrupt
    [r] = runs_of(client, experiment_name)
    assert r.info.status == "KILLED" and r.data.metrics["acc"] == 0.5


@pytest.mark.slow  # 25 s: SQLite's wait for a lock, as MLflow opens it, is 20 s
def test_a_write_mlflows_thread_failed_while_the_store_was_locked_is_made_again_before_the_run_ends(
    tmp_path: Path, experiment_name: str
) -> None:
    """Another process holds the sqlite store longer than SQLite waits: MLflow's asynchronous write
    fails, and the run's flush writes it again once the store is free, so the run ends FINISHED with
    everything it logged."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with tracked_run(TrackingConfig(uri=uri, experiment_name=experiment_name)) as run:
        run.log_metrics({"before": 1.0})
        run.flush()
        other = sqlite3.connect(tmp_path / "mlflow.db", isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
        run.log_metrics({"locked": 2.0})
        operations, _ = run._pending[-1]
        with pytest.raises(MlflowException, match="database is locked"):
            operations[0].wait()
        other.execute("ROLLBACK")
    stored = MlflowClient(uri).get_run(run.run_id)
    assert stored.info.status == "FINISHED" and stored.data.metrics == {"before": 1.0, "locked": 2.0}


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_released_copy_has_no_opacus_hooks_or_per_sample_state(mode: str) -> None:
    """The model a run logs: trained weights only, loadable without Opacus. (functorch: Opacus sets a
    vmapped closure on each layer, which a run's model could not be pickled with to be logged.)"""
    model = OpacusCNN((1, 28, 28), 10)
    data = torch.utils.data.TensorDataset(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    private, _, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
    )  # fmt: skip
    x, y = next(iter(loader))
    torch.nn.functional.cross_entropy(private(x), y).backward()
    assert any(p.grad_sample is not None for p in model.parameters())  # what a copy would carry along
    if mode == "hooks":
        assert "opacus" in pickle.dumps(model).decode("latin-1")

    released = released_copy(model)
    frozen = pickle.dumps(released).decode("latin-1")
    assert "opacus" not in frozen and "grad_sample" not in frozen
    assert all(not m._forward_hooks and not m._backward_hooks for m in released.modules())
    for mine, theirs in zip(released.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    assert not released.training
    assert model._forward_hooks or any(m._forward_hooks for m in model.modules())  # the original keeps them


@pytest.mark.slow  # two 1-epoch runs, each in its own process
@pytest.mark.parametrize("log_model", [True, False])
def test_a_run_logs_in_its_own_process_and_imports_the_model_flavour_only_to_log_its_model(
    tmp_path: Path, log_model: bool
) -> None:
    """A whole run logs from its own process, which starts no other: no tracking process (issue 57).
    mlflow.pytorch imports torch's ecosystem (Lightning, torchmetrics and torchvision where installed:
    10 CPU-seconds a process on the H100 machine's image): only a run that logs its model imports it."""
    script = (
        "import sys, psutil\n"
        "from hydra import compose, initialize_config_module\n"
        "from dpsweep.run.runner import train\n"
        "with initialize_config_module('dpsweep.conf', version_base='1.3'):\n"
        "    cfg = compose('config', overrides=['train.epochs=1', 'train.progress=false', "
        f"'tracking.log_model={str(log_model).lower()}', "
        f"'tracking.uri=sqlite:///{tmp_path}/mlflow.db', 'tracking.experiment_name=solo'])\n"
        "result = train(cfg)\n"
        "children = [p.cmdline() for p in psutil.Process().children(recursive=True)]\n"
        "print(result.run_id, 'mlflow.pytorch' in sys.modules, children or '-')\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr
    run_id, flavour, children = done.stdout.split(maxsplit=2)
    assert (flavour, children.strip()) == (str(log_model), "-")
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id)
    assert run.info.status == "FINISHED" and "epsilon" in run.data.metrics
    assert (run.data.tags.get("model.logged") == "true") is log_model
