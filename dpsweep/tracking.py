"""MLflow tracking: one run per training job that always ends FINISHED, FAILED or KILLED.

    with tracked_run(TrackingConfig(), tags={"dataset.name": "digits"}) as run:
        run.log_params({"train.batch_size": 64})
        run.log_metrics({"test_accuracy": 0.93}, step=1)

A run that raises ends FAILED with the error in the tags ``error`` and ``error.type`` and the
traceback as the artifact ``error.txt``; an interrupted one (Ctrl-C, SystemExit) ends KILLED.
Out-of-memory failures are tagged ``failure.kind=oom``, since they are data for memory models.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dpsweep.config import ConfigError, TrackingConfig
from dpsweep.liveness import ProcessId, heartbeat

if TYPE_CHECKING:  # torch is imported where it is used: tracking alone (a sweep's driver) stays light
    import torch

FAILURE_TAGS = frozenset({"error", "error.type", "failure.kind"})  # set when a run fails or is interrupted
# A RUNNING run names its process (host:pid:start, see dpsweep.liveness) and beats every HEARTBEAT_S,
# so that a later command can tell a live run from one whose process died (dpsweep.reconcile).
PROCESS_TAG = "run.process"
HEARTBEAT_TAG = "run.heartbeat"  # unix seconds of the last beat
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
    """Logs to one MLflow run by id (no global 'active run' state)."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client = client
        self.run_id = run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            chunk = items[i : i + 100]
            retry_busy(lambda chunk=chunk: self.client.log_batch(self.run_id, params=chunk))  # type: ignore[misc]

    def log_metrics(self, metrics: Mapping[str, float], step: int = 0) -> None:
        now = _now_ms()
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if items:
            retry_busy(lambda: self.client.log_batch(self.run_id, metrics=items))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        items = [RunTag(k, str(v)[:MAX_TAG_CHARS]) for k, v in tags.items()]
        if items:
            retry_busy(lambda: self.client.log_batch(self.run_id, tags=items))

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_image(self, image: Any, artifact_file: str) -> None:
        """An (H, W) or (H, W, 3) uint8 array as a PNG artifact (MLflow's image viewer shows it)."""
        retry_busy(lambda: self.client.log_image(self.run_id, image, artifact_file=artifact_file))

    def log_file(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """A local file as an artifact, under ``artifact_path`` (a folder of the run's artifacts)."""
        retry_busy(lambda: self.client.log_artifact(self.run_id, str(local_path), artifact_path))

    def log_model(self, module: Any, input_example: Any, artifact_path: str = "model") -> None:
        """A torch module as an MLflow PyTorch-flavour model (``MLmodel``, weights, signature from the
        input example and the module's output), under the run's ``artifact_path``:
        ``mlflow.pytorch.load_model(f"runs:/{run_id}/model")`` loads it (with dpsweep importable)."""
        import mlflow.pytorch  # torch and the flavour: only for runs that log a model
        import torch
        from mlflow.models import infer_signature

        with torch.no_grad():
            output = module(torch.as_tensor(input_example)).numpy()
        quiet = logging.getLogger("mlflow.pytorch")  # its warning on pickle: the format is chosen knowingly
        level = quiet.level
        with tempfile.TemporaryDirectory(prefix="dpsweep-model-") as tmp:
            path = Path(tmp) / artifact_path
            quiet.setLevel(logging.ERROR)
            try:
                mlflow.pytorch.save_model(
                    module, str(path), signature=infer_signature(input_example, output), input_example=input_example,
                    pip_requirements=[f"torch=={importlib.metadata.version('torch')}"],  # its classes: dpsweep's
                    serialization_format="pickle",  # the whole module (torch.save), as the Opacus examples keep it
                )  # fmt: skip
            finally:
                quiet.setLevel(level)
            retry_busy(lambda: self.client.log_artifacts(self.run_id, str(path), artifact_path))

    def log_dataset_splits(self, description: Mapping[str, Any], sizes: Mapping[str, int]) -> str:
        """Each split of the dataset (``sizes``: split -> examples, e.g. ``{"train": 1437, "test": 360}``)
        as an MLflow dataset input of the run (the UI's Dataset column), context-tagged with the split.
        ``description`` is the dataset's config (name, root, image size, split seed, …).

        The digest is of that description and the sizes, not of the examples: a hash of the private
        training data would let anyone holding a candidate dataset test whether it was used, a release
        no accountant covers. Returns the digest (12 hex digits)."""
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        public = {str(k): str(v) for k, v in description.items()} | {f"n_{k}": str(v) for k, v in sizes.items()}
        digest = hashlib.sha256(json.dumps(public, sort_keys=True).encode()).hexdigest()[:12]
        name = str(description.get("name", "dataset"))
        inputs = []
        for split in sizes:
            source = CodeDatasetSource(public | {"split": split})
            meta = MetaDataset(source, name=f"{name}-{split}", digest=digest)  # type: ignore[abstract]
            inputs.append(DatasetInput(meta._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", split)]))
        retry_busy(lambda: self.client.log_inputs(self.run_id, datasets=inputs))
        return digest


def source_tags(entry_point: str = "dpsweep") -> dict[str, str]:
    """MLflow's own run-context tags (``mlflow.user``, ``mlflow.source.type``, and the git commit where
    MLflow finds one), resolved by MLflow's context registry as ``mlflow.start_run`` resolves them,
    with the source named after the command rather than the script that happens to run it (a
    launcher's bootstrap, for jobs). Resolved once per process: the jobs of an inline sweep share it."""
    return dict(_source_tags(entry_point))


@functools.lru_cache(maxsize=8)
def _source_tags(entry_point: str) -> dict[str, str]:
    from mlflow.tracking.context import registry

    resolved = registry.resolve_tags({})
    return {k: v for k, v in resolved.items() if k.startswith("mlflow.")} | {"mlflow.source.name": entry_point}


@contextmanager
def system_metrics(run_id: str, uri: str, after_s: float | None, interval_s: float = 10.0) -> Iterator[None]:
    """MLflow's system metrics (CPU, memory, disk, network, and GPU where pynvml finds one) logged to
    ``run_id`` every ``interval_s``, from ``after_s`` seconds into the block (None: never). The delay
    keeps short runs (tests, probes) free of them; a run longer than it gets them for the rest."""
    if after_s is None:
        yield
        return
    started: list[Any] = []

    def start() -> None:  # psutil and pynvml are imported only by runs that reach after_s
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no "Started monitoring" lines
        monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, samples_before_logging=1, tracking_uri=uri)
        monitor.start()
        started.append(monitor)

    timer = threading.Timer(after_s, start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # a start already under way ends first
        for monitor in started:  # stop its thread, flush its last sample
            monitor.finish()


DEFAULT_URI = TrackingConfig.uri  # dpsweep's default store (sqlite:///mlflow.db), relative to where it ran


UI_ADDRESS = "http://127.0.0.1:5000"  # where `mlflow ui` (make ui) serves by default


def ui_url(server: str, experiment_id: str) -> str:
    """The MLflow UI page of an experiment's training runs. MLflow 3's UI opens experiments in its
    GenAI view (traces, token usage) unless the page asks for the model-training one, whatever the
    experiment's kind: ``workflowType=machine_learning`` does (checked in a real browser)."""
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}?workflowType=machine_learning"


def next_steps(uri: str, experiment: str, sweep_id: str | None = None) -> str:
    """The line a finished run or sweep ends with: the report command for its runs, and how to browse
    them (the command that serves the UI, for a local store, and the page of the experiment's runs)."""
    report = f"dpsweep-report --experiment {experiment}" + (f" --sweep {sweep_id}" if sweep_id else "")
    if uri != DEFAULT_URI:
        report += f" --tracking-uri {uri}"
    local = urlparse(uri).scheme in ("sqlite", "file", "")
    browse = f"mlflow ui --backend-store-uri {uri}" + (" (make ui)" if uri == DEFAULT_URI else "") if local else uri
    try:
        found = MlflowClient(uri).get_experiment_by_name(experiment)
    except Exception:  # the line is a hint: a store that cannot be read now just gets no page
        found = None
    if found is not None:
        browse += f", then open {ui_url(UI_ADDRESS if local else uri, found.experiment_id)}"
    return f"dpsweep: next: {report}; browse the runs: {browse}"


def _now_ms() -> int:
    return int(time.time() * 1000)


_READY: set[str] = set()  # tracking URIs whose store this process has opened
BUSY_RETRIES = 8  # attempts of a write that SQLite refused as "database is locked"


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive lock on a local sqlite store (a file ``<db>.lock`` beside it), for what must not
    interleave between processes: creating the store, claiming a config. No-op for other stores."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def open_client(uri: str) -> MlflowClient:
    """A client of ``uri`` whose store exists. A new sqlite store is created (its schema and
    migrations) under :func:`store_lock`: MLflow's migrations collide when several processes open a
    fresh database at once, and the loser can leave it broken for good."""
    if uri not in _READY and uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        if not os.access(db.parent if str(db.parent) else Path("."), os.W_OK):
            raise ConfigError(
                "tracking.uri", uri, f"a database in a directory dpsweep can write ({db.parent.absolute()})"
            )
        with store_lock(uri):
            try:
                retry_busy(lambda: MlflowClient(uri).search_experiments(max_results=1))
            except Exception as err:  # SQLAlchemy's DatabaseError ("file is not a database"), MLflow's own
                raise ConfigError(
                    "tracking.uri", uri, f"an MLflow database, or a path where one can be made: {db} is not one ({err})"
                ) from err
    _READY.add(uri)
    return MlflowClient(uri)


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


def _holder(client: MlflowClient, experiment: str, claim: Claim) -> Any:
    """The run that holds the claimed config in the experiment: FINISHED, or RUNNING and alive, and
    not an earlier run of the same job (a requeue)."""
    for run in client.search_runs([experiment], filter_string=f"tags.`config.hash` = '{claim.config_hash}'"):
        tags = run.data.tags
        if tags.get("sweep.role") == "parent" or (claim.owner is not None and tags.get(OWNER_TAG) == claim.owner):
            continue
        if run.info.status == "FINISHED" or (
            run.info.status == "RUNNING" and PROCESS_TAG in tags and why_dead(tags, time.time()) is None
        ):
            return run
    return None


def _create_run(client: MlflowClient, cfg: TrackingConfig, tags: dict[str, str], claim: Claim | None) -> Any:
    """A new run; with a ``claim``, only if no other run holds that config, checked and created under
    :func:`store_lock` so that two jobs of one config cannot both start it (a remote tracking server
    has no such lock: there the check narrows the window but cannot close it)."""
    exp = experiment_id(client, cfg.experiment_name)
    tags = source_tags() | tags
    if claim is None:
        return retry_busy(lambda: client.create_run(exp, run_name=cfg.run_name, tags=tags))
    if claim.owner is not None:
        tags = tags | {OWNER_TAG: claim.owner}
    with store_lock(cfg.uri):
        holder = _holder(client, exp, claim)
        if holder is not None:
            raise Claimed(holder.info.run_id, holder.info.status)
        return retry_busy(lambda: client.create_run(exp, run_name=cfg.run_name, tags=tags))


T = TypeVar("T")


def retry_busy(call: Callable[[], T]) -> T:
    """``call()``, retried with exponential backoff (0.05 s doubling, BUSY_RETRIES attempts) while
    SQLite answers "database is locked" or "busy": concurrent jobs writing one local store."""
    for attempt in range(BUSY_RETRIES):
        try:
            return call()
        except Exception as err:  # MlflowException and SQLAlchemy's OperationalError both carry the text
            text = str(err).lower()
            if attempt == BUSY_RETRIES - 1 or ("database is locked" not in text and "busy" not in text):
                raise
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


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


# MLflow 3's UI opens an experiment by its kind; without one it guesses, and an experiment of
# training runs can open on an empty GenAI traces page. dpsweep's are model training.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def experiment_id(client: MlflowClient, name: str) -> str:
    """Id of the experiment ``name``, created if missing (safe when several jobs race), and marked as
    a model-training experiment for MLflow's UI unless it has a kind already."""
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return str(client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}))
        except MlflowException:  # another job created it first (with the tag)
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if EXPERIMENT_KIND_TAG not in found.tags:  # made by an older dpsweep, or by hand
        retry_busy(lambda: client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND))
    return str(found.experiment_id)


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError) or "out of memory" in str(err).lower():
        return True
    torch = sys.modules.get("torch")  # a torch OOM can only come from a process that imported torch
    return torch is not None and isinstance(err, torch.OutOfMemoryError)


