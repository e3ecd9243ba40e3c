"""Optuna's private names: the door to them.

A sweep job runs one trial of a study that its sweeper created; the job knows the trial's number
and needs the trial itself, to report to it and ask the pruner.
"""

from __future__ import annotations

import optuna

PRIVATE_NAMES = (  # (module, attribute path): what tests/unit/interop checks still exists
    ("optuna.study.study", "Study.__init__:_storage"),
    ("optuna.study.study", "Study.__init__:_study_id"),
)


def trial(study: optuna.Study, number: int) -> optuna.Trial:
    """The running trial number ``number`` of ``study``, to report intermediate values to and prune.

    Private names: ``optuna.Study._storage`` and ``optuna.Study._study_id``. Optuna's public API gives
    a trial to ``study.ask()`` (a new one) or a frozen copy (``study.trials``), not a running trial by
    its number; ``optuna.Trial(study, trial_id)`` needs the storage's id for it."""
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    return optuna.Trial(study, trial_id)
