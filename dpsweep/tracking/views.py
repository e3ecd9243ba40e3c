"""The view of an experiment that ``dpsweep-ui`` opens in MLflow's UI: ε against accuracy, what was
swept, best first, and a chart view that opens on ε against accuracy (one of MLflow's shared views,
saved on the experiment). Of a private tuning
(``sweep.private_tuning``) it shows the released trial alone: the view filters out the runs tagged
``tuning.withheld`` (the other trials and the parent run, which holds K), and shows no ``train.seed``
column while a released trial is among its runs (Papernot & Steinke 2022's bound needs K secret; a
trial's seed is secret too).

    from dpsweep.tracking.views import save_view   # dpsweep.cli.ui
    key = save_view(open_client(uri), experiment_id)
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from mlflow.tracking import MlflowClient

from dpsweep.config import task_objectives
from dpsweep.errors import InputError
from dpsweep.tracking import VIEW_KEY, VIEW_TAG
from dpsweep.tracking.store import retry_busy
from dpsweep.tracking.sweeps import RELEASED_TAG, WITHHELD_TAG, delete_models

VIEW_RUNS = 1000  # the newest runs of an experiment whose params and metrics choose its view's columns
# the view's runs: all but those a private tuning withholds (MLflow's search syntax, which its UI sends as is)
VIEW_FILTER = f"tags.`{WITHHELD_TAG}` IS NULL"
SECRET_PARAMS = ("train.seed",)  # no column while a released trial of a private tuning is in the view
# the chart view's sections (MLflow's names for metrics without a prefix and for system/<name>)
MODEL_SECTION, SYSTEM_SECTION = "Model metrics", "System metrics"
SYSTEM_PREFIX = "system/"  # MLflow's system metrics (its System metrics section)
# the sections of dpsweep's memory figures: system/memory/…_mib (dpsweep.memory.tables.metric), and the
# memory/…_bytes of older runs; per rank system/memory/rankN/… (MLflow names a section by the metric's
# name up to its last "/")
MEMORY_SECTIONS = ("system/memory", "memory")
SCATTER_RUNS = 100  # the runs the ε-objective scatter shows (MLflow's default for a scatter)
DURATION_COLUMN = "duration"  # the id of the runs table's column of a run's duration, which it always shows
SAID_BY_EPSILON = ("dp.enabled",)  # no column of its own: a non-private run has no ε
EPSILON = "epsilon"  # a private run's headline ε, under dp.accountant (epsilon_<accountant>: under each)


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

    Its columns answer "ε against accuracy" at once: the objective of the runs' tasks, then ε (the
    headline ``epsilon``, not ``epsilon_<accountant>``), then what was swept (:func:`swept_params`), and
    nothing else (MLflow's column selector adds more); a 1440 px window shows them without scrolling where
    a few keys were swept (MLflow gives each 100 px). Its rows are sorted by
    the objective of the newest run's task, best first; so sorted, the UI lists a sweep's jobs as rows of
    their own, where in its default order (by date) it nests them under their sweep's run, collapsed. A
    shared view sets columns and order, not which runs are expanded (MLflow leaves ``runsExpanded`` out
    of it). The newest :data:`VIEW_RUNS` runs it shows choose the columns. Its chart view
    (:func:`chart_state`) opens on ε against the objective.

    Its filter (:data:`VIEW_FILTER`) leaves out what a private tuning withholds (:func:`withhold`): of a
    tuning, the view shows the released trial alone, and while one is among its runs, no ``train.seed``
    column (:data:`SECRET_PARAMS`)."""
    withhold(client, experiment_id)
    runs = retry_busy(lambda: client.search_runs(
        [experiment_id], VIEW_FILTER, max_results=VIEW_RUNS, order_by=["attributes.start_time DESC"]
    ))  # fmt: skip
    trained = [r for r in runs if "task.name" in r.data.params]  # not a sweep's own run
    metrics = {k for r in runs for k in r.data.metrics}
    objectives = task_objectives()
    # the objectives of the runs' tasks, the newest run's first: those that some run logged
    scored = dict.fromkeys(
        objectives[r.data.params["task.name"]] for r in trained if r.data.params["task.name"] in objectives
    )
    headline = [k for k in [*scored, EPSILON] if k in metrics]
    swept = swept_params(trained)
    if any(r.data.tags.get(RELEASED_TAG) == "true" for r in runs):
        swept = [k for k in swept if k not in SECRET_PARAMS]
    columns = [*(f"metrics.`{k}`" for k in headline), *(f"params.`{k}`" for k in swept)]
    # MLflow lays out the metrics by name (epsilon before test_accuracy) and the run's duration before
    # them, unless a column order says otherwise
    state: dict[str, Any] = {"selectedColumns": columns, "columnOrder": [*columns, DURATION_COLUMN]}
    state |= {"searchFilter": VIEW_FILTER, "runsHiddenMode": "SHOW_ALL"}  # the charts show every run, not 10
    objective = next((k for k in scored if k in metrics), None)
    if objective is not None:
        state |= {"orderByKey": f"metrics.`{objective}`", "orderByAsc": False}
    state |= chart_state(objective, metrics)
    retry_busy(lambda: client.set_experiment_tag(experiment_id, VIEW_TAG + VIEW_KEY, json.dumps(state)))
    return VIEW_KEY


