"""The root :class:`Config`, its registration in Hydra's ConfigStore, and what is done with a whole config.

The YAML files under ``conf/`` hold the values; the dataclasses of the group modules hold the keys and
their types, so a misspelt key or a value of the wrong type fails at composition with Hydra's own message::

    dpsweep train.bach_size=64      # Key 'bach_size' not in 'TrainConfig'
    dpsweep train.device=gpu        # Invalid value 'gpu', expected one of [auto, cpu, cuda]

A key the schema lacks that Hydra added anyway (``+train.bach_size=64``) is refused by :func:`to_config`.
Range checks that types cannot express (``noise_multiplier > 0``, ``delta < 1/N``, ...) are the groups'
own, run by ``dpsweep.config.validate`` and ``validate_for_dataset`` before any training starts.
Here too: flattening to dotted keys, and the part of a config that determines a run's result
(:func:`identity`, :func:`identity_hash`) apart from its :func:`settings`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from dpsweep.config.audit import AuditConfig
from dpsweep.config.checks import ConfigError
from dpsweep.config.dataset import TorchvisionDatasetConfig, dataset_schemas
from dpsweep.config.dp import DPConfig, spelled_as_before
from dpsweep.config.launcher import LauncherConfig
from dpsweep.config.model import CNNConfig, MLPConfig, VGG16FrozenConfig
from dpsweep.config.optimizer import AdamConfig, SGDConfig
from dpsweep.config.sweep import SweepConfig
from dpsweep.config.task import task_schemas
from dpsweep.config.tracking import TrackingConfig
from dpsweep.config.train import TrainConfig


@dataclass
class Config:
    task: Any = MISSING  # a TaskConfig subclass, chosen by the task/ group, with the task's own settings
    dataset: Any = MISSING  # a DatasetConfig subclass, chosen by the dataset/ group
    model: Any = MISSING  # a ModelConfig subclass
    dp: DPConfig = MISSING
    optimizer: Any = MISSING  # an OptimizerConfig subclass
    train: TrainConfig = MISSING
    tracking: TrackingConfig = MISSING
    sweep: SweepConfig = field(default_factory=SweepConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)


def register_configs() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent).

    Each YAML option under ``conf/<group>/`` names its schema first in its defaults list.
    """
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name, task in task_schemas().items():  # every TaskConfig subclass: a new task adds no line here
        cs.store(group="task", name=f"base_{name}", node=task)
    for name, dataset in dataset_schemas().items():  # every named DatasetConfig subclass, as tasks
        cs.store(group="dataset", name=f"base_{name}", node=dataset)
    cs.store(group="dataset", name="base_torchvision", node=TorchvisionDatasetConfig)  # mnist's and cifar10's
    cs.store(group="model", name="base_cnn", node=CNNConfig)
    cs.store(group="model", name="base_mlp", node=MLPConfig)
    cs.store(group="model", name="base_vgg16_frozen", node=VGG16FrozenConfig)
    cs.store(group="dp", name="base_dp", node=DPConfig)
    cs.store(group="optimizer", name="base_sgd", node=SGDConfig)
    cs.store(group="optimizer", name="base_adam", node=AdamConfig)
    cs.store(group="train", name="base_train", node=TrainConfig)
    cs.store(group="tracking", name="base_tracking", node=TrackingConfig)


def to_config(cfg: DictConfig | Config) -> Config:
    """Return the typed :class:`Config` object for a composed DictConfig (or pass one through)."""
    if isinstance(cfg, Config):
        return cfg
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):
        raise TypeError(
            "train() needs a config composed against the dpsweep schema "
            "(hydra.compose(config_name='config') or the dpsweep CLI), got a plain mapping"
        )
    _refuse_unknown_keys(cfg, obj)
    return obj


