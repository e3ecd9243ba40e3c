"""The engines (dpsweep.mechanisms.engines): each states its requirements once and refuses a config that asks
more, naming the key, the value and the engine; a combination of task, mechanism and engine that no owner
declares is refused; a toy engine runs its checks from one registry line; and the old spelling
``dp.grad_sample_mode=fused`` is read as ``dp.engine=fused`` with one warning and the same identity."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
from helpers import Composer

from dpsweep.config import (
    ClassifierTaskConfig,
    ConfigError,
    DPConfig,
    GradSampleMode,
    flatten,
    identity,
    step_kind,
    to_config,
    validate,
)
from dpsweep.config import dp as dp_config
from dpsweep.data.facts import DatasetFacts
from dpsweep.mechanisms import MECHANISMS, engines
from dpsweep.mechanisms.base import EngineTable
from dpsweep.mechanisms.dpsgd import DPSGD
from dpsweep.mechanisms.engines import ENGINES, Engine, engine_of
from dpsweep.plan import config_hash, prepare

DIGITS = DatasetFacts(1437, (1, 28, 28), 10)
USERS = ["dp.unit=user", "dataset.users=partition", "dataset.num_users=50", "train.batch_size=10"]
FTRL = ["dp.mechanism=dpftrl", "optimizer.momentum=0.9"]
FUSED = ["dp.engine=fused"]
OLD_FUSED = ["dp.grad_sample_mode=fused"]
WARNING = "dpsweep: dp.grad_sample_mode=fused is now dp.engine=fused; the old spelling goes in the next release"


def refusal(make_cfg: Composer, *overrides: str) -> ConfigError:
    """The ConfigError that planning ``overrides`` raises (the checks that need no data pass first)."""
    cfg = to_config(make_cfg(*overrides))
    with pytest.raises(ConfigError) as err:
        validate(cfg)
        prepare(cfg, DIGITS)
    return err.value


@pytest.mark.parametrize(
    ("overrides", "key", "value", "allowed"),
    [
        # opacus: per example only; ghost clipping has one fixed norm and no per-sample gradient for a canary
        (["dp.engine=opacus", *USERS], "dp.unit", "user", "example with dp.engine=opacus"),
        (["dp.grad_sample_mode=ghost", "dp.clipping=adaptive"], "dp.clipping", "adaptive",
         "fixed or quantile with dp.mechanism=dpsgd at dp.unit=example (its engine: opacus) and "
         "dp.grad_sample_mode=ghost: Opacus's ghost clipping has a fixed norm"),
        (["dp.grad_sample_mode=ghost", "audit.mode=white_box"], "audit.mode", "white_box",
         "off with dp.mechanism=dpsgd at dp.unit=example (its engine: opacus) and dp.grad_sample_mode=ghost"),
        # own_steps: one fixed C, a step one pass, one process, no Opacus mode
        ([*FTRL, "dp.clipping=quantile"], "dp.clipping", "quantile",
         "fixed with dp.mechanism=dpftrl at dp.unit=example (its engine: own_steps)"),
        ([*USERS, "train.physical_batch_size=5"], "train.physical_batch_size", 5,
         "null with dp.mechanism=dpsgd at dp.unit=user (its engine: own_steps): a step is one pass"),
        ([*FTRL, "dp.grad_sample_mode=ghost"], "dp.grad_sample_mode", "ghost",
         "hooks (its default) with dp.mechanism=dpftrl at dp.unit=example (its engine: own_steps)"),
        ([*FTRL, "train.devices=2"], "train.devices", 2,
         "1 with dp.mechanism=dpftrl at dp.unit=example (its engine: own_steps): its steps are one process's"),
        # fused: its own keys, rows of a pass at least B, fixed C, one process
        ([*FUSED, "dp.clipping=adaptive"], "dp.clipping", "adaptive", "fixed with dp.engine=fused"),
        ([*FUSED, "train.physical_batch_size=16"], "train.physical_batch_size", 16,
         "null with dp.engine=fused: dp.pad_to sets the rows of a pass"),
        ([*FUSED, "dp.pad_to=63"], "dp.pad_to", 63, "an integer at least train.batch_size=64"),
        (["dp.pad_to=96"], "dp.pad_to", 96, "null unless dp.engine=fused (the rows of every pass)"),
        (["dp.compile=true"], "dp.compile", True, "null unless dp.engine=fused"),
        ([*FUSED, "train.devices=2"], "train.devices", 2, "1 with dp.engine=fused: its steps are one process's"),
        # sufficient_statistics: DPALS's rounds clip no gradient
        (["task=recommender", "dp.clipping=quantile"], "dp.clipping", "quantile",
         "fixed with dp.mechanism=dpals at dp.unit=user (its engine: sufficient_statistics)"),
    ],
)  # fmt: skip
def test_each_engine_refuses_what_it_cannot_run_naming_key_value_and_engine(
    make_cfg: Composer, overrides: list[str], key: str, value: object, allowed: str
) -> None:
    err = refusal(make_cfg, *overrides)
    assert (err.key, err.value) == (key, value) and allowed in str(err), str(err)


@pytest.mark.parametrize(
    ("overrides", "key", "value", "allowed"),
    [
        # a mechanism none of whose engines the task takes
        (["dp.mechanism=dpals"], "dp.mechanism", "dpals", "dpftrl or dpsgd with image classification"),
        # an engine the mechanism does not declare at the unit
        ([*FUSED, *FTRL], "dp.mechanism", "dpftrl", "dpsgd with dp.engine=fused at dp.unit=example"),
        (["dp.engine=own_steps"], "dp.mechanism", "dpsgd", "dpftrl with dp.engine=own_steps at dp.unit=example"),
        # an engine the task does not take
        (["task=gan", *FUSED], "dp.engine", "fused", "opacus with task=gan"),
        (["task=recommender", "task.method=dpam", "dp.mechanism=dpsgd", *FUSED], "dp.engine", "fused",
         "sufficient_statistics or own_steps with task=recommender"),
        # an audit the task does not declare, a distributed path it lacks
        (["task=recommender", "audit.mode=black_box"], "audit.mode", "black_box",
         "off with task=recommender: task=recommender is not audited: DP-ALS releases"),
        (["task=gan", "train.devices=2"], "task", "gan", "classifier with train.devices=2: task=gan has no"),
    ],
)  # fmt: skip
def test_a_combination_no_owner_declares_is_refused(
    make_cfg: Composer, overrides: list[str], key: str, value: object, allowed: str
) -> None:
    err = refusal(make_cfg, *overrides)
    assert (err.key, err.value) == (key, value) and allowed in str(err), str(err)


@pytest.mark.parametrize(
    ("overrides", "engine"),
    [
        ([], "opacus"), (USERS, "own_steps"), (FTRL, "own_steps"), ([*FTRL, *USERS], "own_steps"),
        (FUSED, "fused"), ([*FUSED, *USERS], "fused"), (OLD_FUSED, "fused"),
        (["task=recommender"], "sufficient_statistics"),
        (["task=recommender", "task.method=dpam", "dp.mechanism=dpsgd"], "own_steps"), (["task=gan"], "opacus"),
    ],
)  # fmt: skip
def test_null_is_the_mechanisms_own_engine_at_the_unit_and_each_combination_declared_plans(
    make_cfg: Composer, overrides: list[str], engine: str
) -> None:
    cfg = to_config(make_cfg(*overrides))
    validate(cfg)
    assert engine_of(cfg).name == engine and engines.check(cfg).name == engine


def test_a_toy_engine_is_asked_as_the_others_from_one_registry_line(
    make_cfg: Composer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine, a mechanism that declares it and a task that takes it, none of them named by the checks."""
    toy = Engine("toy", "a toy engine", units=("example",), clipping=("fixed", "quantile"), distributed=True)
    monkeypatch.setitem(ENGINES._entries, "toy", toy)

    class ToySGD(DPSGD):
        engines_at: ClassVar[EngineTable] = {"example": ("toy",)}

    monkeypatch.setitem(MECHANISMS._entries, "toysgd", ToySGD())
    monkeypatch.setattr(ClassifierTaskConfig, "engines", (*ClassifierTaskConfig.engines, "toy"))
    plan = prepare(to_config(make_cfg("dp.mechanism=toysgd", "dp.clipping=quantile")), DIGITS)
    assert plan.privacy is not None and engine_of(plan.config) is toy
    err = refusal(make_cfg, "dp.mechanism=toysgd", "train.physical_batch_size=8")
    assert err.key == "train.physical_batch_size" and "(its engine: toy): a step is one pass" in str(err), str(err)
    err = refusal(make_cfg, "dp.mechanism=toysgd", *FUSED)
    assert (err.key, err.value) == ("dp.mechanism", "toysgd") and "dpsgd with dp.engine=fused" in str(err), str(err)
    monkeypatch.setattr(ClassifierTaskConfig, "engines", ("opacus", "own_steps", "fused"))
    err = refusal(make_cfg, "dp.mechanism=toysgd")
    assert err.key == "dp.mechanism" and "(it trains through dp.engine=toy)" in str(err), str(err)


