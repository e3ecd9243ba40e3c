"""The tracking process: MLflow in a child process that a run logs through, so that importing MLflow
overlaps importing torch, and logging overlaps training (issue 19).

    from dpsweep.tracking.channel import service
    service().call("runs_by_hash", uri, "demo", "FINISHED")         # waits for the answer
    service().post("log_metrics", uri, run_id, {"loss": 0.3}, 1, t)  # returns at once
    service().flush()                                                # every post done, or its error raised

Importing MLflow 3 with its SQL store takes 1.3-2.3 s of CPU on the 2-core development VM (its
tracing, GenAI and gateway modules, SQLAlchemy's ORM, Alembic): about as long as importing torch and
Opacus, and a bare Opacus script pays none of it. Python's import lock and GIL keep two imports in
one process from overlapping, so the child imports MLflow on the other core while the run imports
torch; the run's logging calls are then handed over without waiting.

Ops are named functions of :mod:`dpsweep.tracking.child` (the child's entry point). Arguments and
answers are plain data, pickled, never MLflow entities, so the run's process never imports MLflow.
``post`` does not wait: an op that fails raises its error at the next :meth:`Service.flush` (as
MLflow's own asynchronous logging does); a run flushes before it ends, so its status says whether
everything it logged was recorded. Errors of dpsweep's own types (bad input, a claimed config) cross
as themselves; any other (MLflow's) becomes :class:`TrackingError` with the child's traceback. The
``MLFLOW_*`` environment variables go with each op where they changed since the child started.

The child ignores SIGINT and SIGTERM: a Ctrl-C or a scheduler's SIGTERM interrupts the run, which
then still writes its KILLED status through the child. The child ends when this process closes its
end of the socket, at exit however it exits (a SIGKILL included: the kernel closes it).

Nothing posted is lost with the child. The posts it has not confirmed yet (a call's answer confirms
every op sent before it; a post asks for a confirmation every ``CONFIRM_EVERY`` posts) are kept, as
sent; where the child dies (killed, out of memory), the next op starts another and sends them again
first, with a line on stderr. The ops are idempotent where it matters (MLflow stores a metric, param
or tag logged twice once; artifacts are overwritten). A call that the dead child never answered is
made again too, except ``begin_run`` (it would create a second run), which raises. After
``RESTART_LIMIT`` deaths the service gives up: what was not confirmed is named on stderr, and the
op raises :class:`TrackingError`, so the run cannot end FINISHED with less than it logged.

Where there is nothing to overlap, the ops run in the process itself (:class:`InProcess`), with the
same post-then-flush semantics, and no tracking process is started:

- a process that may run on one CPU core only (:func:`dpsweep.process.cpu_cores`: ``taskset -c 0``, a
  one-CPU cluster job, a packed trial given one core). There the child's imports cannot overlap the
  run's; they add to its CPU time. On one pinned core of the development VM, a 1-epoch run took
  10.9-11.7 s with the child and 8.0-8.2 s without (the benchmarks page, "On one pinned core");
- a process that imports MLflow itself anyway, which says so with :func:`serve_in_process` (a test
  session does).

Forked children (a forkserver's jobs) start their own service if they need one.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any, NoReturn, Protocol

from dpsweep.process import cpu_cores

CHILD_MODULE = "dpsweep.tracking.child"  # python -m dpsweep.tracking.child <fd> <argv0>
EXIT_WAIT_S = 30.0  # at exit, how long to wait for the child to finish what was posted
CONFIRM_EVERY = 64  # posts between two confirmations asked of the child (the kept posts are at most this many more)
RESTART_LIMIT = 3  # tracking processes started again after one died, per process
NOT_REPEATABLE = frozenset({"begin_run"})  # calls not made again on a new child (a second run)
STICKY = ("start_system_metrics", "stop_system_metrics")  # a start is sent again until its stop is posted


class TrackingError(RuntimeError):
    """An op failed in the tracking process (the message holds its error and traceback), or the
    process itself ended."""


class Service(Protocol):
    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``op`` and return its answer (raising its error)."""

    def post(self, op: str, *args: Any, **kwargs: Any) -> None:
        """Queue ``op``; its error, if any, is raised by the next :meth:`flush`."""

    def flush(self) -> None:
        """Wait until every posted op has run; raise the first error among them."""


