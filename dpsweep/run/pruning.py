"""Optuna, as a training job sees it: the study's storage, the pruners, and the per-epoch trial reporter.

A job of an Optuna study (``dpsweep -m search=accuracy_tpe``, see ``dpsweep.launchers.optuna_sweeper``)
gets ``sweep.study``, ``sweep.trial``, ``sweep.storage`` and ``sweep.pruner``; with a pruner it reports
its test accuracy after each epoch and stops when the pruner says so. The study side (samplers,
objectives, search spaces) lives in ``dpsweep.launchers.search``. Current Optuna (>= 4) is used
directly: the hydra-optuna-sweeper package pins optuna < 3.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import optuna

from dpsweep.config import ConfigError, SweepConfig
from dpsweep.interop import optuna_private
from dpsweep.registry import Registry

optuna.logging.set_verbosity(optuna.logging.WARNING)

PRUNERS: Registry[Callable[[SweepConfig], optuna.pruners.BasePruner]] = Registry("pruner")
PRUNERS.register("median")(
    lambda s: optuna.pruners.MedianPruner(
        n_startup_trials=s.pruner_startup_trials, n_warmup_steps=s.pruner_warmup_epochs
    )
)


# ---------------------------------------------------------------------------------------------
# storages: sqlite (default), any SQLAlchemy URL (PostgreSQL for clusters), or a journal file
# ---------------------------------------------------------------------------------------------
def open_storage(url: str) -> optuna.storages.BaseStorage:
    """``sqlite:///optuna.db``, ``postgresql://...`` or ``journal:///path/to/study.log``."""
    if url.startswith("journal://"):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len("journal://") :])
        _writable_dir("hydra.sweeper.optuna.storage", url, path.parent)
        return JournalStorage(JournalFileBackend(str(path)))
    if url.startswith("sqlite:///"):
        _writable_dir("hydra.sweeper.optuna.storage", url, Path(url[len("sqlite:///") :]).parent)
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
    except Exception as err:  # SQLAlchemy raises many kinds for an unreachable or malformed URL
        raise ConfigError(
            "hydra.sweeper.optuna.storage", url, f"a reachable Optuna storage ({type(err).__name__}: {err})"
        ) from err


def _engine_kwargs(url: str) -> dict[str, Any]:
    scheme = urlparse(url).scheme
    return {"connect_args": {"connect_timeout": 5}} if scheme.startswith("postgresql") else {}


def _writable_dir(key: str, value: str, folder: Path) -> None:
    folder = folder if str(folder) else Path(".")
    if not folder.is_dir():
        raise ConfigError(key, value, f"a storage in an existing directory ({folder.absolute()} does not exist)")


# ---------------------------------------------------------------------------------------------
# the job's trial
# ---------------------------------------------------------------------------------------------
class TrialReporter:
    """Reports a job's per-epoch test_accuracy to its Optuna trial; says when the pruner stops it."""

    def __init__(self, sweep: SweepConfig) -> None:
        assert sweep.study and sweep.storage and sweep.trial is not None and sweep.pruner
        pruner = PRUNERS.get(sweep.pruner, key="sweep.pruner")(sweep)
        self.study = optuna.load_study(study_name=sweep.study, storage=open_storage(sweep.storage), pruner=pruner)
        self.trial = optuna_private.trial(self.study, sweep.trial)

    def should_prune(self, epoch: int, test_accuracy: float) -> bool:
        self.trial.report(test_accuracy, step=epoch)
        return self.trial.should_prune()
