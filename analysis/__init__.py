"""Analysis of logged runs (installed as ``dpsweep.analysis``): privacy–accuracy reports (the ``report`` package:
tables, notes, renderers and plots) and memory models built from MLflow runs, and plots of ε against each DP knob."""
