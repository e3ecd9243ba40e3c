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

**A checkpoint's counters and ledger are checked against the run's plan**, not trusted: a readable file of
the right config may still be altered (an emptied accountant history resumed a 4-epoch run to ε = 2.279
where its plan spends 2.948). Its epoch must lie in 0..``train.epochs`` and its steps in 0..the plan's
steps for those epochs (:func:`peek`: else set aside as ``checkpoint.pt.invalid-<time>`` before any work,
and the run starts afresh). Once loaded, a DP run's step count must be the plan's for its epochs and the
privacy ledger the restored run would report (its task's: an Opacus accountant's history, a step
counter in an optimizer's or a module's state) must charge exactly the plan's mechanisms for those
steps (:func:`check_resumed`: else set aside as ``invalid`` too, and the run fails naming
``train.checkpoint_dir``; run again, it starts afresh).

    dpsweep train.checkpoint_dir=ckpt/  # kill it, run it again: it continues from the last epoch
"""

from __future__ import annotations

import io
import math
import os
import pickle
import random
import stat
import threading
import time
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from opacus import PrivacyEngine
from torch import nn

from dpsweep.config import ConfigError
from dpsweep.data.resident import Generators
from dpsweep.plan import RunPlan, mechanism_of, setting
from dpsweep.privacy import ledger
from dpsweep.privacy.ledger import Ledger

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


def capture_rng(loader_generator: torch.Generator | Generators) -> dict[str, Any]:
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


def restore_rng(rng: dict[str, Any], loader_generator: torch.Generator | Generators) -> None:
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


READ_TIMEOUT_S = 10.0  # a checkpoint not read by then (a hung network mount) is unreadable


class Unreadable(ValueError):
    """Not a checkpoint dpsweep can read: not a regular file, no answer in time, or not what it saves."""


def read(path: Path, timeout_s: float = READ_TIMEOUT_S) -> dict[str, Any]:
    """A checkpoint's contents, unpickled by torch's allow-list alone (``weights_only=True``: no code runs).
    Its path comes from a run's tag, which any writer of a shared store can set, so only a regular file
    is read (a FIFO or a device is refused without waiting for a writer), within ``timeout_s``; whatever
    else fails, or a file that is not a dict of what :func:`save` writes, raises :class:`Unreadable`
    (FileNotFoundError where there is no file)."""
    data = _regular_file_bytes(path, timeout_s)
    try:
        blob = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as err:  # the file's bytes are untrusted: anything the unpickler raises means unreadable
        raise Unreadable(f"{path}: {type(err).__name__}") from err
    if not isinstance(blob, dict) or not isinstance(blob.get("training_state"), dict):
        raise Unreadable(f"{path}: not a dpsweep checkpoint (a {type(blob).__name__})")
    return blob


def _regular_file_bytes(path: Path, timeout_s: float) -> bytes:
    """The bytes of the regular file at ``path``, read in a thread given ``timeout_s`` (module docstring
    of :func:`read`); Unreadable otherwise, FileNotFoundError where nothing is there."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, and is refused below
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise Unreadable(f"{path}: not a regular file")
                with os.fdopen(os.dup(fd), "rb") as f:
                    box["data"] = f.read()
            finally:
                os.close(fd)
        except BaseException as err:
            box["error"] = err

    worker = threading.Thread(target=work, name="dpsweep-checkpoint-read", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise Unreadable(f"{path}: no answer within {timeout_s:g} s (a hung mount?)")
    error = box.get("error")
    if isinstance(error, FileNotFoundError | Unreadable):
        raise error
    if error is not None:
        raise Unreadable(f"{path}: {error}") from error
    data: bytes = box["data"]
    return data


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
    set_aside: Path | None = None  # where an unreadable, other config's or invalid checkpoint was moved


def peek(directory: Path, expected_hash: str, plan: RunPlan | None = None) -> Found:
    """The saved training state (run id, epoch), read once, without loading the model.

    A checkpoint that cannot be read (truncated, garbled, or holding more than tensors and numbers) is
    renamed ``checkpoint.pt.corrupt-<time>`` and the run starts afresh. Checkpoints are written
    atomically (:func:`save`), so this takes a fault outside dpsweep: a full disk, a bad copy, a
    crafted file. A checkpoint of another config is never loaded: it is renamed
    ``checkpoint.pt.config-<its hash>`` and the run starts afresh (a reused ``hydra.sweep.dir`` gives a
    new sweep's job the directory of an old job of another config; issue 39, item 5). Given the run's
    ``plan``, one whose counters lie outside its range (:func:`out_of_range`) is renamed
    ``checkpoint.pt.invalid-<time>`` and the run starts afresh."""
    path = directory / FILENAME
    try:
        state = _read_state(path)
    except FileNotFoundError:
        return Found(None)
    except UNREADABLE:
        return Found(None, _set_aside(path, "corrupt"))
    if state.config_hash != expected_hash:
        aside = path.with_name(f"{FILENAME}.config-{state.config_hash}")
        path.replace(aside)
        return Found(None, aside)
    if plan is not None and out_of_range(plan, state) is not None:
        return Found(None, _set_aside(path, "invalid"))
    return Found(state)


def _set_aside(path: Path, why: str) -> Path:
    """``path`` renamed ``<name>.<why>-<time>``, kept for inspection; the new path."""
    aside = path.with_name(f"{path.name}.{why}-{time.strftime('%Y%m%dT%H%M%S')}")
    path.replace(aside)
    return aside


def planned_steps(plan: RunPlan, epochs: int) -> int:
    """The optimizer steps the plan takes in the first ``epochs`` epochs: its mechanism's steps for that many
    (``ceil(N/B)`` an epoch for DP-SGD, one round for DPALS), at most ``plan.steps`` (a task that stops
    at its budget takes no more)."""
    cfg = plan.config
    s = replace(setting(cfg, plan.facts.n_train), epochs=epochs)
    return min(plan.steps, mechanism_of(cfg).steps(s))


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def out_of_range(plan: RunPlan, state: TrainingState) -> str | None:
    """Why ``state``'s counters cannot be those of a run of ``plan`` (None: they can): its epoch an integer
    in 0..``train.epochs``, its steps an integer in 0..the plan's for those epochs, its memory peak not
    negative."""
    epochs = plan.config.train.epochs
    if not _is_count(state.epoch) or not 0 <= state.epoch <= epochs:
        return f"epoch {state.epoch!r}, outside 0..train.epochs={epochs}"
    most = planned_steps(plan, state.epoch)
    if not _is_count(state.steps) or not 0 <= state.steps <= most:
        return f"{state.steps!r} steps after epoch {state.epoch}, outside 0..{most} (the plan's steps for those epochs)"
    if not _is_count(state.run_peak_bytes) or state.run_peak_bytes < 0:
        return f"a memory peak of {state.run_peak_bytes!r} bytes"
    return None


Mechanisms = list[tuple[tuple[str, float, float, float], int]]  # (kind, σ, q, ε) -> how many times, sorted


def _mechanisms(bill: Ledger) -> Mechanisms:
    """What ``bill`` charges, as the accountants see it (:func:`dpsweep.privacy.ledger.leaves`): each
    mechanism and how many times it ran, however the entries split and name them."""
    counts: dict[tuple[str, float, float, float], int] = {}
    for entry in bill.entries:
        for leaf in ledger.leaves(entry.event):
            if leaf.count > 0:
                key = (leaf.kind, leaf.noise_multiplier, leaf.sample_rate, leaf.epsilon)
                counts[key] = counts.get(key, 0) + leaf.count
    return sorted(counts.items())


def _same(a: Mechanisms, b: Mechanisms) -> bool:
    """The same mechanisms the same number of times (σ, q and ε to 1e-9 relative: a float's last bits)."""
    if len(a) != len(b):
        return False
    for ((kind_a, *params_a), n_a), ((kind_b, *params_b), n_b) in zip(a, b, strict=True):
        close = all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(params_a, params_b, strict=True))
        if kind_a != kind_b or n_a != n_b or not close:
            return False
    return True


