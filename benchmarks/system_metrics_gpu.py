"""Check: what MLflow's system metrics show of GPU memory during training, and whether it follows the batch size.

    .venv/bin/python benchmarks/system_metrics_gpu.py --json system_metrics_gpu.json   # on a CUDA machine
    .venv/bin/python benchmarks/system_metrics_gpu.py --device cpu --batch-sizes 16 64  # the CPU path only

For each batch size B (``--batch-sizes``: 16, 64, 128) and each of ``dp=off`` and ``dp=dpsgd``: one
``dpsweep`` run of the ``cnn`` on digits served at ``--image-size`` px (224, so that the batch holds most
of the memory), ``--epochs`` epochs, in a fresh process, with MLflow's system metrics from the start
(``tracking.system_metrics_after_s=0``) every ``--interval-s`` seconds. It then reads each run's
``system/gpu_0_memory_usage_megabytes`` back from the store (pynvml's reading of the whole card: what the
run's caching allocator reserved, plus CUDA's context) and prints, per run, how many samples were logged
and their largest and last values.

The question it answers (issue 38): a DP run withholds its peak memory because the peak reveals the sizes
of its Poisson batches. If the GPU memory that system metrics log grows with B, it is a coarse form of the
same peak. Measured on an H200 (2026-11-26, analysis/data/system_metrics_gpu_h200.json), before DP runs
withheld it: 4.8, 5.1 and 11.4 GB for DP runs of B = 16, 64 and 128 (2.9, 3.2 and 3.8 GB non-private), so
DP runs now log none (``dpsweep.tracking.monitors.GPU_MEMORY_METRIC``), and this script lists the DP runs that still do.

The CPU twin (``--device cpu``) logs no GPU metrics at all: it checks that this script runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GPU_MEMORY = "system/gpu_0_memory_usage_megabytes"


def run_one(dp: str, batch_size: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    name = f"{dp}_b{batch_size}"
    overrides = ["model=cnn", f"dataset.image_size={args.image_size}", f"train.batch_size={batch_size}",
                 f"train.epochs={args.epochs}", f"train.device={args.device}", f"dp={dp}",
                 "tracking.system_metrics_after_s=0", f"tracking.system_metrics_interval_s={args.interval_s}",
                 "tracking.log_model=false",
                 f"tracking.uri={uri}", "tracking.experiment_name=system_metrics_gpu", f"tracking.run_name={name}",
                 f"hydra.run.dir={workdir / name}"]  # fmt: skip
    if dp == "dpsgd":
        overrides.append("dp.noise_multiplier=1.0")
    done = subprocess.run([sys.executable, "-m", "dpsweep", *overrides], cwd=workdir, text=True,
                          capture_output=True, check=False)  # fmt: skip
    if done.returncode != 0:  # recorded, and shown whole: the other runs go on
        print(f"dpsweep {' '.join(overrides)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}", flush=True)
        return {"dp": dp, "batch_size": batch_size, "failed": done.returncode, "samples": 0, "max_megabytes": None,
                "last_megabytes": None, "system_metric_keys": []}  # fmt: skip
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("system_metrics_gpu")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{name}'")
    run = runs[0]
    history = sorted(client.get_metric_history(run.info.run_id, GPU_MEMORY), key=lambda m: m.step)
    system_keys = sorted(k for k in run.data.metrics if k.startswith("system/"))
    values = [m.value for m in history]
    return {
        "dp": dp, "batch_size": batch_size, "run_id": run.info.run_id, "samples": len(values),
        "gpu_memory_megabytes": values, "max_megabytes": max(values, default=None),
        "last_megabytes": values[-1] if values else None,
        "system_metric_keys": system_keys,
    }  # fmt: skip


def machine() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        try:
            import pynvml

            pynvml.nvmlInit()
            out["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as e:  # the driver's version is informative only
            out["driver"] = f"unknown ({e})"
    else:
        out["cpu"] = platform.processor() or platform.machine()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="system_metrics_gpu_") as tmp:
        for dp in ("off", "dpsgd"):
            for b in args.batch_sizes:
                r = run_one(dp, b, args, Path(tmp))
                rows.append(r)
                print(f"dp={dp:5} B={b:5}: {r['samples']} samples of {GPU_MEMORY}; max {r['max_megabytes']} MB, "
                      f"last {r['last_megabytes']} MB; system metrics: {len(r['system_metric_keys'])} keys",
                      flush=True)  # fmt: skip
    off = [r for r in rows if r["dp"] == "off" and r["max_megabytes"] is not None]
    tracks = len(off) >= 2 and all(a["max_megabytes"] < b["max_megabytes"] for a, b in itertools.pairwise(off))
    dp_logged = [r["batch_size"] for r in rows if r["dp"] == "dpsgd" and r["samples"]]
    verdict = {
        "gpu_memory_grows_with_batch_size": tracks if off else None,
        "dp_runs_logging_gpu_memory": dp_logged,
    }
    print(f"GPU memory grows with the batch size (dp=off): {verdict['gpu_memory_grows_with_batch_size']}; "
          f"DP runs that log it: {dp_logged or 'none'}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "verdict": verdict, "runs": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
