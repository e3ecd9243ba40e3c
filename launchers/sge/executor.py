"""submitit executor, job, watcher and job environment for Son of Grid Engine (``qsub``).

Layout follows submitit's own Slurm backend (``submitit/slurm/slurm.py``): the executor writes a
job script and pickles, the watcher polls the scheduler in batches, the job environment reads the
scheduler's variables inside a running job.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import typing as tp
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, fields
from pathlib import Path

from submitit.core import core, job_environment, logger, utils

from dpsweep.interop import submitit_private

QSTAT_PENDING = ("qw", "hqw", "hRwq", "h", "w")


# ---------------------------------------------------------------------------------------------
# job script
# ---------------------------------------------------------------------------------------------
def _hms(minutes: float) -> str:
    seconds = max(1, round(minutes * 60))
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


@dataclass(frozen=True)
class QsubOptions:
    """The ``#$`` directives of a job script, by submitit's parameter names (see :func:`make_qsub_script`).

    - time: ``-l h_rt`` = timeout; ``-l s_rt`` = timeout - signal_delay_s sends SIGUSR1 first, which
      submitit handles as its checkpoint signal (SUBMITIT_PREEMPT_SIGNAL=USR1);
    - memory: ``-l <memory_resource>=<mem_gb per slot>G`` (sites use mem_free, h_vmem or their own);
    - GPUs: ``-l`` + ``gpu_resource`` with ``{gpus}`` filled in (sites name GPUs differently);
    - CPUs: ``-pe <parallel_env> <cpus>`` when more than one.
    """

    job_name: str = "submitit"
    queue: str | None = None
    timeout_min: float = 5
    signal_delay_s: int = 90
    cpus_per_task: int | None = None
    parallel_env: str = "smp"
    gpus_per_node: int | None = None
    gpu_resource: str = "gpu={gpus}"
    mem_gb: float | None = None
    memory_resource: str = "mem_free"
    array_parallelism: int = 256
    setup: list[str] | None = None
    stderr_to_stdout: bool = False
    export_env: bool = True
    rerunnable: bool = True
    additional_parameters: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.array_parallelism < 1:
            raise ValueError(f"array_parallelism must be >= 1, got {self.array_parallelism}")
        if "{gpus}" not in self.gpu_resource:
            raise ValueError(f"gpu_resource={self.gpu_resource!r} needs a {{gpus}} placeholder, e.g. gpu={{gpus}}")


def make_qsub_script(command: str, folder: str | Path, options: QsubOptions | None = None, array_size: int = 1) -> str:
    """The text of a qsub script running ``command`` for an array of ``array_size`` tasks, with the
    ``#$`` directives of ``options`` (:class:`QsubOptions`)."""
    o = options or QsubOptions()
    if array_size < 1:
        raise ValueError(f"array_size must be >= 1, got {array_size}")
    paths = utils.JobPaths(folder=folder)
    task_id = "$JOB_ID_$TASK_ID"  # SGE expands these pseudo variables in -o/-e paths
    stdout = str(paths.stdout).replace("%j", task_id).replace("%t", "0")
    stderr = str(paths.stderr).replace("%j", task_id).replace("%t", "0")
    directives: list[tuple[str, str]] = [
        ("-N", o.job_name),
        ("-S", "/bin/bash"),
        ("-cwd", ""),
        ("-t", f"1-{array_size}"),
        ("-tc", str(min(array_size, o.array_parallelism))),
        ("-o", stdout),
    ]
    directives.append(("-j", "y") if o.stderr_to_stdout else ("-e", stderr))
    if o.export_env:
        directives.append(("-V", ""))
    if o.rerunnable:
        directives.append(("-r", "y"))
    if o.queue:
        directives.append(("-q", o.queue))
    directives.append(("-l", f"h_rt={_hms(o.timeout_min)}"))
    if o.timeout_min * 60 > 2 * o.signal_delay_s:
        directives.append(("-l", f"s_rt={_hms(o.timeout_min - o.signal_delay_s / 60)}"))
    slots = o.cpus_per_task or 1
    if slots > 1:
        directives.append(("-pe", f"{o.parallel_env} {slots}"))
    if o.mem_gb is not None:
        per_slot_mb = int(o.mem_gb * 1024 / slots)
        directives.append(("-l", f"{o.memory_resource}={per_slot_mb}M"))
    if o.gpus_per_node:
        directives.append(("-l", o.gpu_resource.format(gpus=o.gpus_per_node)))
    for flag, value in (o.additional_parameters or {}).items():
        directives.append((flag if flag.startswith("-") else f"-{flag}", str(value)))
    lines = ["#!/bin/bash", "", "# Parameters"]
    lines += [f"#$ {flag} {value}".rstrip() for flag, value in directives]
    if o.setup:
        lines += ["", "# setup", *o.setup]
    lines += [
        "",
        "# command",
        "export SUBMITIT_EXECUTOR=sge",
        "export SUBMITIT_PREEMPT_SIGNAL=USR1",
        command,
        "",
    ]
    return "\n".join(lines)


def _valid_script_parameters() -> set[str]:
    return {f.name for f in fields(QsubOptions)}


