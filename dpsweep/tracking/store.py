"""The MLflow side of tracking: every function that talks to an MLflow store, with plain arguments.

    from dpsweep.tracking.store import open_client  # in the process of a run, or of a command that reads a store

A run's process logs through :mod:`dpsweep.tracking`, which calls these functions at its first
logging call (this module imports MLflow). Commands that read or mend a store (``dpsweep-report``,
``dpsweep-runs``, ``dpsweep-plan``, ``dpsweep-memory``) call them directly.

The run ops (:func:`begin_run` ... :func:`end_run`) take the tracking URI and the run id each time;
one client per URI is kept. Local sqlite stores are written under :func:`store_lock` where several
processes must not interleave, and every write retries while SQLite reports itself busy. Params,
metrics and tags can be written on MLflow's asynchronous logging (``synchronous=False``): the write
returns MLflow's ``RunOperations`` at once, whose ``wait()`` raises its error.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import mlflow
from mlflow.entities import Metric, Param, RunTag
from mlflow.environment_variables import MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from dpsweep.config import ConfigError, TrackingConfig
from dpsweep.process.shutdown import signals_deferred
from dpsweep.tracking import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    FAILURE_TAGS,
    MAX_PARAM_CHARS,
    MAX_TAG_CHARS,
    OWNER_TAG,
    PROCESS_TAG,
    Claim,
    Claimed,
    sqlite_path,
    why_dead,
)
from dpsweep.tracking.probes import probe

# MLflow's asynchronous logging writes its batches from a pool of threads, 10 by default, in whatever order
# they finish: one thread writes them in the order logged (a param keeps its first value, a tag its last)
MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE.set(1)

_READY: set[str] = set()  # tracking URIs whose store this process has opened
BUSY_RETRIES = 8  # attempts of a write that SQLite refused as "database is locked"
F = TypeVar("F", bound=Callable[..., Any])


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive lock on a local sqlite store (a file ``<db>.lock`` beside it), for what must not
    interleave between processes: creating the store, claiming a config. No-op for other stores."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def open_client(uri: str) -> MlflowClient:
    """A client of ``uri`` whose store exists. A new sqlite store is created (its schema and
    migrations) under :func:`store_lock`: MLflow's migrations collide when several processes open a
    fresh database at once, and the loser can leave it broken for good. A server (http, https, or a
    database's: postgresql, mysql, mssql) must answer first (:func:`dpsweep.tracking.probes.probe`):
    MLflow's own clients retry an unreachable one for minutes, then print a traceback (issue 39, item
    13; issue 55, item 5). A URI MLflow cannot open (an unknown scheme, its retired file store) is
    refused with MLflow's reason."""
    if uri in _READY:
        return MlflowClient(uri)
    probe(uri)
    db = sqlite_path(uri)
    if db is not None:
        if not os.access(db.parent if str(db.parent) else Path("."), os.W_OK):
            raise ConfigError(
                "tracking.uri", uri, f"a database in a directory dpsweep can write ({db.parent.absolute()})"
            )
        with store_lock(uri):
            try:
                if not db.exists() and db.name != ":memory:":
                    _create_store(db)
                retry_busy(lambda: MlflowClient(uri).search_experiments(max_results=1))
            except Exception as err:  # SQLAlchemy's DatabaseError ("file is not a database"), MLflow's own
                raise ConfigError(
                    "tracking.uri", uri, f"an MLflow database, or a path where one can be made: {db} is not one ({err})"
                ) from err
    try:
        client = MlflowClient(uri)
    except MlflowException as err:  # its store registries': an unknown scheme, the file store's retirement
        raise ConfigError(
            "tracking.uri", uri, "a tracking URI MLflow can open (sqlite:///mlflow.db, postgresql://host/db, "
            f"http://host:5000): {str(err).strip().split('. ')[0]}",
        ) from err  # fmt: skip
    _READY.add(uri)
    return client


def open_store(uri: str) -> None:
    """Open (or create) the store at ``uri``: ConfigError where it is not one or cannot be made."""
    open_client(uri)


def _create_store(db: Path) -> None:
    """A new MLflow database at ``db``, made whole or not at all (under :func:`store_lock`): MLflow
    creates its tables and runs its migrations in a file beside it, which is renamed to ``db`` once
    they are all done. A process killed part way (a refused sweep's exit that stopped waiting for it on
    a loaded machine, a Ctrl-C) leaves no half-migrated ``db``, which MLflow would then fail to open
    ("table ... already exists"); its leftover is removed by the next creation."""
    for stale in db.parent.glob(f".{db.name}.*.new*"):  # with SQLite's journal
        stale.unlink(missing_ok=True)
    building = db.with_name(f".{db.name}.{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}.new")
    try:
        MlflowClient(f"sqlite:///{building}").search_experiments(max_results=1)
        os.replace(building, db)
    finally:
        for left in db.parent.glob(f"{building.name}*"):
            left.unlink(missing_ok=True)


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


