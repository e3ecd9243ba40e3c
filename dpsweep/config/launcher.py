"""The launcher/ group: the resources of each job of a sweep, and their checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dpsweep import units
from dpsweep.config.checks import ConfigError, require
from dpsweep.registry import Registry

if TYPE_CHECKING:
    from dpsweep.config.schema import Config

AUTO = "auto"


@dataclass(frozen=True)
class LauncherSpec:
    """What a launcher can do, declared once by its owner (``launchers/``: its Hydra plugin class, and its
    yaml under ``conf/launcher/``); the checks and the sweepers ask it, never a launcher's name.

    A new launcher is a class, a spec and a yaml (docs: guides/extending.md)::

        LAUNCHERS.register("name")(LauncherSpec("name", processes=True))  # the spec, here or in its module

        class NameLauncher(DpsweepLauncher):  # dpsweep.launchers.base; a Hydra plugin under hydra_plugins
            spec = LAUNCHERS.get("name")

    and ``conf/launcher/name.yaml`` sets ``launcher.name: name`` and selects the class
    (``override /hydra/launcher: ...``, a node whose ``_target_`` is the class).
    """

    name: str
    processes: bool = False  # each job its own process: trials can share a device (launcher.trials_per_device)
    ranks: bool = False  # a run across train.devices ranks: torchrun here, or a scheduler's tasks
    nodes: bool = False  # a run across train.nodes nodes (one scheduler task a rank)
    scheduler: str | None = None  # the cluster scheduler jobs are submitted to; None: they run on this machine
    submit_command: str | None = None  # the scheduler's client tool a sweep needs on PATH
    # each rank of a run a task of its scheduler's job: a job array's tasks are one shape, so one
    # train.devices and train.nodes a sweep
    rank_tasks: bool = False
    title: str | None = None  # how messages name where jobs run ("Slurm"); None: launcher=<name>

    @property
    def inline(self) -> bool:
        """Trials run one after another in the sweep's own process."""
        return not self.processes

    @property
    def said(self) -> str:
        """The launcher as a message names it: ``on {said}``."""
        return self.title or f"launcher={self.name}"

    @property
    def remote(self) -> bool:
        """Jobs run on a scheduler's hosts, not this machine (its GPUs and cores say nothing of theirs)."""
        return self.scheduler is not None


LAUNCHERS: Registry[LauncherSpec] = Registry("launcher")
LAUNCHERS.register("inline")(LauncherSpec("inline", ranks=True))
LAUNCHERS.register("local")(LauncherSpec("local", processes=True, ranks=True))
LAUNCHERS.register("slurm")(
    LauncherSpec(
        "slurm",
        processes=True,
        ranks=True,
        nodes=True,
        scheduler="slurm",
        submit_command="sbatch",
        rank_tasks=True,
        title="Slurm",
    )
)
LAUNCHERS.register("sge")(
    LauncherSpec("sge", processes=True, scheduler="sge", submit_command="qsub", title="Grid Engine")
)


def spec(launcher: LauncherConfig | str) -> LauncherSpec:
    """The spec of ``launcher.name`` (UnknownNameError naming ``launcher`` and the valid names otherwise)."""
    name = launcher if isinstance(launcher, str) else launcher.name
    return LAUNCHERS.get(name, key="launcher")


def launchers_where(capability: Callable[[LauncherSpec], bool]) -> list[str]:
    """The names of the launchers whose spec has ``capability``, e.g. ``launchers_where(lambda s: s.processes)``:
    what an error lists as allowed."""
    return [name for name in LAUNCHERS if capability(LAUNCHERS.get(name))]


