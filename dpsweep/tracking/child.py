"""The tracking process's entry point and its ops (see :mod:`dpsweep.tracking.channel`).

    python -m dpsweep.tracking.child <fd> <argv0>     # started by dpsweep.tracking.channel

``fd`` is its end of the socket to the run's process; ``argv0`` that process's ``sys.argv[0]``, so
that MLflow's source tags (the script, its git commit) describe the run's process and not this one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpsweep.tracking import store
from dpsweep.tracking.channel import in_background, serve
from dpsweep.tracking.dead_runs import reconcile

if TYPE_CHECKING:
    from dpsweep.config import TrackingConfig


def reconcile_runs(uri: str, experiment: str | None) -> list[tuple[str, str, str | None]]:
    """:func:`dpsweep.tracking.dead_runs.reconcile` as plain data: (run id, reason, checkpoint removed)."""
    return [(d.run_id, d.reason, d.checkpoint_removed) for d in reconcile(uri, experiment)]


def open_store(uri: str) -> None:
    """Open (or create) the store at ``uri``: ConfigError where it is not one or cannot be made."""
    store.open_client(uri)


def warm_store(uri: str) -> None:
    """Open the store at ``uri`` ahead of the run's :func:`open_store`, which reports what fails, and
    do what the process's first run creation would otherwise wait for: MLflow's tracking URI set, and
    the source tags resolved (GitPython imported)."""
    with contextlib.suppress(Exception):
        store.open_client(uri)
        store.use_uri(uri)
        store.source_tags()


WARM_MODEL = __name__ == "__main__"  # the tracking process runs this module; an InProcess service warms nothing


def begin_run(cfg: TrackingConfig, *args: Any, **kwargs: Any) -> str:
    """:func:`dpsweep.tracking.store.begin_run`; then, in the tracking process, for a run that logs
    its model, the model's imports in a thread (:func:`warm_model`). A run that logs none never
    imports them."""
    run_id = store.begin_run(cfg, *args, **kwargs)
    if cfg.log_model and WARM_MODEL:
        in_background(warm_model)
    return run_id


OPS: dict[str, Callable[..., Any]] = {
    "open_store": open_store,
    "warm_store": warm_store,
    "begin_run": begin_run,
    "end_run": store.end_run,
    "log_params": store.log_params,
    "log_metrics": store.log_metrics,
    "set_tags": store.set_tags,
    "log_text": store.log_text,
    "log_image": store.log_image,
    "log_file": store.log_file,
    "log_model": store.log_model,
    "log_dataset_splits": store.log_dataset_splits,
    "start_system_metrics": store.start_system_metrics,
    "stop_system_metrics": store.stop_system_metrics,
    "run_finished": store.run_finished,
    "ensure_experiments": store.ensure_experiments,
    "runs_by_hash": store.runs_by_hash,
    "runs_of_sweep": store.runs_of_sweep,
    "close_orphaned_runs": store.close_orphaned_runs,
    "log_results_table": store.log_results_table,
    "release_best": store.release_best,
    "experiment_of": store.experiment_of,
    "reconcile": reconcile_runs,
}


def warm() -> None:
    """What the first dataset logged would otherwise wait for, done in a thread once the store is open:
    MLflow's dataset entities."""
    import mlflow.data.code_dataset_source
    import mlflow.data.meta_dataset  # noqa: F401


def warm_model() -> None:
    """What the first model logged would otherwise wait for, in a thread once its run has begun: the
    PyTorch flavour, and MLflow's map of the installed distributions' modules (0.65 s on the 2-core
    development VM), which ``save_model`` builds to check a model's requirements, whatever
    ``pip_requirements`` says. That map is a private function of MLflow's: where it is missing, the
    first model logged builds it as before.

    Only for a run that logs its model (:func:`begin_run`): the flavour imports torch, and where they
    are installed PyTorch Lightning, torchmetrics and torchvision (``mlflow.pytorch`` imports its
    Lightning autologger). That took 10 CPU-seconds per tracking process on the H100 machine's image
    (py-spy of a packed job of 8 trials), which K trials of a packed job paid K times over on the job's
    cores while they started."""
    import mlflow.models
    import mlflow.pytorch  # noqa: F401
    from mlflow.utils import requirements_utils

    getattr(requirements_utils, "_init_packages_to_modules_map", lambda: None)()


WARM_AFTER = frozenset({"warm_store", "open_store", "begin_run"})  # the store is open


if __name__ == "__main__":
    fd, argv0 = sys.argv[1:]
    sys.argv = [argv0]
    serve(int(fd), OPS, warm, WARM_AFTER)
