"""The torchrun command that starts a run's ranks (dpsweep.distributed.launch), and which process is a rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dpsweep.distributed import Ranks, current, launch, torchrun_command
from dpsweep.process import RANKS_ENV


def test_the_ranks_run_the_same_command_in_the_launchers_output_directory() -> None:
    command = torchrun_command(4, ["train.devices=4", "train.epochs=2", "hydra.run.dir=elsewhere"], "outputs/x")
    assert command == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=4",
        "-m", "dpsweep.cli.train", "train.devices=4", "train.epochs=2", "hydra.run.dir=outputs/x",
    ]  # fmt: skip


def test_a_process_is_a_rank_only_where_dpsweep_started_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")  # e.g. a Slurm or an outer torchrun's, not dpsweep's
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv(RANKS_ENV, raising=False)
    assert current() == Ranks()
    monkeypatch.setenv(RANKS_ENV, "1")
    assert current() == Ranks(1, 2, 1) and not current().leader and current().distributed


# What torchrun 2.x writes on stderr when rank 1 of two is killed with SIGKILL (recorded from a real run,
# paths shortened): its agent's log lines, rank 0's traceback as torch prints it, then its own traceback
# and report. The ranks' own lines are interleaved with it.
TORCHRUN_STDERR = (Path(__file__).parent / "torchrun_rank_killed.txt").read_text()


def test_torchruns_report_is_kept_in_a_file_and_the_ranks_lines_are_shown(tmp_path: Path) -> None:
    """A failed rank's 40 lines of torchrun (issue 55, item 6): the ranks' own lines and the exception of a
    rank's traceback are shown; torchrun's log lines, tracebacks and table go to the report, whose root
    cause is one line."""
    import io

    kept, shown = io.StringIO(), io.StringIO()
    launch._sort_lines(io.StringIO(TORCHRUN_STDERR), kept, shown)
    assert shown.getvalue().splitlines() == [
        "dpsweep: interrupted (SIGTERM); a run in progress was ended KILLED, keeping what it had logged",
        "[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:36745: Connection reset by "
        "peer.",
    ]
    assert "ChildFailedError" in kept.getvalue() and "Sending process 18425" in kept.getvalue()
    assert len(kept.getvalue().splitlines()) + 1 == len(TORCHRUN_STDERR.splitlines())  # all but the ranks' line
    assert launch.root_cause(kept.getvalue()) == "rank 1 (exit code -9, SIGKILL)"


def test_a_ranks_own_traceback_without_torchruns_frames_is_shown_whole() -> None:
    import io

    text = 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nValueError: bad\nafter\n'
    kept, shown = io.StringIO(), io.StringIO()
    launch._sort_lines(io.StringIO(text), kept, shown)
    assert shown.getvalue() == text and kept.getvalue() == ""
    assert launch.root_cause("no table") is None
