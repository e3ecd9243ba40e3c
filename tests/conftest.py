"""Shared fixtures: composed configs and a real MLflow sqlite backend per test session."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAST, Composer
from hydra import compose, initialize_config_module
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs from its own directory: relative outputs (./mlruns artifacts of sqlite stores,
    outputs/, multirun/) never land in the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite MLflow store for the session (creating the schema takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture()
def experiment_name(request: pytest.FixtureRequest) -> str:
    """A fresh experiment per test, so each test sees only its own runs."""
    return "test-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)


@pytest.fixture()
def make_cfg(mlflow_uri: str, experiment_name: str) -> Iterator[Composer]:
    """Compose the real config tree with overrides, tracking into this test's experiment."""

    def _compose(*overrides: str, fast: bool = True) -> DictConfig:
        tracking = [f"tracking.uri={mlflow_uri}", f"tracking.experiment_name={experiment_name}"]
        return compose("config", overrides=[*(FAST if fast else []), *tracking, *overrides])

    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        yield _compose


@pytest.fixture()
def client(mlflow_uri: str) -> MlflowClient:
    return MlflowClient(mlflow_uri)


@pytest.fixture()
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]
