"""Benchmark: several trials per device (``launcher.trials_per_device``, issue 34 item 1), in one run.

    .venv/bin/python benchmarks/packing.py                                   # every section
    .venv/bin/python benchmarks/packing.py --ks 1,2,4,8,16 --json analysis/data/packing_h100.json
    .venv/bin/python benchmarks/packing.py --sections throughput --ks 1,2 --trials 4   # a CPU check

Sections (each a real ``dpsweep -m launcher=local`` sweep into a fresh sqlite store):

- ``context``: the device memory one CUDA process holds outside PyTorch's allocator (context, cuBLAS
  and cuDNN workspaces), after one cnn step in a fresh process: ``mem_get_info`` used less what the
  GPU held before, less ``memory_reserved``. dpsweep plans K trials' shares with it
  (``dpsweep.memory.packing.CUDA_CONTEXT_BYTES``). GPU only.
- ``throughput``: trials per hour of a 16-trial DP ``cnn`` grid (σ x C x seed = 2 x 2 x 4, digits at
  28 px, ``--epochs`` epochs each) run K trials per device for each K of ``--ks``, one job at a time
  (``launcher.max_parallel=1``: one device); the ratio to K = 1 is the gain in trials per GPU-hour.
  Goal (issue 34): at least 5x for some K, on a GPU.
- ``auto``: a memory-bound grid (cnn with 512 hidden units on 224 px inputs, B = 64, DP) with
  ``launcher.trials_per_device=auto``, ``train.memory_model`` fitted from ``--probes`` and
  ``launcher.gpu_memory`` = the card's free memory: the K chosen, the trials' states, and the GPU
  memory in use at its highest (nvidia-smi, every 0.2 s) against K x (predicted peak + context). GPU only.
- ``oom``: the same trials without a memory model (each pass holds its whole Poisson batch, planned
  by nobody), K = auto's K + 1 in one job: the trials that ran out of memory must end FAILED with
  CUDA's error and the others FINISHED. GPU only.

Every figure is written to ``--json`` with the device's name, driver and torch version.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GRID = ["dp.noise_multiplier=0.8,1.2", "dp.max_grad_norm=0.5,1.0", "train.seed=0,1,2,3"]  # 16 trials
BIG = ["dataset.image_size=224", "model.hidden_units=512", "train.batch_size=64", "train.epochs=1"]
BIG_GRID = ["dp.noise_multiplier=0.8,1.2", "train.seed=0,1,2"]  # 6 trials
QUIET = ["train.progress=false", "tracking.log_model=false"]
THROUGHPUT_GOAL = 5.0
SUBMITIT_STAMP = re.compile(r"submitit \w+ \((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\) - (Starting with|Exiting after)")


def dpsweep(folder: Path, *overrides: str) -> tuple[float, list[dict[str, Any]], str, float]:
    """One sweep in ``folder`` (its own sqlite store): wall seconds, its runs, its output, and when it
    started (epoch seconds, for :func:`phases`)."""
    uri = f"sqlite:///{folder}/mlflow.db"
    command = [sys.executable, "-m", "dpsweep", "-m", "launcher=local", "launcher.max_parallel=1",
               "launcher.gpus_per_job=1", *QUIET, f"tracking.uri={uri}", f"hydra.sweep.dir={folder}/multirun",
               *overrides]  # fmt: skip
    t0, started = time.perf_counter(), time.time()
    proc = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode not in (0, 1):  # 1: some trial failed (the OOM section expects that)
        raise SystemExit(f"dpsweep exited {proc.returncode}:\n{out}")
    return wall, runs(uri), out, started


def runs(uri: str) -> list[dict[str, Any]]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("dpsweep")
    found = client.search_runs([experiment.experiment_id]) if experiment else []
    return [{
        "run_id": r.info.run_id, "status": r.info.status, "seconds": (r.info.end_time - r.info.start_time) / 1e3,
        "start": r.info.start_time / 1e3, "end": r.info.end_time / 1e3,
        "device_sharing": r.data.tags.get("device.sharing"), "error": r.data.tags.get("error", "")[:300],
        "test_accuracy": r.data.metrics.get("test_accuracy"), "epsilon": r.data.metrics.get("epsilon"),
    } for r in found if r.info.end_time and r.data.tags.get("sweep.role") != "parent"]  # fmt: skip


def phases(folder: Path, found: list[dict[str, Any]], started: float, wall: float) -> dict[str, float]:
    """Where the sweep's wall time went, in seconds (the parts add up to ``wall``): the driver
    before its first job and after its last, the gaps between jobs (submitting, polling), and within
    each job (submitit's log stamps its start and end) the time to its first run's start (processes,
    imports, config, store), its runs (first start to last end) and after its last run. Also the
    median time from a job's start to each of its runs' starts."""
    from datetime import datetime

    jobs = []
    for log in sorted((folder / "multirun/.submitit").glob("*/*_log.out")):
        stamps = {m[2]: datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                  for m in SUBMITIT_STAMP.finditer(log.read_text())}  # fmt: skip
        if len(stamps) == 2:
            jobs.append((stamps["Starting with"], stamps["Exiting after"]))
    jobs.sort()
    if not jobs or not found:
        return {}
    out = {"driver_before_first_job_s": jobs[0][0] - started,
           "between_jobs_s": sum(b[0] - a[1] for a, b in itertools.pairwise(jobs)),
           "driver_after_last_job_s": started + wall - jobs[-1][1],
           "job_start_to_first_run_s": 0.0, "runs_s": 0.0, "last_run_to_job_end_s": 0.0}  # fmt: skip
    starts: list[float] = []
    for begin, end in jobs:
        inside = [r for r in found if begin - 1 <= r["start"] <= end]
        if not inside:
            continue
        first, last = min(r["start"] for r in inside), max(r["end"] for r in inside)
        out["job_start_to_first_run_s"] += first - begin
        out["runs_s"] += last - first
        out["last_run_to_job_end_s"] += end - last
        starts += [r["start"] - begin for r in inside]
    out["median_job_start_to_run_s"] = sorted(starts)[len(starts) // 2] if starts else 0.0
    return {k: round(v, 2) for k, v in out.items()}


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "cpu_cores": os.cpu_count()}
    if torch.cuda.is_available():
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
        env |= {"device": smi.split(", ")[0], "nvidia_smi": smi, "cuda": torch.version.cuda}
    else:
        import platform

        env["device"] = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    return env


class GpuMemoryWatch:
    """The GPU memory in use at its highest while it runs (nvidia-smi every 0.2 s; no CUDA context here)."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout  # fmt: skip
            if smi.strip():
                self.peak_mib = max(self.peak_mib, int(smi.split()[0]))
            time.sleep(0.2)

    def __enter__(self) -> GpuMemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


CONTEXT_PROBE = """
import json, torch
from dpsweep.config import CNNConfig
from dpsweep.models import classifiers
free0, total = torch.cuda.mem_get_info()  # creates the context: free0 is after it
model = classifiers.build(CNNConfig(), (1, 28, 28), 10).cuda()
x, y = torch.randn(64, 1, 28, 28, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
torch.nn.functional.cross_entropy(model(x), y).backward()
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
print(json.dumps({"used_bytes": total - free, "reserved_bytes": torch.cuda.memory_reserved(), "total_bytes": total}))
"""


def context_section() -> dict[str, Any]:
    before = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True).stdout.split()[0]) * 2**20  # fmt: skip
    out = subprocess.run([sys.executable, "-c", CONTEXT_PROBE], capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    r["used_before_bytes"] = before
    r["outside_allocator_bytes"] = r["used_bytes"] - before - r["reserved_bytes"]
    print(f"context: {r['outside_allocator_bytes'] / 2**20:.0f} MiB outside the allocator per CUDA process "
          f"(reserved {r['reserved_bytes'] / 2**20:.0f} MiB)")  # fmt: skip
    return r


def throughput_section(ks: list[int], trials: int, epochs: int, save: Any = None) -> dict[str, Any]:
    grid = (
        GRID
        if trials == 16
        else ["dp.noise_multiplier=0.8,1.2", f"train.seed={','.join(map(str, range(trials // 2)))}"]
    )
    rows: list[dict[str, Any]] = []
    section: dict[str, Any] = {"grid": grid, "epochs": epochs, "rows": rows}
    for k in ks:
        with tempfile.TemporaryDirectory(prefix=f"packing-k{k}-") as d:
            wall, found, out, started = dpsweep(Path(d), f"launcher.trials_per_device={k}", f"train.epochs={epochs}",
                                                *grid)  # fmt: skip
            where = phases(Path(d), found, started, wall)
        finished = sum(r["status"] == "FINISHED" for r in found)
        row = {"k": k, "trials": len(found), "finished": finished, "wall_s": round(wall, 2),
               "trials_per_hour": round(finished / wall * 3600, 1),
               "median_trial_s": round(sorted(r["seconds"] for r in found)[len(found) // 2], 2) if found else None,
               "device_sharing": sorted({str(r["device_sharing"]) for r in found}), "phases": where}  # fmt: skip
        if finished != trials:
            row["output_tail"] = out[-3000:]
        rows.append(row)
        print(f"throughput: K={k:>2}  {finished}/{len(found)} finished in {wall:7.1f} s  "
              f"{row['trials_per_hour']:8.1f} trials/h; " + ", ".join(f"{n} {v}" for n, v in where.items()),
              flush=True)  # fmt: skip
        if save is not None:
            save("throughput", section)  # each K as it is measured: a run cut short keeps what it measured
    base = next((r["trials_per_hour"] for r in rows if r["k"] == 1), None)
    for r in rows:
        r["vs_k1"] = round(r["trials_per_hour"] / base, 2) if base else None
        print(f"throughput: K={r['k']:>2}  {r['vs_k1']}x the trials per hour of K=1")
    best = max((r["vs_k1"] or 0.0 for r in rows), default=0.0)
    return section | {"best_vs_k1": best, "goal": f">= {THROUGHPUT_GOAL}x (on a GPU)", "met": best >= THROUGHPUT_GOAL}


def fit_model(probes: Path, folder: Path) -> Path:
    out = folder / "memory_model.json"
    command = [sys.executable, "-m", "dpsweep.cli.memory", "fit", "--csv", str(probes), "--model", "cnn",
               "--out", str(out), "--plot", str(folder / "residuals.png")]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return out


def predicted(model: Path, gpu_memory: str, folder: Path) -> dict[str, Any]:
    """dpsweep-memory predict's peak for the big config, as a sweep's trial plans it alone."""
    proc = subprocess.run([sys.executable, "-m", "dpsweep.cli.memory", "predict", "--memory-model", str(model),
                           "--gpu-memory", gpu_memory, "--json", *BIG, "dp.noise_multiplier=0.8"],
                          cwd=folder, capture_output=True, text=True)  # fmt: skip
    return {"returncode": proc.returncode, "stdout": proc.stdout[-4000:], "stderr": proc.stderr[-2000:]}


def auto_section(probes: Path, context: dict[str, Any] | None) -> dict[str, Any]:
    free_mib = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True).stdout.split()[0])  # fmt: skip
    ctx = (context or {}).get("outside_allocator_bytes", 0) / 2**20
    gpu_memory = f"{int(free_mib - ctx)}MiB"  # what one process's allocator may take: the free memory less a context
    with tempfile.TemporaryDirectory(prefix="packing-auto-") as d:
        folder = Path(d)
        model = fit_model(probes, folder)
        with GpuMemoryWatch() as watch:
            wall, found, out, _ = dpsweep(folder, "launcher.trials_per_device=auto", f"train.memory_model={model}",
                                       f"launcher.gpu_memory={gpu_memory}", *BIG, *BIG_GRID)  # fmt: skip
        chosen = [line for line in out.splitlines() if line.startswith("dpsweep: launcher.trials_per_device=auto")]
        prediction = predicted(model, gpu_memory, folder)
    found_k = re.search(r"=auto: (\d+) trials fit", chosen[0]) if chosen else None
    k = int(found_k.group(1)) if found_k else None
    states = {s: sum(r["status"] == s for r in found) for s in {r["status"] for r in found}}
    stdout = prediction["stdout"]
    peak = json.loads(stdout[stdout.index("[") :])[0]["peak_bytes"] if "[" in stdout else None
    expected_mib = k * (peak + ctx * 2**20) / 2**20 if k and peak else None  # K allocator peaks and contexts
    prediction |= {"peak_bytes": peak, "k_trials_expected_mib": expected_mib}
    print(f"auto: K={k} for {gpu_memory}; {states}; GPU memory in use at most {watch.peak_mib} MiB "
          f"(K x (predicted peak {(peak or 0) / 2**20:.0f} MiB + context): {expected_mib or 0:.0f} MiB)")  # fmt: skip
    return {"gpu_memory": gpu_memory, "k": k, "line": chosen, "states": states, "wall_s": round(wall, 1),
            "peak_used_mib": watch.peak_mib, "prediction": prediction, "runs": found,
            "output_tail": out[-3000:] if states.get("FINISHED") != len(found) else ""}  # fmt: skip


def oom_section(k: int) -> dict[str, Any]:
    seeds = ",".join(map(str, range(k)))
    with tempfile.TemporaryDirectory(prefix="packing-oom-") as d, GpuMemoryWatch() as watch:
        wall, found, out, _ = dpsweep(Path(d), f"launcher.trials_per_device={k}", *BIG, "dp.noise_multiplier=0.8",
                                   f"train.seed={seeds}")  # fmt: skip
    states = {s: sum(r["status"] == s for r in found) for s in {r["status"] for r in found}}
    oom = sum("out of memory" in r["error"].lower() for r in found)
    print(f"oom: K={k} without a memory model: {states}; {oom} runs name CUDA out of memory; "
          f"GPU memory in use at most {watch.peak_mib} MiB")  # fmt: skip
    return {"k": k, "states": states, "oom_errors": oom, "wall_s": round(wall, 1), "peak_used_mib": watch.peak_mib,
            "runs": found, "clean": oom >= 1 and states.get("FINISHED", 0) + oom == len(found),
            "output_tail": out[-3000:]}  # fmt: skip


def main() -> int:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="context,throughput,auto,oom")
    p.add_argument("--ks", default="1,2,4,8,16", help="trials per device to time")
    p.add_argument("--trials", type=int, default=16, help="16: the sigma x C x seed grid; fewer: sigma x seed")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--probes", type=Path, default=REPO / "analysis/data/gpu_probes_h100.csv")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import torch

    sections = args.sections.split(",")
    gpu = torch.cuda.is_available()
    result: dict[str, Any] = {"environment": environment(), "date": time.strftime("%Y-%m-%d"), "command": sys.argv}

    def save(name: str, value: Any) -> None:
        result[name] = value
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1, default=str))

    for name in sections:  # in the order given
        if name == "context" and gpu:
            save(name, context_section())
        elif name == "throughput":
            save(name, throughput_section([int(k) for k in args.ks.split(",")], args.trials, args.epochs, save))
        elif name == "auto" and gpu:
            save(name, auto_section(args.probes, result.get("context")))
        elif name == "oom" and gpu:
            save(name, oom_section(((result.get("auto") or {}).get("k") or 2) + 1))
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
