"""What a checkpoint path may hold besides a checkpoint (issue 55, items 2 and 4): the path comes from a
run's tag, which any writer of a shared MLflow store can set. A FIFO there hung ``dpsweep-runs
reconcile`` (and so ``dpsweep-report`` and ``dpsweep -m``, which reconcile first), and a bare tensor,
a symlink to a text file or a directory ended a run on a traceback. Now only a regular file is read, in
bounded time, and anything else is unreadable: set aside, and the run starts afresh."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import Composer, dead_run, runs_of
from mlflow.tracking import MlflowClient

from dpsweep.run import checkpoint
from dpsweep.run.runner import train
from dpsweep.tracking.dead_runs import reconcile


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _directory(path: Path) -> None:
    path.mkdir()


def _bare_tensor(path: Path) -> None:
    torch.save(torch.zeros(3), path)


def _symlink_to_text(path: Path) -> None:
    text = path.with_name("notes.txt")
    text.write_text("not a checkpoint\n")
    path.symlink_to(text)


def _list(path: Path) -> None:
    torch.save([1, 2, 3], path)


NOT_CHECKPOINTS: dict[str, Callable[[Path], None]] = {
    "fifo": _fifo, "directory": _directory, "bare tensor": _bare_tensor, "symlink to text": _symlink_to_text,
    "list": _list,
}  # fmt: skip


@pytest.mark.parametrize("kind", list(NOT_CHECKPOINTS))
def test_a_checkpoint_path_that_is_no_checkpoint_is_unreadable_at_once(tmp_path: Path, kind: str) -> None:
    path = tmp_path / checkpoint.FILENAME
    NOT_CHECKPOINTS[kind](path)
    started = time.monotonic()
    assert checkpoint.peek_any(tmp_path) is None
    with pytest.raises(checkpoint.Unreadable):
        checkpoint.read(path)
    assert time.monotonic() - started < 5  # a FIFO with no writer: refused, not waited on


@pytest.mark.parametrize("kind", ["fifo", "directory", "bare tensor", "symlink to text"])
def test_a_run_sets_such_a_path_aside_and_starts_afresh(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str, kind: str
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    NOT_CHECKPOINTS[kind](ckpt / checkpoint.FILENAME)
    result = train(make_cfg("train.epochs=1", f"train.checkpoint_dir={ckpt}"))
    [run] = runs_of(client, experiment_name)
    assert run.info.status == "FINISHED" and result.steps == 23
    assert ".corrupt-" in run.data.tags["checkpoint.set_aside"]


def test_reconcile_does_not_hang_on_a_fifo_at_a_dead_runs_checkpoint(tmp_path: Path) -> None:
    """A dead RUNNING run whose ``train.checkpoint_dir`` tag names a directory holding a FIFO: reconcile
    ends it KILLED in seconds, in a real ``dpsweep-runs`` process (it hung there, waiting for a writer)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / checkpoint.FILENAME)
    uri, client, run_id = dead_run(tmp_path, {"train.checkpoint_dir": str(ckpt)})
    command = [str(Path(sys.executable).parent / "dpsweep-runs"), "reconcile", "--tracking-uri", uri]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert client.get_run(run_id).info.status == "KILLED"
    assert (ckpt / checkpoint.FILENAME).exists()  # not a checkpoint of that run: left where it is
    assert reconcile(uri, "dead") == []
