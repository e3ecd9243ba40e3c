"""The view of an experiment that ``dpsweep-ui`` opens in MLflow's UI: ε against accuracy, what was
swept, best first (one of MLflow's shared views, saved on the experiment). Of a private tuning
(``sweep.private_tuning``) it shows the released trial alone: the view filters out the runs tagged
``tuning.withheld`` (the other trials and the parent run, which holds K), and shows no ``train.seed``
column while a released trial is among its runs (Papernot & Steinke 2022's bound needs K secret; a
trial's seed is secret too).

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
from dpsweep.tracking.sweeps import RELEASED_TAG, WITHHELD_TAG, delete_models

VIEW_RUNS = 1000  # the newest runs of an experiment whose params and metrics choose its view's columns
# the view's runs: all but those a private tuning withholds (MLflow's search syntax, which its UI sends as is)
VIEW_FILTER = f"tags.`{WITHHELD_TAG}` IS NULL"
SECRET_PARAMS = ("train.seed",)  # no column while a released trial of a private tuning is in the view


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
    ``runsExpanded`` out of it). The newest :data:`VIEW_RUNS` runs it shows choose the columns.

    Its filter (:data:`VIEW_FILTER`) leaves out what a private tuning withholds (:func:`withhold`): of a
    tuning, the view shows the released trial alone, and while one is among its runs, no ``train.seed``
    column (:data:`SECRET_PARAMS`)."""
    withhold(client, experiment_id)
    runs = retry_busy(lambda: client.search_runs(
        [experiment_id], VIEW_FILTER, max_results=VIEW_RUNS, order_by=["attributes.start_time DESC"]
    ))  # fmt: skip
    trained = [r for r in runs if "task.name" in r.data.params]  # not a sweep's own run
    objectives = task_objectives()
    objective = next(
        (objectives[r.data.params["task.name"]] for r in trained if r.data.params["task.name"] in objectives), None
    )
    headline = sorted({k for r in runs for k in r.data.metrics if "/" not in k}, key=lambda k: (k != objective, k))
    swept = differing_params(trained)
    if any(r.data.tags.get(RELEASED_TAG) == "true" for r in runs):
        swept = [k for k in swept if k not in SECRET_PARAMS]
    state: dict[str, Any] = {
        "selectedColumns": [
            *(f"metrics.`{k}`" for k in headline), *(f"params.`{k}`" for k in swept),
            "attributes.`Models`", "attributes.`Dataset`",
        ],
        "searchFilter": VIEW_FILTER,
    }  # fmt: skip
    if objective in headline:
        state |= {"orderByKey": f"metrics.`{objective}`", "orderByAsc": False}
    retry_busy(lambda: client.set_experiment_tag(experiment_id, VIEW_TAG + VIEW_KEY, json.dumps(state)))
    return VIEW_KEY


def withhold(client: MlflowClient, experiment_id: str) -> list[str]:
    """Tag ``tuning.withheld`` what a private tuning does not release and is not tagged so yet (a sweep
    that ended before its release, or a store from before the tag): every run of a private tuning's
    sweep (tag ``sweep.private_tuning=True``) but its released trial (``tuning.released=true``), and
    that sweep's parent run, which holds K (tag ``tuning.k``). Of a sweep whose parent run has ended
    (one that ended before its release), the models its trials logged are deleted
    (:func:`dpsweep.tracking.sweeps.delete_models`: MLflow's Models tab lists them whatever the view
    filters), as the release deletes those of the trials it withholds; while the sweep runs they stay,
    one of them to be released. Returns the ids tagged now."""
    trials = _search(client, experiment_id, "tags.`sweep.private_tuning` = 'True'")
    sweeps = {r.data.tags["sweep.id"] for r in trials if "sweep.id" in r.data.tags}
    parents = [
        r for r in _search(client, experiment_id, "tags.`sweep.role` = 'parent'")
        if r.data.tags.get("sweep.id") in sweeps or "tuning.k" in r.data.tags
    ]  # fmt: skip
    tagged = []
    for r in [*trials, *parents]:
        if r.data.tags.get(RELEASED_TAG) == "true" or WITHHELD_TAG in r.data.tags:
            continue
        retry_busy(lambda run_id=r.info.run_id: client.set_tag(run_id, WITHHELD_TAG, "true"))  # type: ignore[misc]
        tagged.append(r.info.run_id)
    ended = {r.data.tags.get("sweep.id") for r in parents if r.info.status != "RUNNING"} - {None}
    withheld = {
        r.info.run_id for r in trials
        if r.data.tags.get(RELEASED_TAG) != "true" and r.data.tags.get("sweep.id") in ended
    }  # fmt: skip
    if withheld:
        delete_models(client, experiment_id, withheld)
    return tagged


def _search(client: MlflowClient, experiment_id: str, filter_string: str) -> list[Any]:
    """Every run of the experiment that matches ``filter_string`` (all pages)."""
    out: list[Any] = []
    token = None
    while True:
        page = retry_busy(lambda token=token: client.search_runs(  # type: ignore[misc]
            [experiment_id], filter_string, max_results=10000, page_token=token
        ))  # fmt: skip
        out.extend(page)
        token = page.token
        if not token:
            return out
