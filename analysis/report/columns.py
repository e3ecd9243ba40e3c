"""What a report's frames hold: the MLflow params behind the table's columns, run outcomes, tasks and
their objectives, mechanisms and privacy units, and the accessors that read one column of a run frame.

Tasks: a run's accuracy is its task's objective metric (``TaskConfig.objective`` in dpsweep.config;
runs without a ``task.name`` are classifier runs). A row of a task whose model group is only an
evaluation model shows the task's name as its ``model`` (:func:`run_models`), so its rows are a
block of their own with the task's non-private row as baseline.

Mechanisms and privacy units (``dp.mechanism``, ``dp.unit``): each private row has a ``mechanism`` (a
name of the registry ``dpsweep.mechanisms``, whose label and note the report shows) and a ``unit``
(``example``, or ``user``: ε protects all of one user's examples, N = dataset.num_users), from its
params, else its tags; runs from before these keys have the schema's defaults, and non-private rows
have neither (None).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from dpsweep.config import UNITS, ClassifierTaskConfig, DPConfig, shown_model, task_schemas
from dpsweep.errors import InputError
from dpsweep.memory.tables import BYTES_PER_UNIT, LEGACY_PREFIX, OLD_PREFIX, metric
from dpsweep.registry import Registry

# Table column -> the MLflow param it shows. Every other hyperparameter that varies gets its own
# column as well (see table.swept_params), so that no two rows look alike.
HYPERPARAMETERS: dict[str, str] = {
    "dataset": "dataset.name",
    "model": "model.name",
    "batch_size": "train.batch_size",
    "noise_multiplier": "dp.noise_multiplier",
    "max_grad_norm": "dp.max_grad_norm",
    "clipping": "dp.clipping",
    "lr": "optimizer.lr",
    "epochs": "train.epochs",
    "delta": "dp.delta",
    "accountant": "dp.accountant",
}
SETTING_COLUMNS = [name for name in HYPERPARAMETERS if name not in ("dataset", "model")]  # after model (and task)
INTEGER_COLUMNS = ("batch_size", "epochs")
FLOAT_COLUMNS = ("noise_multiplier", "max_grad_norm", "lr", "delta")
# Runs that differ only in these are replicates of one config (identity() keeps them, since they
# change a run's numbers, but not what the run measures).
REPLICATE_PARAMS = ("train.seed",)
# Not in NON_IDENTITY_PREFIXES yet, but it cannot change a result: evaluation is deterministic.
NOT_HYPERPARAMETERS = ("train.eval_batch_size",)
# Params a run decided from its data (released privately), which differ between seeds of one config.
DECIDED_PARAMS = ("dp.max_grad_norm_chosen",)
# Params that say which kind of run it is rather than how it was tuned; never a swept axis.
ROW_KIND_PARAMS = ("dataset.name", "model.name", "dp.enabled", "task.name")

# Tasks (dpsweep.config.TaskConfig): a run's score is its task's objective metric, and what a report says
# of a task's rows (the objective's name and note, sample grids, a reference score, a share averaged
# per row) is its schema's: this package names no task. Runs from before tasks existed log no
# task.name: they are classifier runs. A task whose model group is only an evaluation model shows the
# task's name as the row's model, so each task's rows form blocks of their own, with their own
# non-private baseline.
DEFAULT_TASK: str = ClassifierTaskConfig.name

# How a private row noised its gradients and whom its ε protects (issue 17): table column -> the
# param (also a tag, set at the end of a DP run) it shows. Runs from before these keys log neither:
# they ran DP-SGD over examples (the defaults). Non-private rows have neither (None).
PRIVACY_KINDS: dict[str, str] = {"mechanism": "dp.mechanism", "unit": "dp.unit"}
PRIVACY_KIND_DEFAULTS: dict[str, str] = {
    name: str(getattr(value, "value", value))
    for name, value in (("mechanism", DPConfig.mechanism), ("unit", DPConfig.unit))
}  # the schema's defaults
DEFAULT_OF_PARAM = {PRIVACY_KINDS[name]: value for name, value in PRIVACY_KIND_DEFAULTS.items()}
# dp.neighbours (a DP run's tag; the mechanism's ``neighbours``) in words; runs without it ran the default
NEIGHBOUR_NOTES = {
    "add_or_remove_one": "one unit added or removed",
    "replace_one_with_zero": "one unit replaced by a zero record",
}
# The keys only runs at one privacy unit read (dpsweep.config.UNITS: who holds which examples, what a
# dp.unit=user row's users are). Without DP they change nothing a run computes, so a baseline is matched
# without them.
USER_PARAMS = tuple(key for facts in UNITS.values() for key in facts.keys)

# Memory of the first training iteration at each stage (levels, not increments), and the peaks: the
# report's column (in bytes) -> the figure's name (dpsweep.memory.tables.metric: logged in MiB as
# system/memory/<stage>_mib; older runs logged bytes as memory/<name> or memory.<name>).
MEMORY_STAGES: dict[str, str] = {
    "model_load_bytes": "model_load_bytes",
    "batch_load_bytes": "batch_load_bytes",
    "backward_bytes": "backward_bytes",
    "optimizer_step_bytes": "optimizer_step_bytes",
    "iteration_peak_bytes": "iteration_peak_bytes",
    "run_peak_bytes": "peak_bytes",
}

# MLflow run status -> outcome in the report (KILLED and tagged optuna.pruned=true: pruned).
OUTCOMES: dict[str, str] = {
    "FINISHED": "finished",
    "FAILED": "failed",
    "KILLED": "failed",
    "RUNNING": "running",
    "SCHEDULED": "running",
}
# duplicate: a FINISHED run whose config.hash (the seed included) a newer FINISHED run repeats; a
# repeat of one run is not another seed, so it is left out of its row and named in a warning.
# diverged: a FINISHED run tagged run.diverged (non-finite weights or loss, or accuracy at chance:
# dpsweep.run.divergence); it is no baseline and no point of a curve, so it is left out and named.
OUTCOME_ORDER = ("finished", "failed", "pruned", "running", "duplicate", "diverged")
MISSING = "\0missing"  # stands for a param a run did not log, where missing must equal missing

# A private tuning's runs (sweep.private_tuning; dpsweep.tracking.sweeps.release_best tags them): each
# one's ``tuning`` (a report_runs column), the released trial (tag tuning.released=true) or a withheld
# one (any other run of the tuning). A report shows the released trials only, unless asked for all
# (build_report's all_trials): the number of trials K must stay secret (Papernot & Steinke 2022).
RELEASED, WITHHELD = "released", "withheld"
TUNING_ACCOUNTANT = "rdp"  # of epsilon_tuning where a run lacks the tag tuning.accountant (dpsweep.privacy.tuning)
NOT_FOR_RELEASE = "not for release"

# How labels name a hyperparameter (config labels, memory groups, plot titles); others by their key.
SHORT_NAMES = {
    "train.batch_size": "B",
    "dp.noise_multiplier": "σ",
    "dp.max_grad_norm": "C",
    "optimizer.lr": "lr",
    "train.epochs": "epochs",
    "dp.delta": "δ",
    "dp.accountant": "accountant",
    "dp.mechanism": "mechanism",
    "dp.unit": "unit",
    "task.method": "method",
}
KIND_OF_PARAM = {key: name for name, key in PRIVACY_KINDS.items()}  # dp.mechanism -> mechanism

T = TypeVar("T")


class ReportError(InputError):
    """The selection cannot be reported on. ``option`` names the input at fault (``experiment``,
    ``sweep``, ``runs``, ``tracking_uri``, ``format``, ``sort``); the error's ``key`` is its flag
    (``--tracking-uri``), ``value`` its value and ``allowed`` what is allowed."""

    def __init__(self, option: str, value: Any, reason: str) -> None:
        super().__init__("--" + option.replace("_", "-"), value, reason)


def lookup(registry: Registry[T], name: str, option: str) -> T:
    """``registry``'s entry ``name``; an unknown name raises ReportError listing the valid ones."""
    if name not in registry:
        raise ReportError(option, name, f"unknown {registry.kind}; valid: {', '.join(registry.names())}")
    return registry.get(name)


