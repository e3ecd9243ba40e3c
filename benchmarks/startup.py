"""Benchmark: how long each command takes to start, against a bare ``python -c pass`` in the same run.

    .venv/bin/python benchmarks/startup.py             # median of 3 runs of each command
    .venv/bin/python benchmarks/startup.py --repeat 5  # more runs (steadier medians)

Each command runs as its own process, from a temporary directory, with its output discarded; the
figure is the median wall time. Goals (issue 14), each measured against the bare interpreter in the
same run: ``--help`` of every command and an ε query within 1.5 s of it, and a ``dpsweep-plan`` of
the demo sweep within 3 s. It exits 1 if a goal is missed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
# name -> (argv, the goal: seconds above bare Python, or None for the record only)
COMMANDS: dict[str, tuple[list[str], float | None]] = {
    "dpsweep-epsilon --help": ([str(BIN / "dpsweep-epsilon"), "--help"], 1.5),
    "dpsweep-plan --help": ([str(BIN / "dpsweep-plan"), "--help"], 1.5),
    "dpsweep-plan experiment=demo": ([str(BIN / "dpsweep-plan"), "experiment=demo"], 3.0),
    "dpsweep-epsilon (a query)": ([str(BIN / "dpsweep-epsilon"), "-s", "60000", "-b", "256", "-n", "1.1", "-e", "10"],
                                  1.5),
    "dpsweep-report --help": ([str(BIN / "dpsweep-report"), "--help"], 1.5),
    "dpsweep-memory --help": ([str(BIN / "dpsweep-memory"), "--help"], 1.5),
    "dpsweep-runs --help": ([str(BIN / "dpsweep-runs"), "--help"], 1.5),
    "dpsweep --help": ([str(BIN / "dpsweep"), "--help"], 1.5),
}  # fmt: skip


def seconds(argv: list[str], cwd: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per command (default 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dpsweep-startup-") as cwd:
        bare = seconds([sys.executable, "-c", "pass"], cwd, args.repeat)
        print(f"bare python -c pass: {bare:.2f} s (median of {args.repeat})")
        missed = []
        for name, (argv, goal) in COMMANDS.items():
            took = seconds(argv, cwd, args.repeat)
            verdict = "" if goal is None else ("  PASS" if took - bare <= goal else "  FAIL")
            target = f" (goal: within {goal:g} s)" if goal is not None else ""
            print(f"  {name:<30} {took:6.2f} s, {took - bare:+6.2f} s over bare python{target}{verdict}")
            if verdict == "  FAIL":
                missed.append(name)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
