"""dpsweep's commands, on top of the core: each module is one console script.

    dpsweep          dpsweep.cli.train     one run, or a sweep with -m (Hydra)
    dpsweep-plan     dpsweep.cli.plan      the jobs of a sweep with their ε and memory, without training
    dpsweep-epsilon  dpsweep.cli.epsilon   the privacy cost of a DP-SGD setting
    dpsweep-report   dpsweep.cli.report    privacy–accuracy tables and plots from MLflow
    dpsweep-memory   dpsweep.cli.memory    memory probes, fits and predictions
    dpsweep-runs     dpsweep.cli.runs      close the runs whose process died (reconcile)

Every command's ``main(argv)`` runs in-process and returns its exit code; bad input is one line on
stderr and exit code 2 (``dpsweep.cli.errors``).
"""
