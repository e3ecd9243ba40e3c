"""Per-epoch checkpoints, so that a preempted or requeued job resumes where it stopped.

A checkpoint holds the model, the optimizer, the privacy accountant (its history of steps), the RNG
states, the MLflow run id and the per-epoch metrics so far. Steps taken after the last checkpoint
are discarded with the model state and redone from the restored RNG state: they are the same steps
on the same samples and noise, and nothing of the discarded ones was released, so the ε reported
after a resume (the restored accountant plus the steps since) covers every step behind the model.
DP runs are saved with Opacus's ``PrivacyEngine.save_checkpoint``; a checkpoint is only resumed by
a run of the same config (its hash is stored and compared).

**A checkpoint runs no code.** Checkpoint directories often sit on shared file systems, and a pickle
can run any command as it loads. Every checkpoint holds only tensors, numbers, strings and the
containers of those (NumPy's RNG state is kept as a tensor), and is read with
``torch.load(weights_only=True)``, torch's allow-listed unpickler; Opacus's own
``PrivacyEngine.load_checkpoint`` unpickles with ``weights_only=False``, so its three steps (model,
accountant, optimizer) are done here instead. A file that needs anything else is refused as unreadable:
set aside as ``checkpoint.pt.corrupt-<time>``, and the run starts afresh.

    dpsweep train.checkpoint_dir=ckpt/  # kill it, run it again: it continues from the last epoch
"""

from __future__ import annotations

import os
import pickle
import random
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from opacus import PrivacyEngine
from torch import nn

from dpsweep.config import ConfigError

FILENAME = "checkpoint.pt"


@dataclass
class TrainingState:
    """What a resumed run needs besides the model, optimizer and accountant."""

    config_hash: str
    run_id: str
    epoch: int  # last completed epoch
    steps: int  # optimizer steps taken so far
    epochs: list[dict[str, float]] = field(default_factory=list)
    run_peak_bytes: int = 0
    rng: dict[str, Any] = field(default_factory=dict)


def capture_rng(loader_generator: torch.Generator) -> dict[str, Any]:
    """Every RNG a step draws from: Opacus draws its noise on the parameters' device, so on a GPU
    the CUDA generators must be restored too, or a resumed run would repeat earlier noise."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    numpy_state = (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(position), int(has_gauss),
                   float(cached_gaussian))  # fmt: skip
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        # NumPy's MT19937 state as a tensor and plain numbers: what torch.load(weights_only=True) reads
        "numpy": numpy_state,
        "python": random.getstate(),
        "loader": loader_generator.get_state(),
    }


def restore_rng(rng: dict[str, Any], loader_generator: torch.Generator) -> None:
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None:
        torch.cuda.set_rng_state_all(rng["cuda"])
    kind, keys, position, has_gauss, cached_gaussian = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    random.setstate(rng["python"])
    loader_generator.set_state(rng["loader"])


def save(
    directory: Path,
    state: TrainingState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: PrivacyEngine | None,
) -> Path:
    """Write the checkpoint atomically (temporary file, then rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILENAME
    tmp = directory / f".{FILENAME}.{os.getpid()}.tmp"
    extra = {"training_state": state.__dict__}
    if engine is not None:
        engine.save_checkpoint(path=tmp, module=model, optimizer=optimizer, checkpoint_dict=extra)
    else:
        torch.save(
            {**extra, "module_state_dict": model.state_dict(), "optimizer_state_dict": optimizer.state_dict()}, tmp
        )
    tmp.replace(path)
    return path


# What torch.load raises on a truncated or garbled file (zip archive, pickle, tensor storage), or on one
# that holds anything but tensors, numbers, strings and their containers (weights_only: UnpicklingError).
UNREADABLE = (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, KeyError, TypeError, ValueError)


def read(path: Path) -> dict[str, Any]:
    """A checkpoint's contents, unpickled by torch's allow-list alone (``weights_only=True``: no code runs)."""
    blob: dict[str, Any] = torch.load(path, weights_only=True, map_location="cpu")
    return blob


def _read_state(path: Path) -> TrainingState:
    """The training state saved at ``path`` (raises OSError or one of UNREADABLE)."""
    return TrainingState(**read(path)["training_state"])


def peek_any(directory: Path) -> TrainingState | None:
    """The training state saved in ``directory`` whatever its config (None: none, or unreadable)."""
    path = directory / FILENAME
    try:
        return _read_state(path)
    except (OSError, *UNREADABLE):
        return None


@dataclass(frozen=True)
class Found:
    """What :func:`peek` found in a checkpoint directory."""

    state: TrainingState | None  # the state to resume from; None: start afresh
    set_aside: Path | None = None  # where an unreadable checkpoint was moved


def peek(directory: Path, expected_hash: str) -> Found:
    """The saved training state (run id, epoch), read once, without loading the model.

    A checkpoint that cannot be read (truncated, garbled, or holding more than tensors and numbers) is
    renamed ``checkpoint.pt.corrupt-<time>`` and the run starts afresh. Checkpoints are written
    atomically (:func:`save`), so this takes a fault outside dpsweep: a full disk, a bad copy, a
    crafted file. A checkpoint of another config is never loaded: it is renamed
    ``checkpoint.pt.config-<its hash>`` and the run starts afresh (a reused ``hydra.sweep.dir`` gives a
    new sweep's job the directory of an old job of another config; issue 39, item 5)."""
    path = directory / FILENAME
    if not path.exists():
        return Found(None)
    try:
        state = _read_state(path)
    except UNREADABLE:
        aside = path.with_name(f"{FILENAME}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
        path.replace(aside)
        return Found(None, aside)
    if state.config_hash != expected_hash:
        aside = path.with_name(f"{FILENAME}.config-{state.config_hash}")
        path.replace(aside)
        return Found(None, aside)
    return Found(state)


def _check_hash(directory: Path, state: TrainingState, expected_hash: str) -> None:
    if state.config_hash != expected_hash:
        raise ConfigError(
            "train.checkpoint_dir",
            str(directory),
            f"a directory without another config's checkpoint: {directory / FILENAME} belongs to config "
            f"{state.config_hash}, this run is {expected_hash}; remove it or use another train.checkpoint_dir",
        )


def load(
    directory: Path,
    expected_hash: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: PrivacyEngine | None,
) -> TrainingState:
    """Restore model, optimizer and accountant from the checkpoint :func:`peek` found in ``directory``.
    Its config is checked again on the loaded state (the file may have been replaced since)."""
    blob = read(directory / FILENAME)
    model.load_state_dict(blob["module_state_dict"])
    if engine is not None:  # what PrivacyEngine.load_checkpoint restores, from the safely read file
        engine.accountant.load_state_dict(blob["privacy_accountant_state_dict"])
    optimizer.load_state_dict(blob["optimizer_state_dict"])
    state = TrainingState(**blob["training_state"])
    _check_hash(directory, state, expected_hash)
    return state


def remove(directory: Path) -> None:
    (directory / FILENAME).unlink(missing_ok=True)