# ---------------------------------------------------------------------------------------------
# watcher: qstat while queued or running, qacct once finished
# ---------------------------------------------------------------------------------------------
def _task_ids(tasks: str) -> list[int]:
    """SGE task lists: '3', '1-4:1', '1,3,5-7:2'."""
    out: list[int] = []
    for part in tasks.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part.strip())
        if not m:
            continue
        first, last, step = int(m.group(1)), int(m.group(2) or m.group(1)), int(m.group(3) or 1)
        out.extend(range(first, last + 1, step))
    return out


def _state_from_qstat(code: str) -> str:
    if "E" in code:
        return "FAILED"  # Eqw: the job cannot start (e.g. missing output directory); it waits forever
    if "d" in code:
        return "CANCELLED"
    if "r" in code or "t" in code or "R" in code or "s" in code.lower():
        return "RUNNING"
    return "PENDING"


def parse_qstat_xml(text: str | bytes) -> dict[str, dict[str, str]]:
    """``qstat -xml`` -> {"<job>_<task>": {"State": ..., "qstat_state": ...}}."""
    if isinstance(text, bytes):
        text = text.decode()
    out: dict[str, dict[str, str]] = {}
    if not text.strip():
        return out
    for job in ET.fromstring(text).iter("job_list"):
        number = (job.findtext("JB_job_number") or "").strip()
        code = (job.findtext("state") or "").strip()
        tasks = (job.findtext("tasks") or "").strip()
        for task in _task_ids(tasks) or [1]:
            out[f"{number}_{task}"] = {"State": _state_from_qstat(code), "qstat_state": code}
    return out


def parse_qacct(text: str | bytes) -> dict[str, dict[str, str]]:
    """``qacct -j <id>`` -> {"<job>_<task>": {"State": COMPLETED|FAILED|CANCELLED, "exit_status": ..., ...}}."""
    if isinstance(text, bytes):
        text = text.decode()
    out: dict[str, dict[str, str]] = {}
    for record in re.split(r"^=+\s*$", text, flags=re.MULTILINE):
        fields = {}
        for line in record.strip().splitlines():
            key, _, value = line.partition(" ")
            fields[key.strip()] = value.strip()
        if "jobnumber" not in fields:
            continue
        task = fields.get("taskid", "undefined")
        task = task if task.isdigit() else "1"
        exit_status = fields.get("exit_status", "0").split()[0]
        failed = fields.get("failed", "0").split()[0]
        if exit_status in ("0",) and failed == "0":
            state = "COMPLETED"
        elif exit_status in ("137", "143") or failed == "100":
            state = "CANCELLED"  # killed by a signal (qdel, limits)
        else:
            state = "FAILED"
        out[f"{fields['jobnumber']}_{task}"] = {"State": state, "exit_status": exit_status, "failed": failed}
    return out


class SgeInfoWatcher(core.InfoWatcher):
    def _make_command(self) -> list[str] | None:
        if not self._registered - self._finished:
            return None
        return ["qstat", "-u", "*", "-xml"]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        return parse_qstat_xml(string)

    def update(self) -> None:
        before = self._num_calls
        super().update()
        if self._num_calls == before:
            return
        current = parse_qstat_xml(self._output) if self._output else {}
        gone = [j for j in self._registered - self._finished if j not in current]
        for job_id in gone:  # left the queue: ask accounting (records appear a few seconds after the end)
            self._info_dict.pop(job_id, None)
        for main in sorted({j.split("_")[0] for j in gone}):
            try:
                text = subprocess.run(["qacct", "-j", main], capture_output=True, text=True, timeout=60).stdout
            except (OSError, subprocess.SubprocessError) as err:
                logger.get_logger().warning(f"qacct -j {main} failed: {err}")
                continue
            self._info_dict.update(parse_qacct(text))
        for job_id in gone:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        info = self.get_info(job_id, mode=mode)
        return info.get("State") or "UNKNOWN"


class SgeJob(core.Job[core.R]):
    watcher = SgeInfoWatcher(delay_s=600)

    def cancel(self, check: bool = True) -> None:
        main, _, task = self.job_id.partition("_")
        command = ["qdel", main] + (["-t", task] if task else [])
        (subprocess.check_call if check else subprocess.call)(command, stdout=subprocess.DEVNULL)


# ---------------------------------------------------------------------------------------------
# inside a running job
# ---------------------------------------------------------------------------------------------
class SgeJobEnvironment(job_environment.JobEnvironment):
    _env: tp.ClassVar[dict[str, str]] = {"job_id": "JOB_ID", "array_job_id": "JOB_ID", "array_task_id": "SGE_TASK_ID"}

    @property
    def array_task_id(self) -> str | None:
        task = os.environ.get("SGE_TASK_ID", "")
        return task if task.isdigit() else None

    @property
    def array_job_id(self) -> str | None:
        return os.environ.get("JOB_ID") if self.array_task_id else None

    @property
    def num_tasks(self) -> int:
        return 1

    @property
    def num_nodes(self) -> int:
        return 1

    @property
    def node(self) -> int:
        return 0

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def hostnames(self) -> list[str]:
        return [socket.gethostname()]

    def _requeue(self, countdown: int) -> None:
        target = os.environ["JOB_ID"] + (f".{self.array_task_id}" if self.array_task_id else "")
        subprocess.check_call(["qmod", "-rj", target], timeout=60)
        logger.get_logger().info(f"Requeued job {target} ({countdown} remaining timeouts)")


