"""dpsweep: experiments and hyperparameter sweeps for differentially private deep learning.

Hydra composes the configs (``conf/``), Opacus trains with DP-SGD, MLflow records every run.
Modules, one per concept: ``config``, ``data``, ``models``, ``privacy``, ``memory``, ``tracking``,
``train``; ``dpsweep.launchers`` and ``dpsweep.analysis`` are installed from the top-level
``launchers/`` and ``analysis/`` directories.
"""

__version__ = "0.1.0"