def run_finished(uri: str, run_id: str) -> bool:
    """Whether the run ``run_id`` exists in the store at ``uri`` and ended FINISHED."""
    try:
        return bool(retry_busy(lambda: open_client(uri).get_run(run_id)).info.status == "FINISHED")
    except MlflowException:  # no such run (a checkpoint from another store)
        return False


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
    between this one finding its checkpoint and reopening its run)."""
    mlflow.set_tracking_uri(cfg.uri)
    client = open_client(cfg.uri)
    alive = {PROCESS_TAG: ProcessId.current().token, HEARTBEAT_TAG: f"{time.time():.0f}"}
    str_tags = {k: str(v) for k, v in (tags or {}).items()} | alive
    if resume_run_id is not None:
        run = client.get_run(resume_run_id)
        resumed_in = client.get_experiment(run.info.experiment_id).name
        if resumed_in != cfg.experiment_name:
            raise ConfigError(
                "tracking.experiment_name", cfg.experiment_name,
                f"{resumed_in!r}, the experiment of run {resume_run_id} that this config's checkpoint resumes "
                "(or another train.checkpoint_dir to start afresh)",
            )  # fmt: skip
        with store_lock(cfg.uri):  # checked and taken over at once: one live process per run
            run = client.get_run(resume_run_id)
            held = run.data.tags
            if run.info.status == "FINISHED":  # finished by another process since its checkpoint was found
                raise Claimed(resume_run_id, "FINISHED")  # (it removes the checkpoint next): never reopened
            if (
                run.info.status == "RUNNING" and held.get(PROCESS_TAG, alive[PROCESS_TAG]) != alive[PROCESS_TAG]
                and why_dead(held, time.time()) is None
            ):  # fmt: skip
                raise Claimed(resume_run_id, "RUNNING")
            retry_busy(lambda: client.set_tag(resume_run_id, PROCESS_TAG, alive[PROCESS_TAG]))
    else:
        run = _create_run(client, cfg, str_tags, claim)
    tracker = Tracker(client, run.info.run_id)
    status = "FAILED"
    try:
        if resume_run_id is not None:  # reopened after an interruption: it is no longer a failure
            client.update_run(resume_run_id, status="RUNNING")
            for stale in FAILURE_TAGS & set(run.data.tags):
                client.delete_tag(resume_run_id, stale)
            previous = int(run.data.tags.get("resume.count", "0"))
            tracker.set_tags(str_tags | {"resume.count": previous + 1})
        with heartbeat(lambda: tracker.set_tags({HEARTBEAT_TAG: f"{time.time():.0f}"}), HEARTBEAT_S):
            yield tracker
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
        retry_busy(lambda: client.set_terminated(run.info.run_id, status))


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (scancel, qdel, preemption) interrupts training, so its MLflow run ends KILLED."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"terminated by signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError, fast, if jobs could not log to ``uri`` (checked before submitting)."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0]
    if scheme == "sqlite":
        db = Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else Path(parsed.path)
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


def ensure_experiments(pairs: set[tuple[str, str]]) -> None:
    """Create each (tracking URI, experiment name) once, before jobs fan out."""
    for uri, name in sorted(pairs):
        experiment_id(open_client(uri), name)


def sweep_jobs(client: MlflowClient, experiment: str, sweep_id: str) -> list[Any]:
    """The runs of a sweep's jobs (tagged with ``sweep.id``; not its parent run)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`sweep.id` = '{sweep_id}'", max_results=50000)
    return [r for r in runs if r.data.tags.get("sweep.role") != "parent"]


