"""Bad input, one way for every command: ``<prog>: error: <key>=<value> is invalid: <allowed>`` on
stderr, and exit code 2 (as argparse does for a malformed command line).

    @exits_on_bad_input("dpsweep-plan")
    def main(argv: Sequence[str] | None = None) -> int: ...

:class:`~dpsweep.errors.InputError` is the base of every error that means "the input is wrong"
(config values, flags, dataset files, memory model files, report queries); Hydra's own composition
errors (a misspelt key, a value of the wrong type) are bad input too.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from dpsweep.errors import EXIT_BAD_INPUT, InputError

BAD_INPUT: tuple[type[BaseException], ...] = (InputError, HydraException, OmegaConfBaseException)

P = ParamSpec("P")


def report_bad_input(prog: str, err: BaseException) -> int:
    """Print ``err`` as one line on stderr; returns the exit code (2)."""
    print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def exits_on_bad_input(prog: str) -> Callable[[Callable[P, int]], Callable[P, int]]:
    """Wrap a command's ``main``: bad input becomes one line on stderr and the return code 2."""

    def wrap(main: Callable[P, int]) -> Callable[P, int]:
        @functools.wraps(main)
        def run(*args: P.args, **kwargs: P.kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except BAD_INPUT as err:
                return report_bad_input(prog, err)

        return run

    return wrap
