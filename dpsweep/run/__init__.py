"""One run of one config: the runner, its checkpoints, Optuna pruning and the final ε computed ahead."""
