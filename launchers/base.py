"""What dpsweep's sweepers ask of a launcher: its spec, and three things a sweep tells it before it launches.

    class SlurmLauncher(DpsweepLauncher, ...):      # launchers/hydra_launchers.py
        spec = LAUNCHERS.get("slurm")               # what it can do (dpsweep.config.launcher.LauncherSpec)

    launcher.trials_per_device = k                  # the grid sweeper and the Optuna study, before a launch
    launcher.trials_per_job = t
    launcher.take_ranks(first.train)
    launcher.on_job_done = progress.job_done        # dpsweep.launchers.session

A launcher is a class, a spec and a yaml: a Hydra plugin class (under ``hydra_plugins``, Hydra's rule for
plugins) that derives from :class:`DpsweepLauncher` and names its spec, and ``conf/launcher/<name>.yaml``,
which sets ``launcher.name`` and selects the class. The defaults here are those of a launcher that runs its
jobs one after another and reports them when its batch returns; a launcher that can do more overrides them.
Hydra's own launchers (a user's ``hydra/launcher=basic``) are not :class:`DpsweepLauncher`: the sweepers
tell them nothing, and ask the spec of the config's ``launcher.name``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher

from dpsweep.config.launcher import LauncherSpec


class DpsweepLauncher(Launcher):
    """A Hydra launcher that declares what it can do (:attr:`spec`) and takes what a sweep tells it."""

    spec: ClassVar[LauncherSpec]  # each concrete launcher's own: LAUNCHERS.get(<its name>)
    # K trials per job, each its own process (dpsweep.launchers.packing); set by the sweeper. A launcher
    # whose spec has no processes keeps 1 (the config check refuses more)
    trials_per_device: int = 1
    # T trials per job, one after another in its process (dpsweep.launchers.serial); set by the sweeper. A
    # launcher whose spec has no processes keeps 1 (the config check refuses more)
    trials_per_job: int = 1
    # told of each job's result as the job ends, where the launcher sees it end before its batch returns;
    # set by the sweeper (progress lines). The sweeper reports the others when the batch returns
    on_job_done: Callable[[JobReturn], None] | None = None

    def take_ranks(self, train: Any) -> None:
        """The ranks of the sweep's runs (``train.devices``, ``train.nodes`` of its first run's config),
        for a launcher whose jobs' shape depends on them (``spec.rank_tasks``); others need nothing."""
