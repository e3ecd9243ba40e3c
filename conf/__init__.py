"""dpsweep's Hydra configs, installed as the package ``dpsweep.conf`` (``pkg://dpsweep.conf``).

Importing it registers every schema the YAML files name: the run's config schemas
(``dpsweep.config``) and the Hydra nodes of dpsweep's sweeper and launchers
(``dpsweep.launchers.nodes``), plus the ``${dpsweep.gpus_or_one:}`` resolver. Hydra imports this
package before it reads ``config.yaml``, so composing works the same from the ``dpsweep`` command,
``initialize_config_module("dpsweep.conf")`` in Python, and a submitit job that composes again.
This is the one place where the config tree meets the launchers: the core (``dpsweep.config``)
knows nothing of them.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from dpsweep.config import register_configs
from dpsweep.launchers import nodes


def gpus_or_one() -> int:
    """Default number of local jobs at once: one per GPU, or 1 without a GPU."""
    import torch  # heavy: only when a launcher=local config is resolved

    return max(1, torch.cuda.device_count())


OmegaConf.register_new_resolver("dpsweep.gpus_or_one", gpus_or_one, replace=True)
register_configs()
nodes.register()  # hydra/sweeper=dpsweep, hydra/launcher=dpsweep_inline|local|slurm|sge