# ---------------------------------------------------------------------------------------------
# executor
# ---------------------------------------------------------------------------------------------
class SgeExecutor(core.PicklingExecutor):
    """Submits pickled calls as SGE array jobs; see the package docstring for the protocol."""

    job_class = SgeJob

    def __init__(
        self,
        folder: str | Path,
        max_num_timeout: int = 3,
        max_pickle_size_gb: float = 1.0,
        python: str | None = None,
    ) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout, max_pickle_size_gb=max_pickle_size_gb)
        self.python = shlex.quote(sys.executable) if python is None else python
        if shutil.which("qsub") is None:
            raise RuntimeError('Could not find "qsub" on PATH: is this a Grid Engine submit host?')

    @classmethod
    def _equivalence_dict(cls) -> core.EquivalenceDict:
        return {
            "name": "job_name",
            "timeout_min": "timeout_min",
            "mem_gb": "mem_gb",
            "nodes": "nodes",
            "cpus_per_task": "cpus_per_task",
            "gpus_per_node": "gpus_per_node",
            "tasks_per_node": "tasks_per_node",
        }

    @classmethod
    def _valid_parameters(cls) -> set[str]:
        return _valid_script_parameters() | {"nodes", "tasks_per_node"}

    def _internal_update_parameters(self, **kwargs: tp.Any) -> None:
        invalid = sorted(set(kwargs) - self._valid_parameters())
        if invalid:
            raise ValueError(
                f"Unavailable parameter(s): {invalid}\nValid parameters are: {sorted(self._valid_parameters())}"
            )
        for key in ("nodes", "tasks_per_node"):
            if kwargs.get(key, 1) not in (1, None):
                raise ValueError(f"{key}={kwargs[key]}: the SGE executor runs single-node, single-task jobs")
        QsubOptions(**self._script_parameters(kwargs))  # validates values
        super()._internal_update_parameters(**kwargs)

    @staticmethod
    def _script_parameters(params: dict[str, tp.Any]) -> dict[str, tp.Any]:
        return {k: v for k, v in params.items() if k not in ("nodes", "tasks_per_node") and v is not None}

    @property
    def _submitit_command_str(self) -> str:
        return " ".join([self.python, f"-u -m {submitit_private.SUBMIT_MODULE}", shlex.quote(str(self.folder))])

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return make_qsub_script(command, self.folder, QsubOptions(**self._script_parameters(self.parameters)))

    def _num_tasks(self) -> int:
        return 1

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return ["qsub", "-terse", "-h", str(submission_file_path)]

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        """``qsub -terse`` prints ``123`` or, for arrays, ``123.1-4:1``."""
        if not isinstance(string, str):
            string = string.decode()
        match = re.search(r"^(?P<id>\d+)(\.\d+-\d+:\d+)?\s*$", string.strip(), flags=re.MULTILINE)
        if match is None:
            raise utils.FailedSubmissionError(f'Could not make sense of qsub output "{string}"')
        return match.group("id")

    def _internal_process_submissions(
        self, delayed_submissions: list[utils.DelayedSubmission]
    ) -> list[core.Job[tp.Any]]:
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        timeout_min = self.parameters.get("timeout_min", 5)
        pickles = []
        for delayed in delayed_submissions:
            path = folder / f"{uuid.uuid4().hex}.pkl"
            delayed.set_timeout(timeout_min, self.max_num_timeout)
            delayed.dump(path)
            pickles.append(path)
        n = len(delayed_submissions)
        script = folder / f".submission_file_{uuid.uuid4().hex}.sh"
        params = self._script_parameters(self.parameters)
        script.write_text(
            make_qsub_script(self._submitit_command_str, self.folder, QsubOptions(**params), array_size=n)
        )
        self._throttle()
        proc = subprocess.run(self._make_submission_command(script), capture_output=True, text=True, check=False)
        self._last_job_submitted = __import__("time").time()
        if proc.returncode != 0:
            raise utils.FailedSubmissionError(f"qsub failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}")
        main = self._get_job_id_from_submission_command(proc.stdout)
        jobs: list[core.Job[tp.Any]] = [
            SgeJob(folder=self.folder, job_id=f"{main}_{i}", tasks=[0]) for i in range(1, n + 1)
        ]
        for job, path in zip(jobs, pickles, strict=True):
            job.paths.move_temporary_file(path, "submitted_pickle")
            job.paths.folder.mkdir(parents=True, exist_ok=True)
        jobs[0].paths.move_temporary_file(script, "submission_file", keep_as_symlink=True)
        subprocess.run(["qrls", main], capture_output=True, check=True, timeout=60)  # all inputs in place: release
        return jobs

    @classmethod
    def affinity(cls) -> int:
        return -1 if shutil.which("qsub") is None else 1  # below Slurm's 2 where both exist
