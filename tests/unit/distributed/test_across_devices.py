"""What the dpsweep command's launch of a run's ranks does around torchrun (dpsweep.run.across_devices):
the ranks' overrides, rank 0's summary handed back, and the runs ended after a failed rank (a real
sqlite store; the whole launch under torchrun: tests/integration/test_distributed.py)."""

from __future__ import annotations

import time
from pathlib import Path

from helpers import dead_run

from dpsweep.run.across_devices import RANK0_SUMMARY, RanksEnded, end_runs, leave_summary, rank_overrides


def test_every_rank_gets_the_jobs_overrides_with_the_jobs_own_checkpoint_directory() -> None:
    given = ["train.devices=2", "train.checkpoint_dir=/given", "train.epochs=3"]
    assert rank_overrides(given, "/job/checkpoint") == [
        "train.devices=2", "train.epochs=3", "train.checkpoint_dir=/job/checkpoint",
    ]  # fmt: skip


def test_rank_0s_summary_reaches_the_job_that_launched_the_ranks(tmp_path: Path) -> None:
    leave_summary(tmp_path, {"line": "dpsweep: run abc", "score": 0.5, "epsilon": None})
    assert (tmp_path / RANK0_SUMMARY).exists()
    ended = RanksEnded(0, None, tmp_path / "torchrun.log", tmp_path)
    assert ended.summary() == {"line": "dpsweep: run abc", "score": 0.5, "epsilon": None}


def test_after_a_failed_rank_no_run_is_left_running_and_rank_0s_run_is_a_ranks_failure(tmp_path: Path) -> None:
    """Rank 0's run that torchrun's SIGTERM ended KILLED (interrupted) is set FAILED, failure.kind=rank;
    a dead RUNNING run (rank 0 killed outright) is ended KILLED; a run of another config, or one that
    ended before this launch, is left as it was."""
    uri, client, dead = dead_run(tmp_path, {"config.hash": "h"})
    experiment = client.get_experiment_by_name("dead").experiment_id

    def ended(config_hash: str) -> str:
        run = client.create_run(experiment, tags={"config.hash": config_hash, "failure.kind": "interrupted"})
        client.set_terminated(run.info.run_id, "KILLED")
        return run.info.run_id

    before = ended("h")
    time.sleep(0.01)
    since_ms = int(time.time() * 1000)
    interrupted, other = ended("h"), ended("other")
    failed, killed = end_runs(uri, "dead", "h", since_ms, 1)
    assert failed == (interrupted,)
    assert [run_id for run_id, _ in killed] == [dead]
    runs = {r: client.get_run(r) for r in (dead, interrupted, other, before)}
    assert runs[interrupted].info.status == "FAILED" and runs[interrupted].data.tags["failure.kind"] == "rank"
    assert runs[dead].info.status == "KILLED" and runs[dead].data.tags["failure.kind"] == "dead"
    for untouched in (other, before):
        assert runs[untouched].info.status == "KILLED", untouched
        assert runs[untouched].data.tags["failure.kind"] == "interrupted", untouched
