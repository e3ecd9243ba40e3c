"""Several trials per job, one after another (``launcher.trials_per_job`` = T): one process, one start-up.

    dpsweep -m launcher=local launcher.trials_per_job=3 dp.noise_multiplier=0.8,1.2 train.seed=0,1,2

A job's process spends most of its start-up importing torch, MLflow, Opacus and the rest (about 85 % of
the 5.3 s to its first step on the 2-core VM: ``benchmarks/job_startup.py``,
``analysis/data/job_startup.json``), and a sweep of N jobs pays it N times. The sweeper groups its jobs T at
a time, in order (:func:`dpsweep.launchers.packing.groups`). Each group is one scheduler job (one array task,
with T x ``launcher.timeout_min``: :func:`job_resources`) whose function, :class:`SerialTrials`, runs its
trials in its own process one after another, each as the same Hydra job a job of one trial runs (the
launcher's own one-trial callable: Hydra's ``run_job``, as launcher=inline runs each job), so each keeps its
own seed, MLflow run, output and checkpoint directory and result. A trial that raises is that trial's
failure (Hydra's ``run_job`` records it, and whatever raises around it is caught here); the next trial of
the job still runs. The job returns one result per trial, in order: start-up is paid once per job, about
(start-up)/T + (per-trial set-up) per trial (``benchmarks/trials_per_job.py``).

Each trial's result is written to the job's directory of trial files as it returns (the packed jobs'
files: :func:`dpsweep.launchers.packing.work_dir`). A requeued job (preempted, timed out:
:meth:`SerialTrials.checkpoint`, submitit's hook) runs its trials again from the same directory: a trial
that had returned keeps its result and is not run again, and the one in progress resumes from its own
checkpoint. A job that ends without a result (killed) keeps the results of the trials that returned
(:func:`dpsweep.launchers.packing.returned`); the others are FAILED, as a job of one trial is.
"""

from __future__ import annotations

import gc
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.utils import JobReturn, JobStatus

from dpsweep.launchers import packing


@dataclass
class SerialTrials:
    """A job of T trials: ``trial`` (the launcher's own one-trial callable) run once per argument tuple,
    one after another in this process; returns their results in order."""

    trial: Any  # the Hydra launcher: trial(overrides, job_dir_key, job_num, job_id, singleton_state)
    folder: str  # where the trials' result files go (under the submitit folder)

    def __call__(self, trials: Sequence[tuple[Any, ...]]) -> list[JobReturn]:
        import cloudpickle

        work = packing.work_dir(self.folder, [args[0] for args in trials])
        work.mkdir(parents=True, exist_ok=True)
        results = []
        for i, args in enumerate(trials):
            path = work / f"trial-{i}.pkl"
            done = packing.returned_file(path)
            if done is not None:  # returned before the job was requeued: not run again
                results.append(done)
                continue
            result = run_one(self.trial, args)
            if result.status == JobStatus.FAILED:
                release_frames(result)
            tmp = path.with_suffix(".result.tmp")
            tmp.write_bytes(cloudpickle.dumps(result))
            tmp.rename(path.with_suffix(".result"))
            results.append(result)
        return results

    def checkpoint(self, trials: Sequence[tuple[Any, ...]]) -> Any:
        """submitit's hook for a job that times out or is preempted (``DelayedSubmission``): requeue the same
        trials, which :meth:`__call__` runs again from the job's files (the module doc)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, trials)


def run_one(trial: Any, args: tuple[Any, ...]) -> JobReturn:
    """One trial's JobReturn: Hydra's (FAILED with the task's error where it raised), or a FAILED one with
    the error that raised around the task (its config composed, its output directory made)."""
    try:
        result: JobReturn = trial(*args)
    except Exception as err:  # not SystemExit or KeyboardInterrupt: a job told to stop stops
        traceback.print_exc()  # the job's log: where it raised
        result = JobReturn(overrides=list(args[0]), status=JobStatus.FAILED)
        result.return_value = err  # JobReturn stores it; reading return_value re-raises it
    return result


def release_frames(result: JobReturn) -> None:
    """Let a failed trial's memory go before the next trial of the job starts: its error's traceback (and
    those it was raised from) holds the frames of its run, and so its model, optimizer state and batches,
    on the GPU too; an out-of-memory trial would leave the next one short. The error itself is kept (the
    driver reports it; a pickled exception carries no traceback)."""
    try:
        result.return_value  # noqa: B018  (Hydra's JobReturn re-raises a failed task's error here)
    except BaseException as err:  # the trial's own error, whatever it is
        seen: set[int] = set()
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            traceback.clear_frames(err.__traceback__)
            err = err.__cause__ or err.__context__  # type: ignore[assignment]
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # the allocator's cached blocks, for the next trial's own


def job_resources(params: dict[str, Any], t: int) -> dict[str, Any]:
    """A job of T trials one after another: T trials' wall-clock time (``timeout_min``), one trial's cores,
    memory and GPUs."""
    out = dict(params)
    if out.get("timeout_min") is not None:
        out["timeout_min"] = out["timeout_min"] * t
    return out
