"""``python -m dpsweep ...`` is the same as the ``dpsweep`` command."""

from dpsweep.train import main

main()