def test_the_old_spelling_is_read_as_the_engine_with_one_warning_and_the_same_identity(
    make_cfg: Composer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dp_config, "_warned", set())  # as in a fresh process
    capsys.readouterr()
    old = [to_config(make_cfg(*OLD_FUSED, *more)) for more in ([], USERS)]
    again = to_config(make_cfg(*OLD_FUSED))
    assert capsys.readouterr().err.splitlines() == [WARNING]  # one line a process, however many configs
    new = [to_config(make_cfg(*FUSED, *more)) for more in ([], USERS)]
    assert capsys.readouterr().err == ""
    for o, n in zip(old, new, strict=True):
        assert (o.dp.engine, o.dp.grad_sample_mode) == ("fused", GradSampleMode.hooks)  # every reader sees the engine
        assert flatten(o) == flatten(n) and config_hash(o) == config_hash(n)
    assert config_hash(again) == config_hash(old[0]) != config_hash(to_config(make_cfg()))
    # hashed and logged as before dp.engine existed: a FINISHED run is still skipped, a checkpoint resumes
    assert identity(flatten(new[0]))["dp.grad_sample_mode"] == "fused" and "dp.engine" not in identity(flatten(new[0]))
    assert "dp.engine" not in identity(flatten(to_config(make_cfg())))
    assert identity(flatten(to_config(make_cfg("dp.engine=opacus"))))["dp.engine"] == "opacus"
    by_hand = DPConfig(grad_sample_mode=GradSampleMode.fused)
    assert dataclasses.astuple(by_hand) == dataclasses.astuple(DPConfig(engine="fused"))
    assert capsys.readouterr().err == ""


def test_the_step_kind_names_the_fused_step_as_the_memory_model_always_has(make_cfg: Composer) -> None:
    """``grad_sample_mode`` of a dpsweep-memory fit: Opacus's mode, ``fused`` for the fused engine, ``none``
    without DP."""
    assert step_kind(to_config(make_cfg(*FUSED)).dp) == "fused"
    assert step_kind(to_config(make_cfg("dp.grad_sample_mode=ghost")).dp) == "ghost"
    assert step_kind(to_config(make_cfg(*FTRL)).dp) == "hooks"
    assert step_kind(to_config(make_cfg("dp=off", *FUSED)).dp) == "none"
    assert engines.step_kind(to_config(make_cfg(*OLD_FUSED))) == "fused"
