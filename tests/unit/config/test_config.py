"""Config schemas: every option composes, typos and wrong types fail at composition, and each
range that types cannot express is rejected by validate() with the key, value and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from helpers import REPO, Composer
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf, ReadonlyConfigError

from dpsweep import config
from dpsweep.config import (
    UNITS,
    ConfigError,
    PrivacyUnit,
    population,
    schema,
    to_config,
    validate,
    validate_for_dataset,
)
from dpsweep.data.facts import DatasetFacts
from dpsweep.plan import prepare
from dpsweep.run.records import resolved_yaml

CONF = REPO / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("__"))
OPTIONS = [(g, y.stem) for g in GROUPS for y in sorted((CONF / g).glob("*.yaml"))]

SCHEMA_OF_OPTION = {
    ("dataset", "digits"): config.DigitsConfig,
    ("dataset", "mnist"): config.TorchvisionDatasetConfig,
    ("dataset", "cifar10"): config.TorchvisionDatasetConfig,
    ("dataset", "flowers102"): config.Flowers102Config,
    ("model", "cnn"): config.CNNConfig,
    ("model", "vgg16_frozen"): config.VGG16FrozenConfig,
    ("dataset", "planted_ratings"): config.PlantedRatingsConfig,
    ("dataset", "movielens"): config.MovieLensConfig,
    ("optimizer", "sgd"): config.SGDConfig,
    ("optimizer", "adam"): config.AdamConfig,
}


REQUIRES = {
    "gan": ["task=gan"],
    "planted_ratings": ["task=recommender"],
    "movielens": ["task=recommender"],
}  # what only a task's config has


def test_every_group_has_options() -> None:
    assert {"dataset", "model", "dp", "optimizer", "train", "tracking", "experiment"} <= set(GROUPS)
    assert len(OPTIONS) >= 13


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_to_its_schema(make_cfg: Composer, group: str, option: str) -> None:
    cfg = make_cfg(*REQUIRES.get(group, []), *REQUIRES.get(option, []), f"{group}={option}")
    typed = to_config(cfg)
    assert isinstance(typed, config.Config)
    expected = SCHEMA_OF_OPTION.get((group, option))
    if expected is not None:
        assert type(getattr(typed, group)) is expected
        assert getattr(typed, group).name == option
    if group != "experiment":
        validate(typed)  # every shipped default is in range


def test_dp_off_is_a_disabled_dp_config(make_cfg: Composer) -> None:
    assert to_config(make_cfg("dp=off")).dp.enabled is False
    assert to_config(make_cfg("dp=dpsgd")).dp.enabled is True


def test_defaults_are_digits_cnn_dpsgd_on_sqlite(make_cfg: Composer) -> None:
    with pytest.MonkeyPatch.context():
        cfg = to_config(make_cfg(fast=False))
    assert (cfg.dataset.name, cfg.model.name, cfg.dp.enabled) == ("digits", "cnn", True)
    assert cfg.dataset.image_size == 28


def test_shipped_tracking_default_is_local_sqlite(make_cfg: Composer) -> None:
    from hydra import compose

    assert compose("config").tracking.uri == "sqlite:///mlflow.db"


# Restated on purpose: Hydra checks ${launcher.setup} against the launcher file itself (typed list).
RESTATED = {("launcher/slurm.yaml", "launcher.setup"), ("launcher/sge.yaml", "launcher.setup")}


def _leaves(prefix: str, node: object) -> dict[str, object]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _leaves(f"{prefix}{key}.", value).items()}
    return {prefix.rstrip("."): node}


@pytest.mark.parametrize(
    "path",
    sorted(str(p.relative_to(CONF)) for p in CONF.glob("*/*.yaml") if p.parent.name not in ("experiment", "search")),
)
def test_option_files_state_no_schema_default(path: str) -> None:
    """Defaults are stated once, in the schema: an option file holds only what differs from it."""
    from hydra.core.config_store import ConfigStore

    import dpsweep.conf  # noqa: F401  (registers the schemas)

    raw = OmegaConf.to_container(OmegaConf.load(CONF / path), resolve=False)
    assert isinstance(raw, dict)
    bases = [d for d in raw.pop("defaults", []) if isinstance(d, str) and d.startswith("base_")]
    raw.pop("hydra", None)
    if bases:  # a group option: its keys are those of its schema
        schema = ConfigStore.instance().load(f"{path.split('/')[0]}/{bases[0]}.yaml").node
    else:  # a @package _global_ option (launchers): its keys are those of the root config
        schema = OmegaConf.structured(config.Config)
    defaults = _leaves("", OmegaConf.to_container(schema, resolve=False, enum_to_str=True))
    restated = [
        k for k, v in _leaves("", raw).items() if k in defaults and defaults[k] == v and (path, k) not in RESTATED
    ]
    assert restated == [], f"{path} restates schema defaults: {restated}"


@pytest.mark.parametrize(
    "override",
    [
        "train.bach_size=64",  # misspelt key
        "train.batch_size=abc",  # wrong type
        "model.hidden_units=1.5",  # float for an int
        "train.device=gpu",  # not one of auto, cpu, cuda
        "dp.accountant=gdp",  # not one of rdp, prv
        "dataset.downscale=2",  # key of another dataset's schema
    ],
)
def test_typos_and_wrong_types_fail_at_composition(make_cfg: Composer, override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        make_cfg(override)


@pytest.mark.parametrize("override", ["dataset=imagenet", "model=resnet50", "dp=laplace"])
def test_unknown_option_lists_the_valid_ones(make_cfg: Composer, override: str) -> None:
    with pytest.raises(MissingConfigException) as info:
        make_cfg(override)
    group = override.split("=")[0]
    for option in [o for g, o in OPTIONS if g == group]:
        assert option in str(info.value)


BAD_STATIC = [
    ("dp.noise_multiplier=0", "dp.noise_multiplier", "0.0"),
    ("dp.noise_multiplier=-1", "dp.noise_multiplier", "-1.0"),
    ("dp.max_grad_norm=0", "dp.max_grad_norm", "0.0"),
    ("dp.delta=0", "dp.delta", "0.0"),
    ("dp.delta=1.5", "dp.delta", "1.5"),
    ("train.batch_size=0", "train.batch_size", "0"),
    ("train.epochs=0", "train.epochs", "0"),
    ("train.epochs=-3", "train.epochs", "-3"),
    ("model.hidden_units=0", "model.hidden_units", "0"),
    ("optimizer.lr=0", "optimizer.lr", "0.0"),
    ("dp.target_epsilon=-1", "dp.target_epsilon", "-1.0"),
    ("optimizer.momentum=-0.5", "optimizer.momentum", "-0.5"),
    ("optimizer.weight_decay=-1", "optimizer.weight_decay", "-1.0"),
    ("dataset.test_fraction=1.5", "dataset.test_fraction", "1.5"),
    ("sweep.min_jobs_for_failure_rate=0", "sweep.min_jobs_for_failure_rate", "0"),
    ("sweep.max_failure_rate=0", "sweep.max_failure_rate", "0.0"),
    ("tracking.log_model_max_mib=0", "tracking.log_model_max_mib", "0.0"),
    ("tracking.system_metrics_after_s=-1", "tracking.system_metrics_after_s", "-1.0"),
    ("tracking.system_metrics_interval_s=0", "tracking.system_metrics_interval_s", "0.0"),
]


@pytest.mark.parametrize(("override", "key", "value"), BAD_STATIC, ids=[b[0] for b in BAD_STATIC])
def test_validate_names_key_value_and_allowed(make_cfg: Composer, override: str, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(to_config(make_cfg(override)))
    assert info.value.key == key
    message = str(info.value)
    assert message.startswith(f"{key}={value}")
    assert "invalid:" in message and len(info.value.allowed) > 10


def test_noise_checks_apply_only_with_dp_on(make_cfg: Composer) -> None:
    validate(to_config(make_cfg("dp=off", "dp.noise_multiplier=0", "dp.delta=5")))


def test_target_epsilon_replaces_the_noise_check(make_cfg: Composer) -> None:
    validate(to_config(make_cfg("dp.noise_multiplier=0", "dp.target_epsilon=2.0")))


def test_batch_larger_than_n_is_rejected(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("train.batch_size=2000"))
    with pytest.raises(ConfigError, match=r"train.batch_size=2000 .*N=1437"):
        validate_for_dataset(cfg, n_train=1437)


def test_delta_at_or_above_one_over_n_needs_explicit_permission(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("dp.delta=0.001"))
    with pytest.raises(ConfigError, match=r"dp.delta=0.001 .*1/N.*allow_large_delta"):
        validate_for_dataset(cfg, n_train=1437)
    validate_for_dataset(to_config(make_cfg("dp.delta=0.001", "dp.allow_large_delta=true")), n_train=1437)
    validate_for_dataset(to_config(make_cfg("dp.delta=1e-4")), n_train=1437)  # 1e-4 < 1/1437


def test_adam_betas_and_sweep_settings_without_dp(make_cfg: Composer) -> None:
    with pytest.raises(ConfigError, match=r"optimizer.betas=\[0.9\] is invalid: two decay rates"):
        validate(to_config(make_cfg("optimizer=adam", "optimizer.betas=[0.9]")))
    with pytest.raises(ConfigError, match=r"sweep\.max_epsilon"):  # checked with DP off too
        validate(to_config(make_cfg("dp=off", "sweep.max_epsilon=-1")))


def test_flowers_train_splits_must_not_repeat(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("dataset=flowers102", "model=vgg16_frozen", "dataset.train_splits=[train,train]"))
    with pytest.raises(ConfigError, match="without repeats"):
        validate(cfg)


def test_flowers_train_splits_must_exclude_test(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("dataset=flowers102", "model=vgg16_frozen", "dataset.train_splits=[train,test]"))
    with pytest.raises(ConfigError, match=r"dataset.train_splits"):
        validate(cfg)


def test_flatten_uses_dotted_keys_and_plain_values(make_cfg: Composer) -> None:
    flat = config.flatten(make_cfg("dp.noise_multiplier=1.3"))
    assert flat["dp.noise_multiplier"] == 1.3
    assert flat["dp.accountant"] == "pld"  # enums become their names
    assert flat["train.device"] == "auto"
    assert "tracking.uri" in flat
    assert not any(isinstance(v, dict) for v in flat.values())


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["experiment=demo"],
        ["experiment=dpgan_digits"],
        ["experiment=ftrl_vs_sgd_digits_users"],
        ["experiment=flowers_vgg16", "dp=off", "optimizer=adam"],
        ["dp.target_epsilon=3", "dp.clipping=quantile", "dataset=cifar10", "model=mlp", "launcher=slurm"],
        ["dataset.users=partition", "dp.unit=user", "dp.grad_sample_mode=fused", "train.device=cpu"],
    ],
)
def test_a_typed_config_flattens_as_omegaconf_flattens_it(make_cfg: Composer, overrides: list[str]) -> None:
    """The dataclass walk gives what OmegaConf.structured would (the config hash rests on it)."""
    cfg = to_config(make_cfg(*overrides))
    through_omegaconf = schema._flatten(OmegaConf.structured(cfg))
    walked = config.flatten(cfg)
    assert list(walked.items()) == list(through_omegaconf.items())
    assert [type(v) for v in walked.values()] == [type(v) for v in through_omegaconf.values()]


def test_a_typed_config_is_made_structured_once_and_read_only(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("dp.noise_multiplier=1.3"))
    node = config.structured(cfg)
    assert node is config.structured(cfg)  # made once per config
    assert OmegaConf.to_container(node) == OmegaConf.to_container(OmegaConf.structured(cfg))
    with pytest.raises(ReadonlyConfigError):
        node.dp.noise_multiplier = 2.0
    flat = config.flatten(cfg)
    flat["dp.noise_multiplier"] = 9.0  # a copy for the caller
    assert config.flatten(cfg)["dp.noise_multiplier"] == 1.3
    other = dataclasses.replace(cfg, dp=dataclasses.replace(cfg.dp, noise_multiplier=2.0))
    assert config.flatten(other)["dp.noise_multiplier"] == 2.0 and config.structured(other) is not node


def test_the_logged_config_has_the_calibrated_noise(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("dp.target_epsilon=3"))
    plan = prepare(cfg, DatasetFacts(1437, (1, 28, 28), 10))
    assert plan.privacy is not None and plan.privacy.noise_multiplier != cfg.dp.noise_multiplier
    logged = yaml.safe_load(resolved_yaml(plan))
    assert logged["dp"]["noise_multiplier"] == plan.privacy.noise_multiplier
    assert logged["dp"]["target_epsilon"] == 3 and logged["train"] == yaml.safe_load(OmegaConf.to_yaml(cfg.train))
    assert config.structured(cfg).dp.noise_multiplier == cfg.dp.noise_multiplier  # the run's config as given


def test_to_config_rejects_a_plain_mapping() -> None:
    with pytest.raises(TypeError, match="schema"):
        to_config(OmegaConf.create({"dataset": {"name": "digits"}}))


def test_every_privacy_unit_says_whom_it_protects_and_its_n(make_cfg: Composer) -> None:
    """dpsweep.config.UNITS: one entry per dp.unit; N is the training examples or the unit's own key."""
    assert set(UNITS) == {u.value for u in PrivacyUnit}
    assert population(to_config(make_cfg()), 1437) == 1437
    users = to_config(make_cfg("dp.unit=user", "dataset.users=partition", "dataset.num_users=50"))
    assert population(users, 1437) == 50 and UNITS["user"].population_key == "dataset.num_users"
    assert population(to_config(make_cfg("dp=off", "dataset.num_users=50")), 1437) == 1437  # no DP: no unit


def test_the_config_checks_ask_a_tasks_declarations_not_its_name(
    make_cfg: Composer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several devices, an audit, an engine: the task's ClassVars decide (TaskConfig.distributed, audits,
    engines), so a task that declares more is let through without a line of the checks changing."""
    cases = [
        (config.GanTaskConfig, "distributed", True, ["task=gan", "train.devices=2"], "task"),
        (
            config.RecommenderTaskConfig,
            "audits",
            ("black_box",),
            ["task=recommender", "audit.mode=black_box"],
            "audit.mode",
        ),
        (config.GanTaskConfig, "engines", ("opacus", "fused"), ["task=gan", "dp.engine=fused"], "dp.engine"),
    ]
    for schema_class, name, declared, overrides, key in cases:
        cfg = to_config(make_cfg(*overrides))
        with pytest.raises(ConfigError) as err:
            validate(cfg)
        assert err.value.key == key, str(err.value)
        monkeypatch.setattr(schema_class, name, declared)
        validate(cfg)