def _refuse_unknown_keys(given: DictConfig, typed: Config) -> None:
    """Keys the schema lacks (``+train.bach_size=32``: Hydra adds them, and the typed config would drop
    them silently) are refused, with the closest valid keys. Only the keys are compared (the given
    config's node names against the schema's fields), so no value is resolved unless one is refused."""
    for key in _unknown_keys(given, typed):
        value = OmegaConf.select(given, key)
        if isinstance(value, DictConfig):  # name the first value under the unknown node, as a dotted key
            leaf, value = next(iter(_flatten(value).items()), ("", {}))
            key = f"{key}.{leaf}" if leaf else key
        close = nearest_keys(key, list(flatten(typed)))
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(key, value, f"a key of the dpsweep config (this one is not in its schema){hint}")


def _unknown_keys(given: DictConfig, typed: object, prefix: str = "") -> Iterator[str]:
    """The dotted key of each node of ``given`` whose name is no field of the dataclass ``typed`` at the
    same place; below a field that is not a dataclass (a dict of any keys), every key is known."""
    if not dataclasses.is_dataclass(typed):
        return
    names = {f.name for f in dataclasses.fields(typed)}
    for name in map(str, given):
        if name not in names:
            yield prefix + name
        elif isinstance(node := _unresolved_child(given, name), DictConfig):
            yield from _unknown_keys(node, getattr(typed, name), f"{prefix}{name}.")


def _unresolved_child(cfg: DictConfig, key: str) -> Any:
    """``cfg[key]``, or None where reading it would resolve an interpolation or a missing value."""
    return None if OmegaConf.is_interpolation(cfg, key) or OmegaConf.is_missing(cfg, key) else cfg[key]


def flatten(cfg: DictConfig | Config) -> dict[str, Any]:
    """Flatten a config to dotted keys: ``{"dp.noise_multiplier": 1.0, ...}`` (enums as strings).
    A typed config is walked as its dataclasses (what ``OmegaConf.structured`` would give, in about
    a thousandth of the time: a plan of 10,000 jobs hashes each; tests compare the two)."""
    if isinstance(cfg, DictConfig):
        return _flatten(cfg)
    out: dict[str, Any] = {}
    _walk_typed(cfg, "", out)
    return out


def schema_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key the schema's dataclasses declare (a group's base schema: a dataset's own keys
    are those of its subclass), for did-you-mean hints before any config is composed."""
    import typing

    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints.get(f.name)
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            keys += [f"{prefix}{f.name}", *schema_keys(kind, f"{prefix}{f.name}.")]
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _walk_typed(value: Any, key: str, out: dict[str, Any]) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _walk_typed(getattr(value, f.name), f"{key}.{f.name}" if key else f.name, out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk_typed(v, f"{key}.{k}" if key else str(k), out)
    else:
        out[key] = _plain(value)


def _plain(value: Any) -> Any:
    """A leaf as ``OmegaConf.to_container(..., enum_to_str=True)`` gives it: enums by name, tuples
    as lists, containers inside lists converted too."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def structured(cfg: Config) -> DictConfig:
    """``OmegaConf.structured(cfg)``, read-only, made once per config (it takes about 15 ms, and a
    run asks for it again for its ``config.yaml``)."""
    key = repr(cfg)  # a dataclass's repr holds every field
    if key not in _STRUCTURED:
        if len(_STRUCTURED) >= 64:
            _STRUCTURED.clear()
        node = OmegaConf.structured(cfg)
        OmegaConf.set_readonly(node, True)
        _STRUCTURED[key] = node
    return _STRUCTURED[key]


_STRUCTURED: dict[str, DictConfig] = {}


def _flatten(node: DictConfig) -> dict[str, Any]:
    container = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", container)
    return out


# Keys that do not change what a run computes: where it is tracked, launched or checkpointed.
NON_IDENTITY_PREFIXES = (
    "tracking.", "launcher.", "sweep.", "train.checkpoint_dir", "train.progress", "train.eval_batch_size",
    "train.eval_every", "train.memory_model", "model.feature_cache_dir", "task.grid_every", "task.memorisation_",
)  # fmt: skip


# Keys only some tasks have: a task's own settings (task.* besides task.name). A report compares them
# over the rows that have them.
TASK_SECTIONS = ("task",)


