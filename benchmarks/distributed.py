"""Benchmark: one run across 1, 2 and 4 ranks (``train.devices``) on this machine, end to end.

    .venv/bin/python benchmarks/distributed.py                 # about 2 minutes on 2 CPU cores
    .venv/bin/python benchmarks/distributed.py --device cuda --devices 1,2 --json analysis/data/distributed_gpu.json

Each count runs ``dpsweep train.devices=N`` (digits, cnn, B = 64, DP-SGD through Opacus, 4 epochs) as
a user would, and records the run's ε (the same for every count: the ranks' ledger is one process's),
its test accuracy, the command's wall time, and the median seconds of an epoch after the first
(printed by rank 0), with the examples a second that makes (N = 1,437 examples an epoch, in
expectation). On the CPU the ranks are gloo processes of one thread each sharing the machine's cores,
against one process with torch's own threads: the figure is the cost of the distributed path there,
not a speed-up; the issue's speed-up target is for GPUs (the VGG16 head at 224 px, 2 devices against 1).

Writes ``--json`` (default ``analysis/data/distributed_cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

EPOCH = re.compile(r"epoch (\d+)/\d+ .*\(([\d.]+) s\)")
SUMMARY = re.compile(r"test_accuracy=([\d.]+)\s+ε=([\d.]+)")
N_TRAIN = 1437  # digits' training split: the examples an epoch draws, in expectation


def run(devices: int, epochs: int, device: str, folder: str) -> dict[str, float]:
    """One ``dpsweep`` run on ``devices`` ranks, in ``folder``: its ε, accuracy, wall time and epoch seconds."""
    store = f"sqlite:///{folder}/mlflow.db"
    command = [
        str(Path(sys.executable).parent / "dpsweep"), f"train.devices={devices}", f"train.epochs={epochs}",
        f"train.device={device}", "train.progress=false", "tracking.log_model=false", f"tracking.uri={store}",
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=folder)
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    seconds = {int(m[1]): float(m[2]) for m in EPOCH.finditer(done.stdout)}
    summary = SUMMARY.findall(done.stdout)[-1]
    epoch_s = statistics.median(s for e, s in seconds.items() if e > 1)
    return {
        "devices": devices, "epsilon": float(summary[1]), "test_accuracy": float(summary[0]), "wall_s": wall_s,
        "epoch_s": epoch_s, "examples_per_s": N_TRAIN / epoch_s,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="1,2,4", help="comma-separated rank counts")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", default="analysis/data/distributed_cpu.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpsweep-distributed-") as tmp:
        for devices in (int(d) for d in args.devices.split(",")):
            row = run(devices, args.epochs, args.device, tmp)
            rows.append(row)
            print(f"{devices} rank(s): ε = {row['epsilon']:.3f}, test accuracy {row['test_accuracy']:.4f}, "
                  f"{row['epoch_s']:.2f} s an epoch ({row['examples_per_s']:.0f} examples/s), "
                  f"{row['wall_s']:.1f} s in all", flush=True)  # fmt: skip
    base = rows[0]["examples_per_s"]
    for row in rows:
        row["speedup"] = row["examples_per_s"] / base
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{platform.machine()}, {os.cpu_count()} cores"
    record = {
        "machine": f"{name}, Python {platform.python_version()}, torch {torch.__version__}",
        "epochs": args.epochs, "device": args.device, "runs": rows,
    }  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{record['machine']}; speed-up against 1 rank: "
          + ", ".join(f"{r['devices']}: {r['speedup']:.2f}x" for r in rows) + f"; wrote {args.json}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