def column(frame: pd.DataFrame, name: str) -> pd.Series:
    """``frame[name]``, or all-missing when no run has it (a param, metric or tag nobody logged)."""
    if name in frame.columns:
        return frame[name]
    return pd.Series(np.nan if name.startswith("metrics.") else None, index=frame.index, dtype=object)


def memory_column(frame: pd.DataFrame, name: str) -> pd.Series:
    """Memory figure ``name`` (``backward_bytes``) of each run, in bytes: logged in MiB as
    ``metrics.system/memory/backward_mib`` (:func:`dpsweep.memory.tables.metric`), or in bytes as
    ``metrics.memory/backward_bytes`` (runs logged before issue 56) or ``metrics.memory.backward_bytes``
    (dpsweep <= 0.2)."""
    current = pd.to_numeric(column(frame, f"metrics.{metric(name)}"), errors="coerce") * BYTES_PER_UNIT
    for prefix in (OLD_PREFIX, LEGACY_PREFIX):
        current = current.where(current.notna(), column(frame, f"metrics.{prefix}{name}"))
    return current


def param_or_tag(frame: pd.DataFrame, key: str) -> pd.Series:
    """The param ``key``, falling back to the tag of the same name (e.g. dp.delta, dp.accountant)."""
    return column(frame, f"params.{key}").where(column(frame, f"params.{key}").notna(), column(frame, f"tags.{key}"))


def objective_notes() -> dict[str, str]:
    """Objective metric -> what it measures, for the notes under a table (tasks that say)."""
    return {cls.objective: cls.objective_note for cls in task_schemas().values() if cls.objective_note}