def identity(flat: dict[str, Any]) -> dict[str, Any]:
    """The part of a flattened config that determines the run's result (for hashes and resume).

    Without DP, σ, C, δ and the accountant have no effect, so only ``dp.enabled`` is kept; without an
    audit (``audit.mode=off``) none of ``audit.*`` is (a plain run's hash and params are as before audits);
    ``train.devices`` and ``train.nodes`` only above 1 (ranks draw their batches otherwise than one process);
    ``dp.engine`` only where set, and an engine once spelt as a ``dp.grad_sample_mode`` as that
    (:func:`dpsweep.config.dp.spelled_as_before`: both spellings, and the runs before, share one hash).
    """
    flat = spelled_as_before(flat)
    dp_off = flat.get("dp.enabled") is False
    audit_off = flat.get("audit.mode", "off") == "off"
    return {
        k: v
        for k, v in flat.items()
        if not k.startswith(NON_IDENTITY_PREFIXES)
        and not (dp_off and k.startswith("dp.") and k != "dp.enabled")
        and not (audit_off and k.startswith("audit."))
        and not (k in ("train.devices", "train.nodes") and v == 1)
    }


def identity_hash(flat_identity: dict[str, Any]) -> str:
    """Stable hash of a flattened config's identity (keys sorted; values as JSON): resume and skipping."""
    blob = json.dumps(flat_identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


SWEEPER_KEYS = ("sweep.id", "sweep.parent_run_id")  # what dpsweep's grid sweeper adds to every job


def given_overrides(overrides: Sequence[str]) -> list[str]:
    """A job's overrides as the user gave them, without those the sweeper added (SWEEPER_KEYS)."""
    return [o for o in overrides if o.partition("=")[0] not in SWEEPER_KEYS]


def swept_keys(jobs: Sequence[Sequence[str]]) -> list[str]:
    """The keys the user's overrides (:func:`given_overrides`) set to several values among ``jobs``, or in
    some jobs only: what tells the jobs apart, in the order first given (``+``/``~`` left off)."""
    values: dict[str, set[str | None]] = {}
    for job in jobs:
        for o in given_overrides(job):
            key, _, value = o.partition("=")
            values.setdefault(key.lstrip("+~"), set()).add(value)
    given = [{o.partition("=")[0].lstrip("+~") for o in given_overrides(job)} for job in jobs]
    return [k for k, v in values.items() if len(v) > 1 or not all(k in keys for keys in given)]


def settings(flat: dict[str, Any]) -> dict[str, Any]:
    """The rest of a flattened config: where a run is tracked, launched or checkpointed
    (NON_IDENTITY_PREFIXES), which does not change what it computes; unset ones left out."""
    return {k: v for k, v in flat.items() if k.startswith(NON_IDENTITY_PREFIXES) and v is not None}


HINTS = 3  # keys a did-you-mean offers at most
MIN_FRAGMENT = 3  # a shorter misspelt name is not looked for inside the schema's names ("lr" is in too many)


def nearest_keys(key: str, keys: Sequence[str], n: int = HINTS) -> list[str]:
    """The keys nearest the misspelt ``key``, nearest first: where some key's last name starts with the
    misspelt last name or holds it (of :data:`MIN_FRAGMENT` letters or more), those, the key's own group
    (``dp.`` of ``dp.noise``) first, then the closest spelled of the rest; else the closest spelled keys
    (difflib, as ``get_close_matches``)."""
    group, _, name = key.rpartition(".")

    def spelling(candidate: str) -> float:
        return difflib.SequenceMatcher(None, key, candidate).ratio()

    holding = []
    for candidate in keys:
        cgroup, _, cname = candidate.rpartition(".")
        if len(name) >= MIN_FRAGMENT and candidate != key and name in cname:
            holding.append(((cgroup != group, not cname.startswith(name), -spelling(candidate)), candidate))
    if holding:
        return [candidate for _, candidate in sorted(holding)[:n]]
    return difflib.get_close_matches(key, list(dict.fromkeys(keys)), n=n, cutoff=0.6)
