"""``train(cfg)``: one run of one config, importable (the runner, ``dpsweep.runner``, does the work).

    from hydra import compose, initialize_config_module
    from dpsweep.train import train
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        result = train(compose("config", overrides=["train.epochs=2"]))
    result.test_accuracy, result.epsilon, result.run_id

The ``dpsweep`` command is ``dpsweep.cli.train``.
"""

from dpsweep.runner import OverBudget, TrainResult, train

__all__ = ["OverBudget", "TrainResult", "train"]
