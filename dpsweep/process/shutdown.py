"""Ending a command's or a sweep job's process: Python's own exit, after a one-line report of an interrupt.

    [project.scripts]
    dpsweep = "dpsweep.cli.train:console"     # console() is run_then_exit(main)
    <interpreter> -u -m dpsweep.launchers.job -u -m submitit.core._submit <folder>   # a sweep job

Figure (issue 57, ``benchmarks/startup_machinery.py``, 2-core VM): ending each process without the
interpreter's teardown (CPython's private ``threading._shutdown`` and ``atexit._run_exitfuncs``, then
``os._exit``) saved 33 CPU s of a 16-job local sweep's 192 but no wall time (145 s with it, 136 s
without, on a shared machine), so it was removed: a process ends as Python ends it.

One public step is kept before that exit. The teardown clears the modules and runs full collections of
every object as it goes (about 1.4 CPU-s for the default run; about 1.5 for the hand-written script of
``benchmarks/overhead.py --vs-script``, which imports the same torch, Opacus and MLflow).
:func:`run_then_exit` collects once (what the run left in reference cycles is finalised now, while every
module is intact), then ``gc.freeze()`` moves what is still alive out of the collector's reach, so the
teardown's collections find nothing to walk: the default 1-epoch run, pinned to one core, took 9.5 CPU-s
and 10.5 s before, 8.1 CPU-s and 9.1 s after (three runs each, 2026-11-29). Threads, atexit handlers,
``weakref.finalize`` callbacks (temporary directories), logging's handlers and the standard streams end
as before. What is still reachable from a module when the process exits is not finalised: a module's
dict outlives its module in a reference cycle that only a collection frees, so a file left open in a
global loses what it had buffered. Python never promised otherwise ("It is not guaranteed that
``__del__()`` methods are called for objects that still exist when the interpreter exits", the language
reference, Data model, ``object.__del__``); the rule here is that whatever must be flushed or closed is
closed by the code that opened it (``with``), or through ``atexit`` or ``weakref.finalize``.

:func:`run_then_exit` runs ``main`` and exits with the code Python would exit with. An uncaught
exception other than SystemExit is left to Python (its traceback), except, for a command (``prog``),
an interrupt: Ctrl-C, or SIGTERM as :class:`Terminated`. That is one line on stderr and the shell's
code for the signal (130, 143), not a traceback of every frame the interrupt went through.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn


def exit_code(stop: SystemExit) -> int:
    """The status Python exits with for ``stop`` (printing a message code to stderr as Python does)."""
    code = stop.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


@contextlib.contextmanager
def signals_deferred(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Iterator[None]:
    """``signals`` held back until the block ends, then delivered to the handlers they had. A run's end
    (its failure recorded, its status written) is then not cut short by a signal, e.g. torchrun's SIGTERM
    arriving while rank 0 fails on a dead rank's closed connection, which left the run RUNNING (later
    found dead and its checkpoint deleted). Main thread only: Python sets handlers there alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


class Terminated(KeyboardInterrupt):
    """A signal (SIGTERM: scancel, qdel, a local sweep's driver gone) delivered as an interrupt, so that
    the run in progress ends KILLED; ``signum`` gives the exit code 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def interrupted(prog: str, stop: KeyboardInterrupt) -> int:
    """Say in one line that ``prog`` was interrupted; the exit code a shell gives the signal."""
    signum = stop.signum if isinstance(stop, Terminated) else int(signal.SIGINT)
    why = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    print(f"{prog}: interrupted ({why}); a run in progress was ended KILLED, keeping what it had logged",
          file=sys.stderr, flush=True)  # fmt: skip
    return 128 + signum


def run_then_exit(main: Callable[[], int | None], prog: str | None = None) -> NoReturn:
    """Run ``main`` (its return value is the exit code, as in ``sys.exit(main())``), then exit, the
    collector frozen after one last collection (module docstring). ``prog``: a command's name, for its
    one line on an interrupt (None: left to Python)."""
    try:
        code = exit_code(SystemExit(main()))
    except SystemExit as stop:
        code = exit_code(stop)
    except KeyboardInterrupt as stop:
        if prog is None:
            raise
        code = interrupted(prog, stop)
    with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C now: the run is over, its code stands
        gc.collect()  # what the run left in reference cycles is finalised now, every module intact
        gc.freeze()  # the teardown's collections then skip what is left (module docstring)
    sys.exit(code)
