"""Each inline sweep job's config composed once: the sweeper's composition is served to the launcher.

    loader = ComposedJobs(hydra_context.config_loader)
    job_cfg = loader.compose(master, job)               # the sweeper: preflight, hashes, claims
    loader.load_sweep_config(master, [*job, "sweep.parent_run_id=..."])   # the inline launcher

Hydra's basic launcher (``launcher=inline``) composes each job's config from its overrides, after the
sweeper composed the same job to check it: about 0.1 s per job, twice. The launcher's overrides are the
sweeper's job plus the overrides the sweeper adds once the parent run exists (``sweep.parent_run_id``),
so :meth:`ComposedJobs.load_sweep_config` takes a copy of the job's kept config and applies those with
Hydra's own override semantics, recording them as a fresh composition does (``hydra.overrides.task``,
``hydra.job.override_dirname``). Anything else (a config group or ``hydra.*`` among the extra overrides,
a job never composed) is composed afresh. A test checks the served configs against fresh compositions.

In-process launchers only: the submitit launchers pickle their Hydra context into every job.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.config_loader import ConfigLoader
from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.config_source import ConfigSource
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict


class ComposedJobs(ConfigLoader):
    """A config loader that keeps each job config it composes through :meth:`compose` and serves copies
    of them to :meth:`load_sweep_config`; every other call goes to the loader it wraps."""

    def __init__(self, loader: ConfigLoader, keep: bool = True) -> None:
        self.loader = loader
        self.keep = keep  # False: compose() keeps nothing (a launcher that composes in its own processes)
        self.kept: dict[tuple[str, ...], DictConfig] = {}  # job overrides -> its config, hydra node included
        self.served = 0  # configs served from kept (not composed again)

    def compose(self, master: DictConfig, job: Sequence[str]) -> DictConfig:
        """The job's config without the ``hydra`` node (whose job fields exist only at run time); the
        whole config is kept for the launcher."""
        full = self.loader.load_sweep_config(master, list(job))
        if self.keep:
            self.kept[tuple(job)] = full
        cfg = copy.deepcopy(full)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        for n in range(len(sweep_overrides), -1, -1):  # the longest kept job the overrides start with
            kept = self.kept.get(tuple(sweep_overrides[:n]))
            if kept is not None:
                served = self._extended(kept, sweep_overrides[n:])
                if served is not None:
                    self.served += 1
                    return served
                break
        return self.loader.load_sweep_config(master_config, sweep_overrides)

    def _extended(self, kept: DictConfig, extra: list[str]) -> DictConfig | None:
        """A copy of ``kept`` with ``extra`` applied as Hydra applies a job's overrides after composing
        its defaults; None where ``extra`` holds what changes the composition itself."""
        parser = OverridesParser.create(config_loader=self.loader)
        parsed = parser.parse_overrides(extra)
        if any(
            o.is_hydra_override() or o.package is not None or self.get_group_options(o.key_or_group) for o in parsed
        ):
            return None  # a config group or hydra.*: the composition itself changes
        cfg = copy.deepcopy(kept)
        ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)
        task = [*cfg.hydra.overrides.task, *(o.input_line for o in parsed)]
        dirname = cfg.hydra.job.config.override_dirname
        with open_dict(cfg.hydra):
            cfg.hydra.overrides.task = task
            cfg.hydra.job.override_dirname = get_overrides_dirname(
                overrides=parser.parse_overrides(task),
                kv_sep=dirname.kv_sep,
                item_sep=dirname.item_sep,
                exclude_keys=dirname.exclude_keys,
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
