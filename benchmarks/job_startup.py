"""Benchmark: where a job's start-up goes, from its process's start to its first training step (issue 59, item 4).

    .venv/bin/python benchmarks/job_startup.py            # 3 runs of each kind (medians), JSON committed
    .venv/bin/python benchmarks/job_startup.py --quick    # 1 of each, both ways at once (the slow tier's check)

Two kinds of job, each the default run (digits, ``cnn``, DP-SGD) of one epoch, in a folder whose MLflow
store exists (as after a user's first run: a new store's tables take about a second more, once): a plain
``dpsweep train.epochs=1``, and the job of a sweep ``dpsweep -m launcher=local train.epochs=1 train.seed=S``
(its own process, started by submitit as ``python -u -m dpsweep.launchers.job -u -m submitit.core._submit
<folder>``; a sweep of one job a time, so that its process is told apart). Each repeat runs a job of each
kind instrumented, then one as shipped, so that the machine's changing load falls alike on both. The end
point is the end of the run's first optimizer step: the step of exactly B whose memory stages the run logs
(``StageLog.log_first_iteration``; with DP it is taken and undone before epoch 1, whose first step costs the
same).

Measured two ways, in separate runs:

- **end to end**, on the code as it ships: the process's start (``/proc/<pid>/stat``, against a clock
  calibrated here) to the timestamp MLflow stores with the run's first metric, the memory stages logged
  right after that step (read back with ``MlflowClient``);
- **by phase**, the same commands with two public tools turned on: ``PYTHONPROFILEIMPORTTIME=1``
  (``python -X importtime``: each import's own microseconds, on stderr) and a ``sitecustomize`` module on
  ``PYTHONPATH`` that wraps a dozen of the runner's calls as their modules are imported and writes a
  timestamped mark on stderr as each is entered and left. The real process runs its own code in its own
  order; the marks only cut its timeline into windows. Each window's imports (the ``importtime`` lines
  between its marks) go to *imports*, by top-level package; the rest to the window's phase:
  interpreter (start to ``sitecustomize``), config (Hydra's composition, submitit's unpickling of the job,
  the early checks, the config's and the plan's checks), data (``loaders.build``), store (opening the
  MLflow store, closing dead runs of the config, creating the run), model (the task built, its private
  step attached), tracking (tags, params, ``config.yaml`` and the dataset inputs logged before training:
  MLflow logs asynchronously, so this is the calls' time on the job's path) and the first step.

The phases sum to the instrumented time to the first step by construction; that sum is checked
against the end-to-end figure (the tools' own cost shows as the gap). Figures are medians over
``--repeat`` runs; the load average is recorded, as other work on the machine slows every phase.
The JSON goes to ``analysis/data/job_startup.json`` with the machine named.
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
import textwrap
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
OUT = Path(__file__).resolve().parents[1] / "analysis" / "data" / "job_startup.json"
MARK = "@@job_startup"  # the sitecustomize's lines on stderr: MARK name wall_s cpu_s [pid start_ticks]
PHASES = ("interpreter", "imports", "config", "store", "tracking", "data", "model", "first_step")
# The window that ends at each mark, and its phase (what the process did since the previous mark)
WINDOWS = {
    "site": "interpreter", "train": "config", "checked": "config", "data<": "config", "data>": "data",
    "plan<": "config", "plan>": "config", "store<": "config", "store>": "store", "dead<": "store",
    "dead>": "store", "build<": "config", "build>": "model", "run<": "tracking", "run>": "store",
    "config_logged<": "tracking", "config_logged>": "tracking", "start<": "tracking", "start>": "model",
    "params<": "model", "params>": "tracking", "step": "first_step",
}  # fmt: skip
# Top-level packages reported together; any other under its own name (under 10 ms: in "others")
PACKAGES = {
    "torch": "torch", "torchvision": "torch", "mlflow": "mlflow", "opacus": "opacus", "dp_accounting": "dp_accounting",
    "hydra": "hydra", "omegaconf": "hydra", "antlr4": "hydra", "hydra_plugins": "hydra", "sklearn": "sklearn",
    "scipy": "scipy", "numpy": "numpy", "pandas": "pandas", "dpsweep": "dpsweep", "launchers": "dpsweep",
    "submitit": "submitit", "sqlalchemy": "sqlalchemy", "alembic": "sqlalchemy", "optuna": "optuna",
}  # fmt: skip

# Written to a temporary folder on PYTHONPATH: marks the runner's calls as dpsweep.run.runner is imported.
SITECUSTOMIZE = textwrap.dedent("""
    import importlib.abc, importlib.util, os, sys, time

    def _mark(name, extra=""):
        sys.stderr.write(f"MARK {name} {time.time():.6f} {time.process_time():.6f}{extra}\\n")
        sys.stderr.flush()

    with open("/proc/self/stat") as _f:
        _mark("site", f" {os.getpid()} {_f.read().rsplit(')', 1)[1].split()[19]}")

    _SEEN = set()

    def _once(name):
        if name not in _SEEN:
            _SEEN.add(name)
            _mark(name)

    def _wrap(owner, attr, before, after):
        run = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            _once(before)
            try:
                return run(*args, **kwargs)
            finally:
                _once(after)

        setattr(owner, attr, wrapped)

    class _Entered:  # tracked_run's context manager: marked once the run exists
        def __init__(self, cm):
            self.cm = cm

        def __enter__(self):
            got = self.cm.__enter__()
            _once("run>")
            return got

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

    class _Task:  # tasks.get(name): its build marked
        def __init__(self, task):
            self.task = task

        def __getattr__(self, attr):
            return getattr(self.task, attr)

        def build(self, inputs):
            _once("build<")
            try:
                built = self.task.build(inputs)
            finally:
                _once("build>")
            _wrap(built, "start", "start<", "start>")
            return built

    def _patch(runner):
        _wrap(runner, "train", "train", "train_done")
        _wrap(runner, "_checked_config", "checked<", "checked")
        _wrap(runner.loaders, "build", "data<", "data>")
        _wrap(runner, "prepare", "plan<", "plan>")
        _wrap(runner, "open_store", "store<", "store>")
        _wrap(runner, "close_dead_of_config", "dead<", "dead>")
        _wrap(runner.records, "log_config", "config_logged<", "config_logged>")
        _wrap(runner.Tracker, "log_params", "params<", "params>")
        get, tracked = runner.tasks.get, runner.tracked_run
        runner.tasks.get = lambda name: _Task(get(name))

        def tracked_run(*args, **kwargs):
            _once("run<")
            return _Entered(tracked(*args, **kwargs))

        runner.tracked_run = tracked_run
        first = runner.StageLog.log_first_iteration

        def log_first_iteration(self):
            if not self.logged:
                _once("step")
            return first(self)

        runner.StageLog.log_first_iteration = log_first_iteration

    class _Patcher(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "dpsweep.run.runner":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Patcher())
