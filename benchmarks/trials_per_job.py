"""Benchmark: start-up per trial with ``launcher.trials_per_job`` = 1 and 3 (issue 59, item 4), in one run.

    .venv/bin/python benchmarks/trials_per_job.py              # T = 1 and 3, 2 repeats each, JSON committed
    .venv/bin/python benchmarks/trials_per_job.py --repeat 1   # one sweep of each

Each sweep is ``dpsweep -m launcher=local train.seed=0,...,5 train.epochs=1`` (digits, ``cnn``, DP-SGD; one job
at a time, ``launcher.max_parallel=1``) with ``launcher.trials_per_job=T``, in a folder and MLflow store of its
own, the two Ts alternated so that the machine's changing load falls alike on both. A trial's time is split
in two from the runs' own MLflow timestamps, sorted by start: its **run** (``start_time`` to ``end_time``: the
store, tracking, data, model and training; ``benchmarks/job_startup.py`` puts the first step 0.2-0.3 s after
the run's creation) and its **start-up**, the gap from the previous run's end (the first trial's: from the
driver's ``N jobs to run`` line, read as it is printed) to its run's start: the driver's collecting of the
previous job and submitting of the next, and the job process's start, imports and config. At T = 1 every
trial pays a process's start-up; at T = 3 the second and third trial of a job pay only their own Hydra job
and config. Expected: about (start-up)/T + (a trial's own set-up) per trial, so halved at T = 3.

Reported: each sweep's start-up per trial (mean gap), run time per trial, wall time per trial (the driver's
first line of jobs to its summary, over 6), medians over repeats, and the ratios T = 3 over T = 1. The JSON
goes to ``analysis/data/trials_per_job.json`` with the machine and its load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
OUT = Path(__file__).resolve().parents[1] / "analysis" / "data" / "trials_per_job.json"
TRIALS = 6
SWEEP = ["-m", "launcher=local", "launcher.max_parallel=1", f"train.seed={','.join(map(str, range(TRIALS)))}",
         "train.epochs=1", "train.progress=false", "tracking.log_model=false"]  # fmt: skip


def sweep(folder: Path, t: int) -> dict[str, Any]:
    """One sweep at ``launcher.trials_per_job=t``: its start-up, run and wall time per trial, in seconds."""
    from mlflow.tracking import MlflowClient

    folder.mkdir(parents=True)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    args = [str(BIN / "dpsweep"), *SWEEP, f"launcher.trials_per_job={t}", f"hydra.sweep.dir={folder / 'sweep'}",
            f"tracking.uri={uri}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.Popen(args, cwd=folder, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = last = None
    lines = []
    for line in proc.stdout:  # each line's time as the driver prints it (it flushes each)
        lines.append(line)
        if " to run (sweep " in line:
            first = time.time()
        if line.startswith("dpsweep: sweep "):
            last = time.time()
    if proc.wait() != 0 or first is None or last is None:
        raise SystemExit(f"the sweep at T = {t} failed:\n{''.join(lines)}")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("dpsweep")
    assert exp is not None
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("sweep.role") != "parent"]
    runs.sort(key=lambda r: r.info.start_time)
    assert len(runs) == TRIALS and all(r.info.status == "FINISHED" for r in runs), [r.info.status for r in runs]
    starts = [r.info.start_time / 1000 for r in runs]
    ends = [r.info.end_time / 1000 for r in runs]
    gaps = [starts[0] - first, *(s - e for s, e in zip(starts[1:], ends[:-1], strict=True))]
    return {
        "startup_per_trial_s": round(statistics.mean(gaps), 3),
        "startup_s": [round(g, 3) for g in gaps],
        "run_per_trial_s": round(statistics.mean(e - s for s, e in zip(starts, ends, strict=True)), 3),
        "wall_per_trial_s": round((last - first) / TRIALS, 3),
        "processes": len({r.data.tags.get("job.pid") for r in runs}),
        "epsilon": sorted({round(r.data.metrics["epsilon"], 6) for r in runs}),
    }


def machine() -> dict[str, Any]:
    import importlib.metadata as md

    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())  # fmt: skip
    out: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                           "platform": platform.platform()}  # fmt: skip
    for pkg in ("torch", "mlflow", "opacus", "hydra-core", "submitit"):
        out[pkg] = md.version(pkg)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="sweeps of each T, alternated")
    parser.add_argument("--out", type=Path, default=OUT)
    a = parser.parse_args()
    info = machine() | {"load_average_before": [round(x, 2) for x in os.getloadavg()]}
    results: dict[int, list[dict[str, Any]]] = {1: [], 3: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeat):
            for t in (1, 3):
                results[t].append(sweep(Path(tmp) / f"t{t}-{i}", t))
                print(f"T = {t}, repeat {i}: {results[t][-1]}", flush=True)
    info["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    keys = ("startup_per_trial_s", "run_per_trial_s", "wall_per_trial_s")
    med = {t: {k: round(statistics.median(r[k] for r in rs), 3) for k in keys} for t, rs in results.items()}
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=OUT.parents[2]).stdout
    report = {
        "machine": info,
        "revision": rev.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "workload": "dpsweep " + " ".join(SWEEP) + " launcher.trials_per_job=T",
        "trials": TRIALS,
        "repeat": a.repeat,
        "startup": "from the previous run's end (the first: the driver's 'N jobs to run' line) to the run's start",
        "median": {f"T={t}": m for t, m in med.items()},
        "ratio_T3_over_T1": {k: round(med[3][k] / med[1][k], 3) for k in keys},
        "sweeps": {f"T={t}": rs for t, rs in results.items()},
    }
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"median": report["median"], "ratio_T3_over_T1": report["ratio_T3_over_T1"]}, indent=1))


if __name__ == "__main__":
    main()
