"""One run of one config: the runner, its checkpoints, Optuna pruning, and whether it diverged."""
