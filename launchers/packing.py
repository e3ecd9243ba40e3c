"""Several trials per device (``launcher.trials_per_device`` = K): one job holds one GPU and runs K trials.

    dpsweep -m launcher=local launcher.gpus_per_job=1 launcher.trials_per_device=4 \\
        dp.noise_multiplier=0.8,1.2 dp.max_grad_norm=0.5,1 train.seed=0,1,2,3

The sweeper groups its jobs K at a time (:func:`groups`). Each group is one scheduler job (one GPU,
K x ``launcher.cpus_per_job`` cores and K x ``launcher.mem_gb``) whose function, :class:`PackedTrials`,
starts every trial as its own process, ``python -m dpsweep.launchers.packing FILE``. A trial is the
same Hydra job a job of one trial runs (its own MLflow run, seed, noise stream, ledger, checkpoint and
failure record), and being a process of its own keeps one trial's failure (an error, CUDA out of
memory, a crash) from the others. The job returns one result per trial, in order; a trial process that
ends without one is a FAILED result naming its exit status.

K processes share the GPU by time-slicing, or through CUDA MPS where its daemon runs
(:func:`device_sharing`); each run is tagged with which (``device.sharing``). Each trial plans its
physical batch against its share of ``launcher.gpu_memory`` (:mod:`dpsweep.memory.packing`), and
``auto`` resolves to the largest K whose predicted peaks fit the device together (:func:`resolve`).

The trial processes die with their job (``DPSWEEP_DRIVER`` names it): a job killed outright leaves no
trial training on, and SIGTERM or SIGINT sent to the job (a scheduler's cancel or requeue) is passed on to
them; the job then ends without a result once they have, as a job of one trial does (its run ended KILLED).

A requeued job (preempted, ``scontrol requeue``, or timed out: :meth:`PackedTrials.checkpoint`, submitit's
hook, requeues it as it does a job of one trial) runs its trials again from the same files (the job's
own directory, :func:`work_dir`): a trial that had returned keeps its result and is not started again,
and the others resume from their own checkpoints, as a requeued job of one trial does.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from hydra.core.utils import JobReturn, JobStatus

from dpsweep.config.launcher import spec
from dpsweep.process import cpu_cores
from dpsweep.process.liveness import ENV_DRIVER, ProcessId, die_with_driver
from dpsweep.process.shutdown import Terminated

if TYPE_CHECKING:
    from dpsweep.config import Config

MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"  # nvidia-cuda-mps-control's pipe directory unless CUDA_MPS_PIPE_DIRECTORY
POLL_S = 0.2  # how often a packed job looks for ended trials
T = TypeVar("T")


def groups(jobs: Sequence[T], k: int) -> list[list[T]]:
    """The jobs K at a time, in order (the last group may be smaller)."""
    return [list(jobs[i : i + k]) for i in range(0, len(jobs), k)]


def device_sharing(trials: int) -> str:
    """How ``trials`` processes share one device: ``exclusive`` (one), ``mps`` where the MPS control
    daemon's pipe exists, else ``time-slicing`` (the driver's default)."""
    if trials <= 1:
        return "exclusive"
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DEFAULT)) / "control"
    return "mps" if pipe.exists() else "time-slicing"


def resolve(typed: Sequence[Config], n_trials: int, backend: str) -> int:
    """K for ``launcher.trials_per_device=auto``: the largest number of these trials whose predicted
    peaks fit ``launcher.gpu_memory`` together (:func:`dpsweep.memory.packing.trials_that_fit`, the
    largest trial's peak planned alone), at most the trials to run and, on this machine (a launcher
    whose spec is not ``remote``: local), its CPU cores over ``launcher.cpus_per_job``."""
    from dpsweep.memory import packing
    from dpsweep.memory.predict import headroom, model_for
    from dpsweep.memory.stages import model_key
    from dpsweep.plan import FactsCache, MemoryBudget, MemoryFiles, prepare
    from dpsweep.units import parse_bytes

    facts, files = FactsCache(), MemoryFiles()
    needs: list[float] = []
    first = typed[0]
    share = 0.0
    for cfg in typed:
        budget = files.budget(cfg, backend)
        assert budget is not None  # auto needs train.memory_model (config check)
        plan = prepare(cfg, facts(cfg), MemoryBudget(budget.models, backend, predict=True))
        assert plan.memory is not None
        needs.append(plan.memory.peak_bytes + plan.memory.resident_bytes)
        share = headroom(model_for(budget.models, model_key(cfg), backend))
    cap = n_trials
    if not spec(first.launcher).remote:  # the trials of a job share this machine's cores
        cap = min(cap, max(1, cpu_cores() // first.launcher.cpus_per_job))
    assert first.launcher.gpu_memory is not None  # auto needs it (config check)
    gpu_memory = parse_bytes(first.launcher.gpu_memory, key="launcher.gpu_memory")
    return packing.trials_that_fit(needs, gpu_memory, share, max(1, cap))


@dataclass
class PackedTrials:
    """A job of K trials: ``trial`` (the launcher's own one-trial callable) run once per argument
    tuple, each in its own process; returns their results in order."""

    trial: Any  # the Hydra launcher: trial(overrides, job_dir_key, job_num, job_id, singleton_state)
    folder: str  # where the trials' argument and result files go (the submitit folder)
    cpus_per_trial: int = 1

    def __call__(self, trials: Sequence[tuple[Any, ...]]) -> list[JobReturn]:
        import cloudpickle

        from dpsweep.tracking.environment import DEVICE_SHARING_ENV

        os.environ[DEVICE_SHARING_ENV] = f"{device_sharing(len(trials))}, {len(trials)} trials"
        work = self._work(trials)
        env = os.environ | {ENV_DRIVER: ProcessId.current().token}
        env.setdefault("OMP_NUM_THREADS", str(self.cpus_per_trial))  # K processes share the job's cores
        procs: dict[int, subprocess.Popen[bytes]] = {}  # the trials this run starts, by index
        for i, args in enumerate(trials):
            path = work / f"trial-{i}.pkl"
            if path.with_suffix(".result").is_file():  # returned before the job was requeued: not run again
                continue
            path.write_bytes(cloudpickle.dumps((self.trial, args)))
            procs[i] = subprocess.Popen([sys.executable, "-u", "-m", __name__, str(path)], env=env)
        received: list[int] = []
        handler = _passing_on(list(procs.values()), received)
        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        if os.environ.get(ENV_DRIVER):  # launcher=local: the SIGTERM sent once the sweep's driver is gone
            die_with_driver()  # finds the handler above, which passes it on (submitit's, before it, drops it)
        try:
            while any(p.poll() is None for p in procs.values()):
                time.sleep(POLL_S)
        finally:
            for s, before in previous.items():
                signal.signal(s, before)
        if received:  # the job itself was ended (scancel, a requeue, the driver gone): no result, as a job of
            raise Terminated(received[0])  # one trial leaves none; the trials that returned keep their files
        return [
            _result(work / f"trial-{i}.pkl", procs[i].returncode if i in procs else None, args)
            for i, args in enumerate(trials)
        ]

    def _work(self, trials: Sequence[tuple[Any, ...]]) -> Path:
        """The job's directory of trial files (:func:`work_dir`)."""
        work = work_dir(self.folder, [args[0] for args in trials])
        work.mkdir(parents=True, exist_ok=True)
        return work

    def checkpoint(self, trials: Sequence[tuple[Any, ...]]) -> Any:
        """submitit's hook for a job that times out or is preempted (``DelayedSubmission``): requeue the same
        trials, which :meth:`__call__` runs again from the job's files (the module doc)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, trials)


def trials_folder(submitit_folder: str, kind: str) -> str:
    """Where a sweep's jobs of several trials (``kind``: ``packed``, at once; ``serial``, in turn) keep their
    trials' result files: the submitit folder with ``kind`` for its ``%j``, made."""
    out = str(submitit_folder).replace("%j", kind)
    Path(out).mkdir(parents=True, exist_ok=True)
    return out


def work_dir(folder: str | Path, overrides: Sequence[Sequence[str]]) -> Path:
    """A packed job's directory of trial files, named by a hash of its trials' overrides (the sweep's id among
    them): the same for the job requeued, and known to the driver, which reads the results of the trials
    that returned when the job itself ended without one (:func:`returned`)."""
    key = hashlib.sha256(json.dumps([list(o) for o in overrides]).encode()).hexdigest()[:16]
    return Path(folder) / f"packed-{key}"


def returned(folder: str | Path, overrides: Sequence[Sequence[str]]) -> list[JobReturn | None]:
    """The results of a packed job's trials that returned (None for the others): for a job that ended
    without a result of its own (cancelled, requeued, its driver gone)."""
    work = work_dir(folder, overrides)
    return [returned_file(work / f"trial-{i}.pkl") for i in range(len(overrides))]


def returned_file(path: Path) -> JobReturn | None:
    """The JobReturn the trial of ``path`` wrote beside it, or None."""
    import cloudpickle

    done = path.with_suffix(".result")
    if not done.is_file():
        return None
    result: JobReturn = cloudpickle.loads(done.read_bytes())
    return result


def _passing_on(procs: Sequence[subprocess.Popen[bytes]], received: list[int]) -> Any:
    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    return handler


def _result(path: Path, returncode: int | None, args: tuple[Any, ...]) -> JobReturn:
    """The trial's JobReturn, or a FAILED one when its process ended without writing it."""
    result = returned_file(path)
    if result is not None:
        return result
    code = returncode if returncode is not None else -1
    how = (
        f"signal {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}"
    )
    ret = JobReturn(overrides=list(args[0]), status=JobStatus.FAILED)
    ret.return_value = RuntimeError(f"the trial's process ended with {how} and no result (killed, or out of memory)")
    return ret


def main(argv: list[str] | None = None) -> int:
    """A trial's process: run the pickled one-trial callable and write its JobReturn beside the file."""
    import cloudpickle

    (arg,) = sys.argv[1:] if argv is None else argv
    path = Path(arg)
    trial, args = cloudpickle.loads(path.read_bytes())
    result = trial(*args)
    tmp = path.with_suffix(".result.tmp")
    tmp.write_bytes(cloudpickle.dumps(result))
    tmp.rename(path.with_suffix(".result"))
    return 0


def job_resources(params: dict[str, Any], k: int) -> dict[str, Any]:
    """A packed job's scheduler parameters: K trials' cores and memory, the GPUs of one trial."""
    out = dict(params)
    for key in ("cpus_per_task", "mem_gb"):
        if out.get(key) is not None:
            out[key] = out[key] * k
    return out


if __name__ == "__main__":
    from dpsweep.process.shutdown import run_then_exit

    run_then_exit(main)
