"""T trials per job, one after another in its process (``launcher.trials_per_job``, issue 59 item 4): the
job's function runs each trial in turn, a trial's failure is its own, a requeued job does not run again the
trials that returned; the key's values and combinations are checked before any job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import Composer
from hydra.core.utils import JobReturn, JobStatus

from dpsweep.config import ConfigError, LauncherConfig, to_config, validate
from dpsweep.config.launcher import trials_per_job
from dpsweep.launchers import packing
from dpsweep.launchers.serial import SerialTrials, job_resources


class Trial:
    """A one-trial callable as the launcher is one: (overrides, job_dir_key, job_num, job_id, state)."""

    def __init__(self, fail: set[int]) -> None:
        self.fail, self.ran = fail, list[int]()

    def __call__(self, overrides: list[str], key: str, num: int, job_id: str, state: Any) -> JobReturn:
        self.ran.append(num)
        if num in self.fail:
            raise RuntimeError(f"trial {num} broke")
        ret = JobReturn(overrides=overrides, status=JobStatus.COMPLETED)
        ret.return_value = num * 10
        return ret


def _args(n: int) -> list[tuple[Any, ...]]:
    return [([f"train.seed={i}"], "hydra.sweep.dir", i, f"job_id_for_{i}", {}) for i in range(n)]


def test_a_job_runs_its_trials_in_turn_and_a_failing_trial_spares_the_next(tmp_path: Path) -> None:
    trial = Trial(fail={0})
    results = SerialTrials(trial, str(tmp_path))(_args(3))
    assert trial.ran == [0, 1, 2]
    assert [r.status for r in results] == [JobStatus.FAILED, JobStatus.COMPLETED, JobStatus.COMPLETED]
    assert results[0].overrides == ["train.seed=0"]
    with pytest.raises(RuntimeError, match="trial 0 broke"):
        results[0].return_value  # noqa: B018 (reading it re-raises the trial's error)
    assert [r.return_value for r in results[1:]] == [10, 20]
    # the driver reads each trial's result from the job's files, had the job ended without one
    kept = packing.returned(tmp_path, [a[0] for a in _args(3)])
    assert [r.status if r is not None else None for r in kept] == [r.status for r in results]


def test_a_requeued_job_does_not_run_again_the_trials_that_returned(tmp_path: Path) -> None:
    args = _args(3)
    SerialTrials(Trial(fail=set()), str(tmp_path))(args)
    work = packing.work_dir(tmp_path, [a[0] for a in args])
    (work / "trial-2.result").unlink()  # the job was requeued while its last trial trained
    again = Trial(fail=set())
    results = SerialTrials(again, str(tmp_path))(args)
    assert again.ran == [2]
    assert [r.return_value for r in results] == [0, 10, 20]


def test_the_sweep_is_cut_in_order_and_a_job_has_t_trials_time() -> None:
    assert packing.groups(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    params = {"timeout_min": 60, "cpus_per_task": 2, "mem_gb": 4, "gpus_per_node": 1}
    assert job_resources(params, 3) == {"timeout_min": 180, "cpus_per_task": 2, "mem_gb": 4, "gpus_per_node": 1}
    assert job_resources(params, 1) == params


@pytest.mark.parametrize("value", [0, -2])
def test_a_bad_number_of_trials_per_job_names_the_key(value: int) -> None:
    with pytest.raises(ConfigError, match=rf"launcher.trials_per_job={value} is invalid: a whole number .* 1 or more"):
        trials_per_job(LauncherConfig(trials_per_job=value))


def test_trials_per_job_needs_a_launcher_of_processes_and_no_trials_per_device(make_cfg: Composer) -> None:
    validate(to_config(make_cfg("launcher=local", "launcher.trials_per_job=3")))
    validate(to_config(make_cfg("launcher=slurm", "launcher.trials_per_job=3")))
    with pytest.raises(ConfigError, match=r"launcher.trials_per_job=3 is invalid: 1 with launcher=inline"):
        validate(to_config(make_cfg("launcher.trials_per_job=3")))
    with pytest.raises(
        ConfigError, match=r"launcher.trials_per_job=2 is invalid: 1 with launcher.trials_per_device=4: .*not both"
    ):
        validate(to_config(make_cfg("launcher=local", "launcher.trials_per_job=2", "launcher.trials_per_device=4")))
    with pytest.raises(ConfigError, match=r"launcher.trials_per_job=0 is invalid: a whole number"):
        validate(to_config(make_cfg("launcher=inline", "launcher.trials_per_job=0")))


class Model:
    """Stands for a failed trial's model, optimizer state and batches."""


def test_a_failed_trials_memory_is_let_go_before_the_next_trial(tmp_path: Path) -> None:
    """The error a trial raised keeps its traceback's frames, and so what its run held (on the GPU too): the
    job lets them go before the next trial, keeping the error itself for the driver."""
    import weakref

    held: list[weakref.ref[Model]] = []

    def trial(overrides: list[str], key: str, num: int, job_id: str, state: Any) -> JobReturn:
        model = Model()  # a local of the failing trial's frames
        held.append(weakref.ref(model))
        if num == 0:
            raise MemoryError("CUDA out of memory")
        assert held[0]() is None, "the failed trial's model is still alive as the next trial runs"
        return JobReturn(overrides=overrides, status=JobStatus.COMPLETED)

    results = SerialTrials(trial, str(tmp_path))(_args(2))
    assert [r.status for r in results] == [JobStatus.FAILED, JobStatus.COMPLETED]
    with pytest.raises(MemoryError, match="CUDA out of memory"):
        results[0].return_value  # noqa: B018 (the error is kept)