# What SQLite and PostgreSQL answer when two writers insert the same row at once (a store's check for
# a row and its insert are not one step): retried by the writes that create a shared row if it is missing.
CONFLICTS = ("unique constraint failed", "duplicate key value violates unique constraint")


def retry_busy(call: Callable[[], T], conflicts: bool = False) -> T:
    """``call()``, retried with exponential backoff (0.05 s doubling, BUSY_RETRIES attempts) while
    SQLite answers "database is locked" or "busy": concurrent jobs writing one local store. With
    ``conflicts``, also while another writer inserted the same row first (:data:`CONFLICTS`): for a
    write that reuses a row that exists, the retry then finds it.

    Each attempt holds SIGTERM and SIGINT back until it returns (:func:`signals_deferred`; not the sleeps
    between attempts): an interrupt raised in the middle of a SQLite statement left its cursor alive in
    the traceback, holding the database's lock, and every later write of the run (its KILLED status
    among them) then failed as "database is locked" for minutes (a launcher=local job whose driver was
    killed while the job read its run)."""
    for attempt in range(BUSY_RETRIES):
        try:
            with signals_deferred():
                return call()
        except Exception as err:  # MlflowException and SQLAlchemy's OperationalError both carry the text
            text = str(err).lower()
            busy = "database is locked" in text or "busy" in text
            if attempt == BUSY_RETRIES - 1 or not (busy or (conflicts and any(c in text for c in CONFLICTS))):
                raise
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


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


def run_finished(uri: str, run_id: str) -> bool:
    """Whether the run ``run_id`` exists in the store at ``uri`` and ended FINISHED."""
    try:
        return bool(retry_busy(lambda: open_client(uri).get_run(run_id)).info.status == "FINISHED")
    except MlflowException:  # no such run (a checkpoint from another store)
        return False


def ensure_experiments(pairs: set[tuple[str, str]]) -> None:
    """Create each (tracking URI, experiment name) once, before jobs fan out."""
    for uri, name in sorted(pairs):
        experiment_id(open_client(uri), name)


def differing_params(runs: list[Any]) -> list[str]:
    """The params whose values differ between ``runs`` (a param some run lacks counts as differing), sorted."""
    keys = sorted({k for r in runs for k in r.data.params})
    return [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]


# ---------------------------------------------------------------------------------------------
# a run's ops: what dpsweep.tracking.Tracker and tracked_run hand over
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def client_of(uri: str) -> MlflowClient:
    """One client per store, for the run ops (its store opened, see :func:`open_client`)."""
    return open_client(uri)


def begin_run(
    cfg: TrackingConfig, tags: Mapping[str, str], resume_run_id: str | None, claim: Claim | None, process: str
) -> str:
    """Create the run (or reopen ``resume_run_id``) with ``tags``; return its id. ``process`` is the
    token of the process that will run it (tag ``run.process``). Raises :class:`Claimed` where
    another run holds the claim or the resumed run, and ConfigError for a resume into another
    experiment: both before anything is written."""
    use_uri(cfg.uri)
    client = client_of(cfg.uri)
    if resume_run_id is None:
        return str(_create_run(client, cfg, dict(tags), claim).info.run_id)
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
            run.info.status == "RUNNING" and held.get(PROCESS_TAG, process) != process
            and why_dead(held, time.time()) is None
        ):  # fmt: skip
            raise Claimed(resume_run_id, "RUNNING")
        retry_busy(lambda: client.set_tag(resume_run_id, PROCESS_TAG, process))
    # reopened after an interruption: it is no longer a failure
    retry_busy(lambda: client.update_run(resume_run_id, status="RUNNING"))
    for stale in FAILURE_TAGS & set(run.data.tags):
        retry_busy(lambda stale=stale: client.delete_tag(resume_run_id, stale))  # type: ignore[misc]
    previous = int(run.data.tags.get("resume.count", "0"))
    _set_tags(client, resume_run_id, dict(tags) | {"resume.count": previous + 1})
    return resume_run_id


def use_uri(uri: str) -> None:
    """Make ``uri`` MLflow's tracking URI in this process (the fluent APIs that log models and
    datasets read it), where it is not already: ``mlflow.set_tracking_uri`` also resets MLflow's
    tracing provider, which costs 0.2 s the second time (it imports the span processors)."""
    if mlflow.get_tracking_uri() != uri:
        mlflow.set_tracking_uri(uri)


