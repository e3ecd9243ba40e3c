"""A scheduler's sweep tells its jobs as the queue sees them (issue 56, item 7): each job's id as it is
submitted, with what it runs, then a line each time its state in the queue changes (never a line per poll),
from the driver's own reads of the queue (submitit's watcher), e.g.::

    dpsweep: job 812_0 submitted to slurm: train.epochs=12
    dpsweep: job 812_0 RUNNING
    dpsweep: job 812_1 PENDING
    ...
    dpsweep: job 812_1 COMPLETED

Two jobs one at a time (``launcher.max_parallel=1``): the first (12 epochs, tens of seconds) is RUNNING at the
queue's reads 2, 4, 8 and 16 s after the submission; the second (6 epochs) waits behind it, PENDING at the first
read, made as the jobs are submitted, and RUNNING at a read after the first job's end (the reads start over
then). The clusters are test_clusters.py's (its fixtures, on this machine).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from test_clusters import SGE, SLURM, finished_runs, sge, slurm, sweep  # noqa: F401  (fixtures: sge, slurm)

pytestmark = pytest.mark.cluster
ORDER = ("PENDING", "RUNNING", "COMPLETING", "COMPLETED")  # the states of a job that waits, runs, returns, in turn
# the first long, the second waiting behind it
TWO_JOBS = ["launcher.max_parallel=1", "train.epochs=12,6", "train.progress=false", "tracking.log_model=false"]


def _assert_told(proc: subprocess.CompletedProcess[str], scheduler: str, sweep_dir: Path) -> None:
    """Both jobs named as submitted (the ids of their folders), each state change a line, in order, before
    the job's progress line: the first job seen RUNNING, the second PENDING, both COMPLETED."""
    out = proc.stdout
    assert proc.returncode == 0 and ": 2 finished, 0 skipped, 0 failed" in out, out + proc.stderr
    submitted = re.findall(rf"^dpsweep: job (\S+) submitted to {scheduler}: train\.epochs=(\d+)$", out, re.M)
    assert [epochs for _, epochs in submitted] == ["12", "6"], out
    ids = [job_id for job_id, _ in submitted]
    assert set(ids) <= {p.name for p in (sweep_dir / ".submitit").iterdir() if p.is_dir()}, out
    lines = out.splitlines()
    first_result = next(i for i, line in enumerate(lines) if line.startswith("dpsweep: [1/2]"))
    assert all(lines.index(f"dpsweep: job {job_id} submitted to {scheduler}: {what}") < first_result
               for job_id, what in zip(ids, ["train.epochs=12", "train.epochs=6"], strict=True)), out  # fmt: skip
    states = {}
    for job_id in ids:
        told = [line.rsplit(" ", 1)[1] for line in lines if line.startswith(f"dpsweep: job {job_id} ")]
        states[job_id] = told[1:]  # after its "submitted" line
        assert states[job_id] == [s for s in ORDER if s in states[job_id]], out  # in order, each once: no repeats
        assert states[job_id][-1] == "COMPLETED", out
    long_job, waiting_job = ids
    assert "RUNNING" in states[long_job], out
    # the waiting job's start is told too: the queue is read again 0, 2, 4, 8 ... s after the first job's end
    assert [s for s in states[waiting_job] if s != "COMPLETING"] == ["PENDING", "RUNNING", "COMPLETED"], out
    running_at = lines.index(f"dpsweep: job {long_job} RUNNING")
    assert running_at < first_result, out  # told while it ran, not at the end


@SLURM
@pytest.mark.usefixtures("slurm")
def test_a_slurm_sweep_prints_its_job_ids_and_their_queue_states(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = sweep("launcher=slurm", *TWO_JOBS, f"hydra.sweep.dir={sweep_dir}")
    _assert_told(proc, "slurm", sweep_dir)
    assert len(finished_runs(tmp_path)) == 2


@SGE
@pytest.mark.usefixtures("sge")
def test_an_sge_sweep_prints_its_job_ids_and_their_queue_states(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = sweep("launcher=sge", *TWO_JOBS, f"hydra.sweep.dir={sweep_dir}")
    _assert_told(proc, "sge", sweep_dir)
    assert len(finished_runs(tmp_path)) == 2
