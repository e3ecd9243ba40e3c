"""The engines (dpsweep.mechanisms.engines): each states its requirements once and refuses a config that asks
more, naming the key, the value and the engine; a combination of task, mechanism and engine that no owner
declares is refused; a toy engine runs its checks from one registry line; and the old spelling
``dp.grad_sample_mode=fused`` is read as ``dp.engine=fused`` with one warning and the same identity."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import pytest
from helpers import Composer

from dpsweep.config import (
    ClassifierTaskConfig,
    ConfigError,
    DPConfig,
    GradSampleMode,
    dp,
    flatten,
    identity,
    step_kind,
    to_config,
    validate,
)
from dpsweep.data.facts import DatasetFacts
from dpsweep.mechanisms import MECHANISMS, engines
from dpsweep.mechanisms.base import EngineTable
from dpsweep.mechanisms.dpftrl import DPFTRL
from dpsweep.mechanisms.dpsgd import DPSGD
from dpsweep.mechanisms.engines import ENGINES, Engine, engine_of
from dpsweep.plan import MemoryFiles, config_hash, prepare

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
        # critic: task=gan's own step, one fixed C, a step one pass (once restated by the task)
        (["task=gan", "dp.clipping=quantile"], "dp.clipping", "quantile",
         "fixed with dp.mechanism=dpsgd at dp.unit=example (its engine: critic)"),
        (["task=gan", "train.physical_batch_size=8"], "train.physical_batch_size", 8,
         "null with dp.mechanism=dpsgd at dp.unit=example (its engine: critic): a critic step is one pass"),
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
        (["task=gan", *FUSED], "dp.engine", "fused", "critic with task=gan"),
        (["task=gan", "dp.engine=opacus"], "dp.engine", "opacus", "critic with task=gan"),
        (["task=recommender", "task.method=dpam", "dp.mechanism=dpsgd", *FUSED], "dp.engine", "fused",
         "sufficient_statistics or own_steps with task=recommender"),
        # an audit the task does not declare, a distributed path it lacks
        (["task=recommender", "audit.mode=black_box"], "audit.mode", "black_box",
         "off with task=recommender: task=recommender is not audited: DP-ALS releases"),
        (["task=recommender", "task.method=dpam", "dp.mechanism=dpsgd", "audit.mode=black_box"], "audit.mode",
         "black_box", "task=recommender is not audited: DPAM's item steps are user-level DP-SGD"),
        (["task=recommender", "task.method=sgd", "dp.mechanism=dpsgd", "audit.mode=white_box"], "audit.mode",
         "white_box", "task=recommender is not audited: the joint baseline's steps are user-level DP-SGD"),
        # a task.method the mechanism does not declare it trains (Mechanism.methods)
        (["task=recommender", "task.method=dpam"], "dp.mechanism", "dpals", "dpsgd with task.method=dpam"),
        (["task=recommender", "dp.mechanism=dpsgd"], "dp.mechanism", "dpsgd", "dpals with task.method=als"),
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
        (["task=recommender", "task.method=dpam", "dp.mechanism=dpsgd"], "own_steps"), (["task=gan"], "critic"),
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
    toy = Engine(
        "toy", "a toy engine", units=("example",), clipping=("fixed", "quantile"), distributed=True, steps=print
    )
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
    monkeypatch.setattr(dp, "_warned", set())  # as in a fresh process
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
    assert step_kind(to_config(make_cfg(*OLD_FUSED)).dp) == "fused"


@pytest.mark.parametrize(
    ("overrides", "engine"),
    [
        ([*FTRL, "dp.grad_sample_mode=functorch"], "own_steps"),
        ([*USERS, "dp.grad_sample_mode=ghost"], "own_steps"),
        (["task=gan", "dp.grad_sample_mode=functorch"], "critic"),  # the GAN's old requirement: it means nothing now
    ],
)
def test_a_grad_sample_mode_an_engine_does_not_read_is_ignored_with_one_warning(
    make_cfg: Composer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    overrides: list[str], engine: str,
) -> None:  # fmt: skip
    """Configs that ran before the engines existed (the value was ignored then) plan, with one line a process."""
    monkeypatch.setattr(engines, "_warned", set())  # as in a fresh process
    capsys.readouterr()
    mode = overrides[-1].partition("=")[2]
    for _ in range(2):
        plan = prepare(to_config(make_cfg(*overrides)), DIGITS)
        assert plan.privacy is not None and engine_of(plan.config).name == engine
    said = f"dpsweep: dp.grad_sample_mode={mode} is ignored by dp.engine={engine} (it reads none); it is refused"
    assert capsys.readouterr().err.splitlines() == [f"{said} from the next release"]


def test_a_mechanism_whose_rule_takes_no_canaries_is_refused_a_white_box_audit_before_any_run(
    make_cfg: Composer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule that says only its gradient (``OwnRule.release`` raises on canary rows): its mechanism declares no
    white_box, and the checks ask it, instead of the run failing at its first step."""

    class GradientOnly(DPFTRL):
        audits: ClassVar[tuple[str, ...]] = ("black_box",)

    monkeypatch.setitem(MECHANISMS._entries, "gradient_only", GradientOnly())
    toy = ["dp.mechanism=gradient_only", "optimizer.momentum=0.9"]
    err = refusal(make_cfg, *toy, "audit.mode=white_box")
    assert (err.key, err.value) == ("audit.mode", "white_box"), str(err)
    assert "dp.mechanism=gradient_only at dp.unit=example (its engine: own_steps): its steps let no canary" in str(err)
    assert prepare(to_config(make_cfg(*toy, "audit.mode=black_box")), DIGITS).privacy is not None
    err = refusal(make_cfg, *toy, "train.devices=2")
    assert err.key == "train.devices", str(err)


