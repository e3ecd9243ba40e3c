"""Hydra launchers for dpsweep: local processes, Slurm and Grid Engine, all through submitit.

They extend hydra-submitit-launcher's launchers in two ways:

- a job that dies outside Python (killed, out of memory, node failure) becomes a FAILED
  ``JobReturn`` instead of an exception that would drop every other job's result;
- on Slurm clusters without accounting (``sacct`` disabled), job states come from ``squeue``.

Select them with ``launcher=local|slurm|sge`` (conf/launcher/); the Hydra plugin shim lives in
``hydra_plugins.dpsweep_launchers``.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf
from submitit.slurm.slurm import SlurmInfoWatcher

from dpsweep.config import given_overrides, ranks_shape
from dpsweep.launchers import packing
from dpsweep.process.liveness import driver_environment

log = logging.getLogger(__name__)


# The command submitit's executors start each job with, before "-u -m submitit.core._submit <folder>":
# dpsweep.launchers.job runs submitit's job runner and ends the process without the teardown.
JOB_PYTHON = f"{shlex.quote(sys.executable)} -u -m dpsweep.launchers.job"
POLL_S = 1.0  # how often the driver looks for completed cluster jobs (submitit's watchers rate-limit sacct/qstat)
LOCAL_POLL_S = 0.05  # ... and for local jobs (a poll of the job's process): each job's end is seen within it


class _DpsweepSubmititLauncher(BaseSubmititLauncher):
    """Same executor set-up as hydra-submitit-launcher; results are collected job by job."""

    _INIT_KEYS = frozenset({"max_num_timeout"})
    on_job_done: Callable[[JobReturn], None] | None = None  # told of each job as it completes
    poll_s: float = POLL_S  # how often the driver looks for completed jobs
    trials_per_device: int = 1  # K trials per job (dpsweep.launchers.packing); set by the sweeper
    devices_per_job: int = 1  # train.devices of the sweep's runs; set by take_ranks (Slurm: one task a rank)
    nodes_per_job: int = 1  # train.nodes of the sweep's runs (Slurm)

    def take_ranks(self, train: Any) -> None:
        """The ranks of the sweep's runs (one ``train.devices`` and ``train.nodes`` a sweep on Slurm), which
        shape each job's tasks; the sweeper and the Optuna study call it with their first run's config."""
        self.devices_per_job, self.nodes_per_job = ranks_shape(train)

    def _executor(self, trials: int = 1) -> Any:
        import submitit

        init = {"folder": self.params["submitit_folder"]}
        init |= {f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k in self._INIT_KEYS}
        init[f"{self._EXECUTOR}_python"] = JOB_PYTHON  # each job ends without the interpreter's teardown
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        generic = set(OmegaConf.structured(BaseQueueConf).keys())
        params = {
            k if k in generic else f"{self._EXECUTOR}_{k}": v
            for k, v in packing.job_resources(dict(self.params), trials).items()
            if k not in self._INIT_KEYS | {"submitit_folder"}
        }
        if self._EXECUTOR == "slurm" and self.devices_per_job * self.nodes_per_job > 1:
            params |= ranks_resources(params, self.devices_per_job, self.nodes_per_job)
        executor.update_parameters(**params)
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None
        k = self.trials_per_device
        executor = self._executor(k)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.debug(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")  # hydra.verbose=dpsweep shows these
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.debug(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        folder = None  # where packed jobs keep their trials' files
        if k == 1:
            jobs = executor.map_array(self, *zip(*job_params, strict=True))
            per_job = [[o] for o in job_overrides]
        else:  # K trials per job, each its own process (dpsweep.launchers.packing)
            packed = packing.groups(job_params, k)
            folder = str(self.params["submitit_folder"]).replace("%j", "packed")
            Path(folder).mkdir(parents=True, exist_ok=True)
            cpus = int(self.params.get("cpus_per_task") or 1)
            jobs = executor.map_array(packing.PackedTrials(self, folder, cpus), packed)
            per_job = packing.groups(job_overrides, k)
        self._watch(jobs)
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
                if i not in results and job.done():
                    results[i] = self._collect(job, per_job[i], folder)
                    for ret in results[i]:
                        if self.on_job_done is not None:
                            self.on_job_done(ret)
            if len(results) < len(jobs):
                time.sleep(self.poll_s)
        return [ret for i in range(len(jobs)) for ret in results[i]]

    def _watch(self, jobs: list[Any]) -> None:
        """Hook for a launcher to replace submitit's state watcher."""

    @staticmethod
    def _collect(job: Any, trials: Sequence[Sequence[str]], folder: str | None = None) -> list[JobReturn]:
        """The job's results: its trial's, or each of its K trials' when packed (``folder``: where a packed job
        keeps them; the trials that returned before their job ended without a result keep theirs)."""
        try:
            result = job.results()[0]
            return list(result) if isinstance(result, list) else [result]
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
            return returns


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

    _EXECUTOR = "local"
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


class SlurmLauncher(_DpsweepSubmititLauncher):
    _EXECUTOR = "slurm"

    def _watch(self, jobs: list[Any]) -> None:
        if jobs and not sacct_works():
            watcher = SqueueInfoWatcher(delay_s=60)
            for job in jobs:
                # and each task's (a run across devices: a task a rank), which a task killed without a
                # result would otherwise wait on through sacct for ever
                for part in {job, *(job.task(i) for i in range(job.num_tasks))}:
                    part.watcher = watcher
                watcher.register_job(job.job_id)


class SgeLauncher(_DpsweepSubmititLauncher):
    _EXECUTOR = "sge"