def end_run(uri: str, run_id: str, status: str) -> None:
    """End the run FINISHED, FAILED or KILLED; a FINISHED run that logged a model (its ``outputs``) has
    its objective and ε linked to it first (:func:`dpsweep.tracking.logged_models.link_model_metrics`:
    its final metrics may come after the model, or the model from an earlier job of a resumed run). A
    run without one asks nothing of the store's LoggedModels (an MLflow 2 server has none)."""
    from dpsweep.tracking.logged_models import link_model_metrics  # (it imports this module)

    client = client_of(uri)
    try:
        run = retry_busy(lambda: client.get_run(run_id)) if status == "FINISHED" else None
        if run is not None and run.outputs is not None and run.outputs.model_outputs:
            link_model_metrics(client, run_id)
    finally:
        retry_busy(lambda: client.set_terminated(run_id, status))


def log_params(uri: str, run_id: str, params: Mapping[str, Any], synchronous: bool = True) -> list[Any]:
    """Returns MLflow's ``RunOperations`` of each batch (none where ``synchronous``)."""
    items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
    chunks = [items[i : i + 100] for i in range(0, len(items), 100)]  # MLflow accepts at most 100 params per batch
    return _log_batch(client_of(uri), run_id, synchronous, [{"params": chunk} for chunk in chunks])


def log_metrics(
    uri: str, run_id: str, metrics: Mapping[str, float], step: int, timestamp_ms: int, synchronous: bool = True
) -> list[Any]:
    """``timestamp_ms``: when the run measured them. Returns MLflow's ``RunOperations`` (none where
    ``synchronous``)."""
    items = [Metric(k, float(v), timestamp_ms, step) for k, v in metrics.items()]
    return _log_batch(client_of(uri), run_id, synchronous, [{"metrics": items}] if items else [])


def _set_tags(client: MlflowClient, run_id: str, tags: Mapping[str, Any], synchronous: bool = True) -> list[Any]:
    items = [RunTag(k, str(v)[:MAX_TAG_CHARS]) for k, v in tags.items()]
    return _log_batch(client, run_id, synchronous, [{"tags": items}] if items else [])


def set_tags(uri: str, run_id: str, tags: Mapping[str, Any], synchronous: bool = True) -> list[Any]:
    """Returns MLflow's ``RunOperations`` (none where ``synchronous``)."""
    return _set_tags(client_of(uri), run_id, tags, synchronous)


def _log_batch(client: MlflowClient, run_id: str, synchronous: bool, batches: list[dict[str, Any]]) -> list[Any]:
    """Each of ``batches`` (``log_batch``'s keyword arguments) written now, retried while SQLite is
    busy; or handed to MLflow's asynchronous logging, whose ``RunOperations`` are returned."""
    if not synchronous:
        return [client.log_batch(run_id, synchronous=False, **batch) for batch in batches]
    for batch in batches:
        retry_busy(lambda batch=batch: client.log_batch(run_id, **batch))  # type: ignore[misc]
    return []


def log_text(uri: str, run_id: str, text: str, artifact_file: str) -> None:
    retry_busy(lambda: client_of(uri).log_text(run_id, text, artifact_file))


def log_image(uri: str, run_id: str, image: Any, artifact_file: str) -> None:
    retry_busy(lambda: client_of(uri).log_image(run_id, image, artifact_file=artifact_file))


def log_file(uri: str, run_id: str, local_path: str, artifact_path: str | None) -> None:
    retry_busy(lambda: client_of(uri).log_artifact(run_id, local_path, artifact_path))


# a private tuning's trial's params that its logged model leaves out (dpsweep.privacy.tuning: its seed is
# secret; dpsweep.run.records.WITHHELD_PARAMS leaves it out of the run's params too)
TUNING_SECRET_PARAMS = ("train.seed",)


def models_of(client: MlflowClient, experiment_id: str) -> list[Any]:
    """Every LoggedModel of the experiment that is not deleted (all pages of ``search_logged_models``)."""
    out: list[Any] = []
    token = None
    while True:
        page = retry_busy(lambda token=token: client.search_logged_models(  # type: ignore[misc]
            [experiment_id], max_results=1000, page_token=token
        ))  # fmt: skip
        out.extend(page)
        token = page.token
        if not token:
            return out


