"""Each sweep job's config composed at most once, and most of them not at all: the sweeper's
composition is served to the launcher, and jobs that differ only in values share one composition.

Figure (issue 57, ``benchmarks/startup_machinery.py``, 2-core VM shared with other work): a 16-job local
sweep in 136 s against 191 s with Hydra composing every job (CPU 192 s against 209 s), and ``dpsweep-plan``
of 200 jobs in 3.5 s against 32.7 s. It builds on Hydra's private steps, behind ``dpsweep.interop.hydra_private``.

    loader = ComposedJobs(hydra_context.config_loader)
    job_cfg = loader.compose(master, job)               # the sweeper: preflight, hashes, claims
    loader.load_sweep_config(master, [*job, "sweep.parent_run_id=..."])   # the inline launcher

Hydra composes a job in two parts (``ConfigLoaderImpl._load_configuration_impl``, Hydra 1.3): the
defaults list, from the config groups among the overrides, is composed into a config; then the
other overrides (values: ``train.seed=3``, ``+dp.target_epsilon=3``, ``~key``) are applied to it in
order and recorded (``hydra.overrides.task``, ``hydra.job.override_dirname``). The first part is
most of the 0.1 s a composition takes, and the jobs of a grid over values (seeds, σ, learning
rates) share it. So :meth:`ComposedJobs.compose` composes the group overrides once (a *skeleton*)
and gives each job a copy with its value overrides applied by Hydra's own function; Hydra's
classification decides which overrides are groups (``repository.group_exists``, dict values being
values). Jobs with a ``hydra.*`` override (which can move the config search path), or whose values
fail to apply (Hydra's own error then comes from a fresh composition), are composed afresh.

The launcher's overrides are the sweeper's job plus the overrides the sweeper adds once the parent
run exists (``sweep.parent_run_id``), so :meth:`ComposedJobs.load_sweep_config` serves a copy of the
job's kept config with those applied in the same way. Tests check served and composed configs
against fresh compositions, hydra node included.

The submitit launchers compose in their own processes (their Hydra context is pickled into every
job): for them nothing is kept (``keep=False``), but the sweeper's own compositions still share
skeletons.

``dpsweep-plan`` needs each job's typed config only (:meth:`ComposedJobs.typed`): a skeleton is typed
once (``to_config``), each distinct value line is applied once to a copy of the skeleton by Hydra's
function, which gives the leaf's value as the schema types it, and a job's typed config is the
skeleton's with those leaves set (``dataclasses.replace``): no OmegaConf copy per job (7.6 ms a job
before, 2-core VM). That is exact where nothing else in the config depends on the leaf: a job with a
line that is not a plain ``key=value`` on a leaf of the schema (``+``, ``++``, ``~``, a dict or list, an
interpolation) or whose key an interpolation of the config may read (one that names the key's
top-level section: ``${train.seed}`` for every ``train.*``; a relative one for every key) is typed from
its composition.
Tests check typed configs against ``to_config`` of fresh compositions.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
from collections.abc import Iterator, Sequence
from typing import Any

from hydra.core.config_loader import ConfigLoader
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.plugins.config_source import ConfigSource
from hydra.types import RunMode
from omegaconf import Container, DictConfig, ListConfig, OmegaConf, open_dict

from dpsweep.config import Config, to_config
from dpsweep.interop import hydra_private

Leaf = tuple[list[str], Any]  # a leaf's path in the typed config and its typed value
SCALARS = (str, int, float, bool, type(None))


class ComposedJobs(ConfigLoader):
    """A config loader that keeps each job config it composes through :meth:`compose` and serves copies
    of them to :meth:`load_sweep_config`; every other call goes to the loader it wraps."""

    def __init__(self, loader: ConfigLoader, keep: bool = True) -> None:
        self.loader = loader
        self.keep = keep  # False: compose() keeps nothing (a launcher that composes in its own processes)
        self.kept: dict[tuple[str, ...], DictConfig] = {}  # job overrides -> its config, hydra node included
        self.skeletons: dict[tuple[str, ...], DictConfig] = {}  # group overrides -> their composition
        self.bare_skeletons: dict[tuple[str, ...], DictConfig] = {}  # the same without the hydra node
        self.pickled: dict[tuple[tuple[str, ...], bool], bytes] = {}  # (groups, bare) -> the skeleton pickled
        self.parsed: dict[str, Override] = {}  # an override line -> Hydra's parse of it (a grid repeats its lines)
        self.kinds: dict[str, bool | None] = {}  # an override line -> _is_value's answer
        self.typed_skeletons: dict[tuple[str, ...], tuple[Config, list[str]]] = {}  # groups -> typed, interpolations
        self.leaves: dict[tuple[tuple[str, ...], str], Leaf | None] = {}  # (groups, line) -> its leaf; None: compose
        self.served = 0  # configs served from kept (not composed again)
        self.composed = 0  # compositions by Hydra (skeletons and fresh ones)
        self.typed_from_leaves = 0  # typed configs built from a typed skeleton (no OmegaConf copy)

    def compose(self, master: DictConfig, job: Sequence[str]) -> DictConfig:
        """The job's config without the ``hydra`` node (whose job fields exist only at run time); the
        whole config is kept for the launcher."""
        if not self.keep:  # nothing kept: a copy of a skeleton without its hydra node (a third of the copying)
            bare = self._from_skeleton(master, list(job), bare=True)
            if bare is not None:
                return bare
            cfg = self._fresh(master, list(job))
        else:
            full = self._from_skeleton(master, list(job)) or self._fresh(master, list(job))
            self.kept[tuple(job)] = full
            cfg = pickle.loads(pickle.dumps(full))  # a deep copy (see _with_values): 6.5 ms against deepcopy's 17
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def typed(self, master: DictConfig, job: Sequence[str]) -> Config:
        """``to_config(self.compose(master, job))``: the job's typed config, built from its skeleton's typed
        config and its leaves where that is exact (the module doc), and composed where the composer keeps
        each job's config for the launcher (``keep``: the inline launcher runs each job on it)."""
        lines = list(job)
        parsed = self._parse(lines)
        kinds = [self._is_value(o) for o in parsed]
        if None not in kinds and not self.keep:
            groups = tuple(line for line, value in zip(lines, kinds, strict=True) if not value)
            leaves = [self._leaf(master, groups, o) for o, value in zip(parsed, kinds, strict=True) if value]
            if all(leaf is not None for leaf in leaves):
                cfg = self._typed_skeleton(master, groups)[0]
                try:
                    for path, value in (leaf for leaf in leaves if leaf is not None):
                        cfg = _replaced(cfg, path, value)
                except (TypeError, ValueError):  # a field replace() cannot set: composed below
                    pass
                else:
                    self.typed_from_leaves += 1
                    return cfg
        return to_config(self.compose(master, job))

    def _typed_skeleton(self, master: DictConfig, groups: tuple[str, ...]) -> tuple[Config, list[str]]:
        """The skeleton's typed config and the text of its interpolations, once per skeleton."""
        if groups not in self.typed_skeletons:
            bare = self._from_skeleton(master, list(groups), bare=True)
            assert bare is not None  # groups only: always a skeleton
            self.typed_skeletons[groups] = (to_config(bare), list(_interpolations(bare)))
        return self.typed_skeletons[groups]

    def _leaf(self, master: DictConfig, groups: tuple[str, ...], override: Override) -> Leaf | None:
        """The typed value a plain ``key=value`` line sets, as Hydra applies it to a copy of the skeleton;
        None where the job must be typed from its composition (the module doc). Once per distinct line."""
        line = override.input_line or ""
        if (groups, line) in self.leaves:
            return self.leaves[(groups, line)]
        leaf: Leaf | None = None
        value, key = override.value(), override.key_or_group
        plain = override.type == OverrideType.CHANGE and isinstance(value, SCALARS)
        if plain and not (isinstance(value, str) and "${" in value):
            interpolations = self._typed_skeleton(master, groups)[1]
            head = re.compile(rf"(?<![\w.]){re.escape(key.split('.')[0])}\b")
            if not any("${." in text or head.search(text) for text in interpolations):
                applied = self._from_skeleton(master, [*groups, line], bare=True)
                node = OmegaConf.select(applied, key) if applied is not None else None
                if applied is not None and not isinstance(node, Container):
                    leaf = (key.split("."), node)
        self.leaves[(groups, line)] = leaf
        return leaf

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        for n in range(len(sweep_overrides), -1, -1):  # the longest kept job the overrides start with
            kept = self.kept.get(tuple(sweep_overrides[:n]))
            if kept is not None:
                parsed = self._parse(sweep_overrides)
                if any(self._is_value(o) is not True for o in parsed[n:]):
                    break  # a group or hydra.*: composed afresh below (the kept config is not copied for nothing)
                served = self._with_values(pickle.dumps(kept), parsed[n:], parsed)
                if served is not None:
                    self.served += 1
                    return served
                break
        return self._fresh(master_config, sweep_overrides)

    def _fresh(self, master: DictConfig, overrides: list[str]) -> DictConfig:
        self.composed += 1
        return self.loader.load_sweep_config(master, overrides)

    def _parser(self) -> OverridesParser:
        return OverridesParser.create(config_loader=self.loader)

    def _parse(self, lines: Sequence[str]) -> list[Override]:
        """Hydra's parse of each override line, each distinct line parsed once (2 ms a job of three)."""
        for line in lines:
            if line not in self.parsed:
                [self.parsed[line]] = self._parser().parse_overrides([line])
        return [self.parsed[line] for line in lines]

    def _is_value(self, override: Override) -> bool | None:
        """Whether Hydra applies ``override`` to the composed config rather than to the defaults list
        (``hydra._internal.defaults_list.Overrides``); None where that cannot be told here. Each
        distinct line is asked once (the config repository's lookup is 0.9 ms)."""
        line = override.input_line
        if line in self.kinds:
            return self.kinds[line]
        repository = getattr(self.loader, "repository", None)
        kind = None
        if not (override.is_hydra_override() or override.package is not None or repository is None):
            kind = isinstance(override.value(), dict) or not repository.group_exists(override.key_or_group)
        if line is not None:
            self.kinds[line] = kind
        return kind

    def _from_skeleton(self, master: DictConfig, job: list[str], bare: bool = False) -> DictConfig | None:
        """The job's config as a copy of the composition of its group overrides, with its value
        overrides applied (``bare``: without the hydra node); None where the job must be composed
        afresh (see the module doc)."""
        parsed = self._parse(job)
        kinds = [self._is_value(o) for o in parsed]
        if None in kinds:
            return None
        groups = tuple(line for line, value in zip(job, kinds, strict=True) if not value)
        skeleton = self.skeletons.get(groups)
        if skeleton is None:
            skeleton = self.skeletons[groups] = self._fresh(master, list(groups))
        if bare:
            if groups not in self.bare_skeletons:
                self.bare_skeletons[groups] = pickle.loads(pickle.dumps(skeleton))  # a deep copy (see _with_values)
                with open_dict(self.bare_skeletons[groups]):
                    del self.bare_skeletons[groups]["hydra"]
            skeleton = self.bare_skeletons[groups]
        values = [o for o, value in zip(parsed, kinds, strict=True) if value]
        data = self.pickled.get((groups, bare))
        if data is None:
            data = self.pickled[(groups, bare)] = pickle.dumps(skeleton)
        return self._with_values(data, values, parsed)

    def _with_values(self, base: bytes, values: list[Override], job: list[Override]) -> DictConfig | None:
        """A copy of the config pickled in ``base`` (its resolver cache, copied from the master config by
        Hydra, included) with ``values`` applied as Hydra applies a job's overrides after composing its
        defaults, and recorded as the overrides of ``job``; None where ``values`` hold what changes the
        composition itself, or fail to apply.

        The copy is made through pickle, OmegaConf's own protocol for a config's whole state: a
        skeleton's bytes unpickle in 0.8 ms against ``copy.deepcopy``'s 5.1 ms (the bare default
        config, 2-core VM), most of what planning a grid of 10,000 jobs took."""
        if any(self._is_value(o) is not True for o in values):
            return None  # a config group or hydra.*: the composition itself changes
        cfg: DictConfig = pickle.loads(base)
        try:
            hydra_private.apply_value_overrides(values, cfg)  # Hydra's own step (no public API)
        except Exception:  # a fresh composition raises Hydra's own error for it
            return None
        if "hydra" not in cfg:  # a bare skeleton's copy: no overrides to record
            return cfg
        task = [o for o in job if not o.is_hydra_override()]
        dirname = cfg.hydra.job.config.override_dirname
        with open_dict(cfg.hydra):
            cfg.hydra.overrides.task = [o.input_line for o in task]
            cfg.hydra.job.override_dirname = hydra_private.override_dirname(
                task, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep, exclude_keys=list(dirname.exclude_keys)
            )
        return cfg

    # the rest of the ConfigLoader interface: the wrapped loader's
    def load_configuration(
        self,
        config_name: str | None,
        overrides: list[str],
        run_mode: RunMode,
        from_shell: bool = True,
        validate_sweep_overrides: bool = True,
    ) -> DictConfig:
        return self.loader.load_configuration(config_name, overrides, run_mode, from_shell, validate_sweep_overrides)

    def get_search_path(self) -> ConfigSearchPath:
        return self.loader.get_search_path()

    def get_sources(self) -> list[ConfigSource]:
        return self.loader.get_sources()

    def list_groups(self, parent_name: str) -> list[str]:
        return self.loader.list_groups(parent_name)

    def get_group_options(
        self,
        group_name: str,
        results_filter: ObjectType | None = ObjectType.CONFIG,
        config_name: str | None = None,
        overrides: list[str] | None = None,
    ) -> list[str]:
        return self.loader.get_group_options(group_name, results_filter, config_name, overrides)

    def compute_defaults_list(self, config_name: str | None, overrides: list[str], run_mode: RunMode) -> Any:
        return self.loader.compute_defaults_list(config_name, overrides, run_mode)


def _interpolations(cfg: DictConfig | ListConfig) -> Iterator[str]:
    """The text of every interpolation in ``cfg`` (``${train.seed}``, ``${dpsweep.gpus_or_one:}``): each
    string of its unresolved container that holds one (an escaped ``\\${`` too, which only costs a
    composition)."""
    yield from _strings_with("${", OmegaConf.to_container(cfg, resolve=False))


def _strings_with(text: str, value: Any) -> Iterator[str]:
    if isinstance(value, str) and text in value:
        yield value
    elif isinstance(value, dict | list):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _strings_with(text, item)


def _replaced(obj: Any, path: list[str], value: Any) -> Any:
    """A copy of the dataclass ``obj`` with the field at ``path`` set to ``value`` (the dataclasses on the way
    copied, the others shared); TypeError where a step of the path is not a dataclass's field."""
    name = path[0]
    if not dataclasses.is_dataclass(obj) or name not in {f.name for f in dataclasses.fields(obj)}:
        raise TypeError(f"{name!r} is not a field of {type(obj).__name__}")
    inner = value if len(path) == 1 else _replaced(getattr(obj, name), path[1:], value)
    return dataclasses.replace(obj, **{name: inner})  # type: ignore[type-var]
