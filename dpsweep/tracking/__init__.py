"""MLflow tracking in the run's process, on MLflow's asynchronous logging: a tracking child made a sweep 11% slower.

    with tracked_run(TrackingConfig(), tags={"dataset.name": "digits"}) as run:
        run.log_params({"train.batch_size": 64})
        run.log_metrics({"test_accuracy": 0.93}, step=1)

One run per training job, that always ends FINISHED, FAILED or KILLED. A run that raises ends FAILED
with the error in the tags ``error`` and ``error.type`` and the traceback as the artifact
``error.txt``; an interrupted one (Ctrl-C, SystemExit, a scheduler's SIGTERM) ends KILLED.
Out-of-memory failures are tagged ``failure.kind=oom``, since they are data for memory models.

Params, metrics and tags go to MLflow's asynchronous logging (``synchronous=False``): the call returns
at once. A run waits for them before it ends (:meth:`Tracker.flush`), so its status says whether all
it logged was recorded. Artifacts, models and datasets are written at the call.

MLflow is imported at the first call that needs it (:mod:`dpsweep.tracking.store`; 1.3 CPU-s), not by
this module. The functions at the end (``runs_by_hash`` ...) are a sweep driver's questions to the store.

Until issue 57 a run logged through a child process that imported MLflow while the run imported torch
(issue 19). ``benchmarks/tracking_process.py`` on the 2-core development VM, load average 10-11
(``analysis/data/tracking_process.json``): 8 one-epoch jobs on the local launcher took 221 s with the
child, 199 s in process; a job's start to its first step 36.4 s and 38.2 s; a single run 26.0 s and
26.8 s. No 10% of a sweep's wall time in the child's favour: its imports took the other job's core.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from dpsweep.config import TrackingConfig
from dpsweep.errors import redact
from dpsweep.process.liveness import DRIVER_GONE, ProcessId, heartbeat
from dpsweep.process.shutdown import Terminated, signals_deferred

FAILURE_TAGS = frozenset({"error", "error.type", "failure.kind"})  # set when a run fails or is interrupted
# A RUNNING run names its process (host:pid:start, see dpsweep.process.liveness) and beats every HEARTBEAT_S,
# so that a later command can tell a live run from one whose process died (dpsweep.tracking.dead_runs).
PROCESS_TAG = "run.process"
HEARTBEAT_TAG = "run.heartbeat"  # unix seconds of the last beat
PRIVACY_LEDGER = "privacy_ledger.json"  # a DP run's artifact: every release, its parameters and share of ε
HEARTBEAT_S = 30.0
STALE_AFTER_S = 10 * HEARTBEAT_S  # a run of another host with no beat for this long is dead
MAX_TAG_CHARS = 5000  # MLflow's limit on tag values is 8000 characters
MAX_PARAM_CHARS = 6000  # MLflow's limit on param values


class RunEnded(Exception):
    """Raised inside a run to end it early with a given status and tags (e.g. a pruned trial)."""

    def __init__(self, message: str, status: str, tags: Mapping[str, str]) -> None:
        super().__init__(message)
        self.status = status
        self.tags = dict(tags)


class Tracker:
    """Logs to one MLflow run by id (no global 'active run' state). Params, metrics and tags return at
    once (MLflow's asynchronous logging); :meth:`flush` waits for them and raises the first error."""

    writes = True  # False for a rank of a run that is not rank 0 (SilentTracker)

    def __init__(self, uri: str, run_id: str) -> None:
        self.uri = uri
        self.run_id = run_id
        # each asynchronous write: MLflow's RunOperations, and the write again, synchronously (flush)
        self._pending: list[tuple[list[Any], Callable[[], Any]]] = []
        self._lock = threading.Lock()  # the heartbeat's thread sets tags too

    def _write_async(self, write: Callable[..., list[Any]], *args: Any) -> None:
        operations = write(self.uri, self.run_id, *args, synchronous=False)
        with self._lock:
            self._pending.append((operations, lambda: write(self.uri, self.run_id, *args)))

    def log_params(self, params: Mapping[str, Any]) -> None:
        from dpsweep.tracking import store

        self._write_async(store.log_params, {k: str(v) for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        from dpsweep.tracking import store

        self._write_async(store.log_metrics, {k: float(v) for k, v in metrics.items()}, step, _now_ms())

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from dpsweep.tracking import store

        self._write_async(store.set_tags, {k: str(v) for k, v in tags.items()})

    def log_text(self, text: str, artifact_file: str) -> None:
        from dpsweep.tracking import store

        store.log_text(self.uri, self.run_id, text, artifact_file)

    def log_image(self, image: Any, artifact_file: str) -> None:
        """An (H, W) or (H, W, 3) uint8 array as a PNG artifact (MLflow's image viewer shows it)."""
        from dpsweep.tracking import store

        store.log_image(self.uri, self.run_id, image, artifact_file)

    def log_file(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """A local file as an artifact, under ``artifact_path`` (a folder of the run's artifacts)."""
        from dpsweep.tracking import store

        store.log_file(self.uri, self.run_id, str(local_path), artifact_path)

    def log_model(self, module: Any, input_example: Any, name: str | None = None) -> None:
        """A torch module (on the CPU) as an MLflow PyTorch-flavour model (``MLmodel``, weights,
        signature from the input example and the module's output): an MLflow 3 LoggedModel, the run's
        output, named ``name`` or by what it is (``digits-cnn-dpsgd-eps1_84``: its dataset, model,
        mechanism and ε; the run's tag ``model.name``), with the run's objective and ε
        (:mod:`dpsweep.tracking.logged_models`). ``mlflow.pytorch.load_model("models:/<model_id>")`` loads
        it (with dpsweep importable), as does ``runs:/<run_id>/<model.name>``."""
        import torch

        from dpsweep.tracking import store

        self.flush()  # the model carries the run's params and tags, and its objective and ε so far
        with torch.no_grad():
            output = module(torch.as_tensor(input_example)).numpy()
        version = importlib.metadata.version("torch")
        store.log_model(self.uri, self.run_id, module, input_example, output, name, version)

    def log_dataset_splits(self, description: Mapping[str, Any], sizes: Mapping[str, int]) -> str:
        """Each split of the dataset (``sizes``: split -> examples, e.g. ``{"train": 1437, "test": 360}``)
        as an MLflow dataset input of the run (the UI's Dataset column), context-tagged with the split.
        ``description`` is the dataset's config (name, root, image size, split seed, …).

        The digest is of that description and the sizes, not of the examples: a hash of the private
        training data would let anyone holding a candidate dataset test whether it was used, a release
        no accountant covers. Returns the digest (12 hex digits)."""
        from dpsweep.tracking import store

        public = {str(k): str(v) for k, v in description.items()} | {f"n_{k}": str(v) for k, v in sizes.items()}
        digest = hashlib.sha256(json.dumps(public, sort_keys=True).encode()).hexdigest()[:12]
        store.log_dataset_splits(self.uri, self.run_id, public, digest, list(sizes))
        return digest

    def flush(self) -> None:
        """Wait until everything logged so far is stored. A write MLflow's thread failed (SQLite busy
        past its timeout, a refused value) is made again, synchronously: stored, or its error raised."""
        with self._lock:
            pending, self._pending = self._pending, []
        errors: list[Exception] = []
        for operations, again in pending:  # every one waited for: a run's failure is recorded after them
            try:
                for operation in operations:
                    operation.wait()
            except Exception:  # MLflow's summary of the failures; the write made again raises the error itself
                try:
                    again()
                except Exception as err:
                    errors.append(err)
        if errors:
            raise errors[0]


@contextmanager
def system_metrics(
    run_id: str, uri: str, after_s: float | None, interval_s: float = 10.0, private: bool = False
) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory, disk, network, and GPU where pynvml finds one) logged to
    ``run_id`` every ``interval_s``, from ``after_s`` seconds into the block (None: never), by MLflow's
    monitor thread. The delay keeps short runs (tests, probes) free of them; a run longer than it
    gets them for the rest. A ``private`` (DP) run logs no GPU memory: it follows the sizes of the
    run's Poisson batches (``dpsweep.tracking.monitors.GPU_MEMORY_METRIC``)."""
    if after_s is None:
        yield
        return
    from dpsweep.tracking import monitors

    monitors.start_system_metrics(run_id, uri, after_s, interval_s, private)
    try:
        yield
    finally:  # stop its thread, flush its last sample
        monitors.stop_system_metrics(run_id)


DEFAULT_URI = TrackingConfig.uri  # dpsweep's default store (sqlite:///mlflow.db), relative to where it ran


UI_ADDRESS = "http://127.0.0.1:5000"  # where dpsweep-ui (make ui) serves by default


# The view of an experiment's runs that dpsweep-ui saves and opens: one of MLflow's shared views, the
# experiment tag VIEW_TAG + VIEW_KEY, which MLflow's UI applies for the URL parameter viewStateShareKey
# (dpsweep.tracking.views.save_view)
VIEW_TAG = "mlflow.sharedViewState."
VIEW_KEY = "dpsweep"


def ui_url(server: str, experiment_id: str, view: str | None = None) -> str:
    """The MLflow UI page of an experiment's training runs, in the shared ``view`` if given. MLflow 3's UI
    opens experiments in its GenAI view (traces, token usage) unless the page asks for the
    model-training one, whatever the experiment's kind: ``workflowType=machine_learning`` does (checked
    in a real browser)."""
    page = f"{server.rstrip('/')}/#/experiments/{experiment_id}"
    if view:  # the UI applies a shared view on its runs tab only, not on the page it redirects there from
        return f"{page}/runs?workflowType=machine_learning&viewStateShareKey={view}"
    return f"{page}?workflowType=machine_learning"


def next_steps(uri: str, experiment: str, sweep_id: str | None = None) -> str:
    """The line a finished run or sweep ends with: the report command for its runs, and how to browse
    them (the command that serves the UI, for a local store, and the page of the experiment's runs)."""
    report = f"dpsweep-report --experiment {experiment}" + (f" --sweep {sweep_id}" if sweep_id else "")
    if uri != DEFAULT_URI:
        report += f" --tracking-uri {uri}"
    local = urlparse(uri).scheme in ("sqlite", "file", "")
    from dpsweep.tracking.store import experiment_of

    found = experiment_of(uri, experiment)  # None where the store cannot be read now: the line is a hint
    # dpsweep-ui saves its view before it opens the page; a server's page is the plain one
    page = None if found is None else ui_url(UI_ADDRESS if local else uri, found, VIEW_KEY if local else None)
    if local:  # dpsweep-ui serves the store and opens the page; a server serves its own UI
        browse = f"dpsweep-ui --experiment {experiment}" + ("" if uri == DEFAULT_URI else f" --tracking-uri {uri}")
        browse += f", which opens {page}" if page else ""
    else:
        browse = page or uri
    return redact(f"dpsweep: next: {report}; browse the runs: {browse}")  # a URL's password is never printed


def _now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Claim:
    """A sweep job's claim on its config: the config hash, and its owner (the sweep id), so that a
    requeued job of the same sweep does not mistake its own earlier run for another's."""

    config_hash: str
    owner: str | None = None


OWNER_TAG = "claim.owner"


class Claimed(Exception):
    """Another run holds the config: FINISHED, or RUNNING in a live process."""

    def __init__(self, run_id: str, status: str) -> None:
        super().__init__(f"already {status} as run {run_id}")
        self.run_id, self.status = run_id, status


def why_dead(tags: dict[str, str], now_s: float) -> str | None:
    """Why a RUNNING run's process is gone (None: alive, or nothing to judge by)."""
    process = ProcessId.parse(tags.get(PROCESS_TAG, ""))
    if process is None:
        return None
    alive = process.alive()
    if alive is False:
        return f"its process {process.token} is no longer running"
    beat = tags.get(HEARTBEAT_TAG)
    if alive is None and beat is not None and now_s - float(beat) > STALE_AFTER_S:
        return f"no heartbeat from {process.token} for {now_s - float(beat):.0f} s (> {STALE_AFTER_S:.0f} s)"
    return None


# The kind of dpsweep's experiments for MLflow's UI: model training. MLflow 3.17's UI reads it only where its
# GenAI / Model training switch is disabled, which it never is there: the URL's workflowType and the browser's
# local storage decide (dpsweep.tracking.ui_server, whose server opens every way in on model training).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError) or "out of memory" in str(err).lower():
        return True
    torch = sys.modules.get("torch")  # a torch OOM can only come from a process that imported torch
    return torch is not None and isinstance(err, torch.OutOfMemoryError)


class SilentTracker(Tracker):
    """The tracker of a rank other than 0 of a run across devices (``train.devices``): rank 0 writes
    the run (``run_id`` is its), the others log nothing."""

    writes = False

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_image(self, image: Any, artifact_file: str) -> None:
        pass

    def log_file(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_model(self, module: Any, input_example: Any, name: str | None = None) -> None:
        pass

    def log_dataset_splits(self, description: Mapping[str, Any], sizes: Mapping[str, int]) -> str:
        return ""

    def flush(self) -> None:
        pass


@contextmanager
def tracked_run(
    cfg: TrackingConfig,
    tags: Mapping[str, Any] | None = None,
    resume_run_id: str | None = None,
    claim: Claim | None = None,
) -> Iterator[Tracker]:
    """Start an MLflow run (or reopen ``resume_run_id``, e.g. after a requeue); end it FINISHED,
    FAILED (error recorded) or KILLED, whatever happens. With ``claim`` (the config hash of a sweep's
    job) a config another run holds raises :class:`Claimed` before any run is created; so does a
    ``resume_run_id`` that another live process is running or has finished (two jobs sharing one
    checkpoint directory, e.g. two identical sweeps started in the same second: the other may finish
    between this one finding its checkpoint and reopening its run). Everything logged in the block
    is stored before the run ends FINISHED; a logging call that failed ends it FAILED instead."""
    process = ProcessId.current().token
    alive = {PROCESS_TAG: process, HEARTBEAT_TAG: f"{time.time():.0f}"}
    str_tags = {k: str(v) for k, v in (tags or {}).items()} | alive
    from dpsweep.tracking import store

    run_id = store.begin_run(cfg, str_tags, resume_run_id, claim, process)
    tracker = Tracker(cfg.uri, run_id)
    status = "FAILED"
    try:
        with heartbeat(lambda: tracker.set_tags({HEARTBEAT_TAG: f"{time.time():.0f}"}), HEARTBEAT_S):
            yield tracker
        tracker.flush()
        status = "FINISHED"
    except RunEnded as end:  # a planned early end, not a failure: keep what was logged, tag why
        status = end.status
        tracker.set_tags(end.tags | {"ended.reason": str(end)})
        raise
    except (KeyboardInterrupt, SystemExit) as err:
        status = "KILLED"
        _record_failure(tracker, err, kind="interrupted")
        raise
    except BaseException as err:
        _record_failure(tracker, err, kind="oom" if _is_oom(err) else "exception")
        raise
    finally:
        with signals_deferred():  # a signal now (a second one, or torchrun's) waits until the run has ended
            if status != "FINISHED":  # (a finished run flushed above)
                with contextlib.suppress(Exception):  # already reported (FAILED); the status must still be written
                    tracker.flush()  # what the run logged before it failed, and its failure, are stored first
            store.end_run(cfg.uri, run_id, status)


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (scancel, qdel, preemption) interrupts training, so its MLflow run ends KILLED. A
    launcher=local job whose driver ended before this was installed (its SIGTERM went to submitit's
    handler, which ignores it) is interrupted here, before its run begins."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        TERMINATED.set()
        raise Terminated(signum)

    TERMINATED.clear()
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        if DRIVER_GONE.is_set():  # (set before its SIGTERM is sent: a later one finds the handler)
            raise KeyboardInterrupt("the sweep's driver is gone")
        yield
        if TERMINATED.is_set():  # raised where Python ignores exceptions (a weakref callback, a __del__)
            raise Terminated(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


# Set by terminate_as_interrupt's SIGTERM handler. Its Terminated may land in a weakref callback or a __del__,
# where Python prints it and goes on: the run's next epoch (and the block's end) raise it again from here.
TERMINATED = threading.Event()


SQLITE_PREFIX = "sqlite:///"  # a local sqlite store's URI: the database's path follows


def sqlite_path(uri: str) -> Path | None:
    """The database file of a local sqlite store (``sqlite:///mlflow.db``: ``mlflow.db``;
    ``sqlite:////abs/x.db``: ``/abs/x.db``); None for any other store."""
    return Path(uri[len(SQLITE_PREFIX) :]) if uri.startswith(SQLITE_PREFIX) else None


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError, fast, if jobs could not log to ``uri`` (checked before submitting)."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0]
    if scheme == "sqlite":
        db = sqlite_path(uri) or Path(parsed.path)
        folder = db.parent if str(db.parent) else Path(".")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConnectionError(
                f"tracking.uri={uri}: the directory {folder.absolute()} does not exist or is not writable"
            )
    elif scheme in ("http", "https"):
        health = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(health, timeout=timeout_s) as reply:
                ok = reply.status == 200
        except (OSError, ValueError) as err:
            raise ConnectionError(
                f"tracking.uri={uri}: no MLflow server answers at {health} ({err}); start one "
                "(launchers/scripts/mlflow_server_up.sh) or correct the URI"
            ) from err
        if not ok:
            raise ConnectionError(f"tracking.uri={uri}: {health} did not answer OK")
    elif scheme in ("postgresql", "mysql", "mssql"):
        default_port = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}[scheme]
        try:
            socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), timeout_s).close()
        except OSError as err:
            raise ConnectionError(f"tracking.uri={uri}: cannot connect to the database ({err})") from err


def _record_failure(tracker: Tracker, err: BaseException, kind: str) -> None:
    try:
        tracker.set_tags(
            {"error": f"{type(err).__name__}: {err}"[:MAX_TAG_CHARS], "error.type": type(err).__name__,
             "failure.kind": kind}
        )  # fmt: skip
        tracker.log_text("".join(traceback.format_exception(err)), "error.txt")
    except Exception:  # recording must never hide the original error or keep the run RUNNING
        pass


# ---------------------------------------------------------------------------------------------
# the store's answers to a run or a sweep's driver, from the modules that import MLflow, imported at
# their first use (PEP 562: this module stays free of MLflow)
# ---------------------------------------------------------------------------------------------
_FROM_THE_STORE = {  # name -> its module (open_store: ConfigError unless the URI is a store, or can be made one)
    **dict.fromkeys(("open_store", "run_finished", "ensure_experiments"), "store"),
    **dict.fromkeys(("runs_by_hash", "runs_of_sweep", "close_orphaned_runs", "log_results_table"), "sweeps"),
    **dict.fromkeys(("close_dead_of_config", "failed_by_a_rank"), "dead_runs"),
}

if TYPE_CHECKING:
    from dpsweep.tracking.dead_runs import close_dead_of_config as close_dead_of_config
    from dpsweep.tracking.dead_runs import failed_by_a_rank as failed_by_a_rank
    from dpsweep.tracking.store import ensure_experiments as ensure_experiments
    from dpsweep.tracking.store import open_store as open_store
    from dpsweep.tracking.store import run_finished as run_finished
    from dpsweep.tracking.sweeps import close_orphaned_runs as close_orphaned_runs
    from dpsweep.tracking.sweeps import log_results_table as log_results_table
    from dpsweep.tracking.sweeps import runs_by_hash as runs_by_hash
    from dpsweep.tracking.sweeps import runs_of_sweep as runs_of_sweep


def __getattr__(name: str) -> Any:
    if name not in _FROM_THE_STORE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_FROM_THE_STORE[name]}"), name)


def release_best(
    uri: str, experiment: str, sweep_id: str, objective: str, procedure: Mapping[str, Any]
) -> tuple[str | None, int]:
    """Tag the sweep's best FINISHED trial released, the others not, and make the released one report
    the tuning ``procedure`` (:func:`dpsweep.tracking.sweeps.release_best`), its model too (the whole
    tuning's ε: :func:`dpsweep.tracking.logged_models.link_model`); its run id and the number finished."""
    from dpsweep.tracking import logged_models, sweeps

    best, finished = sweeps.release_best(uri, experiment, sweep_id, objective, dict(procedure))
    if best is not None:
        logged_models.link_model(uri, best)
    return best, int(finished)


def reconcile(uri: str, experiment: str | None, spare: str = "") -> list[tuple[str, str, str | None]]:
    """End KILLED the experiment's dead RUNNING runs (:func:`dpsweep.tracking.dead_runs.reconcile`; the
    checkpoints of config ``spare`` kept): each one's (run id, reason, checkpoint removed)."""
    from dpsweep.tracking import dead_runs

    return [(d.run_id, d.reason, d.checkpoint_removed) for d in dead_runs.reconcile(uri, experiment, spare=spare)]