""").replace("MARK", MARK)


def clock_ticks() -> tuple[float, float]:
    """The wall-clock time of the machine's boot as ``/proc/<pid>/stat`` counts process starts (its
    ``btime`` is whole seconds: calibrated here on short processes started at a known time), and the tick."""
    hz = float(os.sysconf("SC_CLK_TCK"))
    boots = []
    for _ in range(5):
        before = time.time()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
        after = time.time()
        ticks = start_ticks(child.pid)
        child.wait()
        boots.append((before + after) / 2 - ticks / hz)
    return statistics.median(boots), hz


def start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks after boot


def run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def first_metric_times(cwd: Path) -> dict[str, float]:
    """Each run's first logged metric, in wall-clock seconds, by ``train.seed`` (its memory stages)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    found = {}
    for exp in client.search_experiments():
        for r in client.search_runs([exp.experiment_id]):
            stamps = [m.timestamp for k in r.data.metrics for m in client.get_metric_history(r.info.run_id, k)]
            if "train.seed" in r.data.params and stamps:  # a run, not a sweep's parent
                found[r.data.params["train.seed"]] = min(stamps) / 1000
    return found


class JobWatch:
    """The start (wall-clock seconds) of each job process of a sweep run in ``cwd``, seen in ``/proc`` as it runs
    (other sweeps may run on the machine at the same time)."""

    def __init__(self, boot: float, hz: float, cwd: Path) -> None:
        self.boot, self.hz, self.cwd, self.done = boot, hz, cwd.resolve(), threading.Event()
        self.seen: dict[int, tuple[int, bytes, float]] = {}  # pid: its parent, argv[0] and start
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.done.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and int(entry.name) not in self.seen:
                    try:
                        cmd = (entry / "cmdline").read_bytes()
                        # not another sweep on the machine, nor the instrumented job run beside (--quick)
                        mine = (entry / "cwd").resolve() == self.cwd
                        if b"dpsweep.launchers.job" in cmd and mine and b"PYTHONPROFILEIMPORTTIME" not in env(entry):
                            pid = int(entry.name)
                            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                            self.seen[pid] = (ppid, cmd.split(b"\0")[0], self.boot + start_ticks(pid) / self.hz)
                    except OSError:
                        continue
            time.sleep(0.02)

    def starts(self) -> list[float]:
        """The job processes' starts: Python started by submitit, not a shell, nor a process a job forked."""
        pythons = {pid for pid, (_, argv0, _) in self.seen.items() if Path(argv0.decode()).name.startswith("python")}
        return sorted(start for pid, (ppid, _, start) in self.seen.items() if pid in pythons and ppid not in pythons)


