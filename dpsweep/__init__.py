"""dpsweep: experiments and hyperparameter sweeps for differentially private deep learning.

Hydra composes the configs (``conf/``), Opacus and ``torch.func`` train, MLflow records every run.
One folder per concept; layers point one way, from the top (checked by ``make lint``):

- ``cli``: one module per console script; ``launchers`` (sweeps) and ``analysis`` (reports) are
  installed inside this namespace from the repository's top-level folders;
- ``run``: one run of one config (``dpsweep.run.runner.train``), its checkpoints, Optuna pruning;
- ``tasks``: what a run trains (``classifier``, ``gan``, ``recommender``), in a registry by ``task.name``;
- ``plan``: everything decided about a run before it starts (``prepare``);
- ``memory``, ``mechanisms`` and ``audit``: memory stages and predictions; how each DP mechanism trains;
  a one-run privacy audit's canaries and its ε lower bound;
- ``models``; then ``tracking`` (MLflow runs that always end) and ``data`` (datasets, users);
- ``config``: the typed schema and its checks;
- ``privacy``: accounting without torch (ledger, RDP, schedules, private statistics, tuning);
- base: ``process``, ``units``, ``registry``, ``errors``.
"""

__version__ = "0.1.0"
