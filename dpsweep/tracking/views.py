"""The view of an experiment that ``dpsweep-ui`` opens in MLflow's UI: ε against accuracy, what was
swept, best first (one of MLflow's shared views, saved on the experiment).

    from dpsweep.tracking.views import save_view   # dpsweep.cli.ui
    key = save_view(open_client(uri), experiment_id)
"""

from __future__ import annotations

import json
from typing import Any

from mlflow.tracking import MlflowClient

from dpsweep.config import task_objectives
from dpsweep.errors import InputError
from dpsweep.tracking import VIEW_KEY, VIEW_TAG
from dpsweep.tracking.store import differing_params, retry_busy

VIEW_RUNS = 1000  # the newest runs of an experiment whose params and metrics choose its view's columns


def latest_experiment(client: MlflowClient) -> str:
    """The id of the experiment whose run started last (the page ``dpsweep-ui`` opens by default);
    InputError naming ``--experiment`` when the store holds no run."""
    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, order_by=["attributes.start_time DESC"], max_results=1) if ids else []
    if not runs:
        raise InputError("--experiment", None, "the name of an experiment: the store holds no run yet")
    return str(runs[0].info.experiment_id)


def save_view(client: MlflowClient, experiment_id: str) -> str:
    """Save on the experiment the view of its runs that ``dpsweep-ui`` opens, as one of MLflow's shared
    views (the experiment tag ``VIEW_TAG + VIEW_KEY``, which the UI applies for the URL parameter
    ``viewStateShareKey``), and return its key.

    Its columns answer "ε against accuracy" at once: the runs' headline metrics (those MLflow does not
    group under a prefix such as ``memory/``: the objective, ε under each accountant), then the params
    that differ between the training runs (what was swept), then the model and the dataset. Its rows are
    sorted by the objective of the newest run's task, best first; so sorted, the UI lists a sweep's jobs
    as rows of their own, where in its default order (by date) it nests them under their sweep's run,
    collapsed. A shared view sets columns and order, not which runs are expanded (MLflow leaves
    ``runsExpanded`` out of it). The newest :data:`VIEW_RUNS` runs choose the columns."""
    runs = retry_busy(lambda: client.search_runs(
        [experiment_id], max_results=VIEW_RUNS, order_by=["attributes.start_time DESC"]
    ))  # fmt: skip
    trained = [r for r in runs if "task.name" in r.data.params]  # not a sweep's own run
    objectives = task_objectives()
    objective = next(
        (objectives[r.data.params["task.name"]] for r in trained if r.data.params["task.name"] in objectives), None
    )
    headline = sorted({k for r in runs for k in r.data.metrics if "/" not in k}, key=lambda k: (k != objective, k))
    swept = differing_params(trained)
    state: dict[str, Any] = {
        "selectedColumns": [
            *(f"metrics.`{k}`" for k in headline), *(f"params.`{k}`" for k in swept),
            "attributes.`Models`", "attributes.`Dataset`",
        ],
    }  # fmt: skip
    if objective in headline:
        state |= {"orderByKey": f"metrics.`{objective}`", "orderByAsc": False}
    retry_busy(lambda: client.set_experiment_tag(experiment_id, VIEW_TAG + VIEW_KEY, json.dumps(state)))
    return VIEW_KEY