def sampling_tasks() -> list[str]:
    """The tasks whose runs log sample grids (samples/epoch_NNN.png)."""
    return [name for name, cls in task_schemas().items() if cls.logs_samples]


def row_shares() -> list[str]:
    """The per-run shares (and their baselines) that tasks average per row, in the table's order."""
    return list(dict.fromkeys(m for cls in task_schemas().values() for m in cls.row_share if m))


def objective_name(metric: str) -> str:
    """``test accuracy``, ``TSTR accuracy``: a metric as a header or an axis names it."""
    labels = {cls.objective: cls.objective_label for cls in task_schemas().values() if cls.objective_label}
    return labels.get(metric, metric.replace("_", " "))


def run_tasks(runs: pd.DataFrame) -> pd.Series:
    """Each run's task (param, else tag ``task.name``; runs from before tasks: the classifier)."""
    return param_or_tag(runs, "task.name").astype(object).fillna(DEFAULT_TASK).astype(str)


def run_models(runs: pd.DataFrame) -> pd.Series:
    """What the table's ``model`` column shows for each run: its model.name, or its task's name for
    a task whose model group is only an evaluation model (``dpsweep.config.shown_model``)."""
    schemas = task_schemas()
    models = param_or_tag(runs, "model.name")
    shown = [
        shown_model(schemas[task], model) if task in schemas else model
        for task, model in zip(run_tasks(runs), models, strict=True)
    ]
    return pd.Series(shown, index=runs.index, dtype=object)


# A task's method (issue 56, item 9): the param of a task whose schema has a ``method`` field, e.g. the
# ratings task's als, popularity, dpam and sgd, whose rows all show the task's name as their model.
METHOD_PARAM = "task.method"


def method_tasks() -> dict[str, str]:
    """Task name -> its default method, for the tasks whose schema has a ``method`` field."""
    out = {}
    for name, schema in task_schemas().items():
        found = [f for f in dataclasses.fields(schema) if f.name == METHOD_PARAM.split(".", 1)[1]]
        if found and isinstance(found[0].default, str):
            out[name] = found[0].default
    return out


def run_methods(runs: pd.DataFrame) -> pd.Series:
    """Each run's method (param, else tag ``task.method``; a run without either, its task's default) for
    the runs of a task with methods (:func:`method_tasks`); None for the others."""
    defaults = method_tasks()
    logged = param_or_tag(runs, METHOD_PARAM).astype(object)
    shown = [
        (defaults[task] if pd.isna(value) else str(value)) if task in defaults else None
        for task, value in zip(run_tasks(runs), logged, strict=True)
    ]
    return pd.Series(shown, index=runs.index, dtype=object)


def run_pairs(runs: pd.DataFrame) -> list[tuple[Any, Any]]:
    """(dataset, model) of each run, the model as the table shows it (:func:`run_models`)."""
    return list(zip(param_or_tag(runs, "dataset.name"), run_models(runs), strict=True))


def row_tasks(table: pd.DataFrame) -> pd.Series:
    """The task of each of ``table``'s rows (a table from before the column: the classifier)."""
    return table["task"] if "task" in table else pd.Series(DEFAULT_TASK, index=table.index, dtype=object)


def row_units(table: pd.DataFrame) -> pd.Series:
    """The privacy unit of each of ``table``'s rows: ``example`` where not said (a table from before
    the column, or a non-private row, which protects nothing)."""
    units = table["unit"] if "unit" in table else pd.Series(None, index=table.index, dtype=object)
    return units.astype(object).fillna(PRIVACY_KIND_DEFAULTS["unit"])


def mechanism_order(mechanism: str) -> tuple[int, str]:
    """The default mechanism first, then the registered ones by name, unknown ones after, by name."""
    known = known_mechanisms()
    return (known.index(mechanism) if mechanism in known else len(known), mechanism)


def known_mechanisms() -> list[str]:
    from dpsweep.mechanisms import MECHANISMS  # dp-accounting: imported where a report names mechanisms

    default = PRIVACY_KIND_DEFAULTS["mechanism"]
    return [default, *(m for m in MECHANISMS.names() if m != default)]


def mechanism_label(mechanism: str) -> str:
    """The registered mechanism's label (e.g. DP-SGD); the name itself for one this process lacks."""
    from dpsweep.mechanisms import MECHANISMS

    return MECHANISMS.get(mechanism).label if mechanism in MECHANISMS else mechanism


def mechanism_note(mechanism: str) -> str | None:
    """How the registered mechanism is accounted, in one line; None for one this process lacks."""
    from dpsweep.mechanisms import MECHANISMS

    return MECHANISMS.get(mechanism).note if mechanism in MECHANISMS else None


def mechanism_neighbours(mechanism: str) -> str:
    """The neighbouring relation of a registered mechanism's ε (``?`` for one this process lacks)."""
    from dpsweep.mechanisms import MECHANISMS

    return MECHANISMS.get(mechanism).neighbours if mechanism in MECHANISMS else "?"
