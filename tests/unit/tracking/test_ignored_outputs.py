"""What dpsweep leaves in the working directory by default is ignored by git (issue 56, item 10).

``mlflow.db.lock`` showed up in ``git status`` after ``make demo``. The files are made here by the code
that makes them in a run: the default MLflow store opened as a run opens it (the store and its lock),
and an Optuna search's default storage opened as the sweeper opens it (the study and dpsweep's lock).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO

from dpsweep.config import TrackingConfig
from dpsweep.launchers.nodes import OptunaSearchConf
from dpsweep.launchers.optuna_sweeper import open_locked
from dpsweep.tracking.store import open_client


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_default_stores_and_their_locks_are_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _git(tmp_path, "init", "-q")
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    open_client(TrackingConfig.uri)
    open_locked(OptunaSearchConf.storage)
    made = sorted(p.name for p in tmp_path.iterdir() if p.name not in (".git", ".gitignore"))
    assert {"mlflow.db", "mlflow.db.lock", "optuna.db"} <= set(made), made
    untracked = _git(tmp_path, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert untracked == ["?? .gitignore"], (made, untracked)
