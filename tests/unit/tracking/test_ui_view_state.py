"""The view ``dpsweep-ui`` saves on an experiment (:func:`dpsweep.tracking.views.save_view`), read back
from a real sqlite store: its columns (the objective, ε, what was swept; issue 56, item 1) and its chart
view (ε against the objective first, memory last and collapsed; issue 56, item 2)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from dpsweep.tracking import VIEW_KEY, VIEW_TAG
from dpsweep.tracking.views import save_view

# what a private run of the classifier logs besides its params (dpsweep.run.runner), and a sweep's run
DP_PARAMS = {f"dp.{k}": v for k, v in {"enabled": "True", "delta": "1e-05", "max_grad_norm": "1.0",
                                       "accountant": "pld", "noise_multiplier": "1.1"}.items()}  # fmt: skip
# memory in MiB under MLflow's system/ prefix (dpsweep.memory.tables.metric), per rank too; MLflow's own
# system metrics; and what runs logged before (bytes under memory/)
MEMORY = {"system/memory/model_load_mib": 1.5, "system/memory/backward_mib": 250.0,
          "system/memory/rank1/backward_mib": 240.0}  # fmt: skip
SYSTEM = {"system/cpu_utilization_percentage": 12.0}
OLD_MEMORY = {"memory/backward_bytes": 2.5e8}


def _run(client: MlflowClient, exp: str, params: Mapping[str, str], metrics: Mapping[str, float]) -> str:
    run_id = client.create_run(exp).info.run_id
    client.log_batch(
        run_id,
        metrics=[Metric(k, v, 0, step) for step in (1, 2) for k, v in metrics.items()],
        params=[Param(k, v) for k, v in params.items()],
    )
    return str(run_id)


def _view(client: MlflowClient, exp: str) -> dict[str, Any]:
    assert save_view(client, exp) == VIEW_KEY
    state = json.loads(client.get_experiment(exp).tags[VIEW_TAG + VIEW_KEY])
    assert isinstance(state, dict)
    return state


def _sweep(client: MlflowClient, experiment_name: str) -> str:
    """A seed sweep of private runs, a non-private baseline (no ``dp.*`` params but ``dp.enabled``) and the
    sweep's own run (its counters as metrics)."""
    exp = client.create_experiment(experiment_name)
    _run(client, exp, {"sweep.overrides": "train.seed=0,1"}, {"sweep.finished": 2, "sweep.failed": 0})
    task = {"task.name": "classifier", "model.name": "cnn", "train.epochs": "3"}
    for seed in (0, 1):
        _run(client, exp, task | DP_PARAMS | {"train.seed": str(seed)},
             {"test_accuracy": 0.8 + seed / 100, "epsilon": 3.453556, "epsilon_rdp": 3.6, "epsilon_prv": 3.44,
              **MEMORY})  # fmt: skip
    _run(client, exp, task | {"dp.enabled": "False", "train.seed": "0"}, {"test_accuracy": 0.9, **MEMORY, **SYSTEM})
    return str(exp)


def test_the_view_shows_the_objective_then_epsilon_then_the_swept_key_alone(
    client: MlflowClient, experiment_name: str
) -> None:
    state = _view(client, _sweep(client, experiment_name))
    # not every accountant's ε, the sweep's counters or memory; not the dp.* params the baseline lacks
    assert state["selectedColumns"] == ["metrics.`test_accuracy`", "metrics.`epsilon`", "params.`train.seed`"]
    # MLflow lays metrics out by name, and a run's duration before them, unless a column order says otherwise
    assert state["columnOrder"][:3] == state["selectedColumns"]
    assert state["orderByKey"] == "metrics.`test_accuracy`" and state["orderByAsc"] is False


def test_a_group_chosen_per_run_is_one_column_and_its_own_axes_stay(client: MlflowClient, experiment_name: str) -> None:
    """``model=cnn,mlp``: model.width differs because the model does (one column: model.name), unless it
    was swept within a model too."""
    exp = client.create_experiment(experiment_name)
    for model, width, lr in [("cnn", "32", "0.1"), ("cnn", "32", "0.2"), ("mlp", "256", "0.1"), ("mlp", "256", "0.2")]:
        _run(client, exp, {"task.name": "classifier", "model.name": model, "model.width": width, "optimizer.lr": lr},
             {"test_accuracy": 0.5})  # fmt: skip
    assert _view(client, exp)["selectedColumns"] == [
        "metrics.`test_accuracy`", "params.`model.name`", "params.`optimizer.lr`"
    ]  # fmt: skip
    _run(client, exp, {"task.name": "classifier", "model.name": "mlp", "model.width": "512", "optimizer.lr": "0.1"},
         {"test_accuracy": 0.5})  # fmt: skip
    assert "params.`model.width`" in _view(client, exp)["selectedColumns"]


def test_the_chart_view_opens_on_epsilon_against_the_objective_with_memory_last_and_collapsed(
    client: MlflowClient, experiment_name: str
) -> None:
    state = _view(client, _sweep(client, experiment_name))
    scatter, line = state["compareRunCharts"][:2]
    assert scatter["type"] == "SCATTER" and not scatter["deleted"]
    assert scatter["xaxis"] == {"key": "epsilon", "type": "METRIC"}
    assert scatter["yaxis"] == {"key": "test_accuracy", "type": "METRIC"}
    assert (line["type"], line["metricKey"], line["xAxisKey"]) == ("LINE", "test_accuracy", "step")  # per epoch
    sections = state["compareRunSections"]
    first = sections[0]
    assert (first["name"], first["display"]) == ("Model metrics", True)
    assert scatter["metricSectionId"] == line["metricSectionId"] == first["uuid"]
    # memory last, after MLflow's System metrics, collapsed; MLflow keeps this order only where told the
    # sections were reordered (by name it puts system/memory before Model metrics)
    assert [(s["name"], s["display"]) for s in sections[1:]] == [
        ("System metrics", True), ("system/memory", False), ("system/memory/rank1", False)
    ]  # fmt: skip
    assert state["isAccordionReordered"] is True


def test_memory_a_store_logged_before_under_memory_is_collapsed_last_too(
    client: MlflowClient, experiment_name: str
) -> None:
    """A store that holds runs of both namings: each memory section last and collapsed, the older first."""
    exp = _sweep(client, experiment_name)
    _run(client, exp, {"task.name": "classifier", "model.name": "cnn", "train.seed": "2"},
         {"test_accuracy": 0.7, **OLD_MEMORY})  # fmt: skip
    sections = _view(client, exp)["compareRunSections"]
    assert [(s["name"], s["display"]) for s in sections] == [
        ("Model metrics", True), ("System metrics", True),
        ("memory", False), ("system/memory", False), ("system/memory/rank1", False),
    ]  # fmt: skip
