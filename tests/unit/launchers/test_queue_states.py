"""The lines of a scheduler's sweep about its jobs (issue 56, item 7), without a scheduler: squeue's answers
read by dpsweep's own watcher (``SqueueInfoWatcher.read_info``, as its ``update`` does after each call), and
the lines :class:`QueueStates` prints from them. The real schedulers' are in
tests/system/test_cluster_progress.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dpsweep.launchers.hydra_launchers import QueueStates, SqueueInfoWatcher, swept


@dataclass
class Job:
    """What QueueStates reads of a submitit job: its id and its watcher."""

    job_id: str
    watcher: SqueueInfoWatcher


def _squeue_says(watcher: SqueueInfoWatcher, text: str) -> None:
    watcher._info_dict.update(watcher.read_info(text))  # what InfoWatcher.update does with squeue's output


def test_a_line_a_change_of_state_never_one_a_poll(capsys: pytest.CaptureFixture[str]) -> None:
    watcher = SqueueInfoWatcher(delay_s=60)
    jobs = [Job("812_0", watcher), Job("812_1", watcher)]
    for job in jobs:
        watcher.register_job(job.job_id)
    queue = QueueStates("slurm")
    common = ["launcher=slurm", "sweep.id=s1"]  # the sweeper's own key left out too
    trials = [[[*common, "train.epochs=12"]], [[*common, "train.epochs=1"]]]
    queue.submitted(jobs, trials)
    for answer in ("812_0|PENDING\n812_1|PENDING", "812_0|RUNNING\n812_1|PENDING", "812_0|RUNNING\n812_1|PENDING"):
        _squeue_says(watcher, answer)
        for job in jobs:
            queue.seen(job)
            queue.seen(job)  # the driver's next poll, the queue not read again: no line
    queue.ended(jobs[0], returned=True)  # its result came before the queue told its end
    _squeue_says(watcher, "812_1|CANCELLED")
    queue.seen(jobs[1])
    queue.ended(jobs[1], returned=False)
    assert capsys.readouterr().out.splitlines() == [
        "dpsweep: job 812_0 submitted to slurm: train.epochs=12",
        "dpsweep: job 812_1 submitted to slurm: train.epochs=1",
        "dpsweep: job 812_0 PENDING",
        "dpsweep: job 812_1 PENDING",
        "dpsweep: job 812_0 RUNNING",
        "dpsweep: job 812_0 COMPLETED",
        "dpsweep: job 812_1 CANCELLED",
    ]


def test_a_job_that_left_the_queue_without_a_result_failed(capsys: pytest.CaptureFixture[str]) -> None:
    """squeue no longer lists it (the watcher's GONE): not a state to print; it ended FAILED."""
    watcher = SqueueInfoWatcher(delay_s=60)
    job = Job("9", watcher)
    watcher.register_job(job.job_id)
    queue = QueueStates("slurm")
    _squeue_says(watcher, "9|RUNNING")
    queue.seen(job)
    _squeue_says(watcher, "")
    queue.seen(job)
    queue.ended(job, returned=False)
    assert capsys.readouterr().out.splitlines() == ["dpsweep: job 9 RUNNING", "dpsweep: job 9 FAILED"]


def test_a_job_is_named_by_what_tells_it_from_the_others() -> None:
    trials = [["launcher=sge", "dp.noise_multiplier=0.8", "train.seed=0"], ["launcher=sge", "dp.noise_multiplier=1.2"]]
    own = swept(trials)
    assert [own(t) for t in trials] == [["dp.noise_multiplier=0.8", "train.seed=0"], ["dp.noise_multiplier=1.2"]]
    assert swept(trials[:1])(trials[0]) == []  # a job alone: its id says it
