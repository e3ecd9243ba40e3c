"""Hydra 1.3's private composition steps (``hydra._internal``): the door to them.

Hydra's public API composes a whole config (``hydra.compose``, ``ConfigLoader.load_sweep_config``);
it has no public function for the steps inside: applying value overrides to a composed config,
naming a job's ``override_dirname``, checking a multirun's overrides, expanding sweep overrides
into jobs. Each function here is one of those steps, Hydra's own code, so that what dpsweep computes
is what Hydra computes.
"""

from __future__ import annotations

from collections.abc import Sequence

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.override_parser.types import Override
from hydra.types import RunMode
from omegaconf import DictConfig

PRIVATE_NAMES = (  # (module, attribute path): what tests/unit/interop checks still exists
    ("hydra._internal.config_loader_impl", "ConfigLoaderImpl._apply_overrides_to_config"),
    ("hydra._internal.config_loader_impl", "ConfigLoaderImpl.validate_sweep_overrides_legal"),
    ("hydra._internal.config_loader_impl", "get_overrides_dirname"),
    ("hydra._internal.core_plugins.basic_sweeper", "BasicSweeper.split_arguments"),
)


def apply_value_overrides(values: Sequence[Override], cfg: DictConfig) -> None:
    """Apply value overrides (``train.seed=3``, ``+key=v``, ``~key``) to the composed ``cfg`` in place,
    as Hydra does after composing a job's defaults list.

    Private name: ``hydra._internal.config_loader_impl.ConfigLoaderImpl._apply_overrides_to_config``.
    No public API applies overrides to a config already composed (``OmegaConf.update`` knows neither
    ``+``/``++``/``~`` nor Hydra's typed values)."""
    ConfigLoaderImpl._apply_overrides_to_config(list(values), cfg)


def override_dirname(overrides: Sequence[Override], kv_sep: str, item_sep: str, exclude_keys: list[str]) -> str:
    """A job's ``hydra.job.override_dirname`` for its task overrides, as Hydra writes it.

    Private name: ``hydra._internal.config_loader_impl.get_overrides_dirname``. Hydra sets the field
    only while it composes; no public function names it."""
    return get_overrides_dirname(
        overrides=list(overrides), kv_sep=kv_sep, item_sep=item_sep, exclude_keys=list(exclude_keys)
    )


def check_multirun_overrides(overrides: Sequence[Override]) -> None:
    """Raise Hydra's own error for what it refuses among a multirun's command-line overrides (a sweep
    over ``hydra.*`` keys), before any composition.

    Private name: ``hydra._internal.config_loader_impl.ConfigLoaderImpl.validate_sweep_overrides_legal``.
    Hydra runs this check inside its launch; no public API runs it alone."""
    ConfigLoaderImpl.validate_sweep_overrides_legal(list(overrides), RunMode.MULTIRUN, from_shell=True)


def sweep_jobs(overrides: Sequence[Override]) -> list[list[str]]:
    """The override lists of the jobs of a grid sweep (the cartesian product of its axes, the last
    varying fastest), as Hydra's basic sweeper expands them.

    Private name: ``hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments``. No
    public Hydra API expands sweep overrides into jobs. Imported here, at the call, after Hydra's
    plugin scan, which re-executes ``basic_sweeper.py``."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    [jobs] = BasicSweeper.split_arguments(list(overrides), max_batch_size=None)
    return jobs
