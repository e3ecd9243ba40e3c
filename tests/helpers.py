"""Helpers shared by the tests (imported as ``helpers``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

from collections.abc import Callable

from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

# Settings that keep a training test to a few seconds on 2 CPU cores.
FAST = ["train.epochs=2", "train.progress=false"]

Composer = Callable[..., DictConfig]


def runs_of(client: MlflowClient, experiment: str) -> list[Run]:
    """All runs of an experiment (none if it does not exist)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return list(client.search_runs([exp.experiment_id]))
