"""Is a process still alive? Process identities, heartbeats, and jobs that die with their driver.

    me = ProcessId.current()          # host, pid and the kernel's start time of this process
    ProcessId.parse(me.token).alive() # True; False once it has exited (a reused pid is not it); None on another host
    with heartbeat(lambda: ..., every_s=30): ...   # call a function every 30 s in a daemon thread
    die_with_driver()                 # SIGTERM this process (again every 30 s) once $DPSWEEP_DRIVER is gone

A pid alone does not identify a process: the kernel reuses them. The start time in clock ticks since
boot (``/proc/<pid>/stat``, field 22, see proc(5)) does, on one host. Across hosts only a heartbeat
can tell: a run whose heartbeat is older than a few intervals belongs to a process that is gone.

A host name is not a host either: a container run with the host's network (``--network host``)
shares its name but has its own process ids. The token also names the process's PID namespace
(``/proc/self/ns/pid``, namespaces(7)); a process of another namespace is judged by its heartbeat,
as one of another host (issue 39, item 11). A zombie (state Z: exited, not yet reaped by its parent)
is not alive (item 4): its jobs and runs would otherwise outlive it.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ENV_DRIVER = "DPSWEEP_DRIVER"  # the token of the process a local job lives for (set by launcher=local)
DRIVER_POLL_S = 1.0  # how often a job looks for its driver
DRIVER_RESEND_S = 30.0  # how often a job whose driver is gone is sent SIGTERM again while it runs on


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on (proc(5)); None where there is no /proc or no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()  # the command name, in parentheses, may hold spaces


def start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (proc(5): /proc/<pid>/stat field 22); None
    where there is no /proc or no such process."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None else None  # field 22 overall; fields[0] is field 3 (state)


def exited(pid: int) -> bool:
    """Whether ``pid`` has exited but is not reaped yet: a zombie (state Z) or dead (X)."""
    fields = _stat(pid)
    return fields is not None and fields[0] in ("Z", "X")


def pid_namespace() -> str | None:
    """This process's PID namespace (the inode of /proc/self/ns/pid); None where there is no /proc."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return None
    return link[link.find("[") + 1 : link.rfind("]")] or None


@dataclass(frozen=True)
class ProcessId:
    host: str
    pid: int
    start: int | None  # clock ticks since boot; None where /proc is not available
    namespace: str | None = None  # the PID namespace the pid is of; None: unknown (older tokens)

    @classmethod
    def current(cls) -> ProcessId:
        return cls(socket.gethostname(), os.getpid(), start_ticks(os.getpid()), pid_namespace())

    @property
    def token(self) -> str:
        """``host:pid:start``, then ``@namespace`` where it is known."""
        base = f"{self.host}:{self.pid}:{self.start if self.start is not None else ''}"
        return base + (f"@{self.namespace}" if self.namespace else "")

    @classmethod
    def parse(cls, token: str) -> ProcessId | None:
        """The identity written by :attr:`token`; None when the text is not one."""
        base, at, namespace = token.rpartition("@")
        if not at:
            base, namespace = token, ""
        host, _, rest = base.rpartition(":")
        host, _, pid = host.rpartition(":")
        if not host or not pid.isdigit() or not (rest.isdigit() or rest == "") or (at and not namespace.isdigit()):
            return None
        return cls(host, int(pid), int(rest) if rest else None, namespace or None)

    def alive(self) -> bool | None:
        """Whether this process still runs: None when it ran on another host, or in another PID
        namespace of this one (a container): ask its heartbeat."""
        if self.host != socket.gethostname():
            return None
        if self.namespace is not None and self.namespace != pid_namespace():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else
            pass
        if exited(self.pid):  # a zombie: exited, its parent has not reaped it yet
            return False
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


DRIVER_GONE = threading.Event()  # set by die_with_driver's watch once the driver is gone
_WATCHED: set[ProcessId] = set()  # the drivers this process watches: one watch each, whatever the trials


def die_with_driver(poll_s: float = DRIVER_POLL_S, resend_s: float = DRIVER_RESEND_S) -> bool:
    """When ``$DPSWEEP_DRIVER`` names a process on this host, watch it in a daemon thread and send this
    process SIGTERM once it is gone (its run then ends KILLED), then again every ``resend_s`` seconds for
    as long as the process runs on. Returns whether this process watches its driver (one watch a process,
    whatever the trials it runs one after another).

    A job still starting may not be listening yet (submitit's job process logs "Bypassing signal
    SIGTERM" and goes on): :data:`DRIVER_GONE` is set first, and the run's SIGTERM handler looks at it
    as it is installed (``dpsweep.tracking.terminate_as_interrupt``), so the job ends before training.

    One SIGTERM is not enough: it can be lost, and the job then trains on for good, racing a re-run of
    the sweep (CI saw one train on for 11 minutes). A handler that ignores it may be the one installed
    (submitit's, above) in a process that never looks at :data:`DRIVER_GONE`; and CPython drops the
    exception a signal handler raises while the main thread runs a finalizer (a ``__del__``, a
    generator closed as it is freed, a weakref callback): "Exception ignored in ..." on stderr, and
    the interrupt is gone. Hence the repeats. ``resend_s`` is long beside the seconds a run takes to
    end KILLED, which a second SIGTERM would cut short. An error of the watch itself is printed and
    the watch goes on: a watch that ended would leave the job training on, as a lost signal does."""
    driver = ProcessId.parse(os.environ.get(ENV_DRIVER, ""))
    if driver is None or driver.pid == os.getpid() or driver.alive() is None:
        return False  # no driver, an inline job (the driver itself), or a driver on another host
    if driver in _WATCHED:  # a later trial of a job of several (launcher.trials_per_job): one SIGTERM per resend
        return True
    _WATCHED.add(driver)

    def watch() -> None:
        while _runs(driver):
            time.sleep(poll_s)
        DRIVER_GONE.set()  # before the signal: a SIGTERM handler installed later looks at it
        while True:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(resend_s)

    threading.Thread(target=watch, name="dpsweep-driver-watch", daemon=True).start()
    return True


def _runs(driver: ProcessId) -> bool:
    """Whether the driver still runs, for the watch: an error asking (a race with /proc) counts as
    running, said on stderr; the next poll asks again."""
    try:
        return bool(driver.alive())
    except Exception as err:
        print(f"dpsweep: could not tell whether the sweep's driver {driver.token} runs: {err!r}", file=sys.stderr,
              flush=True)  # fmt: skip
        return True
