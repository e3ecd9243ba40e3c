"""What every console script does around its ``main``: the command line's secrets handed over first
(``dpsweep.tracking.credentials``: before Hydra or argparse reads it, so that neither writes a password
anywhere), then ``main``, then its exit, an interrupt said in one line (``dpsweep.process.shutdown``).

    def console() -> NoReturn:
        run_script(main, "dpsweep-report")
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from dpsweep.cli.errors import report_bad_input
from dpsweep.errors import InputError
from dpsweep.process.shutdown import run_then_exit

URI_ENVIRONMENT = ("MLFLOW_TRACKING_URI",)  # dpsweep.tracking.credentials.URI_ENVIRONMENT (a test checks)


def run_script(main: Callable[..., Any], prog: str) -> NoReturn:
    """``main`` as the console script ``prog`` (module docstring)."""
    if any("://" in a for a in sys.argv) or any("://" in os.environ.get(n, "") for n in URI_ENVIRONMENT):
        # only then: dpsweep.tracking imports the config's schemas (Hydra), which dpsweep-epsilon never needs
        from dpsweep.tracking import credentials

        try:
            credentials.clean_argv(sys.argv)
        except InputError as err:
            sys.exit(report_bad_input(prog, err))
    run_then_exit(main, prog)