def env(entry: Path) -> bytes:
    try:
        return (entry / "environ").read_bytes()
    except OSError:
        return b""


def end_to_end(kind: str, seed: int, cwd: Path, boot: float, hz: float) -> float:
    """Seconds from the job process's start to its run's first metric, on the shipped code."""
    if kind == "plain":
        child = subprocess.Popen(plain_argv(seed), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started = boot + start_ticks(child.pid) / hz
        out, err = child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"dpsweep exited {child.returncode}:\n{out}\n{err}")
        return first_metric_times(cwd)[str(seed)] - started
    watch = JobWatch(boot, hz, cwd)
    watch.thread.start()
    try:
        run(sweep_argv(seed), cwd, dict(os.environ))
    finally:
        watch.done.set()
        watch.thread.join()
    starts = watch.starts()
    if len(starts) != 1:
        raise SystemExit(f"saw {len(starts)} job processes for one job: {watch.seen}")
    return first_metric_times(cwd)[str(seed)] - starts[0]


def plain_argv(seed: int) -> list[str]:
    """A run in its own output folder (its checkpoint's): two runs started in the same second would share one."""
    return [str(BIN / "dpsweep"), "train.epochs=1", f"train.seed={seed}", f"hydra.run.dir=runs/{seed}"]


def sweep_argv(seed: int) -> list[str]:
    """A sweep of one job (its own output folder, so that its job's log is found)."""
    return [str(BIN / "dpsweep"), "-m", "launcher=local", "launcher.max_parallel=1", "train.epochs=1",
            f"train.seed={seed}", f"hydra.sweep.dir=sweeps/{seed}"]  # fmt: skip


def phases_of(stderr: str, boot: float, hz: float) -> dict[str, Any]:
    """One instrumented process's phases (seconds) and imports by package, from its stderr."""
    marks: list[tuple[str, float, float]] = []
    imports: dict[str, float] = defaultdict(float)  # by package, after the interpreter's start
    window_imports = 0.0
    phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    cpu: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    start = last = last_cpu = None
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line and start is not None:
            own, _, name = (part.strip() for part in line[len("import time:") :].split("|"))
            if own.isdigit():
                seconds = int(own) / 1e6
                top = name.split(".")[0]
                imports[PACKAGES.get(top, top)] += seconds
                window_imports += seconds
        elif line.startswith(MARK + " "):
            name, wall, used, *rest = line.split()[1:]
            if name == "site":
                start = boot + int(rest[1]) / hz
                last, last_cpu = start, 0.0
            if name not in WINDOWS or last is None or last_cpu is None:
                continue
            phase = WINDOWS[name]
            own_s = float(wall) - last - (window_imports if phase != "interpreter" else 0.0)
            phases[phase] += own_s
            phases["imports"] += window_imports if phase != "interpreter" else 0.0
            cpu[phase] += float(used) - last_cpu
            marks.append((name, float(wall) - (start or 0.0), float(used)))
            last, last_cpu, window_imports = float(wall), float(used), 0.0
            if name == "step":
                break
    if not marks or marks[-1][0] != "step":
        raise SystemExit(f"no first step marked in the process's stderr:\n{stderr[-3000:]}")
    total = marks[-1][1]
    return {"phases": phases, "total": total, "cpu_total": marks[-1][2], "imports": dict(imports),
            "marks": [m[0] for m in marks]}  # fmt: skip


def instrumented(kind: str, seed: int, cwd: Path, site: Path, boot: float, hz: float) -> dict[str, Any]:
    """The job's phases, on the same command with the import profile and the marks turned on."""
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    if kind == "plain":
        return phases_of(run(plain_argv(seed), cwd, env).stderr, boot, hz)
    run(sweep_argv(seed), cwd, env)
    logs = sorted((cwd / "sweeps" / str(seed)).rglob("*_log.err"))
    if len(logs) != 1:
        raise SystemExit(f"found {len(logs)} job logs (want 1) under {cwd / 'sweeps' / str(seed)}")
    return phases_of(logs[0].read_text(), boot, hz)


