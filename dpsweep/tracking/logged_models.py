"""A run's trained model as MLflow 3's UI shows it (issue 56, item 3): a name that says what it is, and
the run's objective and ε linked to it, each with the dataset split it is of.

    name = model_name(run)                  # 'digits-cnn-dpsgd-eps1_84', 'digits-cnn-nonprivate'
    link_model_metrics(client, run_id)      # the model's page: test_accuracy, epsilon, epsilon_<accountant>

MLflow 3 links a metric to a LoggedModel when the metric carries the model's id (``Metric(model_id=…)``
in ``MlflowClient.log_batch``); its dataset name and digest (``dataset_name``, ``dataset_digest``) are
what the model's page lists as the datasets it was evaluated on. The objective is linked with the run's
``test`` split, ε with its ``train`` split (ε is a guarantee about the training examples): the dataset
inputs the run logged (:meth:`dpsweep.tracking.Tracker.log_dataset_splits`).

The store calls these in the run's process: :func:`dpsweep.tracking.store.log_model` names the
model and links what the run logged before it; :func:`dpsweep.tracking.store.end_run` links the rest
once the run has finished, whichever came first (a resumed run's model was logged by its earlier job);
:func:`link_model` links what a private tuning's release logs on its trial after it ended
(:func:`dpsweep.tracking.release_best`).
"""

from __future__ import annotations

import math
import re
from typing import Any

from mlflow.entities import LoggedModelStatus, Metric
from mlflow.tracking import MlflowClient

from dpsweep.config import task_objectives, task_schemas
from dpsweep.tracking.store import client_of, retry_busy
from dpsweep.units import rounded_up

EPSILON = "epsilon"  # a private run's headline ε (dp.accountant's); epsilon_<accountant>: under each
OBJECTIVE_SPLIT, EPSILON_SPLIT = "test", "train"  # the dataset split each linked metric is of
# what MLflow refuses in a LoggedModel's name (mlflow.utils.validation._validate_logged_model_name)
NOT_IN_NAMES = re.compile(r"[/:.%\"']")


def model_name(run: Any) -> str:
    """The name of the run's model: its dataset, its model (the task's name for a task other than the
    classifier, as :func:`dpsweep.run.records.run_name` names it), and its mechanism and ε
    (``digits-cnn-dpsgd-eps1_84``), or ``nonprivate``. ε is the run's headline ``epsilon`` to three
    significant digits, rounded up (a name never states less than the ε spent: 1.83456 -> ``1_84``), its
    point written ``_``: MLflow refuses ``.`` in a LoggedModel's name. A trial of a private tuning's says
    ``tuning`` instead of an ε: its model's ε is the whole tuning's, known only at the release
    (:func:`dpsweep.tracking.sweeps.release_best`), and its own would understate it."""
    params, tags = run.data.params, run.data.tags
    task = params.get("task.name", tags.get("task.name", "model"))
    schema = task_schemas().get(task)
    shown = params.get("model.name", task) if schema is not None and schema.shows_model else task
    parts = [params.get("dataset.name", "data"), shown]
    epsilon = run.data.metrics.get(EPSILON, math.nan)
    if params.get("dp.enabled") != "True":
        parts.append("nonprivate")
    elif tags.get("sweep.private_tuning") == "True":
        parts += [params.get("dp.mechanism", "dp"), "tuning"]
    else:
        parts += [params.get("dp.mechanism", "dp"), *([] if math.isnan(epsilon) else [f"eps{rounded_up(epsilon, 3)}"])]
    return NOT_IN_NAMES.sub("_", "-".join(str(p) for p in parts))


def linked_keys(run: Any) -> list[str]:
    """The run's metrics that its model carries: the objective of its task, and every ε it logged
    (``epsilon``, ``epsilon_<accountant>``, a private tuning's ``epsilon_tuning`` …). A trial of a private
    tuning's ε only once it is released (tag ``tuning.released=true``): until then its ε is its own, less
    than the tuning's, which its release logs (:func:`dpsweep.tracking.sweeps.release_best`)."""
    objective = task_objectives().get(run.data.params.get("task.name", ""))
    keys = [objective] if objective is not None and objective in run.data.metrics else []
    tuning = run.data.tags.get("sweep.private_tuning") == "True"
    if not tuning or run.data.tags.get("tuning.released") == "true":
        keys += sorted(k for k in run.data.metrics if k == EPSILON or k.startswith(EPSILON + "_"))
    return keys


def link_model_metrics(client: MlflowClient, run_id: str) -> list[Metric]:
    """Link the run's :func:`linked_keys` (their latest values, at their step and time) to each READY
    LoggedModel the run logged, each with its dataset split; those a model carries already (same key,
    step and value) are left as they are, and NaN (an ε not computed) is not linked. Returns the metrics
    linked (none where the run logged no model)."""
    run = retry_busy(lambda: client.get_run(run_id))
    same = f"source_run_id = '{run_id}'"
    found = retry_busy(lambda: client.search_logged_models([run.info.experiment_id], filter_string=same))
    models = [m for m in found if m.status == LoggedModelStatus.READY]
    if not models:
        return []
    splits = {
        tag.value: d.dataset
        for d in (run.inputs.dataset_inputs if run.inputs else [])
        for tag in d.tags
        if tag.key == "mlflow.data.context"
    }
    objective = task_objectives().get(run.data.params.get("task.name", ""))
    out: list[Metric] = []
    for key in linked_keys(run):
        history = retry_busy(lambda key=key: client.get_metric_history(run_id, key))  # type: ignore[misc]
        last = max(history, key=lambda m: (m.step, m.timestamp), default=None)
        if last is None or math.isnan(last.value):
            continue
        dataset = splits.get(OBJECTIVE_SPLIT if key == objective else EPSILON_SPLIT)
        for model in models:
            if any((m.key, m.step, m.value) == (key, last.step, last.value) for m in model.metrics or []):
                continue
            out.append(Metric(
                key, last.value, last.timestamp, last.step, model_id=model.model_id,
                dataset_name=dataset.name if dataset else None, dataset_digest=dataset.digest if dataset else None,
            ))  # fmt: skip
    if out:  # the run's own rows are the ones it has (same key, value, step and time): MLflow keeps one
        retry_busy(lambda: client.log_batch(run_id, metrics=out))
    return out


def link_model(uri: str, run_id: str) -> int:
    """:func:`link_model_metrics` of the run ``run_id`` in the store at ``uri``, for a run's metrics logged
    after it ended (a private tuning's release: the whole tuning's ε on the released trial); how many."""
    return len(link_model_metrics(client_of(uri), run_id))