def runs_of_sweep(uri: str, experiment: str, sweep_id: str) -> dict[str, str]:
    """{run id: status} of the runs of a sweep's jobs."""
    return {r.info.run_id: r.info.status for r in sweep_jobs(MlflowClient(uri), experiment, sweep_id)}


RESULTS_TABLE = "results.json"  # the sweep parent run's table of its jobs (MLflow's log_table)


def log_results_table(uri: str, experiment: str, sweep_id: str, parent_run_id: str) -> int:
    """The sweep's jobs as one table on its parent run (``results.json``, MLflow's ``log_table``,
    shown in the run's artifacts): the run name, ``test_accuracy`` and ``epsilon`` first, the
    status, then the params that differ between the jobs. Returns the number of rows."""
    client = MlflowClient(uri)
    runs = sweep_jobs(client, experiment, sweep_id)
    keys = sorted({k for r in runs for k in r.data.params})
    differing = [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]
    table: dict[str, list[Any]] = {"run": [r.info.run_name for r in runs]}
    table["test_accuracy"] = [r.data.metrics.get("test_accuracy") for r in runs]
    table["epsilon"] = [r.data.metrics.get("epsilon") for r in runs]
    table["status"] = [r.info.status for r in runs]
    table |= {k: [r.data.params.get(k) for r in runs] for k in differing}
    if runs:
        retry_busy(lambda: client.log_table(parent_run_id, data=table, artifact_file=RESULTS_TABLE))
    return len(runs)