def measured(kind: str, repeat: int, boot: float, hz: float, side_by_side: bool = False) -> dict[str, Any]:
    """``repeat`` jobs of a kind each way, instrumented and as shipped in turn (so that the machine's load
    changes alike for both; ``side_by_side``: the two at once, which shares the load closer still but has
    each job compete with the other: --quick's check that the phases add up, not a figure), in one folder
    whose MLflow store exists already, as after a user's first run (a new store's tables take about a
    second more, once); each job its own seed: a grid sweep's job skips a config another run finished."""
    with tempfile.TemporaryDirectory(prefix="dpsweep-job-startup-") as tmp:
        cwd, site = Path(tmp) / "work", Path(tmp) / "site"
        cwd.mkdir()
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        from mlflow.tracking import MlflowClient

        MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}").search_experiments()  # the store's tables created
        jobs, e2e = [], []
        for r in range(repeat):
            if side_by_side:
                with ThreadPoolExecutor(2) as pool:
                    job = pool.submit(instrumented, kind, 2 * r, cwd, site, boot, hz)
                    e2e.append(end_to_end(kind, 2 * r + 1, cwd, boot, hz))
                    jobs.append(job.result())
            else:
                jobs.append(instrumented(kind, 2 * r, cwd, site, boot, hz))
                e2e.append(end_to_end(kind, 2 * r + 1, cwd, boot, hz))
        return summary(jobs, e2e)


def bare_python(repeat: int) -> float:
    took = []
    for _ in range(max(repeat, 3)):
        before = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        took.append(time.perf_counter() - before)
    return statistics.median(took)


def summary(jobs: list[dict[str, Any]], e2e: list[float]) -> dict[str, Any]:
    """Medians over the jobs: each phase, its share, the imports by package, against the end-to-end."""
    phases = {p: statistics.median(j["phases"][p] for j in jobs) for p in PHASES}
    packages = {p for j in jobs for p in j["imports"]}
    imports = {p: statistics.median(j["imports"].get(p, 0.0) for j in jobs) for p in packages}
    small = {p for p, s in imports.items() if s < 0.01}  # the long tail, as one figure
    imports = {p: s for p, s in imports.items() if p not in small} | {"others": sum(imports[p] for p in small)}
    total = sum(phases.values())
    return {
        "phases_s": {p: round(s, 3) for p, s in phases.items()},
        "share": {p: round(s / total, 3) for p, s in phases.items()},
        "phase_sum_s": round(total, 3),
        "instrumented_total_s": [round(j["total"], 3) for j in jobs],
        "cpu_to_first_step_s": round(statistics.median(j["cpu_total"] for j in jobs), 3),
        "imports_by_package_s": {p: round(s, 3) for p, s in sorted(imports.items(), key=lambda kv: -kv[1])},
        "end_to_end_s": [round(s, 3) for s in e2e],
        "end_to_end_median_s": round(statistics.median(e2e), 3),
        "phase_sum_over_end_to_end": round(total / statistics.median(e2e), 3),
        "jobs": len(jobs),
    }


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "mlflow", "opacus", "hydra-core", "dp-accounting", "submitit")}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def table(results: dict[str, dict[str, Any]]) -> str:
    kinds = list(results)
    rows = [f"{'phase':<12}" + "".join(f"{k:>22}" for k in kinds)]
    for p in PHASES:
        cells = "".join(f"{results[k]['phases_s'][p]:>13.2f} s {100 * results[k]['share'][p]:5.1f}%" for k in kinds)
        rows.append(f"{p:<12}" + cells)
    rows.append(f"{'sum':<12}" + "".join(f"{results[k]['phase_sum_s']:>13.2f} s       " for k in kinds))
    rows.append(f"{'end to end':<12}" + "".join(f"{results[k]['end_to_end_median_s']:>13.2f} s       " for k in kinds))
    for k in kinds:
        top = ", ".join(f"{p} {s:.2f}" for p, s in list(results[k]["imports_by_package_s"].items())[:8])
        rows.append(f"imports of the {k} job (s): {top}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one run of each kind, instrumented and as shipped side by side (the slow tier's check)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each kind, medians taken (default 3)")
    parser.add_argument("--json", type=Path, default=OUT, help=f"where the figures go (default {OUT})")
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    load_before = os.getloadavg()
    boot, hz = clock_ticks()
    bare = bare_python(repeat)
    results = {}
    for kind in ("plain", "sweep_job"):
        mode = "plain" if kind == "plain" else "sweep"
        results[kind] = measured(mode, repeat, boot, hz, side_by_side=args.quick)
    load_after = os.getloadavg()
    print(f"bare python -c pass: {bare:.3f} s (median)")
    print(table(results))
    record = {
        "machine": {
            "cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), **versions(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in load_after],
        },
        "revision": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                   cwd=Path(__file__).parent, check=False).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "repeat": repeat,
        "side_by_side": args.quick,
        "workloads": {"plain": "dpsweep " + " ".join(plain_argv(0)[1:]),
                      "sweep_job": "dpsweep " + " ".join(sweep_argv(0)[1:])},
        "end_point": "the end of the run's first optimizer step (its memory stages logged after it)",
        "bare_python_s": round(bare, 3),
        **results,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
