"""K trials per device (``launcher.trials_per_device``) on launcher=local: one job, K trial processes.

Real sweeps through the dpsweep app (``helpers.run_dpsweep``); the job and its trials are real
processes, and one of them is killed outright.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import REPO, run_dpsweep
from mlflow.tracking import MlflowClient

from dpsweep.memory.packing import CUDA_CONTEXT_BYTES
from dpsweep.process import cpu_cores


def _trial_runs(cwd: Path) -> list:  # type: ignore[type-arg]
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    exp = client.get_experiment_by_name("dpsweep")
    return [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("sweep.role") != "parent"]


@pytest.mark.slow
def test_one_job_runs_its_trials_at_once_and_one_trials_failure_spares_the_others(tmp_path: Path) -> None:
    """Four trials in one job: two fail (no MNIST files), one is SIGKILLed mid-training (what the
    OOM killer does: its run ends KILLED), one finishes; each trial is its own process."""
    assert Path.cwd() == tmp_path
    sweep_dir = tmp_path / "sweep"
    killed: list[int] = []
    over = threading.Event()

    def kill_the_long_trial() -> None:
        """The 400-epoch digits trial, once it has checkpointed: the one trial process left."""
        trials = ["pgrep", "-f", "dpsweep[.]launchers[.]packing /"]  # a trial's process: -m ... FILE
        deadline, pids = time.monotonic() + 300, []
        while time.monotonic() < deadline and not over.is_set():
            pids = [int(x) for x in subprocess.run(trials, capture_output=True, text=True).stdout.split()]
            if len(pids) == 1 and list(sweep_dir.rglob("checkpoint.pt")):
                time.sleep(2)
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
                return
            over.wait(0.5)
        for pid in pids:  # the long trial never ran alone: end it, so that the sweep ends and fails below
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_long_trial, daemon=True)
    killer.start()
    proc = run_dpsweep("-m", "launcher=local", "launcher.trials_per_device=4", "dataset=mnist,digits",
                       "train.epochs=1,400", "train.progress=false", "tracking.log_model=false",
                       f"hydra.sweep.dir={sweep_dir}")  # fmt: skip
    over.set()
    killer.join(timeout=60)
    out = proc.stdout + proc.stderr
    assert killed, f"the long trial never ran alone:\n{out}"
    assert proc.returncode == 1, out
    assert "dpsweep: 4 trials in 1 job of up to 4 trials, one device each" in proc.stdout, out
    summary = next(x for x in proc.stdout.splitlines() if x.startswith("dpsweep: sweep "))
    assert ": 1 finished, 0 skipped, 3 failed" in summary, out
    assert "ended with signal SIGKILL and no result" in out, out  # the killed trial's result, named
    assert "#0 :" not in out and "][HYDRA]" not in out, out  # issue 33, item 11: no Hydra lines or prefixes
    runs = _trial_runs(tmp_path)  # the MNIST trials failed before their runs began
    assert sorted(r.info.status for r in runs) == ["FINISHED", "KILLED"], out
    assert len({r.data.tags["job.pid"] for r in runs}) == 2  # a process per trial
    assert {r.data.tags["device.sharing"] for r in runs} == {"time-slicing, 4 trials"}
    assert out.count("none found under data/MNIST/raw") >= 2, out  # each MNIST trial's own error
    [done] = [r for r in runs if r.info.status == "FINISHED"]
    assert done.data.params["dataset.name"] == "digits" and "test_accuracy" in done.data.metrics
    assert len(list((sweep_dir / ".submitit").glob("[0-9]*"))) == 1  # one job held them all


def _cnn_model(folder: Path) -> Path:
    """A memory model of the cnn fitted on the committed CPU-twin probes."""
    out = folder / "memory_model.json"
    probes = REPO / "analysis/data/cpu_probes_digits.csv"
    fit = [sys.executable, "-m", "dpsweep.cli.memory", "fit", "--csv", str(probes), "--model", "cnn",
           "--out", str(out), "--plot", str(folder / "residuals.png")]  # fmt: skip
    proc = subprocess.run(fit, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.mark.slow
def test_dpsweep_plan_shows_the_k_auto_picks_from_the_predicted_peaks(tmp_path: Path) -> None:
    """A budget made for exactly 3 trials of the predicted peak (plus a context each beyond the first):
    auto picks K = 3, and dpsweep-plan says how many device jobs the sweep takes."""
    model = _cnn_model(tmp_path)
    predict = [sys.executable, "-m", "dpsweep.cli.memory", "predict", "--memory-model", str(model),
               "--gpu-memory", "1GiB", "--json"]  # fmt: skip
    proc = subprocess.run(predict, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    peak = json.loads(proc.stdout[proc.stdout.index("[") :])[0]["peak_bytes"]
    budget = int(3 * peak + 2 * CUDA_CONTEXT_BYTES + CUDA_CONTEXT_BYTES // 2)  # 3 shares hold a peak; 4 do not
    assert (budget - 3 * CUDA_CONTEXT_BYTES) / 4 < peak <= (budget - 2 * CUDA_CONTEXT_BYTES) / 3
    plan = [sys.executable, "-m", "dpsweep.cli.plan", "launcher=slurm", "launcher.trials_per_device=auto",
            f"train.memory_model={model}", f"launcher.gpu_memory={budget}B", "dp.noise_multiplier=0.8,1.2",
            "train.seed=0,1,2", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]  # fmt: skip
    proc = subprocess.run(plan, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        f"trials per device: 3 (auto: the most whose predicted peaks fit {budget}B together); "
        "6 jobs to run take 2 device jobs" in proc.stdout
    ), proc.stdout + proc.stderr
    # auto with a memory model but no budget to fit the trials in: refused before any job, naming the key
    unbounded = [arg for arg in plan if not arg.startswith("launcher.gpu_memory=")]
    proc = subprocess.run(unbounded, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "launcher.gpu_memory=None is invalid: the GPU memory" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_an_auto_sweep_gives_its_k_to_every_trial(tmp_path: Path) -> None:
    """launcher=local with auto on this machine: K is capped by its CPU cores, printed, and the trials run
    K at a time, tagged so."""
    assert Path.cwd() == tmp_path
    model = _cnn_model(tmp_path)
    k = min(cpu_cores(), 2)
    proc = run_dpsweep("-m", "launcher=local", "launcher.trials_per_device=auto", f"train.memory_model={model}",
                       "launcher.gpu_memory=80GB", "dp.noise_multiplier=0.8,1.2", "train.epochs=1",
                       "train.progress=false", "tracking.log_model=false")  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"dpsweep: launcher.trials_per_device=auto: {k} trials fit 80GB together" in proc.stdout, out
    runs = _trial_runs(tmp_path)
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"], out
    sharing = "exclusive" if k == 1 else f"time-slicing, {k} trials"
    assert {r.data.tags["device.sharing"] for r in runs} == {sharing}