def runs_by_hash(uri: str, experiment: str, status: str = "FINISHED") -> dict[str, str]:
    """{config hash: run id} of the experiment's runs in ``status`` (the newest run per hash). RUNNING
    runs count only when they name their process (tag run.process): older versions' runs left RUNNING
    cannot be told from live ones and must not block their config."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    out: dict[str, str] = {}
    token = None
    while True:
        page = client.search_runs(
            [exp.experiment_id], filter_string=f"attributes.status = '{status}'", max_results=10000,
            order_by=["attributes.start_time ASC"], page_token=token,
        )  # fmt: skip
        for run in page:
            tags = run.data.tags
            if status == "RUNNING" and PROCESS_TAG not in tags:
                continue
            if "config.hash" in tags and tags.get("sweep.role") != "parent":
                out[tags["config.hash"]] = run.info.run_id
        token = page.token
        if not token:
            return out


def trial_run(uri: str, experiment: str, sweep_id: str, trial: int) -> Any:
    """The MLflow run of an Optuna trial of a sweep (None if the job never started one)."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    found = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`sweep.id` = '{sweep_id}' and tags.`optuna.trial` = '{trial}'"
    )
    return found[0] if found else None


def close_orphaned_runs(uri: str, experiment: str, sweep_id: str) -> list[str]:
    """Mark KILLED the runs of a finished sweep still RUNNING: their job died without closing them."""
    client = MlflowClient(uri)
    orphans = [run_id for run_id, status in runs_of_sweep(uri, experiment, sweep_id).items() if status == "RUNNING"]
    for run_id in orphans:
        Tracker(client, run_id).set_tags(
            {
                "error": "the job ended without closing its run (killed by the scheduler or the OS)",
                "failure.kind": "killed",
            }
        )
        client.set_terminated(run_id, "KILLED")
    return sorted(orphans)


def _record_failure(tracker: Tracker, err: BaseException, kind: str) -> None:
    try:
        tracker.set_tags(
            {"error": f"{type(err).__name__}: {err}", "error.type": type(err).__name__, "failure.kind": kind}
        )
        tracker.log_text("".join(traceback.format_exception(err)), "error.txt")
    except Exception:  # recording must never hide the original error or keep the run RUNNING
        pass


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """Commit of the dpsweep source tree, with ``-dirty`` if it has uncommitted changes, asked once per
    process (at its first run: an edit during an inline sweep does not change the code it runs)."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def environment_tags(device: torch.device) -> dict[str, str]:
    import opacus
    import torch

    return {
        "git.commit": git_commit(),
        "torch.version": torch.__version__,
        "opacus.version": opacus.__version__,
        "device.name": device_name(device),
        "job.pid": str(os.getpid()),  # the process the run trained in (memory probes: one each)
    }
