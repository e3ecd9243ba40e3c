"""T trials per job, one after another in its process (``launcher.trials_per_job``, issue 59 item 4), on
launcher=local: real sweeps through the dpsweep app (``helpers.run_dpsweep``), real job processes, a real
sqlite MLflow store each."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_dpsweep, runs_of
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

FAST = ["train.epochs=1", "train.progress=false", "tracking.log_model=false"]
GRID = ["dp.noise_multiplier=0.8,1.2", "train.seed=0,1"]


def _sweep(folder: Path, *args: str) -> tuple[str, list[Run], Path]:
    """The sweep's output, its trials' runs and its submitit folder (a store and a sweep folder of its own)."""
    folder.mkdir(parents=True, exist_ok=True)
    sweep_dir = folder / "sweep"
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    proc = run_dpsweep("-m", "launcher=local", *args, *FAST, f"hydra.sweep.dir={sweep_dir}", f"tracking.uri={uri}")
    out = proc.stdout + proc.stderr
    runs = [r for r in runs_of(MlflowClient(uri), "dpsweep") if r.data.tags.get("sweep.role") != "parent"]
    return (f"exit {proc.returncode}\n{out}", runs, sweep_dir / ".submitit")


@pytest.mark.slow
def test_two_trials_a_job_run_as_half_the_jobs_with_the_same_results(tmp_path: Path) -> None:
    """Four trials at T = 2: two submitit jobs, two processes, four FINISHED runs whose ε and accuracy
    equal those of the same sweep at T = 1 (CPU training is deterministic from the seed)."""
    out, runs, submitit = _sweep(tmp_path / "t2", "launcher.trials_per_job=2", *GRID)
    assert out.startswith("exit 0"), out
    assert "dpsweep: 4 trials in 2 jobs of up to 2 trials, one after another in each job's process" in out, out
    assert len(list(submitit.glob("[0-9]*"))) == 2, out  # a submitit job a pair of trials
    assert len({r.data.tags["job.pid"] for r in runs}) == 2  # a process a job, its trials in turn
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 4, out
    alone_out, alone, alone_submitit = _sweep(tmp_path / "t1", *GRID)
    assert alone_out.startswith("exit 0"), alone_out
    assert len(list(alone_submitit.glob("[0-9]*"))) == 4 and len({r.data.tags["job.pid"] for r in alone}) == 4

    def figures(found: list[Run]) -> dict[tuple[str, str], tuple[float, float]]:
        return {
            (r.data.params["dp.noise_multiplier"], r.data.params["train.seed"]): (
                r.data.metrics["epsilon"],
                r.data.metrics["test_accuracy"],
            )
            for r in found
        }

    assert len({eps for eps, _ in figures(runs).values()}) == 2  # two noise levels: two ε
    assert figures(runs) == figures(alone)


@pytest.mark.slow
def test_a_failing_trial_spares_the_next_trial_of_its_job(tmp_path: Path) -> None:
    """One job of two trials: the first fails in the job (no MNIST files here, which only the job's data
    loading finds), the second still trains to FINISHED in the same process."""
    out, runs, submitit = _sweep(tmp_path, "launcher.trials_per_job=2", "dataset=mnist,digits")
    assert out.startswith("exit 1"), out  # a failed trial fails the sweep, as it does at T = 1
    assert "none found under data/MNIST/raw" in out, out  # the MNIST trial's own error
    summary = next(x for x in out.splitlines() if x.startswith("dpsweep: sweep "))
    assert ": 1 finished, 0 skipped, 1 failed" in summary, out
    assert len(list(submitit.glob("[0-9]*"))) == 1, out  # one job held both
    [done] = runs  # the MNIST trial failed before its run began
    assert done.info.status == "FINISHED" and done.data.params["dataset.name"] == "digits", out


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["launcher=local", "launcher.trials_per_job=0"], "launcher.trials_per_job=0 is invalid: a whole number"),
        (["launcher=local", "launcher.trials_per_job=-3"], "launcher.trials_per_job=-3 is invalid: a whole number"),
        (
            ["launcher=local", "launcher.trials_per_job=two"],
            "launcher.trials_per_job='two' is invalid: a key and value of the config schema (Value 'two' of type "
            "'str' could not be converted to Integer)",
        ),
        (["launcher.trials_per_job=2"], "launcher.trials_per_job=2 is invalid: 1 with launcher=inline"),
        (
            ["launcher=local", "launcher.trials_per_job=2", "launcher.trials_per_device=2"],
            "launcher.trials_per_job=2 is invalid: 1 with launcher.trials_per_device=2",
        ),
    ],
)
def test_bad_trials_per_job_exit_2_before_any_job(tmp_path: Path, args: list[str], said: str) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = run_dpsweep("-m", *args, "train.seed=0,1", *FAST, f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 2 and said in proc.stderr, proc.stdout + proc.stderr
    assert not (sweep_dir / ".submitit").exists()
