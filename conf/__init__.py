"""dpsweep's Hydra configs, installed as the package ``dpsweep.conf`` (``pkg://dpsweep.conf``)."""
