"""launchers/packing.py's trial files: a packed job's directory is named by its trials' overrides (the same
for the job requeued, and known to the driver), and the driver reads the results of the trials that returned."""

from __future__ import annotations

from pathlib import Path

import cloudpickle
import pytest
from hydra.core.utils import JobReturn, JobStatus

from dpsweep.launchers import packing

TRIALS = [["train.seed=0", "sweep.id='s1'"], ["train.seed=1", "sweep.id='s1'"]]


def test_a_packed_jobs_directory_is_its_trials_and_only_theirs(tmp_path: Path) -> None:
    assert packing.work_dir(tmp_path, TRIALS) == packing.work_dir(tmp_path, [list(t) for t in TRIALS])
    other_sweep = [[o.replace("s1", "s2") for o in t] for t in TRIALS]
    assert packing.work_dir(tmp_path, other_sweep) != packing.work_dir(tmp_path, TRIALS)
    assert packing.work_dir(tmp_path, TRIALS[:1]) != packing.work_dir(tmp_path, TRIALS)


def test_the_driver_reads_the_results_of_the_trials_that_returned(tmp_path: Path) -> None:
    assert packing.returned(tmp_path, TRIALS) == [None, None]  # nothing yet (no directory either)
    work = packing.work_dir(tmp_path, TRIALS)
    work.mkdir(parents=True)
    done = JobReturn(overrides=TRIALS[1], status=JobStatus.COMPLETED)
    (work / "trial-1.result").write_bytes(cloudpickle.dumps(done))
    first, second = packing.returned(tmp_path, TRIALS)
    assert first is None and second is not None
    assert second.status == JobStatus.COMPLETED and second.overrides == TRIALS[1]


def test_a_packed_job_asks_for_k_trials_cores_and_memory_and_one_trials_gpus() -> None:
    slurm = {"cpus_per_task": 2, "mem_gb": 4, "gpus_per_node": 1, "timeout_min": 60, "partition": "gpu"}
    assert packing.job_resources(slurm, 4) == slurm | {"cpus_per_task": 8, "mem_gb": 16}
    assert packing.job_resources(slurm, 1) == slurm
    assert packing.job_resources({"cpus_per_task": None, "gpus_per_node": 1}, 3) == {
        "cpus_per_task": None,
        "gpus_per_node": 1,
    }


def test_the_run_says_how_its_trials_share_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert packing.device_sharing(1) == "exclusive"
    assert packing.device_sharing(2) == "time-slicing"  # no MPS control daemon
    (tmp_path / "control").touch()  # the daemon's pipe
    assert packing.device_sharing(2) == "mps" and packing.device_sharing(1) == "exclusive"