def _portable(err: BaseException) -> BaseException:
    """``err`` itself if it is one of dpsweep's and survives pickling, else a TrackingError."""
    if type(err).__module__.startswith("dpsweep."):
        with contextlib.suppress(Exception):
            return pickle.loads(pickle.dumps(err))
    text = "".join(traceback.format_exception(err)).rstrip()
    return TrackingError(f"{type(err).__module__}.{type(err).__qualname__}: {err}\n{text}")


class InProcess:
    """The ops run in this process (it imported MLflow already); posts run at once, their errors
    kept for :meth:`flush` as the child's are."""

    def __init__(self, ops: Mapping[str, Callable[..., Any]]) -> None:
        self.ops = ops
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.ops[op](*args, **kwargs)
        except Exception as err:  # the same errors as from the child
            raise _portable(err) from err

    def post(self, op: str, *args: Any, **kwargs: Any) -> None:
        try:
            self.ops[op](*args, **kwargs)
        except Exception as err:
            with self._lock:
                self._errors.append(_portable(err))

    def flush(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]


class Child:
    """The ops run in a child process (``python -m dpsweep.tracking.child``), in the order sent."""

    def __init__(self) -> None:
        ours, theirs = _socketpair()
        self.process = subprocess.Popen(  # stdout: the child sends its own to stderr (see serve)
            [sys.executable, "-m", CHILD_MODULE, str(theirs.fileno()), sys.argv[0] if sys.argv else ""],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.conn = ours
        self._pid = os.getpid()
        self._env = _mlflow_env()  # as the child inherited it; later changes go with the next op
        self._seq = itertools.count(1)
        self._send_lock = threading.Lock()
        self._state = threading.Condition()
        self._answers: dict[int, tuple[bool, Any]] = {}
        self._waiting: set[int] = set()  # calls whose answer is awaited
        self._last_sent = 0  # the seq of the last op sent ...
        self._answered = 0  # ... and of the last call answered, which confirms every op before it
        self._errors: list[BaseException] = []
        self._ended: str | None = None  # why the child can no longer answer
        self._kept: list[tuple[int, str, bytes]] = []  # posts not confirmed yet, as sent (seq, op, body)
        self._marks: set[int] = set()  # confirmations asked for by posts, not awaited
        self._reader = threading.Thread(target=self._read, name="dpsweep-tracking-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                seq, ok, value = self.conn.recv()
            except (EOFError, OSError):
                break
            with self._state:
                if seq in self._waiting:
                    self._answers[seq] = (ok, value)
                    self._confirm(seq)
                elif seq in self._marks:
                    self._marks.discard(seq)
                    self._confirm(seq)
                elif not ok:  # a post that failed (posts that succeed send nothing)
                    self._errors.append(value)
                self._state.notify_all()
        code = self.process.wait()
        with self._state:
            self._ended = f"the tracking process (pid {self.process.pid}) ended with exit code {code}"
            self._state.notify_all()

    def _confirm(self, seq: int) -> None:
        """The child has run every op up to ``seq`` (under ``_state``): forget those posts, but a
        system metrics start whose stop was not posted (a new child must start them again)."""
        self._answered = max(self._answered, seq)
        self._kept = [k for k in self._kept if k[0] > self._answered or k[1] == STICKY[0]]

    def _send(self, op: str, reply: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        body = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        env = _mlflow_env()
        with self._send_lock:
            changed, self._env = (env if env != self._env else None), env
            seq = self._last_sent = next(self._seq)
            with self._state:
                if reply:
                    self._waiting.add(seq)
                else:
                    if op == STICKY[1]:
                        self._kept = [k for k in self._kept if k[1] != STICKY[0]]
                    self._kept.append((seq, op, body))
                ask = not reply and not self._marks and len(self._kept) >= CONFIRM_EVERY
            try:
                self.conn.send((seq, op, reply, body, changed))
                if ask:  # answered once the child has run them: the kept posts are forgotten then
                    mark = self._last_sent = next(self._seq)
                    with self._state:
                        self._marks.add(mark)
                    self.conn.send((mark, "ping", True, pickle.dumps(((), {})), None))
            except OSError as err:
                with self._state:
                    self._waiting.discard(seq)
                if reply:
                    raise TrackingError(self._ended or f"the tracking process cannot be reached ({err})") from err
                # a post is kept: the child died, and the next op sends it again through a new one
        return seq

    def _died(self, op: str) -> bool:
        """Whether the child ended before answering ``op`` (not: the op failed in it)."""
        with self._state:  # a send that failed finds it dying (its socket closed): the reader sees it end
            self._state.wait_for(lambda: self._ended is not None, timeout=10)
            return self._ended is not None and op not in NOT_REPEATABLE

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        try:
            seq = self._send(op, True, args, kwargs)
        except TrackingError as err:
            if self._died(op):
                return service().call(op, *args, **kwargs)
            raise TrackingError(f"{op}: {self._ended or err}") from err  # as when it dies after the send
        with self._state:
            self._state.wait_for(lambda: seq in self._answers or self._ended is not None)
            self._waiting.discard(seq)
            answered = self._answers.pop(seq, None)
        if answered is None:
            if self._died(op):  # made again by a new child, after what this one had not confirmed
                return service().call(op, *args, **kwargs)
            raise TrackingError(f"{op}: {self._ended}")
        ok, value = answered
        if not ok:
            raise value
        return value

    def post(self, op: str, *args: Any, **kwargs: Any) -> None:
        self._send(op, False, args, kwargs)

    def flush(self) -> None:
        self.call("ping")  # answered after every op sent before it: the child runs them in order
        if self._ended is not None and service() is not self:
            service().flush()  # this one died: its posts went to the new one, with its errors
            return
        with self._state:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self, wait_s: float = EXIT_WAIT_S) -> None:
        """End the child: it finishes what was sent, then exits. Only by the process that started it
        (a forked child's exit must not end its parent's service)."""
        if os.getpid() != self._pid:
            return
        with self._send_lock, self._state:
            idle = self._answered >= self._last_sent
        if idle:  # nothing left to write: no need to wait for it (it may still be importing MLflow)
            self.process.kill()
            self.process.wait()
            return
        with contextlib.suppress(OSError):  # shutdown, not close: the reader thread is blocked on it
            end = socket.socket(fileno=self.conn.fileno())
            end.shutdown(socket.SHUT_WR)
            end.detach()
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _mlflow_env() -> dict[str, str]:
    """MLflow's settings in this process's environment (``MLFLOW_TRACKING_TOKEN``, its HTTP retries…)."""
    return {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}


def _socketpair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


_SERVICE: Service | None = None
_SERVICE_LOCK = threading.Lock()
_RESTARTS = 0  # tracking processes started again in this process after one died
_IN_PROCESS = False  # set by serve_in_process()


def serve_in_process() -> None:
    """Run the ops in this process from now on (:class:`InProcess`), not in a tracking process: for a
    process that imports MLflow itself anyway, where a child would import it a second time. A service
    already started is kept."""
    global _IN_PROCESS
    _IN_PROCESS = True


def service() -> Service:
    """This process's tracking service, started at first use: a :class:`Child`, or :class:`InProcess`
    after :func:`serve_in_process` or where this process may run on one CPU core only."""
    global _SERVICE, _RESTARTS
    with _SERVICE_LOCK:
        current = _SERVICE
        dead = current if isinstance(current, Child) and current._ended is not None else None
        if dead is not None:  # it died (its stderr said why): the next op gets a new one
            if _RESTARTS >= RESTART_LIMIT:
                _give_up(dead)
            _RESTARTS += 1
            current = None
        if current is None:
            if _IN_PROCESS or cpu_cores() < 2:  # nothing to overlap (the module's docstring)
                current = InProcess(importlib.import_module(CHILD_MODULE).OPS)
            else:
                current = Child()
                atexit.register(current.close)
            if dead is not None:
                _take_over(current, dead)
            _SERVICE = current
        return current


def _take_over(new: Child | InProcess, dead: Child) -> None:
    """Post to ``new`` again what ``dead`` had not confirmed, in order, and carry its errors over."""
    with dead._state:
        kept, errors = list(dead._kept), list(dead._errors)
    for _, op, body in kept:
        args, kwargs = pickle.loads(body)
        new.post(op, *args, **kwargs)
    new._errors[:0] = errors
    where = f"started another (pid {new.process.pid})" if isinstance(new, Child) else "went on in this process"
    print(f"dpsweep: {dead._ended}; {where} and sent it again the {len(kept)} operation(s) it had not confirmed",
          file=sys.stderr, flush=True)  # fmt: skip


def _give_up(dead: Child) -> NoReturn:
    with dead._state:
        lost = [op for _, op, _ in dead._kept]
    what = f"{len(lost)} operation(s) it had not confirmed are lost: {', '.join(lost)}" if lost else "nothing was lost"
    print(f"dpsweep: {dead._ended}, the {RESTART_LIMIT + 1}th tracking process to end; {what}", file=sys.stderr)
    raise TrackingError(f"{dead._ended} (after {RESTART_LIMIT} restarts); {what}")


def start() -> None:
    """Start the service now, so that the child imports MLflow while this process goes on (a
    command calls this first thing)."""
    service()


def _forget_in_child() -> None:
    global _SERVICE, _SERVICE_LOCK, _RESTARTS
    _SERVICE, _SERVICE_LOCK, _RESTARTS = None, threading.Lock(), 0  # a forked child: the parent's socket is not its own


os.register_at_fork(after_in_child=_forget_in_child)


def serve(
    fd: int,
    ops: Mapping[str, Callable[..., Any]],
    warm: Callable[[], None] | None = None,
    warm_after: frozenset[str] = frozenset(),
) -> NoReturn:
    """The child's loop: run each op received on ``fd``, in order; answer calls, and posts that fail.
    Ends when the other end closes.

    Once one of the ops ``warm_after`` has run (the store is open: before it, the run's process may
    be waiting on it), a thread runs ``warm`` (imports, caches), so that the ops that need them later
    (model logging needs torch) do not wait, and the work overlaps the run's own imports."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run's process handles them, and ends through us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.dup2(2, 1)  # a library's print must not go where the parent's stdout goes
    conn = Connection(fd)
    code = 0
    try:
        while True:
            try:
                seq, op, reply, body, env = conn.recv()
            except (EOFError, OSError):
                break
            if env is not None:  # the run's process changed MLflow's settings since: follow it
                for key in [k for k in os.environ if k.startswith("MLFLOW_") and k not in env]:
                    del os.environ[key]
                os.environ.update(env)
            try:
                args, kwargs = pickle.loads(body)
                value = None if op == "ping" else ops[op](*args, **kwargs)
                if reply:
                    conn.send((seq, True, value))
            except Exception as err:
                conn.send((seq, False, _portable(err)))
            if op in warm_after and warm is not None:
                in_background(warm)
                warm = None
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)


def in_background(warm: Callable[[], None]) -> None:
    """Run ``warm`` (imports, caches) in a daemon thread of the tracking process."""
    threading.Thread(target=_quietly, args=(warm,), name="dpsweep-warm", daemon=True).start()


def _quietly(warm: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):  # what fails here fails again where it is needed, and says so
        warm()
