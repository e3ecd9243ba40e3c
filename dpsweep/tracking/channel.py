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

A process that has already imported MLflow's SQL store has nothing to overlap: there the ops run in
the process itself (:class:`InProcess`), with the same post-then-flush semantics. Forked children
(a forkserver's jobs) start their own service if they need one.
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

CHILD_MODULE = "dpsweep.tracking.child"  # python -m dpsweep.tracking.child <fd> <argv0>
MLFLOW_STORE_MODULE = "mlflow.store.tracking.sqlalchemy_store"  # imported: ops run in process
EXIT_WAIT_S = 30.0  # at exit, how long to wait for the child to finish what was posted


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
                    self._answered = max(self._answered, seq)
                elif not ok:  # a post that failed (posts that succeed send nothing)
                    self._errors.append(value)
                self._state.notify_all()
        code = self.process.wait()
        with self._state:
            self._ended = f"the tracking process (pid {self.process.pid}) ended with exit code {code}"
            self._state.notify_all()

    def _send(self, op: str, reply: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        body = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        env = _mlflow_env()
        with self._send_lock:
            changed, self._env = (env if env != self._env else None), env
            seq = self._last_sent = next(self._seq)
            if reply:
                with self._state:
                    self._waiting.add(seq)
            try:
                self.conn.send((seq, op, reply, body, changed))
            except OSError as err:
                with self._state:
                    self._waiting.discard(seq)
                raise TrackingError(self._ended or f"the tracking process cannot be reached ({err})") from err
        return seq

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        seq = self._send(op, True, args, kwargs)
        with self._state:
            self._state.wait_for(lambda: seq in self._answers or self._ended is not None)
            self._waiting.discard(seq)
            if seq not in self._answers:
                raise TrackingError(f"{op}: {self._ended}")
            ok, value = self._answers.pop(seq)
        if not ok:
            raise value
        return value

    def post(self, op: str, *args: Any, **kwargs: Any) -> None:
        self._send(op, False, args, kwargs)

    def flush(self) -> None:
        self.call("ping")  # answered after every op sent before it: the child runs them in order
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


def service() -> Service:
    """This process's tracking service, started at first use: a :class:`Child`, or :class:`InProcess`
    where MLflow's SQL store is imported already."""
    global _SERVICE
    with _SERVICE_LOCK:
        current = _SERVICE
        if isinstance(current, Child) and current._ended is not None:
            current = None  # it died (its stderr said why): the next op gets a new one
        if current is None:
            if MLFLOW_STORE_MODULE in sys.modules:
                current = InProcess(importlib.import_module(CHILD_MODULE).OPS)
            else:
                current = Child()
                atexit.register(current.close)
            _SERVICE = current
        return current


def start() -> None:
    """Start the service now, so that the child imports MLflow while this process goes on (a
    command calls this first thing)."""
    service()


def _forget_in_child() -> None:
    global _SERVICE, _SERVICE_LOCK
    _SERVICE, _SERVICE_LOCK = None, threading.Lock()  # a forked child: the parent's socket is not its own


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
                threading.Thread(target=_quietly, args=(warm,), name="dpsweep-warm", daemon=True).start()
                warm = None
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)


def _quietly(warm: Callable[[], None]) -> None:
    with contextlib.suppress(Exception):  # what fails here fails again where it is needed, and says so
        warm()
