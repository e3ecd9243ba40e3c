"""Hydra launchers for dpsweep: in this process (inline), and local processes, Slurm and Grid Engine, all
three through submitit.

Each is a :class:`~dpsweep.launchers.base.DpsweepLauncher` that names its spec
(``dpsweep.config.launcher.LAUNCHERS``): what it can do, which the checks and the sweepers ask. The
submitit ones extend hydra-submitit-launcher's launchers in two ways:

- a job that dies outside Python (killed, out of memory, node failure) becomes a FAILED
  ``JobReturn`` instead of an exception that would drop every other job's result;
- on Slurm clusters without accounting (``sacct`` disabled), job states come from ``squeue``;
- a scheduler's sweep (Slurm, Grid Engine) prints each job's id as it is submitted and its state in the
  queue each time it changes (:class:`QueueStates`), so a job waiting in the queue is not a silence.

Select them with ``launcher=inline|local|slurm|sge`` (conf/launcher/); the Hydra plugin shim lives in
``hydra_plugins.dpsweep_launchers``.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import DictConfig, OmegaConf, open_dict
from submitit.core.core import InfoWatcher
from submitit.slurm.slurm import SlurmInfoWatcher

from dpsweep.config import given_overrides, ranks_shape
from dpsweep.config.launcher import LAUNCHERS
from dpsweep.config.schema import swept_keys
from dpsweep.launchers import packing, serial
from dpsweep.launchers.base import DpsweepLauncher
from dpsweep.process.liveness import driver_environment

log = logging.getLogger(__name__)


# The command submitit's executors start each job with, before "-u -m submitit.core._submit <folder>":
# dpsweep.launchers.job runs submitit's job runner (a rank's environment set first).
JOB_PYTHON = f"{shlex.quote(sys.executable)} -u -m dpsweep.launchers.job"
POLL_S = 1.0  # how often the driver looks for completed cluster jobs (submitit's watchers rate-limit sacct/qstat)
LOCAL_POLL_S = 0.05  # ... and for local jobs (a poll of the job's process): each job's end is seen within it
# The longest wait between two reads of the queue's states (squeue, sacct, qstat: one call for all of a launch's
# jobs): submitit reads them 2 s, 4 s, 8 s ... after a submission, then at least this often (its own default
# for sacct and qstat is 600 s: a job's start would be told up to 10 minutes late)
QUEUE_POLL_MAX_S = 60
# submitit's states of a job not ended (core.InfoWatcher.is_done), and squeue's watcher's word for a job no
# longer listed (SqueueInfoWatcher): neither is a job's last state
NOT_ENDED = frozenset({"READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING", "PREEMPTED", "GONE"})


class InlineLauncher(DpsweepLauncher):
    """Jobs one after another in this process, each on the config the sweeper composed for it (Hydra's
    basic launcher's loop, on Hydra's public API). Its jobs' results come when its batch returns."""

    spec = LAUNCHERS.get("inline")

    def __init__(self) -> None:
        super().__init__()
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        runs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.debug(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(job):
                job.hydra.job.id = idx
                job.hydra.job.num = idx
            context, task = self.hydra_context, self.task_function
            ret = run_job(task, job, "hydra.sweep.dir", "hydra.sweep.subdir", hydra_context=context)
            runs.append(ret)
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs


class _DpsweepSubmititLauncher(DpsweepLauncher, BaseSubmititLauncher):
    """Same executor set-up as hydra-submitit-launcher; results are collected job by job, each told to
    ``on_job_done`` as it completes."""

    _INIT_KEYS = frozenset({"max_num_timeout"})
    poll_s: float = POLL_S  # how often the driver looks for completed jobs
    devices_per_job: int = 1  # train.devices of the sweep's runs; set by take_ranks (spec.rank_tasks: a task a rank)
    nodes_per_job: int = 1  # train.nodes of the sweep's runs (spec.rank_tasks)
    queue: QueueStates | None = None  # a scheduler's launcher: the jobs' ids and states, told as they change

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        if self.spec.scheduler is not None:
            self.queue = QueueStates(self.spec.scheduler)

    def take_ranks(self, train: Any) -> None:
        """The ranks of the sweep's runs (one ``train.devices`` and ``train.nodes`` a sweep where they are a
        job's tasks), which shape each job's tasks; the sweeper and the Optuna study call it with their first
        run's config."""
        self.devices_per_job, self.nodes_per_job = ranks_shape(train)

    def _executor(self, trials: int = 1, in_turn: int = 1) -> Any:
        import submitit

        init = {"folder": self.params["submitit_folder"]}
        init |= {f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k in self._INIT_KEYS}
        init[f"{self._EXECUTOR}_python"] = JOB_PYTHON  # each job's bootstrap: dpsweep.launchers.job
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        generic = set(OmegaConf.structured(BaseQueueConf).keys())
        params = {
            k if k in generic else f"{self._EXECUTOR}_{k}": v
            for k, v in serial.job_resources(packing.job_resources(dict(self.params), trials), in_turn).items()
            if k not in self._INIT_KEYS | {"submitit_folder"}
        }
        if self.spec.rank_tasks and self.devices_per_job * self.nodes_per_job > 1:
            params |= ranks_resources(params, self.devices_per_job, self.nodes_per_job)
        executor.update_parameters(**params)
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        k, t = self.trials_per_device, self.trials_per_job
        executor = self._executor(k, t)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.debug(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")  # hydra.verbose=dpsweep shows these
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.debug(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        folder = None  # where packed jobs, or jobs of several trials in turn, keep their trials' files
        if t > 1:  # T trials per job, one after another in its process (dpsweep.launchers.serial)
            folder = packing.trials_folder(self.params["submitit_folder"], "serial")
            jobs = executor.map_array(serial.SerialTrials(self, folder), packing.groups(job_params, t))
            per_job = packing.groups(job_overrides, t)
        elif k == 1:
            jobs = executor.map_array(self, *zip(*job_params, strict=True))
            per_job = [[o] for o in job_overrides]
        else:  # K trials per job, each its own process (dpsweep.launchers.packing)
            packed = packing.groups(job_params, k)
            folder = packing.trials_folder(self.params["submitit_folder"], "packed")
            cpus = int(self.params.get("cpus_per_task") or 1)
            jobs = executor.map_array(packing.PackedTrials(self, folder, cpus), packed)
            per_job = packing.groups(job_overrides, k)
        self._watch(jobs)
        if self.queue is not None:
            self.queue.submitted(jobs, per_job)
        return self._collect_as_done(jobs, per_job, folder)

    def _collect_as_done(
        self, jobs: list[Any], per_job: Sequence[Sequence[Sequence[str]]], folder: str | None = None
    ) -> list[JobReturn]:
        """Each trial's result in launch order, collected as its job completes: ``on_job_done`` (set by
        dpsweep's sweeper) hears of each one then, not when the last job of the batch is done.
        ``per_job``: the overrides of each job's trials (one each, or K when packed in ``folder``)."""
        results: dict[int, list[JobReturn]] = {}
        while len(results) < len(jobs):
            for i, job in enumerate(jobs):
                if i in results:
                    continue
                done = job.done()  # the result file, else the watcher's state (read at most as often as it allows)
                if self.queue is not None:
                    self.queue.seen(job)
                if done:
                    results[i], returned = self._collect(job, per_job[i], folder)
                    if self.queue is not None:
                        self.queue.ended(job, returned)
                    for ret in results[i]:
                        if self.on_job_done is not None:
                            self.on_job_done(ret)
            if len(results) < len(jobs):
                time.sleep(self.poll_s)
        return [ret for i in range(len(jobs)) for ret in results[i]]

    def _watch(self, jobs: list[Any]) -> None:
        """Hook for a launcher to replace submitit's state watcher."""

    @staticmethod
    def _collect(job: Any, trials: Sequence[Sequence[str]], folder: str | None = None) -> tuple[list[JobReturn], bool]:
        """The job's results: its trial's, or each of its K trials' when packed (``folder``: where a packed job
        keeps them; the trials that returned before their job ended without a result keep theirs); and whether
        the job returned (False: it raised, or ended without a result)."""
        try:
            result = job.results()[0]
            return (list(result) if isinstance(result, list) else [result]), True
        except Exception as err:  # the job ended without a result: killed, OOM-killed, node failure
            kept = packing.returned(folder, trials) if folder is not None else [None] * len(trials)
            returns = []
            for overrides, done in zip(trials, kept, strict=True):
                if done is not None:
                    returns.append(done)
                    continue
                given = " ".join(given_overrides(overrides))
                print(f"dpsweep: job {job.job_id} ({given}) ended without a result: {err}", file=sys.stderr, flush=True)
                ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED)
                ret.return_value = err  # JobReturn stores it; reading return_value re-raises it
                returns.append(ret)
            return returns, False


RESTART_EVERY_S = 10.0  # the queue's reads started over at a job's end at most this often


class QueueStates:
    """A scheduler's jobs as the sweep's driver sees them: each job's id once submitted, with what it runs,
    then a line each time its state in the queue changes, and its last state, e.g.::

        dpsweep: job 812_0 submitted to slurm: dp.noise_multiplier=0.8
        dpsweep: job 812_0 PENDING
        dpsweep: job 812_0 RUNNING
        dpsweep: job 812_0 COMPLETED

    The states are those submitit's watcher last read from the scheduler (squeue, sacct, qstat; one call for
    all the jobs, 2 s, 4 s, 8 s ... after the submission, then every :data:`QUEUE_POLL_MAX_S` at most): no
    call of its own, and a line only when a state changes. A job's result file often shows before the queue
    says it has ended: its last state is then COMPLETED if it returned (whatever its trials' own outcome,
    which the progress lines tell), FAILED if not, unless the queue told its end first (CANCELLED,
    TIMEOUT, OUT_OF_MEMORY ...)."""

    def __init__(self, scheduler: str) -> None:
        self.scheduler = scheduler
        self.shown: dict[str, str] = {}  # job id -> the state last printed
        self.restarted_at = -math.inf  # when the watcher's reads were last started over (time.monotonic)

    def submitted(self, jobs: Sequence[Any], per_job: Sequence[Sequence[Sequence[str]]]) -> None:
        """A line a job: its id and the overrides that tell its trials from the launch's others (``; `` between
        a packed job's trials)."""
        own = swept([o for trials in per_job for o in trials])
        for job, trials in zip(jobs, per_job, strict=True):
            given = "; ".join(" ".join(own(overrides)) for overrides in trials).strip("; ")
            print(f"dpsweep: job {job.job_id} submitted to {self.scheduler}{': ' + given if given else ''}", flush=True)

    def seen(self, job: Any) -> None:
        """The job's state as the watcher last read it (``UNKNOWN``: not read yet, or not listed yet)."""
        state = job.watcher.get_state(job.job_id, mode="cache")
        if state not in ("UNKNOWN", "GONE"):
            self._show(job.job_id, state)

    def ended(self, job: Any, returned: bool) -> None:
        """The job's last state; and the watcher's reads of the queue started over (0, 2, 4, 8 s ... from
        now): a job's end is when the others' states change (the next job of a throttled array starts).
        At most once in :data:`RESTART_EVERY_S`: jobs that end together cost one read of the queue, and an
        array whose jobs keep ending is read every few seconds, not at each end."""
        state = job.watcher.get_state(job.job_id, mode="cache")
        self._show(job.job_id, state if state not in NOT_ENDED else "COMPLETED" if returned else "FAILED")
        now = time.monotonic()
        if now - self.restarted_at >= RESTART_EVERY_S:
            self.restarted_at = now
            job.watcher.register_job(job.job_id)  # submitit's watcher: its reads start over at a registration

    def _show(self, job_id: str, state: str) -> None:
        if self.shown.get(job_id) != state:
            self.shown[job_id] = state
            print(f"dpsweep: job {job_id} {state}", flush=True)


def ranks_resources(params: dict[str, Any], devices: int, nodes: int = 1) -> dict[str, Any]:
    """A Slurm job of one run across ``devices`` devices on each of ``nodes`` nodes: one task a rank (each
    with the job's cores), a GPU a rank where the job asks for GPUs, and the job's memory for each rank."""
    out: dict[str, Any] = {"tasks_per_node": devices, "nodes": nodes}
    if params.get("gpus_per_node"):
        out["gpus_per_node"] = devices
    if params.get("mem_gb") is not None:
        out["mem_gb"] = params["mem_gb"] * devices
    return out


class LocalLauncher(_DpsweepSubmititLauncher):
    """Jobs as processes of this machine. They die with the driver (this process): submitit's local
    controllers outlive it by design, so each job watches the driver named in its environment
    (``dpsweep.process.liveness.die_with_driver``) and ends its run KILLED when the driver is gone, instead of
    training on and racing a re-run of the sweep."""

    _EXECUTOR = "local"  # submitit's executor
    spec = LAUNCHERS.get("local")
    poll_s = LOCAL_POLL_S  # a local sweep on a CPU runs one job at a time: a second's wait after each adds up

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        os.environ.update(driver_environment())  # submitit copies os.environ into each job's
        return super().launch(job_overrides, initial_job_idx)


class SqueueInfoWatcher(SlurmInfoWatcher):
    """Job states from ``squeue`` for clusters whose ``sacct`` is disabled (no accounting).

    A job that squeue no longer lists has left the cluster (state ``GONE``); the launcher then reads
    its result pickle, or reports that it ended without one.
    """

    def _make_command(self) -> list[str] | None:
        ids = {x.split("_")[0] for x in self._registered - self._finished}
        if not ids:
            return None
        return ["squeue", "--noheader", "--states=all", "--array", "--format=%i|%T", "--jobs", ",".join(sorted(ids))]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        info = {}
        for line in text.splitlines():
            job_id, _, state = line.strip().partition("|")
            if job_id:
                info[job_id] = {"JobID": job_id, "State": state}
        for job_id in self._registered - self._finished:
            info.setdefault(job_id, {"JobID": job_id, "State": "GONE"})  # no longer listed: it left the queue
        return info


def sacct_works() -> bool:
    try:
        proc = subprocess.run(["sacct", "--noheader", "-j", "1"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0 and "disabled" not in (proc.stderr + proc.stdout).lower()


def swept(trials: Sequence[Sequence[str]]) -> Callable[[Sequence[str]], list[str]]:
    """Of a trial's overrides, those whose key takes several values (or none) among ``trials``: what tells it
    from the others (the user's, not the sweeper's own: ``dpsweep.config.schema.swept_keys``)."""
    keys = set(swept_keys(trials))
    return lambda overrides: [o for o in given_overrides(overrides) if o.partition("=")[0].lstrip("+~") in keys]


def watch_with(watcher: InfoWatcher, jobs: list[Any]) -> None:
    """``watcher`` for ``jobs`` and each of their tasks (a run across devices on Slurm: a task a rank, which a
    task killed without a result would otherwise wait on for ever when sacct is disabled)."""
    for job in jobs:
        for part in {job, *(job.task(i) for i in range(job.num_tasks))}:
            part.watcher = watcher
        watcher.register_job(job.job_id)


class SlurmLauncher(_DpsweepSubmititLauncher):
    _EXECUTOR = "slurm"
    spec = LAUNCHERS.get("slurm")

    def _watch(self, jobs: list[Any]) -> None:
        """A watcher of the launch's own that reads the queue at least every :data:`QUEUE_POLL_MAX_S`: sacct's,
        or squeue's where accounting is disabled."""
        if jobs:
            watcher = SlurmInfoWatcher if sacct_works() else SqueueInfoWatcher
            watch_with(watcher(delay_s=QUEUE_POLL_MAX_S), jobs)


class SgeLauncher(_DpsweepSubmititLauncher):
    _EXECUTOR = "sge"
    spec = LAUNCHERS.get("sge")

    def _watch(self, jobs: list[Any]) -> None:
        """A watcher of the launch's own that reads qstat (qacct once a job has left) at least every
        :data:`QUEUE_POLL_MAX_S`."""
        from dpsweep.launchers.sge import SgeInfoWatcher

        if jobs:
            watch_with(SgeInfoWatcher(delay_s=QUEUE_POLL_MAX_S), jobs)
