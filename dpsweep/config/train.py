"""The train/ group: batches, epochs, seed, device and checkpoints, and the checks of ``train.*``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from dpsweep.config.checks import ConfigError, require
from dpsweep.config.dp import Clipping
from dpsweep.config.launcher import LAUNCHERS, spec
from dpsweep.config.task import task_schemas
from dpsweep.privacy import ranges

if TYPE_CHECKING:
    from dpsweep.config.schema import Config


class Device(StrEnum):
    auto = "auto"  # cuda when available, else cpu
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class TrainConfig:
    batch_size: int = 64  # logical (expected) batch size B; with DP the sample rate is 1/ceil(N/B) (Opacus)
    epochs: int = 10  # passes over the data; steps = epochs x ceil(N/B)
    seed: int = 0  # seeds torch, numpy and Python; sweep it as an ordinary axis
    device: Device = Device.auto
    eval_batch_size: int = 1024  # examples per evaluation batch (no effect on privacy)
    # Evaluate (the classifier's test accuracy, the GAN's sample grids) every this many epochs; the
    # last epoch always is. ε and the memory peak are still logged every epoch.
    eval_every: int = 1
    progress: bool = True  # tqdm bars for epochs and steps (off by themselves when not on a terminal)
    # Per-epoch checkpoints (model, optimizer, accountant, RNG, MLflow run id); a run started again
    # with the same directory and config resumes from the last completed epoch. The dpsweep command
    # uses the Hydra job's output directory when this is null.
    checkpoint_dir: str | None = None
    # Examples per forward/backward pass (Opacus's BatchMemoryManager): a logical batch is split into
    # physical batches of at most this size, with one optimizer step (and one privacy step) per
    # logical batch, so the privacy accounting is unchanged. null: chosen from train.memory_model and
    # launcher.gpu_memory when both are set, else the whole logical batch in one pass.
    physical_batch_size: int | None = None
    memory_model: str | None = None  # a dpsweep-memory fit JSON file (used to choose physical_batch_size)
    # Memory probe: run only the first iteration on a batch of exactly batch_size examples, record the
    # four memory stages (tag probe=true), and stop; no evaluation, no ε. See dpsweep-memory probe.
    probe: bool = False
    # Hold the training split on the device and draw Poisson batches there (dpsweep.data.resident):
    # same sample rate and steps as Opacus's loader, without per-example loader overhead. For
    # datasets that fit in device memory (digits, MNIST, CIFAR-10, cached VGG16 features).
    device_resident: bool = False
    # Ranks of one run (issue 37): this many processes on each node, one device each (CUDA devices;
    # on the CPU, gloo ranks), started by torchrun, or as Slurm tasks with launcher=slurm. Each takes its share of every
    # Poisson batch (dpsweep.distributed); rank 0 draws the noise and writes the MLflow run; the ledger
    # is a single process's at the same q, σ and steps. DP-SGD through Opacus (hooks) at example level.
    devices: int = 1
    # Nodes of one run (launcher=slurm): train.devices ranks on each, one Slurm task a rank.
    nodes: int = 1


def check(cfg: Config) -> None:
    """B and epochs, evaluation, the physical batch, the memory model it may be chosen from, and ranks."""
    t = cfg.train
    check_devices(cfg)
    ranges.check("batch_size", "train.batch_size", t.batch_size)
    ranges.check("epochs", "train.epochs", t.epochs)
    require(t.eval_batch_size > 0, "train.eval_batch_size", t.eval_batch_size, "a positive integer")
    require(t.eval_every >= 1, "train.eval_every", t.eval_every, "a number of epochs, 1 or more")
    pb = t.physical_batch_size
    require(pb is None or pb > 0, "train.physical_batch_size", pb, "a positive number of examples or null")
    require(
        not (t.probe and pb is not None),
        "train.physical_batch_size",
        pb,
        "null with train.probe=true: a probe measures one pass over exactly train.batch_size examples",
    )
    if t.memory_model is not None and not Path(t.memory_model).is_file():
        raise ConfigError("train.memory_model", t.memory_model, "an existing dpsweep-memory fit JSON file or null")
    require(
        t.memory_model is None or cfg.launcher.gpu_memory is not None,
        "launcher.gpu_memory",
        cfg.launcher.gpu_memory,
        f"the GPU memory with units (e.g. 16GiB) for train.memory_model={t.memory_model!r} to pick the physical batch",
    )


# the keys that shape a run's ranks: on Slurm, its job's tasks, so one value each a sweep or study there
RANK_KEYS = ("train.devices", "train.nodes")


def check_devices(cfg: Config) -> None:
    """``train.devices`` and ``train.nodes``: one rank, or several of a private run whose task has a
    distributed path (``TaskConfig.distributed``), started by a launcher that starts ranks (and nodes)
    (``LauncherSpec.ranks``, ``.nodes``). Whether the run's engine has one is the engine's to say, asked
    where the run is planned (:func:`dpsweep.mechanisms.engines.check`: Opacus's, today). How many devices
    a machine has is checked where torch is imported (:func:`dpsweep.distributed.visible_devices`)."""
    t, dp, task = cfg.train, cfg.dp, type(cfg.task)
    require(t.devices >= 1, "train.devices", t.devices, "1 or more processes, one device each")
    require(t.nodes >= 1, "train.nodes", t.nodes, "1 or more nodes")
    if t.nodes > 1 and not spec(cfg.launcher).nodes:
        across = " or ".join(n for n in LAUNCHERS.names() if spec(n).nodes)
        raise ConfigError("train.nodes", t.nodes, f"1 unless launcher={across} (its tasks on several nodes)")
    if world_size(t) == 1:
        return
    ranked = [name for name, schema in sorted(task_schemas().items()) if schema.distributed]
    starts = [n for n in LAUNCHERS.names() if spec(n).ranks]
    paths = [
        (task.distributed, "task", cfg.task.name, f"{' or '.join(ranked)} with train.devices={t.devices}: "
         f"task={cfg.task.name} has no distributed path (train.devices=1)"),
        (dp.enabled, "dp", "off", f"a private run with train.devices={t.devices}: its distributed path is "
         "Opacus's DP-SGD (train.devices=1 for a non-private run)"),
        (dp.clipping == Clipping.fixed, "dp.clipping", dp.clipping.value, f"fixed with train.devices={t.devices}"),
        (not cfg.audit.enabled, "audit.mode", cfg.audit.mode, f"off with train.devices={t.devices}"),
        (not t.device_resident, "train.device_resident", t.device_resident, f"false with train.devices={t.devices}: "
         "each rank reads its share through the loader"),
        (t.memory_model is None, "train.memory_model", t.memory_model, f"null with train.devices={t.devices}: "
         "give train.physical_batch_size"),
        (not t.probe, "train.probe", t.probe, f"false with train.devices={t.devices}: a probe measures one process"),
        (cfg.launcher.name in starts, "launcher", cfg.launcher.name,
         f"{', '.join(starts)} with train.devices={t.devices} (torchrun here, or a scheduler's tasks)"),
        (str(cfg.launcher.trials_per_device) == "1", "launcher.trials_per_device", cfg.launcher.trials_per_device,
         f"1 with train.devices={t.devices}: a run across devices holds its devices alone"),
    ]  # fmt: skip
    for ok, key, value, allowed in paths:
        require(ok, key, value, allowed)
    pb, world = t.physical_batch_size, world_size(t)
    nodes = f" x train.nodes={t.nodes}" if t.nodes > 1 else ""
    require(pb is None or pb % world == 0, "train.physical_batch_size", pb,
            f"a multiple of train.devices={t.devices}{nodes}: a rank takes its share of a pass")  # fmt: skip


def ranks_shape(train: TrainConfig) -> tuple[int, ...]:
    """The values of :data:`RANK_KEYS`: (``train.devices``, ``train.nodes``)."""
    return tuple(getattr(train, key.removeprefix("train.")) for key in RANK_KEYS)


def world_size(train: TrainConfig) -> int:
    """The ranks of a run: ``train.devices`` on each of ``train.nodes`` nodes."""
    return train.devices * train.nodes
