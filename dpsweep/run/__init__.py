"""One run of one config: the runner, what its MLflow run records about its config, its checkpoints,
Optuna pruning, and whether it diverged."""
