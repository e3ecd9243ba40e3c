"""Analysis of logged runs (installed as ``dpsweep.analysis``): privacy-accuracy tables, plots and
memory models built from MLflow runs."""
