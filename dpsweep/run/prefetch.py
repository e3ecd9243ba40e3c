"""A run's final ε under every accountant, computed ahead in a forked process while the run trains.

    ahead = prefetch.start(plan.privacy.ledger, delta, orders)   # as training starts
    ...                                                          # train
    ahead.collect()              # the child's values join dpsweep.privacy.ledger's cache of this process
    ledger.epsilons(final_ledger, delta, orders)                 # served from it when the ledgers match

At the end of a run the runner reports ε under ``rdp``, ``pld`` and ``prv``. PLD and PRV discretise the
privacy loss: about 0.7 s of one core on the default digits run, which used to come after the last
epoch. The planned ledger (:class:`dpsweep.plan.PlannedPrivacy`) is the ledger a run has when it takes
every planned step, so a child process forked as training starts computes :func:`dpsweep.privacy.ledger.epsilons`
of it on the other core, and the run collects the values at the end.

The values are exact, not estimates: each is the same pure function (:data:`dpsweep.privacy.ledger.ACCOUNTANTS`)
of the same leaves (σ, q, steps of each event), δ and accounting, computed by the same code in a copy of
this process. A run whose final ledger differs from the plan (stopped early, or at its budget)
finds no match and computes its own ε as before; a child that fails or is killed only means the same.

POSIX ``os.fork`` only (Linux, macOS): elsewhere nothing is computed ahead. The child touches no torch,
CUDA or MLflow state, writes its values (a few hundred bytes) to a pipe and leaves with ``os._exit``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import time
import warnings

from dpsweep.privacy import ledger as ledgers
from dpsweep.privacy.ledger import Ledger

COLLECT_TIMEOUT_S = 60.0  # longest wait for the child once the run has trained; then the run computes its own


class Prefetch:
    """A child computing a ledger's ε values; :meth:`collect` waits for them, :meth:`cancel` drops them."""

    def __init__(self, pid: int, read_fd: int) -> None:
        self.pid, self.read_fd = pid, read_fd
        self.collected: int | None = None  # values brought into this process's cache; None before collect
        self.values: ledgers.Computed = {}  # what collect brought

    def collect(self, timeout_s: float = COLLECT_TIMEOUT_S) -> int:
        """Wait for the child, at most ``timeout_s``, and keep its values (:func:`dpsweep.privacy.ledger.remember`);
        the number kept. 0 when the child failed or was still computing (it is then ended): the run
        computes its ε itself. A fork can leave the child waiting forever on a lock that another thread
        held when it was forked; the timeout keeps such a child from holding up the run's end."""
        if self.collected is not None:
            return self.collected
        data = self._read(time.monotonic() + timeout_s)
        if data is None:  # still computing, or stuck: the run computes its own
            self.cancel()
            return 0
        self._close()
        _, status = os.waitpid(self.pid, 0)
        self.values = pickle.loads(data) if os.waitstatus_to_exitcode(status) == 0 and data else {}
        ledgers.remember(self.values)
        self.collected = len(self.values)
        return self.collected

    def _read(self, deadline: float) -> bytes | None:
        """Everything the child writes, up to its end of the pipe; None at the deadline."""
        chunks: list[bytes] = []
        with selectors.DefaultSelector() as waiting:  # any descriptor number (select() stops at 1024)
            waiting.register(self.read_fd, selectors.EVENT_READ)
            while True:
                if not waiting.select(max(0.0, deadline - time.monotonic())):
                    return None
                chunk = os.read(self.read_fd, 1 << 16)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)

    def cancel(self) -> None:
        """End the child (the run failed or stopped before its end) and reap it."""
        if self.collected is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # already reaped
            os.waitpid(self.pid, 0)
        self._close()
        self.collected = 0

    def _close(self) -> None:
        with contextlib.suppress(OSError):  # closed already (a collect that was interrupted)
            os.close(self.read_fd)


def start(bill: Ledger | None, delta: float, orders: tuple[float, ...]) -> Prefetch | None:
    """Fork a child that computes ``ledger.epsilons(bill, delta, orders)``; None where there is nothing
    to compute (no ledger: no DP; or every value is in this process's cache: a sweep's later jobs) or
    no ``os.fork``."""
    if bill is None or not hasattr(os, "fork") or ledgers.all_computed(bill, delta, orders):
        return None
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():  # Python >= 3.12 warns of fork in a threaded process: the child
        warnings.simplefilter("ignore", DeprecationWarning)  # runs only NumPy/SciPy code, then _exit
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its values are checked through collect()
        code = 1
        try:
            os.close(read_fd)
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it quietly, with the run
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            ledgers.epsilons(bill, delta, orders)
            payload = pickle.dumps(ledgers.computed(bill, delta, orders))
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(payload)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    return Prefetch(pid, read_fd)
