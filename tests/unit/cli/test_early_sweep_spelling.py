"""The early checks read Hydra's other spelling of ``-m`` (``hydra.mode=MULTIRUN``) as a sweep and check each
of its jobs, with no subprocess (the end-to-end sweep of that spelling is in the slow tier:
``tests/integration/test_early_refusals.py``)."""

from __future__ import annotations

import pytest

from dpsweep.cli.early import composed_and_checked
from dpsweep.config import ConfigError
from dpsweep.errors import InputError


def test_hydra_mode_multirun_is_a_sweep_of_each_job() -> None:
    checked = composed_and_checked(["hydra.mode=MULTIRUN", "train.seed=0,1"])
    assert checked is not None and checked.sweep, checked
    assert [c.train.seed for c in checked.configs] == [0, 1]
    with pytest.raises(InputError, match=r"train\.seed='0,1' is invalid: one value for a single run"):
        composed_and_checked(["train.seed=0,1"])  # without the spelling: one run, and a comma list refused


def test_a_bad_value_in_one_job_of_that_spelling_is_refused_before_any_work() -> None:
    with pytest.raises(ConfigError, match=r"train\.epochs"):
        composed_and_checked(["hydra.mode=MULTIRUN", "train.epochs=1,0"])
