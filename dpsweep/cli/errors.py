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

from dpsweep.errors import EXIT_BAD_INPUT, InputError

# Hydra's and OmegaConf's exception bases, by module: a command that never imported them cannot have
# raised them, and not importing them keeps --help and pure-maths commands fast.
CONFIG_ERRORS = (("hydra.errors", "HydraException"), ("omegaconf.errors", "OmegaConfBaseException"))


def bad_input_types() -> tuple[type[BaseException], ...]:
    """The exceptions that mean bad input: InputError, and Hydra's and OmegaConf's where loaded."""
    loaded = [getattr(sys.modules[m], name) for m, name in CONFIG_ERRORS if m in sys.modules]
    return (InputError, *loaded)


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
            except Exception as err:
                if not isinstance(err, bad_input_types()):
                    raise
                return report_bad_input(prog, err)

        return run

    return wrap