def swept_params(runs: Sequence[Any]) -> list[str]:
    """The params that were swept between ``runs``, sorted: those with two values or more among the runs
    that have them. A param some runs lack does not differ for that alone: a run without DP logs no
    ``dp.*`` param but ``dp.enabled`` (:func:`dpsweep.run.records.run_params`), and the keys of a config
    group's other choice are absent too. ``dp.enabled`` gets no column: the ε column says which runs are
    private, as ``dpsweep-plan``'s does (:data:`SAID_BY_EPSILON`). Of a group chosen per run (its
    ``<group>.name`` differs: ``dpsweep-plan`` shows ``model=cnn,mlp`` as one swept key), a key whose value
    the choice decides (one value per ``<group>.name``) is left out: it differs because the choice does."""
    values: dict[str, set[str]] = {}
    for r in runs:
        for k, v in r.data.params.items():
            values.setdefault(k, set()).add(v)
    swept = sorted(k for k, seen in values.items() if len(seen) > 1 and k not in SAID_BY_EPSILON)
    chosen = [k.removesuffix(".name") for k in swept if k.endswith(".name")]

    def decided(key: str) -> bool:
        """Whether ``key``'s value follows from its group's choice, in every run that has both."""
        group = next((g for g in chosen if key.startswith(g + ".") and key != g + ".name"), None)
        if group is None:
            return False
        by_choice: dict[str, set[str]] = {}
        for r in runs:
            if key in r.data.params and group + ".name" in r.data.params:
                by_choice.setdefault(r.data.params[group + ".name"], set()).add(r.data.params[key])
        return all(len(seen) == 1 for seen in by_choice.values())

    return [k for k in swept if not decided(k)]


def chart_state(objective: str | None, metrics: Collection[str]) -> dict[str, Any]:
    """The chart view of the shared view (MLflow's ``compareRunCharts`` and ``compareRunSections``, which
    a shared view carries: ``ExperimentPageUIState`` in MLflow's UI): first a scatter of ε against the
    ``objective``, then the objective per epoch; MLflow adds a chart of each other metric after them
    (a section marked ``isReordered`` gets its new charts at its end). The memory figures
    (``system/memory/…_mib``, per rank ``system/memory/rankN/…``, and older runs' ``memory/…_bytes``) get
    sections of their own (:data:`MEMORY_SECTIONS`), last, after MLflow's System metrics, and collapsed
    (``display: false``); ``isAccordionReordered`` keeps the sections in this order, which MLflow would
    otherwise sort by name (``memory`` and ``system/memory`` before ``Model metrics``). ``metrics``:
    every metric key of the view's runs."""
    model = {"uuid": f"{VIEW_KEY}-model", "name": MODEL_SECTION, "display": True, "isReordered": True}
    charts: list[dict[str, Any]] = []
    card = {"deleted": False, "isGenerated": False, "metricSectionId": model["uuid"]}
    if objective is not None and EPSILON in metrics:
        charts.append(card | {
            "uuid": f"{VIEW_KEY}-epsilon-objective", "type": "SCATTER", "runsCountToCompare": SCATTER_RUNS,
            "xaxis": {"key": EPSILON, "type": "METRIC"}, "yaxis": {"key": objective, "type": "METRIC"},
        })  # fmt: skip
    if objective is not None:
        charts.append(card | {
            "uuid": f"{VIEW_KEY}-objective", "type": "LINE", "metricKey": objective, "xAxisKey": "step",
            "scaleType": "linear", "lineSmoothness": 0, "useGlobalXaxisKey": False, "runsCountToCompare": 10,
        })  # fmt: skip
    names = sorted({section_name(k) for k in metrics} - {MODEL_SECTION, SYSTEM_SECTION})
    memory = [n for n in names if any(n == m or n.startswith(m + "/") for m in MEMORY_SECTIONS)]
    system = [SYSTEM_SECTION] if any(section_name(k) == SYSTEM_SECTION for k in metrics) else []  # MLflow's own
    shown = [(n, True) for n in [*(n for n in names if n not in memory), *system]]
    sections = [model] + [
        {"uuid": f"{VIEW_KEY}-{name}", "name": name, "display": display, "isReordered": False}
        for name, display in [*shown, *((n, False) for n in memory)]
    ]
    return {"compareRunCharts": charts, "compareRunSections": sections, "isAccordionReordered": True}


def section_name(key: str) -> str:
    """The chart section MLflow's UI puts metric ``key`` in (``extractChartSectionName`` in MLflow 3.17's
    bundle): its name up to the last "/", ``Model metrics`` for a name without one, ``System metrics``
    for ``system/<name>``. ``system/memory/backward_mib`` -> ``system/memory``."""
    section = key.rsplit("/", 1)[0] if "/" in key else ""
    if section == "":
        return MODEL_SECTION
    return SYSTEM_SECTION if section + "/" == SYSTEM_PREFIX else section


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