def test_an_engine_without_a_step_builder_is_refused_where_a_task_builds_steps_before_any_data(
    make_cfg: Composer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new engine that says no way to build a classifier's step would otherwise train through another's."""
    monkeypatch.setitem(ENGINES._entries, "stepless", Engine("stepless", "no builder", units=("example",)))

    class StepLess(DPSGD):
        engines_at: ClassVar[EngineTable] = {"example": ("stepless",)}

    monkeypatch.setitem(MECHANISMS._entries, "stepless_sgd", StepLess())
    monkeypatch.setattr(ClassifierTaskConfig, "engines", (*ClassifierTaskConfig.engines, "stepless"))
    with pytest.raises(ConfigError) as err:
        engines.checked(to_config(make_cfg("dp.mechanism=stepless_sgd")))  # every entry point's early checks
    assert (err.value.key, err.value.value) == ("dp.engine", "stepless") and "Engine.steps" in str(err.value)
    for name in ClassifierTaskConfig.engines[:-1]:  # every engine the classifier takes says how it builds a step
        assert callable(engines.builder(ENGINES.get(name)))


def test_the_runs_config_check_asks_the_engine_before_the_dataset_is_read(make_cfg: Composer) -> None:
    """The runner's checked config (a run, and the dpsweep command before it starts ranks) is the early one."""
    from dpsweep.run.runner import _checked_config

    with pytest.raises(ConfigError) as err:
        _checked_config(make_cfg(*FUSED, "train.physical_batch_size=16"))
    assert err.value.key == "train.physical_batch_size", str(err.value)


@pytest.mark.parametrize(
    ("default", "explicit"),
    [
        ([], ["dp.engine=opacus"]),
        (USERS, [*USERS, "dp.engine=own_steps"]),
        (["task=gan"], ["task=gan", "dp.engine=critic"]),
    ],
)
def test_the_mechanisms_own_engine_given_by_name_is_the_same_run_as_null(
    make_cfg: Composer, default: list[str], explicit: list[str]
) -> None:
    """Same config hash and params: a FINISHED run of either spelling is skipped, a checkpoint resumes."""
    plans = [prepare(to_config(make_cfg(*overrides)), DIGITS) for overrides in (default, explicit)]
    assert plans[0].config_hash == plans[1].config_hash
    assert identity(flatten(plans[1].config)) == identity(flatten(plans[0].config))
    if "task=gan" not in default:  # another engine is another run
        assert prepare(to_config(make_cfg(*default, *FUSED)), DIGITS).config_hash != plans[0].config_hash


def test_a_memory_model_splits_no_step_of_an_engine_whose_step_is_one_pass(
    make_cfg: Composer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan asks ``Engine.physical_batches``: DP-FTRL's own steps and the fused step stay one pass under a
    small GPU budget (a white-box audit of them is planned), Opacus's are split."""
    import pandas as pd

    from dpsweep.analysis import memory_model

    monkeypatch.chdir(tmp_path)
    reference = Path(__file__).resolve().parents[3] / "analysis" / "data" / "cpu_probes_digits.csv"
    memory_model.save_models(tmp_path / "m.json", memory_model.fit_all(pd.read_csv(reference), "cnn"), meta={})
    chosen = ["train.memory_model=m.json", "launcher.gpu_memory=3MiB", "train.batch_size=256"]
    for overrides in ([*FTRL, "audit.mode=white_box"], [*FUSED, "audit.mode=white_box"], []):
        cfg = to_config(make_cfg(*chosen, *overrides))
        plan = prepare(cfg, DIGITS, MemoryFiles().budget(cfg, "cpu-tensors"))
        assert (plan.physical_batch_size is None) == bool(overrides), overrides
