"""The tracking process's entry point and its ops (see :mod:`dpsweep.tracking.channel`).

    python -m dpsweep.tracking.child <fd> <argv0>     # started by dpsweep.tracking.channel

``fd`` is its end of the socket to the run's process; ``argv0`` that process's ``sys.argv[0]``, so
that MLflow's source tags (the script, its git commit) describe the run's process and not this one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dpsweep.tracking import dead_runs, logged_models, monitors, store, sweeps  # noqa: F401  (@store.op on import)
from dpsweep.tracking.channel import in_background, serve
from dpsweep.tracking.dead_runs import reconcile

if TYPE_CHECKING:
    from dpsweep.config import TrackingConfig


def reconcile_runs(uri: str, experiment: str | None, spare: str = "") -> list[tuple[str, str, str | None]]:
    """:func:`dpsweep.tracking.dead_runs.reconcile` as plain data: (run id, reason, checkpoint removed)."""
    return [(d.run_id, d.reason, d.checkpoint_removed) for d in reconcile(uri, experiment, spare=spare)]


WARM_MODEL = __name__ == "__main__"  # the tracking process runs this module; an InProcess service warms nothing


def begin_run(cfg: TrackingConfig, *args: Any, **kwargs: Any) -> str:
    """:func:`dpsweep.tracking.store.begin_run`; then, in the tracking process, for a run that logs
    its model, the model's imports in a thread (:func:`warm_model`). A run that logs none never
    imports them."""
    run_id = store.begin_run(cfg, *args, **kwargs)
    if cfg.log_model and WARM_MODEL:
        in_background(warm_model)
    return run_id


# every store operation (``@store.op``, in store, sweeps, monitors, dead_runs and logged_models), with the two
# that answer differently here: a run begun warms its model's imports; dead runs are told as plain data
OPS: dict[str, Callable[..., Any]] = {
    **store.OPS,
    "begin_run": begin_run,
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
