"""``python -m dpsweep ...`` is the same as the ``dpsweep`` command."""

from dpsweep.cli.train import main

main()
