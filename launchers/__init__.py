"""Sweeps (installed as ``dpsweep.launchers``): dpsweep's Hydra sweeper, Optuna studies and private
tuning, and the launchers that run their jobs: inline, local processes, Slurm and Grid Engine (``sge/``),
the last three through submitit.
"""
