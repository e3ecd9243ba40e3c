"""Job launchers for sweeps (installed as ``dpsweep.launchers``).

Today sweeps run through Hydra's basic launcher, one job after the other in the dpsweep process.
Parallel local jobs and the Slurm and Grid Engine launchers (via submitit) land here next.
"""