def log_model(
    uri: str, run_id: str, module: Any, input_example: Any, output: Any, name: str | None, torch_version: str
) -> None:
    """A torch module as an MLflow PyTorch-flavour model (``MLmodel``, weights, and the signature of
    ``input_example`` and the module's ``output`` on it): an MLflow 3 LoggedModel in the run's
    experiment, the run's output (the UI's Models column and tab), with the run's params and ``dp.*``
    tags (``dp.release=not-for-release`` among them), and the run's objective and ε so far
    (:func:`dpsweep.tracking.logged_models.link_model_metrics`; :func:`end_run` links the rest). Its
    ``name`` (None: :func:`dpsweep.tracking.logged_models.model_name`, e.g. ``digits-cnn-dpsgd-eps1_84``)
    is also the run's tag ``model.name``. ``models:/<model_id>`` loads it, and so does
    ``runs:/<run_id>/<name>``, which MLflow resolves to the run's model of that name.

    Through the client, not ``mlflow.pytorch.log_model(run_id=…)``: without an active run that files
    the model under the fluent API's current experiment (Default), not the run's.

    Once per run: a run that already has a READY model (its job logged it, then was requeued before the
    run ended) is left as it is, not given a second LoggedModel.

    A trial of a private tuning's model (tag ``sweep.private_tuning=True``) carries no secret param
    (:data:`TUNING_SECRET_PARAMS`: its ``train.seed``), whichever trial is released: the Models tab shows
    every model's params (issue 54, item 3)."""
    client = client_of(uri)
    run = retry_busy(lambda: client.get_run(run_id))
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    from dpsweep.tracking.logged_models import link_model_metrics, model_name  # (it imports this module)

    same = f"source_run_id = '{run_id}'"  # (a filter on status matches nothing)
    earlier = retry_busy(lambda: client.search_logged_models([run.info.experiment_id], filter_string=same))
    if any(m.status == LoggedModelStatus.READY for m in earlier):
        return
    name = name or model_name(run)
    with tempfile.TemporaryDirectory(prefix="dpsweep-model-") as tmp:
        path = Path(tmp) / name
        _save_model(module, input_example, output, torch_version, path)
        tags = {k: v for k, v in run.data.tags.items() if k.startswith("dp.")}
        params = dict(run.data.params)
        if run.data.tags.get("sweep.private_tuning") == "True":
            params = {k: v for k, v in params.items() if k not in TUNING_SECRET_PARAMS}
        model = retry_busy(lambda: client.create_logged_model(
            run.info.experiment_id, name=name, source_run_id=run_id, params=params, tags=tags,
        ))  # fmt: skip
        try:
            retry_busy(lambda: client.log_model_artifacts(model.model_id, str(path)))
        except BaseException:
            retry_busy(lambda: client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED))
            raise
        retry_busy(lambda: client.finalize_logged_model(model.model_id, LoggedModelStatus.READY))
        retry_busy(lambda: client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)]))
    _set_tags(client, run_id, {"model.name": name})
    link_model_metrics(client, run_id)


def _save_model(module: Any, input_example: Any, output: Any, torch_version: str, path: Path) -> None:
    """The module saved at ``path`` in MLflow's PyTorch flavour (imported here: torch and the flavour,
    only for runs that log a model), pickled whole as the Opacus examples keep it."""
    import mlflow.pytorch
    from mlflow.models import infer_signature

    quiet = logging.getLogger("mlflow.pytorch")  # its warning on pickle: the format is chosen knowingly
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        mlflow.pytorch.save_model(
            module, str(path), signature=infer_signature(input_example, output), input_example=input_example,
            pip_requirements=[f"torch=={torch_version}"],  # its classes: dpsweep's
            serialization_format="pickle",  # the whole module (torch.save), as the Opacus examples keep it
        )  # fmt: skip
    finally:
        quiet.setLevel(level)


def log_dataset_splits(uri: str, run_id: str, public: Mapping[str, str], digest: str, splits: list[str]) -> None:
    """Each split as an MLflow dataset input of the run (the UI's Dataset column), described by
    ``public`` (see :meth:`dpsweep.tracking.Tracker.log_dataset_splits`) and context-tagged."""
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Dataset, DatasetInput, InputTag

    name = str(public.get("name", "dataset"))
    inputs = []
    for split in splits:
        source = CodeDatasetSource(dict(public) | {"split": split})
        meta = MetaDataset(source, name=f"{name}-{split}", digest=digest)  # type: ignore[abstract]
        inputs.append(DatasetInput(Dataset(**meta.to_dict()), tags=[InputTag("mlflow.data.context", split)]))
    # a dataset of the experiment is stored once: two jobs may insert it at once, and the later one
    # then links the stored dataset on its retry (issue 39, item 1)
    retry_busy(lambda: client_of(uri).log_inputs(run_id, datasets=inputs), conflicts=True)


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


def experiment_of(uri: str, name: str) -> str | None:
    """Id of the experiment ``name``, or None (also where the store cannot be read now)."""
    try:
        found = MlflowClient(uri).get_experiment_by_name(name)
    except Exception:
        return None
    return None if found is None else str(found.experiment_id)