def _describe(charged: Mechanisms) -> str:
    def one(kind: str, sigma: float, q: float, eps: float) -> str:
        return f"ε={eps:.4g}-DP" if kind == "pure" else f"Gaussian(σ={sigma:.6g}, q={q:.6g})"

    return " + ".join(f"{n} × {one(*key)}" for key, n in charged) or "nothing"


def ledger_disagreement(plan: RunPlan, state: TrainingState, spent: Ledger) -> str | None:
    """Why ``spent``, the ledger of a DP run restored from ``state``, is not the plan's (None: it is): a run
    that completed ``state.epoch`` epochs took the plan's steps for them (:func:`planned_steps`), and
    its ledger charges the plan's mechanisms for those steps (the releases before training, then the
    mechanism's steps: its ``ledger_taken`` at the plan's σ), each as many times."""
    privacy = plan.privacy
    if privacy is None:
        return None
    steps = planned_steps(plan, state.epoch)
    if state.steps != steps:
        return f"{state.steps} steps after epoch {state.epoch}, where the plan takes {steps}"
    cfg = plan.config
    s = setting(cfg, plan.facts.n_train)
    expected = _mechanisms(s.extra + mechanism_of(cfg).ledger_taken(s, privacy.noise_multiplier, steps))
    charged = _mechanisms(spent)
    if _same(charged, expected):
        return None
    return (
        f"a ledger of {_describe(charged)} after {steps} steps, where the plan charges {_describe(expected)} "
        "(an altered accountant history or step counter)"
    )


def check_resumed(directory: Path, plan: RunPlan, state: TrainingState, spent: Ledger, set_aside: bool) -> None:
    """Refuse a loaded checkpoint whose counters or ledger (``spent``: the restored run's, before any step)
    are not its plan's (:func:`out_of_range`, :func:`ledger_disagreement`): it is renamed
    ``checkpoint.pt.invalid-<time>`` (by the run's rank 0: ``set_aside``), and ConfigError names
    ``train.checkpoint_dir``; the run fails, and run again it starts afresh."""
    why = out_of_range(plan, state) or ledger_disagreement(plan, state, spent)
    if why is None:
        return
    path = directory / FILENAME
    aside = _set_aside(path, "invalid") if set_aside and path.exists() else path
    raise ConfigError(
        "train.checkpoint_dir", str(directory), f"a checkpoint whose counters and privacy ledger are its plan's; "
        f"{path} holds {why}. It was set aside as {aside}: run again to start afresh",
    )  # fmt: skip


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
