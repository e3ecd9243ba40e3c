"""Optuna search, the study side: search spaces, samplers and objectives as registries.

    dpsweep -m search=accuracy_tpe                       # conf/search/accuracy_tpe.yaml
    dpsweep -m search=pareto_nsga2 hydra.sweeper.optuna.n_trials=30

The study runs in ``dpsweep.launchers.optuna_sweeper``; what a training job needs of Optuna (storage,
pruners, the trial reporter) is in the core, ``dpsweep.run.pruning``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from dpsweep.config import RANK_KEYS, ConfigError
from dpsweep.config.launcher import LAUNCHERS
from dpsweep.launchers.nodes import ParamSpec
from dpsweep.registry import Registry


def distribution(name: str, spec: ParamSpec) -> BaseDistribution:
    """The Optuna distribution of a search axis; a clear error for an empty or malformed range."""
    where = f"hydra.sweeper.optuna.params.{name}"
    if spec.type == "categorical":
        if not spec.choices:
            raise ConfigError(where, list(spec.choices), "a non-empty list of choices")
        return CategoricalDistribution(list(spec.choices))
    if spec.type not in ("float", "int"):
        raise ConfigError(f"{where}.type", spec.type, "one of float, int, categorical")
    if spec.low is None or spec.high is None or not spec.low < spec.high:
        raise ConfigError(where, f"[{spec.low}, {spec.high}]", "a range with low < high")
    if spec.log and spec.low <= 0:
        raise ConfigError(f"{where}.low", spec.low, "a positive lower bound for a log-scale range")
    if spec.type == "int":
        step = int(spec.step or 1)
        return IntDistribution(int(spec.low), int(spec.high), log=spec.log, step=step)
    return FloatDistribution(spec.low, spec.high, log=spec.log, step=spec.step)


def grid_values(name: str, spec: ParamSpec) -> list[Any]:
    """The points of an axis for the grid sampler: the choices, or low..high by step."""
    if spec.type == "categorical":
        return list(distribution(name, spec).choices)  # type: ignore[attr-defined]
    distribution(name, spec)  # range checks
    if spec.step is None:
        raise ConfigError(f"hydra.sweeper.optuna.params.{name}.step", None, "a step, to grid-search a numeric range")
    n = math.floor((spec.high - spec.low) / spec.step + 1e-9) + 1
    values = [spec.low + i * spec.step for i in range(n)]
    return [int(v) for v in values] if spec.type == "int" else [round(v, 12) for v in values]


# ---------------------------------------------------------------------------------------------
# objectives: what a trial returns to the study
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Objective:
    directions: tuple[str, ...]
    metrics: tuple[str, ...]  # MLflow metrics, in the order of directions; OBJECTIVE: the task's objective
    extra_overrides: Callable[[float | None], list[str]] = lambda budget: []
    forbidden_params: tuple[str, ...] = ()
    description: str = ""

    @property
    def multi(self) -> bool:
        return len(self.directions) > 1

    def metric_names(self, task_objective: str) -> tuple[str, ...]:
        """The MLflow metrics of a study whose task scores runs by ``task_objective`` (e.g. tstr_accuracy)."""
        return tuple(task_objective if m == OBJECTIVE else m for m in self.metrics)


OBJECTIVE = "objective"  # stands for the task's objective (TaskConfig.objective), e.g. test_accuracy
OBJECTIVES: Registry[Objective] = Registry("objective")
OBJECTIVES.register("accuracy")(
    Objective(("maximize",), (OBJECTIVE,), description="maximise the task's accuracy (test_accuracy, tstr_accuracy)")
)
OBJECTIVES.register("accuracy_epsilon")(
    Objective(("maximize", "minimize"), (OBJECTIVE, "epsilon"), description="the task's accuracy up, ε down")
)
OBJECTIVES.register("accuracy_under_budget")(
    Objective(
        ("maximize",),
        (OBJECTIVE,),
        extra_overrides=lambda budget: [f"dp.target_epsilon={budget}"],
        forbidden_params=("dp.noise_multiplier", "dp.target_epsilon"),
        description="best test_accuracy at ε <= epsilon_budget: each trial calibrates σ to the budget",
    )
)


@dataclass(frozen=True)
class SamplerSpec:
    build: Callable[[int | None, Mapping[str, list[Any]]], optuna.samplers.BaseSampler]
    multi_objective_only: bool = False


SAMPLERS: Registry[SamplerSpec] = Registry("sampler")
SAMPLERS.register("tpe")(SamplerSpec(lambda seed, grid: optuna.samplers.TPESampler(seed=seed)))
SAMPLERS.register("random")(SamplerSpec(lambda seed, grid: optuna.samplers.RandomSampler(seed=seed)))
SAMPLERS.register("grid")(SamplerSpec(lambda seed, grid: optuna.samplers.GridSampler(dict(grid), seed=seed)))
SAMPLERS.register("nsga2")(
    SamplerSpec(lambda seed, grid: optuna.samplers.NSGAIISampler(seed=seed), multi_objective_only=True)
)


def check_search_space(
    params: Mapping[str, ParamSpec], known_keys: Sequence[str], objective: Objective, sampler: str, launcher: str
) -> dict[str, BaseDistribution]:
    """Distributions for the search space; a clear error for an unknown key or empty range, or for a
    run's ranks searched where they are a job's tasks (``launcher``'s spec's ``rank_tasks``, Slurm: every
    trial's job is submitted with the first one's tasks)."""
    if not params:
        raise ConfigError("hydra.sweeper.optuna.params", {}, "at least one parameter to search")
    known = set(known_keys)
    runs_on = LAUNCHERS.get(launcher, key="launcher")
    out = {}
    for name, spec in params.items():
        if name in RANK_KEYS and runs_on.rank_tasks:
            raise ConfigError("hydra.sweeper.optuna.params", name, f"a key other than {name} on {runs_on.said}, where "
                              f"a job's tasks are its ranks: set {name} as an override, one value a study")  # fmt: skip
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.8)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError("hydra.sweeper.optuna.params", name, f"a key of the dpsweep config{hint}")
        if name in objective.forbidden_params:
            raise ConfigError("hydra.sweeper.optuna.params", name, "a parameter this objective does not set itself")
        out[name] = distribution(name, spec)
        if sampler == "grid":
            grid_values(name, spec)
    return out
