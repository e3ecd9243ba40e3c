"""Bad input that used to end on a traceback (issue 55, item 4): one line naming the option, the value and
what is allowed, and exit code 2, from ``dpsweep-epsilon`` and ``dpsweep-runs``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import run_script

from dpsweep.cli.epsilon import main

BASE = ["-s", "60000", "-b", "150", "-n", "1.3", "-e", "15"]


def said(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize(
    ("extra", "needle", "allowed"),
    [
        (["--alphas", "1e308"], "--alphas='1e308'", "RDP orders of at most 10000"),
        (["--alphas", "2", "32", "20000"], "--alphas='2 32 20000'", "RDP orders of at most 10000"),
        (["--tuning-trials", "inf"], "--tuning-trials=inf", "a finite mean number of trials above 1"),
        (["--clipping", "quantile", "--clip-epsilon", "inf"], "--clip-epsilon=inf", "a positive ε (finite)"),
        (["--plot", "/dev/full"], "--plot='/dev/full'", "/dev/full is not a directory"),
        (["--plot", "/proc/version"], "--plot='/proc/version'", "/proc/version is not a directory"),
        (["--plot", "/proc/dpsweep-plots"], "--plot='/proc/dpsweep-plots'", "a directory the plots can be written"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_epsilon_refuses_in_one_line(
    capsys: pytest.CaptureFixture[str], extra: list[str], needle: str, allowed: str
) -> None:
    assert main([*BASE, *extra]) == 2
    err = capsys.readouterr().err
    [line] = err.strip().splitlines()
    assert line.startswith(f"dpsweep-epsilon: error: {needle} is invalid: ") and allowed in line, err


def test_epsilon_refuses_a_plot_folder_under_a_file_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    assert main([*BASE, "--plot", str(tmp_path / "notes.txt" / "plots")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out  # refused before ε was priced
    assert f"{tmp_path / 'notes.txt'} is not a directory" in captured.err, captured.err


def test_epsilon_console_script_refuses_a_device_as_plot_folder(tmp_path: Path) -> None:
    proc = run_script("dpsweep-epsilon", *BASE, "--plot", "/dev/full", cwd=tmp_path)
    assert proc.returncode == 2, said(proc)
    expected = "--plot='/dev/full' is invalid: a directory for the plots (/dev/full is not a directory)"
    assert proc.stderr.strip().splitlines() == [f"dpsweep-epsilon: error: {expected}"], said(proc)


@pytest.mark.parametrize(
    ("uri", "because"),
    [("foo://bar", "unsupported URI 'foo://bar'"), ("mlruns", "filesystem tracking backend")],
)
def test_runs_reconcile_refuses_a_uri_mlflow_cannot_open(tmp_path: Path, uri: str, because: str) -> None:
    proc = run_script("dpsweep-runs", "reconcile", "--tracking-uri", uri, cwd=tmp_path)
    assert proc.returncode == 2, said(proc)
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"dpsweep-runs: error: --tracking-uri={uri!r} is invalid: a tracking URI MLflow can open")
    assert because in line, said(proc)
