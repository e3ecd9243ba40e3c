"""Is a process still alive? Process identities, heartbeats, and jobs that die with their driver.

    me = ProcessId.current()          # host, pid and the kernel's start time of this process
    ProcessId.parse(me.token).alive() # True; False once it has exited (a reused pid is not it); None on another host
    with heartbeat(lambda: ..., every_s=30): ...   # call a function every 30 s in a daemon thread
    die_with_driver()                 # SIGTERM this process when the driver named by $DPSWEEP_DRIVER is gone

A pid alone does not identify a process: the kernel reuses them. The start time in clock ticks since
boot (``/proc/<pid>/stat``, field 22, see proc(5)) does, on one host. Across hosts only a heartbeat
can tell: a run whose heartbeat is older than a few intervals belongs to a process that is gone.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ENV_DRIVER = "DPSWEEP_DRIVER"  # the token of the process a local job lives for (set by launcher=local)
DRIVER_POLL_S = 1.0


def start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (proc(5): /proc/<pid>/stat field 22); None
    where there is no /proc or no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name, in parentheses, may hold spaces
    return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)


@dataclass(frozen=True)
class ProcessId:
    host: str
    pid: int
    start: int | None  # clock ticks since boot; None where /proc is not available

    @classmethod
    def current(cls) -> ProcessId:
        return cls(socket.gethostname(), os.getpid(), start_ticks(os.getpid()))

    @property
    def token(self) -> str:
        return f"{self.host}:{self.pid}:{self.start if self.start is not None else ''}"

    @classmethod
    def parse(cls, token: str) -> ProcessId | None:
        """The identity written by :attr:`token`; None when the text is not one."""
        host, _, rest = token.rpartition(":")
        host, _, pid = host.rpartition(":")
        if not host or not pid.isdigit() or not (rest.isdigit() or rest == ""):
            return None
        return cls(host, int(pid), int(rest) if rest else None)

    def alive(self) -> bool | None:
        """Whether this process still runs: None when it ran on another host (ask its heartbeat)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else
            pass
        return self.start is None or start_ticks(self.pid) == self.start


@contextmanager
def heartbeat(beat: Callable[[], None], every_s: float) -> Iterator[None]:
    """Call ``beat()`` every ``every_s`` seconds in a daemon thread while the block runs. A beat that
    raises is skipped (the next one tries again): a missed beat only makes the process look older."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                beat()
            except Exception:  # a transient store error must not kill the job
                continue

    thread = threading.Thread(target=loop, name="dpsweep-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()


def driver_environment() -> dict[str, str]:
    """What a launcher puts in its jobs' environment so that they die with it (:func:`die_with_driver`)."""
    return {ENV_DRIVER: ProcessId.current().token}


def die_with_driver(poll_s: float = DRIVER_POLL_S) -> bool:
    """When ``$DPSWEEP_DRIVER`` names a process on this host, watch it in a daemon thread and send this
    process SIGTERM once it is gone (its run then ends KILLED). Returns whether a watch started."""
    driver = ProcessId.parse(os.environ.get(ENV_DRIVER, ""))
    if driver is None or driver.pid == os.getpid() or driver.alive() is None:
        return False  # no driver, an inline job (the driver itself), or a driver on another host

    def watch() -> None:
        while driver.alive():
            threading.Event().wait(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="dpsweep-driver-watch", daemon=True).start()
    return True