def either(names: list[str]) -> str:
    """``a, b or c``: the names an error allows."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "(none)"


@dataclass
class LauncherConfig:
    """Resources, said once; each launcher maps them to its scheduler (conf/launcher/*.yaml)."""

    # a registered launcher (LAUNCHERS): inline (in-process, one after another) | local | slurm | sge
    name: str = "inline"
    gpus_per_job: int = 0
    cpus_per_job: int = 1
    mem_gb: int = 4  # memory per job, GiB
    timeout_min: int = 60  # wall-clock limit per job, minutes
    partition: str | None = None  # Slurm partition or SGE queue; null: the scheduler's default
    max_parallel: int = 1  # jobs running at once (local: processes; clusters: array throttle)
    setup: list[str] = field(default_factory=list)  # shell lines run before each job (module load, venv)
    gpu_resource: str = "gpu={gpus}"  # SGE only: the -l resource string sites use for GPUs
    # Memory of each job's GPU with units, e.g. 16GiB or 80GB: dpsweep-plan flags configs predicted
    # not to fit (with train.memory_model), and training picks the physical batch from it.
    gpu_memory: str | None = None
    # Trials that share one device (launcher=local, slurm, sge): each job holds one GPU and runs this
    # many trials at once, each its own process and MLflow run; "auto": as many as the memory model
    # predicts fit launcher.gpu_memory together (and the CPU cores allow). A string, as OmegaConf
    # has no int-or-string field: "4" or "auto" (see trials_per_device()).
    trials_per_device: str = "1"
    # Trials run one after another in one job's process (launcher=local, slurm, sge): the sweep's jobs,
    # in order, T at a time, each T one submitted job (a T x launcher.timeout_min limit) that pays the
    # process's start-up (mostly imports) once; each trial keeps its own Hydra job, seed, MLflow run,
    # checkpoint and result (dpsweep.launchers.serial).
    trials_per_job: int = 1


def trials_per_device(launcher: LauncherConfig) -> int | None:
    """K, the trials that share one device; None for ``auto`` (the sweep resolves it before launch)."""
    value = str(launcher.trials_per_device).strip()
    if value == AUTO:
        return None
    try:
        k = int(value)
    except ValueError:
        k = 0
    if k < 1:
        raise ConfigError(
            "launcher.trials_per_device", launcher.trials_per_device, f"a whole number of trials, 1 or more, or {AUTO}"
        )
    return k


def check(cfg: Config) -> None:
    """launcher.name: a registered launcher; launcher.trials_per_device: a number or auto; auto needs a
    memory model and a GPU budget to pick K from; more than one trial per device needs a launcher that
    starts processes (its spec's ``processes``), and one device (``launcher.gpus_per_job`` 0 or 1)."""
    launcher = cfg.launcher
    inline = spec(launcher).inline  # an unknown launcher.name: refused, with the valid names
    k = trials_per_device(launcher)
    if k is None:
        require(
            cfg.train.memory_model is not None,
            "launcher.trials_per_device",
            AUTO,
            "a number of trials, or auto with train.memory_model (a dpsweep-memory fit) to predict each trial's peak",
        )
        require(
            launcher.gpu_memory is not None,
            "launcher.trials_per_device",
            AUTO,
            "a number of trials, or auto with launcher.gpu_memory (e.g. 80GB) for the trials to fit in together",
        )
    require(
        (k == 1) or not inline,
        "launcher.trials_per_device",
        launcher.trials_per_device,
        f"1 with launcher={launcher.name} (its trials run one after another in this process); pack trials with "
        f"launcher={either(launchers_where(lambda s: s.processes))} and -m",
    )
    require(
        (k == 1) or launcher.gpus_per_job <= 1,
        "launcher.gpus_per_job",
        launcher.gpus_per_job,
        f"0 or 1 with launcher.trials_per_device={launcher.trials_per_device}: packed trials share one device",
    )
    _check_trials_per_job(cfg, k)


def trials_per_job(launcher: LauncherConfig) -> int:
    """T, the trials a job runs one after another in its process (ConfigError unless a whole number >= 1)."""
    t = launcher.trials_per_job
    require(
        isinstance(t, int) and not isinstance(t, bool) and t >= 1,
        "launcher.trials_per_job",
        t,
        "a whole number of trials run one after another in a job's process, 1 or more",
    )
    return t


def _check_trials_per_job(cfg: Config, k: int | None) -> None:
    """launcher.trials_per_job: 1 for a launcher that runs its trials in this process; above 1, neither
    with trials per device (a job is one or the other) nor with a run across devices (its ranks)."""
    launcher, t = cfg.launcher, trials_per_job(cfg.launcher)
    if t == 1:
        return
    require(
        not spec(launcher).inline,
        "launcher.trials_per_job",
        t,
        f"1 with launcher={launcher.name} (it runs every trial in this process already); more with "
        f"launcher={either(launchers_where(lambda s: s.processes))} and -m",
    )
    require(
        k == 1,
        "launcher.trials_per_job",
        t,
        f"1 with launcher.trials_per_device={launcher.trials_per_device}: a job runs its trials either at once "
        "on one device (launcher.trials_per_device) or one after another (launcher.trials_per_job), not both",
    )
    require(
        cfg.train.devices == 1 and cfg.train.nodes == 1,
        "launcher.trials_per_job",
        t,
        f"1 with train.devices={cfg.train.devices} and train.nodes={cfg.train.nodes}: a run across devices "
        "holds its job's tasks alone",
    )


def validate_launcher(launcher: LauncherConfig) -> None:
    """Resources must be satisfiable: positive counts, memory in GiB, time in minutes."""
    require(launcher.gpus_per_job >= 0, "launcher.gpus_per_job", launcher.gpus_per_job, "0 or more GPUs")
    require(launcher.cpus_per_job >= 1, "launcher.cpus_per_job", launcher.cpus_per_job, "1 or more CPUs")
    require(launcher.mem_gb > 0, "launcher.mem_gb", launcher.mem_gb, "a positive amount of memory in GiB, e.g. 16")
    require(
        launcher.timeout_min > 0, "launcher.timeout_min", launcher.timeout_min, "a positive time in minutes, e.g. 120"
    )
    require(launcher.max_parallel >= 1, "launcher.max_parallel", launcher.max_parallel, "1 or more jobs at once")
    trials_per_device(launcher)
    trials_per_job(launcher)
    if launcher.gpu_memory is not None:
        units.parse_bytes(launcher.gpu_memory, key="launcher.gpu_memory")
    require(
        "{gpus}" in launcher.gpu_resource,
        "launcher.gpu_resource",
        launcher.gpu_resource,
        "an SGE resource string with a {gpus} placeholder, e.g. gpu={gpus} or h_gpu={gpus}",
    )
