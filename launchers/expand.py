"""The jobs of a ``dpsweep -m`` sweep: its overrides expanded into each job's override list.

    expand(["dp.noise_multiplier=0.8,1.2", "train.seed=range(2)"])
    # [["dp.noise_multiplier=0.8", "train.seed=0"], ["dp.noise_multiplier=0.8", "train.seed=1"],
    #  ["dp.noise_multiplier=1.2", "train.seed=0"], ["dp.noise_multiplier=1.2", "train.seed=1"]]

The expansion is Hydra's basic sweeper's, so that dpsweep's sweeper (``dpsweep.launchers.sweeper``)
and ``dpsweep-plan`` (``dpsweep.cli.plan``) list the same jobs, in the order Hydra launches them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hydra.core.config_loader import ConfigLoader


def expand(
    overrides: Sequence[str], params: Mapping[str, object] | None = None, config_loader: ConfigLoader | None = None
) -> list[list[str]]:
    """The override lists of the jobs of ``dpsweep -m <overrides>``, in launch order: the cartesian
    product of the sweep axes (``a,b``, ``range()``, ``choice()``; ``glob()`` needs ``config_loader``),
    the last one varying fastest. ``params`` (``hydra.sweeper.params``) come first; the command line
    overrides a key they share."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dpsweep.interop import hydra_private

    parser = OverridesParser.create(config_loader=config_loader)
    lines = [f"{key}={value}" for key, value in (params or {}).items()] + list(overrides)
    return hydra_private.sweep_jobs(parser.parse_overrides(lines))  # the basic sweeper's own expansion
