"""Benchmark: ``dpsweep-plan`` of large grids (issue 39, item 13): wall time and peak memory of the
command in a fresh process, imports included, by the number of jobs.

    .venv/bin/python benchmarks/plan_scale.py                          # 500 and 2,000 jobs
    .venv/bin/python benchmarks/plan_scale.py --jobs 10000 --json analysis/data/plan_scale_cpu.json

The grid is seeds × 4 σ × 2 learning rates on digits (every job a distinct config, so each is
composed, checked, hashed and accounted): ``train.seed=range(N/8)``. The goal is the issue's: a grid
of 10,000 planned in seconds; the script prints the figure and says whether 10,000 jobs would take
at most ``GOAL_S`` at the measured rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 60.0  # for 10,000 jobs
BIN = Path(sys.executable).parent


def plan_once(n_jobs: int) -> dict[str, float]:
    """One ``dpsweep-plan --json`` of ``n_jobs`` jobs in a fresh process: seconds and peak RSS."""
    seeds = max(1, n_jobs // 8)
    grid = [f"train.seed=range({seeds})", "dp.noise_multiplier=0.8,1.0,1.2,1.5", "optimizer.lr=0.01,0.05"]
    with tempfile.TemporaryDirectory(prefix="dpsweep-plan-scale-") as cwd:
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        done = subprocess.run([BIN / "dpsweep-plan", "--json", *grid], cwd=cwd, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    rows = len(json.loads(done.stdout))
    return {"jobs": rows, "seconds": round(seconds, 2), "peak_rss_bytes": max(before, peak_kib) * 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", default="500,2000", help="comma-separated grid sizes (default 500,2000)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    sizes = [int(n) for n in args.jobs.split(",")]
    results = [plan_once(n) for n in sizes]
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(f"machine: {machine}")
    for r in results:
        mib = r["peak_rss_bytes"] / 2**20
        print(f"dpsweep-plan of {r['jobs']:>6} jobs: {r['seconds']:7.2f} s, peak RSS {mib:.0f} MiB")
    small, large = results[0], results[-1]
    per_job_s = (large["seconds"] - small["seconds"]) / max(1, large["jobs"] - small["jobs"]) if len(results) > 1 else (
        large["seconds"] / large["jobs"]
    )  # fmt: skip
    fixed_s = small["seconds"] - per_job_s * small["jobs"]
    at_10k = fixed_s + per_job_s * 10_000
    ok = at_10k <= GOAL_S
    print(f"per job {per_job_s * 1000:.1f} ms, fixed {fixed_s:.1f} s: 10,000 jobs in about {at_10k:.0f} s "
          f"(goal <= {GOAL_S:.0f} s): {'met' if ok else 'missed'}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "date": time.strftime("%Y-%m-%d"), "runs": results,
                                         "per_job_s": per_job_s, "fixed_s": fixed_s, "at_10000_s": at_10k,
                                         "goal_s": GOAL_S, "met": ok}, indent=1) + "\n")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
