"""Benchmark: what two pieces of start-up and exit machinery buy on the default workload (issue 57, item 3).

    .venv/bin/python benchmarks/startup_machinery.py                 # the sweep both ways, and the side figures
    .venv/bin/python benchmarks/startup_machinery.py --jobs 4        # a smaller sweep (a quick look)

The pieces: (1) the *fast exit*, ending a command's or a sweep job's process after the interpreter's
shutdown steps that programs rely on (threading's, then atexit's) but without its teardown
(``os._exit``), which CPython exposes only through its private ``threading._shutdown`` and
``atexit._run_exitfuncs``; (2) the *shared compositions* of ``dpsweep.launchers.composed``, each
sweep job's config built from a composition of its config groups shared with other jobs and served
to the launcher, which builds on ``hydra._internal``'s ``ConfigLoaderImpl``.

The workload is a user's: ``dpsweep -m launcher=local launcher.max_parallel=2 train.epochs=1
train.seed=range(16)`` (16 one-epoch jobs of the default digits/cnn DP-SGD run, two at a time) in an
empty folder, timed from the command's start to its exit, once with both pieces and once with Hydra's
own composition of every job and a plain interpreter exit; where the two differ by the threshold
(10%) or more, a third sweep with the plain exit alone splits the figure between the pieces. The
CPU seconds of each sweep's processes are recorded beside its wall time: on a machine shared with
other work, they vary less. Each variant is
forced on every process of the sweep (the command and each job) by a ``sitecustomize`` module on
``PYTHONPATH`` that this script writes: it replaces ``run_then_exit`` and ``ComposedJobs`` as they are
imported, so the figures hold whatever the checkout ships. Each process that applied the variant
leaves a line in a file, which the script counts.

Side figures, cheap: one process's exit after importing torch, Opacus, MLflow and Hydra, each way;
and ``dpsweep-plan`` of a grid of ``--plan-jobs`` distinct jobs with shared and with Hydra's own
compositions (issue 39's large grids). ``--rev`` measures a revision's code (a copy made by ``git
archive``, dpsweep's editable install redirected to it), not the working tree. The figures go to
``analysis/data/startup_machinery.json`` with the machine named (``--machine``).
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
import textwrap
import time
from pathlib import Path

BIN = Path(sys.executable).parent
OUT = Path(__file__).resolve().parents[1] / "analysis" / "data" / "startup_machinery.json"
BOTH = "fast_exit_and_shared_compositions"  # the variants of the sweep
EXIT_PLAIN = "plain_exit_and_shared_compositions"
NEITHER = "plain_exit_and_hydra"
THRESHOLD = 0.10  # a piece is kept only if it buys at least this share of the sweep's wall time

# The patches each process applies as it starts (DPSWEEP_BENCH_EXIT: fast|plain, DPSWEEP_BENCH_COMPOSE: fresh).
# The fast exit is written out here, so that the figure can be measured whether or not dpsweep ships it.
SITECUSTOMIZE = textwrap.dedent("""
    import importlib.abc, os, sys

    EXIT, COMPOSE, MARK, ROOT = (os.environ.get(k, "") for k in ("DPSWEEP_BENCH_EXIT", "DPSWEEP_BENCH_COMPOSE",
                                                                "DPSWEEP_BENCH_MARK", "DPSWEEP_BENCH_ROOT"))

    if ROOT:  # dpsweep imported from a copy of another revision: its editable install's paths redirected there
        for name, finder in list(sys.modules.items()):
            if name.startswith("__editable___dpsweep"):
                old = os.path.dirname(finder.MAPPING["dpsweep"])
                finder.MAPPING.update({k: v.replace(old, ROOT, 1) for k, v in finder.MAPPING.items()})
                spaces = finder.NAMESPACES
                spaces.update({k: [p.replace(old, ROOT, 1) for p in v] for k, v in spaces.items()})

    def _mark(what):
        if MARK:
            with open(MARK, "a") as f:
                f.write(f"{os.getpid()} {what}\\n")

    def _patch_exit(module):
        exit_code, interrupted = module.exit_code, module.interrupted

        def run_then_exit(main, prog=None):
            try:
                code = exit_code(SystemExit(main()))
            except SystemExit as stop:
                code = exit_code(stop)
            except KeyboardInterrupt as stop:
                if prog is None:
                    raise
                code = interrupted(prog, stop)
            if EXIT == "plain":
                sys.exit(code)
            import atexit, contextlib, ctypes, threading
            threading._shutdown()  # CPython's first shutdown steps, as Py_FinalizeEx runs them
            atexit._run_exitfuncs()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            ctypes.CDLL(None).fflush(None)
            os._exit(code)

        module.run_then_exit = run_then_exit
        _mark(f"exit={EXIT}")

    def _patch_compose(module):
        cls = module.ComposedJobs
        cls._from_skeleton = lambda self, master, job, bare=False: None  # every job composed by Hydra
        cls.load_sweep_config = lambda self, master, overrides: self._fresh(master, overrides)
        cls.typed = lambda self, master, job: module.to_config(self.compose(master, job))
        _mark(f"compose={COMPOSE}")

    PATCHES = {}
    if EXIT:
        PATCHES["dpsweep.process.shutdown"] = _patch_exit
    if COMPOSE == "fresh":
        PATCHES["dpsweep.launchers.composed"] = _patch_compose

    class _Patcher(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name not in PATCHES:
                return None
            sys.meta_path.remove(self)
            try:
                import importlib.util
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(module, run=run, patch=PATCHES[name]):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    if PATCHES:
        sys.meta_path.insert(0, _Patcher())
""")

SWEEP = ["-m", "launcher=local", "launcher.max_parallel=2", "train.epochs=1"]


def environment(site: Path, mark: Path, exit_mode: str, compose: str) -> dict[str, str]:
    env = dict(os.environ, DPSWEEP_BENCH_EXIT=exit_mode, DPSWEEP_BENCH_COMPOSE=compose, DPSWEEP_BENCH_MARK=str(mark))
    env["DPSWEEP_BENCH_ROOT"] = str(site / "tree") if (site / "tree").is_dir() else ""
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def timed(argv: list[str], env: dict[str, str], cwd: str) -> float:
    """Seconds from the start of ``argv`` to its exit; its output shown on failure."""
    return timed_cpu(argv, env, cwd)[0]


def timed_cpu(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """Wall seconds from the start of ``argv`` to its exit, and the CPU seconds of its processes (those
    reaped by their parents: the command's jobs too); its output shown on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    took = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return took, cpu


def sweep(site: Path, jobs: int, exit_mode: str, compose: str) -> dict[str, float]:
    """The sweep's wall time under one variant, and how many of its processes applied it."""
    with tempfile.TemporaryDirectory(prefix="dpsweep-machinery-") as cwd:
        mark = Path(cwd) / "patched.txt"
        argv = [str(BIN / "dpsweep"), *SWEEP, f"train.seed=range({jobs})"]
        seconds, cpu = timed_cpu(argv, environment(site, mark, exit_mode, compose), cwd)
        lines = mark.read_text().splitlines() if mark.exists() else []
    patched = len({line.split()[0] for line in lines})
    return {"seconds": round(seconds, 2), "cpu_seconds": round(cpu, 1), "patched_processes": patched}


def one_exit(site: Path, exit_mode: str, repeat: int = 3) -> float:
    """The fastest of ``repeat`` processes that import torch, Opacus, MLflow and Hydra and exit (``exit_mode``)."""
    code = "import torch, opacus, mlflow, hydra; from dpsweep.process.shutdown import run_then_exit; run_then_exit(int)"
    with tempfile.TemporaryDirectory(prefix="dpsweep-exit-") as cwd:
        env = environment(site, Path(cwd) / "patched.txt", exit_mode, "")
        return round(min(timed([sys.executable, "-c", code], env, cwd) for _ in range(repeat)), 2)


def plan(site: Path, jobs: int, compose: str) -> float:
    """``dpsweep-plan --json`` of ``jobs`` distinct jobs (seeds × 4 σ × 2 learning rates), in seconds."""
    grid = [f"train.seed=range({max(1, jobs // 8)})", "dp.noise_multiplier=0.8,1.0,1.2,1.5", "optimizer.lr=0.01,0.05"]
    with tempfile.TemporaryDirectory(prefix="dpsweep-machinery-plan-") as cwd:
        env = environment(site, Path(cwd) / "patched.txt", "", compose)
        return round(timed([str(BIN / "dpsweep-plan"), "--json", *grid], env, cwd), 2)


def saved_share(sweeps: dict[str, dict[str, float]], faster: str, slower: str) -> float:
    """The share of ``slower``'s wall time that ``faster`` saves."""
    return 1 - sweeps[faster]["seconds"] / sweeps[slower]["seconds"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=16, help="sweep jobs (default 16)")
    parser.add_argument("--plan-jobs", type=int, default=200, help="jobs of the dpsweep-plan grid (default 200)")
    parser.add_argument("--machine", default=None, help="the machine's name for the record (default: its CPU)")
    parser.add_argument("--rev", help="measure this git revision's code (git archive; default: the working tree)")
    parser.add_argument("--json", type=Path, default=OUT, help=f"write the figures here (default {OUT})")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    machine = args.machine or f"{platform.processor() or platform.machine()}, {cores} cores"
    machine += f", Python {platform.python_version()}"
    with tempfile.TemporaryDirectory(prefix="dpsweep-site-") as site_dir:
        site = Path(site_dir)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        if args.rev:
            (site / "tree").mkdir()
            archive = subprocess.run(["git", "archive", args.rev], cwd=OUT.parents[2], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(site / "tree")], input=archive.stdout, check=True)
        exits = {mode: one_exit(site, mode) for mode in ("fast", "plain")}
        print(f"one process (torch, Opacus, MLflow, Hydra imported): exit {exits['fast']:.2f} s fast, "
              f"{exits['plain']:.2f} s plain")  # fmt: skip
        plans = {compose or "shared": plan(site, args.plan_jobs, compose) for compose in ("", "fresh")}
        print(f"dpsweep-plan of {args.plan_jobs} jobs: {plans['shared']:.2f} s shared compositions, "
              f"{plans['fresh']:.2f} s Hydra's own")  # fmt: skip
        sweeps = {BOTH: sweep(site, args.jobs, "fast", ""),
                  NEITHER: sweep(site, args.jobs, "plain", "fresh")}  # fmt: skip
        both = saved_share(sweeps, BOTH, NEITHER)
        if both >= THRESHOLD:  # then which piece buys it: the exit alone (below 10% together: neither can)
            sweeps[EXIT_PLAIN] = sweep(site, args.jobs, "plain", "")
    print(f"machine: {machine}")
    print(
        f"a {args.jobs}-job sweep ({' '.join(SWEEP)}), wall time: "
        + ", ".join(f"{name} {run['seconds']} s ({run['cpu_seconds']} CPU s)" for name, run in sweeps.items())
    )
    shares = {"both": both}
    ratio = 1 / (1 - both)
    print(f"both pieces save {both:.1%} of the sweep's wall time (ratio {ratio:.3f}; threshold {THRESHOLD:.0%})")
    if EXIT_PLAIN in sweeps:
        shares["fast_exit"] = saved_share(sweeps, BOTH, EXIT_PLAIN)
        shares["shared_compositions"] = saved_share(sweeps, EXIT_PLAIN, NEITHER)
        print(f"the fast exit saves {shares['fast_exit']:.1%}, shared compositions {shares['shared_compositions']:.1%}")
    record = {
        "machine": machine,
        "revision": args.rev or "working tree",
        "date": time.strftime("%Y-%m-%d"),
        "workload": f"dpsweep {' '.join(SWEEP)} train.seed=range({args.jobs})",
        "sweep_seconds": sweeps,
        "ratio_without_over_with": round(ratio, 3),
        "share_saved": {name: round(share, 3) for name, share in shares.items()},
        "threshold": THRESHOLD,
        "one_process_exit_seconds": exits,
        "plan_seconds": {"jobs": args.plan_jobs, **plans},
    }
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
