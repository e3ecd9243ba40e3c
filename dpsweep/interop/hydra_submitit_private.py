"""hydra-submitit-launcher's subclass hook, whose name is private: the door to it.

dpsweep's launchers (local, Slurm, Grid Engine) subclass the plugin's ``BaseSubmititLauncher`` as
its own ``LocalLauncher`` and ``SlurmLauncher`` do: by setting the class attribute ``_EXECUTOR``, the
submitit executor the launcher builds (``submitit.AutoExecutor(cluster=_EXECUTOR)``). The plugin has
no public way to choose it; the name is listed here so that a test fails the day it moves.
"""

from __future__ import annotations

BASE = "hydra_plugins.hydra_submitit_launcher.submitit_launcher:BaseSubmititLauncher"
PLUGIN_INTERFACE: dict[str, tuple[str, ...]] = {BASE: ("_EXECUTOR",)}


def plugin_names() -> frozenset[str]:
    """Every private name of :data:`PLUGIN_INTERFACE`."""
    return frozenset(name for names in PLUGIN_INTERFACE.values() for name in names)
