"""Benchmark: what the tracking child process (issue 19) bought, against logging in the run's own process
on MLflow's asynchronous logging (issue 57), on the default workload: a sweep on the local launcher.

    .venv/bin/python benchmarks/tracking_process.py            # 8 jobs, 1 epoch each: about 6 min on 2 cores
    .venv/bin/python benchmarks/tracking_process.py --jobs 16  # a longer sweep

The two variants are two commits, side by side: ``--child`` (the last with the tracking process) and
``--in-process`` (the one that removed it; the diff between them is that change only). Each is
extracted with ``git archive`` into a temporary directory laid out as the installed package is, and
put first on ``PYTHONPATH``, so that neither sees the working tree (nor anyone's edits under way).

Measured, in one run of this script, the variants interleaved (child, in-process, in-process, child
... over ``--rounds``) so that a drift in the machine's load falls on both:

- a sweep's wall time: ``dpsweep -m launcher=local launcher.max_parallel=2 train.epochs=1
  train.seed=0,...,N-1``, each sweep in a fresh directory with its own sqlite store;
- each job's start to its first step: from its process's start (the run's tag ``run.process``, which
  names the process's start in clock ticks since boot) to its first metric (the memory stages, measured
  at the first optimizer step);
- a single ``dpsweep train.epochs=1`` (the demo's unit of work), wall time.

Writes ``analysis/data/tracking_process.json`` with the machine (CPU model, cores, load average
before and after), the versions and the commits, and prints the ratios (child / in-process).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHILD = "16e17d87391c56d2cd576f266d8fbe8ce76b53c7"  # the last commit with the tracking child process
IN_PROCESS = "6988d9623acbe28c87dbcae83424ef3ee19006dd"  # the commit that removed it (its only change)
OUT = REPO / "analysis" / "data" / "tracking_process.json"


def tree(rev: str, into: Path) -> Path:
    """The package at ``rev``, laid out as installed (``pyproject.toml``'s package-dir): a
    ``PYTHONPATH`` entry."""
    src, pkg = into / "src", into / "pkg"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "dpsweep", "launchers", "conf", "analysis"],
                             capture_output=True, check=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    shutil.copytree(src / "dpsweep", pkg / "dpsweep")
    for name, where in (("launchers", "launchers"), ("conf", "conf"), ("analysis", "analysis")):
        shutil.copytree(src / name, pkg / "dpsweep" / where)
    shutil.copytree(src / "launchers" / "hydra_plugins", pkg / "hydra_plugins")
    return pkg


def environment(pkg: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DPSWEEP_"))}
    return env | {"PYTHONPATH": str(pkg), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return took


def boot_s() -> float:
    stat = Path("/proc/stat").read_text().splitlines()
    return next(float(line.split()[1]) for line in stat if line.startswith("btime"))


def first_steps_s(db: Path) -> list[float]:
    """Each job's seconds from its process's start to its first metric (not the sweep's parent run's)."""
    ticks = os.sysconf("SC_CLK_TCK")
    con = sqlite3.connect(db)
    rows = con.execute(
        "select t.value, min(m.timestamp) from tags t join metrics m on m.run_uuid = t.run_uuid "
        "where t.key = 'run.process' and t.run_uuid not in "
        "(select run_uuid from tags where key = 'sweep.role' and value = 'parent') group by t.run_uuid"
    ).fetchall()
    con.close()
    out = []
    for process, first_ms in rows:
        start_ticks = int(process.split("@")[0].rsplit(":", 1)[1])
        out.append(first_ms / 1000 - (boot_s() + start_ticks / ticks))
    return sorted(out)


def sweep(pkg: Path, jobs: int, epochs: int) -> tuple[float, list[float]]:
    with tempfile.TemporaryDirectory(prefix="dpsweep-bench-sweep-") as cwd:
        seeds = ",".join(str(s) for s in range(jobs))
        argv = [str(BIN / "dpsweep"), "-m", "launcher=local", "launcher.max_parallel=2", f"train.epochs={epochs}",
                f"train.seed={seeds}", f"tracking.uri=sqlite:///{cwd}/mlflow.db"]  # fmt: skip
        took = timed(argv, Path(cwd), environment(pkg))
        firsts = first_steps_s(Path(cwd) / "mlflow.db")
    if len(firsts) != jobs:
        raise SystemExit(f"{len(firsts)} of {jobs} jobs logged a metric")
    return took, firsts


def single(pkg: Path, epochs: int) -> float:
    with tempfile.TemporaryDirectory(prefix="dpsweep-bench-run-") as cwd:
        argv = [str(BIN / "dpsweep"), f"train.epochs={epochs}", f"tracking.uri=sqlite:///{cwd}/mlflow.db"]
        return timed(argv, Path(cwd), environment(pkg))


def machine() -> dict[str, object]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    versions = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(*(m.version(p) for p in "
         "('torch', 'mlflow', 'opacus', 'hydra-core')))"], capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return {
        "cpu_model": model, "cores": os.cpu_count(), "python": platform.python_version(),
        "torch": versions[0], "mlflow": versions[1], "opacus": versions[2], "hydra_core": versions[3],
        "kernel": platform.release(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=8, help="jobs per sweep (default 8)")
    parser.add_argument("--epochs", type=int, default=1, help="train.epochs of each job (default 1)")
    parser.add_argument("--rounds", type=int, default=1, help="sweeps per variant, interleaved (default 1)")
    parser.add_argument("--singles", type=int, default=2, help="single runs per variant, interleaved (default 2)")
    parser.add_argument("--child", default=CHILD, help="the commit with the tracking process")
    parser.add_argument("--in-process", default=IN_PROCESS, help="the commit that logs in process")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--machine", default=f"{os.cpu_count()}-core {platform.node()}", help="the machine, in words")
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.perf_counter()
    sweeps: dict[str, list[float]] = {"child": [], "in_process": []}
    firsts: dict[str, list[float]] = {"child": [], "in_process": []}
    singles: dict[str, list[float]] = {"child": [], "in_process": []}
    with tempfile.TemporaryDirectory(prefix="dpsweep-bench-trees-") as trees:
        pkgs = {"child": tree(args.child, Path(trees) / "child"),
                "in_process": tree(args.in_process, Path(trees) / "in_process")}  # fmt: skip
        orders = [("child", "in_process"), ("in_process", "child")]  # A B, then B A: drift falls on both
        for i in range(args.singles):
            for variant in orders[i % 2]:
                singles[variant].append(single(pkgs[variant], args.epochs))
                print(f"single run, {variant}: {singles[variant][-1]:.1f} s", flush=True)
        for i in range(args.rounds):
            for variant in orders[i % 2]:
                took, steps = sweep(pkgs[variant], args.jobs, args.epochs)
                sweeps[variant].append(took)
                firsts[variant].extend(steps)
                print(f"sweep of {args.jobs}, {variant}: {took:.1f} s; start to first step: median "
                      f"{statistics.median(steps):.2f} s", flush=True)  # fmt: skip
    load_after = os.getloadavg()
    median = {k: {"sweep_wall_s": statistics.median(sweeps[k]), "first_step_s": statistics.median(firsts[k]),
                  "single_run_wall_s": statistics.median(singles[k])} for k in sweeps}  # fmt: skip
    ratio = {key: median["child"][key] / median["in_process"][key] for key in median["child"]}
    result = {
        "what": "the tracking child process against in-process logging on MLflow's asynchronous logging; "
        "ratios are child / in-process (below 1: the child is faster)",
        "workload": f"dpsweep -m launcher=local launcher.max_parallel=2 train.epochs={args.epochs} "
        f"train.seed=0..{args.jobs - 1} (digits, cnn, DP-SGD defaults), fresh sqlite store each",
        "commits": {"child": args.child, "in_process": args.in_process},
        "machine": {"name": args.machine}
        | machine()
        | {"load_average_before": load_before, "load_average_after": load_after},
        "seconds": {"sweep_wall_s": sweeps, "first_step_s": firsts, "single_run_wall_s": singles},
        "median": median,
        "ratio_child_over_in_process": ratio,
        "benchmark_wall_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (1 min), on {os.cpu_count()} cores")
    for key, value in ratio.items():
        print(f"{key}: child {median['child'][key]:.2f} s, in process {median['in_process'][key]:.2f} s, "
              f"child / in process = {value:.3f}")  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
