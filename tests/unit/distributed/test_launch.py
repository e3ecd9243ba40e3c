"""The torchrun command that starts a run's ranks (dpsweep.distributed.launch), and which process is a rank."""

from __future__ import annotations

import sys

import pytest

from dpsweep.distributed import Ranks, current, torchrun_command
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
