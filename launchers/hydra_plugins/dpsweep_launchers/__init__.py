"""Hydra plugin shim: Hydra instantiates plugins only from classes defined under ``hydra_plugins``.

The code lives in ``dpsweep.launchers``; these subclasses give it the module path Hydra requires
(``_target_: hydra_plugins.dpsweep_launchers.<Class>``), and each launcher keeps the spec of the class it
derives from (``spec``: what it can do, ``dpsweep.config.launcher.LAUNCHERS``). A wheel install is found
by Hydra's plugin scan; ``dpsweep.config`` also registers them, for editable installs the scan cannot see.
"""

from dpsweep.launchers import hydra_launchers, sweeper


class InlineLauncher(hydra_launchers.InlineLauncher):
    """Sweep jobs one after another in the sweep's process."""


class LocalLauncher(hydra_launchers.LocalLauncher):
    """Sweep jobs as local processes (submitit's local executor)."""


class SlurmLauncher(hydra_launchers.SlurmLauncher):
    """Sweep jobs as one Slurm job array."""


class SgeLauncher(hydra_launchers.SgeLauncher):
    """Sweep jobs as one Grid Engine array job."""


class DpsweepSweeper(sweeper.DpsweepSweeper):
    """Grid sweeps and Optuna studies that record failures, go on, and summarise."""


PLUGINS = (InlineLauncher, LocalLauncher, SlurmLauncher, SgeLauncher, DpsweepSweeper)
