"""Benchmark: K training-dominated DP trials per device (``launcher.trials_per_device``, issue 59 item 1).

    .venv/bin/python benchmarks/packing_long.py                        # on a GPU: every case, K, sharing
    .venv/bin/python benchmarks/packing_long.py --cases cnn32 --ks 1,16   # one device call (about 8 min)
    .venv/bin/python benchmarks/packing_long.py --quick                # CPU, tiny trials, K = 1 and 2 (CI slow tier)

``benchmarks/packing.py`` packed trials of about 4 s of training, whose K = 1 jobs spent 9.5 s starting:
most of its gain was start-ups side by side. Here each trial trains for ``--trial-seconds`` (60 s) alone on
the GPU, so that start-up is a small share of it, and the question is whether K trials share the GPU.

Cases (real ``dpsweep -m launcher=local`` sweeps into fresh sqlite stores, DP-SGD through Opacus, B = 256):

- ``cnn32``: ``cnn`` on CIFAR-size inputs, 32 x 32 px, N = 50,000 training images;
- ``head224``: the cached VGG16 head (``vgg16_frozen``, random frozen weights, feature cache on) on 224 px
  inputs, N = 10,000; its feature cache is built by one warm-up trial before anything is timed.

The data are synthetic (random pixels and labels) in MNIST's on-disk format (IDX files under
``dataset.root``), read by dpsweep's own ``mnist`` loader and held on the device (``train.device_resident``):
no downloads. They have one channel, not CIFAR-10's three: torchvision's CIFAR-10 and Flowers-102 loaders
check the real files' md5s, so fabricated files of those formats do not load outside a test's monkeypatch.

Each row is one sweep of a grid σ ∈ {0.8, 1.2} x seeds: at K = 1 the two σ alone, one job after another
(each trial's "alone" reference: its seconds and its ε); at K ≥ 2 (even), K trials in one job at once. Per row:
trials per hour (finished trials / the sweep's wall time), the ratio to K = 1 with the default sharing, the
GPU's busy share (utilization.gpu every 0.5 s, pynvml or nvidia-smi; GPU only), each trial's slowdown (its
run's seconds / the seconds of the same σ alone), its peak memory (``system/memory/iteration_peak_mib``)
against ``dpsweep-memory predict``'s peak for the same config from ``--probes``, and whether its ε equals
the ε of the same σ alone. Sharing: the device's default (time-slicing) and CUDA MPS
(``nvidia-cuda-mps-control -d`` with its own pipe and log folders, quit after; K = 1 is not repeated under
MPS: a lone process has nothing to share). Every row is written to ``--json`` as it is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import REPO, dpsweep, environment, phases  # the sibling benchmark's sweep runner

SIGMAS = (0.8, 1.2)  # the grid's σ; each packed trial is compared with the same σ alone
PEAK_METRIC = "system/memory/iteration_peak_mib"  # dpsweep.memory.stages.StageMemory.metrics
BUSY_PERIOD_S = 0.5
RUN_ARGS = ["dp=dpsgd", "dataset=mnist", "train.device_resident=true", "train.eval_every=10"]
ERROR_EXIT = 2


@dataclass
class Case:
    """One kind of trial: its overrides, its synthetic data's size and its assumed alone step time."""

    name: str
    overrides: list[str]
    n_train: int
    n_test: int
    batch_size: int
    step_s: float  # assumed seconds per DP step alone (from analysis/data/throughput_h200.json where present)
    step_source: str
    epochs: int = 0
    warm_up: bool = False  # one short trial first (the feature cache)
    extra: dict[str, Any] = field(default_factory=dict)


def assumed_step_s(setting: str, default: float) -> tuple[float, str]:
    """The Opacus hooks step at B = 256 measured by benchmarks/throughput.py on an H200, else ``default``."""
    path = REPO / "analysis/data/throughput_h200.json"
    if path.exists():
        for t in json.loads(path.read_text()).get("timings", []):
            if t["setting"] == setting and t["mode"] == "hooks" and t["batch_size"] == 256:
                return float(t["median_s"]), f"{path.name}: {setting} hooks B=256 median"
    return default, "assumed"


def cases(quick: bool) -> dict[str, Case]:
    if quick:  # the same paths in seconds on 2 CPU cores
        return {"cnn32": Case("cnn32", ["model=cnn", "dataset.image_size=16", "model.hidden_units=16"], 512, 64, 64,
                              0.02, "assumed (CPU, tiny)", epochs=2)}  # fmt: skip
    cnn_s, cnn_src = assumed_step_s("cnn", 0.005)
    head_s, head_src = assumed_step_s("head", 0.008)
    return {
        "cnn32": Case("cnn32", ["model=cnn", "dataset.image_size=32"], 50_000, 2_000, 256, cnn_s, cnn_src),
        "head224": Case("head224", ["model=vgg16_frozen", "model.pretrained=false", "model.feature_cache=true",
                                    "dataset.image_size=224"], 10_000, 1_000, 256, head_s, head_src, warm_up=True),
    }  # fmt: skip


def plan_epochs(case: Case, trial_s: float) -> None:
    """Epochs so that the trial trains ``trial_s`` alone at the assumed step time (printed)."""
    steps = max(1, round(case.n_train / case.batch_size))  # Poisson steps per epoch: int(1/q) ~ N/B
    if not case.epochs:
        case.epochs = max(1, math.ceil(trial_s / (steps * case.step_s)))
    case.extra = {"steps_per_epoch": steps, "expected_train_s": round(case.epochs * steps * case.step_s, 1)}
    print(f"{case.name}: assuming {case.step_s * 1e3:.2f} ms per DP step alone ({case.step_source}), {steps} "
          f"steps per epoch: {case.epochs} epochs ~ {case.extra['expected_train_s']} s of training alone")  # fmt: skip


def write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file (MNIST's format): magic 0x08 (unsigned byte) and the rank, the sizes big-endian, the bytes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fabricate(root: Path, n_train: int, n_test: int, seed: int = 0) -> None:
    """Random 28 x 28 images and labels as MNIST's four raw files under ``root/MNIST/raw``."""
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, n))


def case_overrides(case: Case, data: Path) -> list[str]:
    extra = [f"model.feature_cache_dir={data}/features"] if "model=vgg16_frozen" in case.overrides else []
    return [*RUN_ARGS, *case.overrides, *extra, f"dataset.root={data}", f"train.batch_size={case.batch_size}"]


def grid(k: int) -> list[str]:
    """K = 1: each σ alone (seed 0); K >= 2: K trials, σ x K/2 seeds."""
    seeds = ",".join(str(s) for s in range(max(1, k // 2)))
    return [f"dp.noise_multiplier={','.join(map(str, SIGMAS))}", f"train.seed={seeds}"]


class BusyWatch:
    """The GPU's busy share while it runs: utilization.gpu every 0.5 s (pynvml where installed, else
    nvidia-smi; no CUDA context here)."""

    def __init__(self, enabled: bool) -> None:
        self.samples: list[float] = []
        self.enabled = enabled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _reader(self) -> Any:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # not installed, or no driver: nvidia-smi reads the same counter
            query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"]
            return lambda: float(subprocess.run(query, capture_output=True, text=True).stdout.split()[0])

    def _loop(self) -> None:
        read = self._reader()
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.samples.append(read())
            self._stop.wait(BUSY_PERIOD_S)

    def __enter__(self) -> BusyWatch:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()

    def share(self) -> float | None:
        return round(sum(self.samples) / len(self.samples) / 100, 3) if self.samples else None


@contextlib.contextmanager
def mps(folder: Path) -> Iterator[tuple[dict[str, str] | None, str]]:
    """A CUDA MPS control daemon with its own pipe and log folders: (the environment that reaches it, "")
    or (None, why it could not start). Quit on leaving."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    for d in env.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    full = os.environ | env
    try:
        started = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=full, capture_output=True, text=True)
    except FileNotFoundError:
        yield None, "nvidia-cuda-mps-control not found"
        return
    probe = [sys.executable, "-c", "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()"]
    check = subprocess.run(probe, env=full, capture_output=True, text=True) if started.returncode == 0 else started
    try:
        if check.returncode != 0:
            yield None, f"MPS did not start (exit {check.returncode}): {(check.stdout + check.stderr)[-500:]}"
        else:
            yield env, ""
    finally:
        if started.returncode == 0:
            subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=full, capture_output=True, text=True)
            time.sleep(1)  # the server exits after its clients


def run_extras(uri: str, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Each run's σ, seed and logged peak memory (MiB), by run id."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    out = {}
    for run_id in run_ids:
        r = client.get_run(run_id)
        params, metrics = r.data.params, r.data.metrics
        out[run_id] = {"sigma": float(params.get("dp.noise_multiplier", "nan")), "seed": params.get("train.seed"),
                       "peak_mib": metrics.get(PEAK_METRIC)}  # fmt: skip
    return out


def sweep_row(case: Case, data: Path, k: int, env: dict[str, str] | None, gpu: bool) -> dict[str, Any]:
    """One sweep of ``grid(k)`` with K trials per device: its wall time, trials per hour, busy share, runs."""
    with tempfile.TemporaryDirectory(prefix=f"packing-long-{case.name}-k{k}-") as d:
        folder = Path(d)
        saved = {name: os.environ.get(name) for name in env or {}}
        os.environ.update(env or {})  # the sweep's processes reach the MPS daemon
        try:
            with BusyWatch(gpu) as busy:
                wall, found, out, started = dpsweep(folder, f"launcher.trials_per_device={k}",
                                                    f"train.epochs={case.epochs}", *case_overrides(case, data),
                                                    *grid(k))  # fmt: skip
        finally:
            for name, value in saved.items():
                os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
        where = phases(folder, found, started, wall)
        extras = run_extras(f"sqlite:///{folder}/mlflow.db", [r["run_id"] for r in found])
    runs = [r | extras[r["run_id"]] for r in found]
    finished = sum(r["status"] == "FINISHED" for r in runs)
    row = {"k": k, "trials": len(runs), "finished": finished, "wall_s": round(wall, 2),
           "trials_per_hour": round(finished / wall * 3600, 2), "busy_share": busy.share(),
           "busy_samples": len(busy.samples), "phases": where, "runs": runs}  # fmt: skip
    if finished != len(runs) or not runs:
        row["output_tail"] = out[-3000:]
    return row


def predicted_peak(case: Case, data: Path, probes: Path, folder: Path, gpu: bool) -> dict[str, Any]:
    """``dpsweep-memory predict``'s peak for the case at σ = SIGMAS[0], from a model fitted on ``probes``."""
    model = folder / "memory_model.json"
    fit = subprocess.run([sys.executable, "-m", "dpsweep.cli.memory", "fit", "--csv", str(probes), "--out", str(model)],
                         capture_output=True, text=True)  # fmt: skip
    if fit.returncode != 0:
        return {"error": f"fit exited {fit.returncode}: {fit.stderr[-1000:]}", "peak_bytes": None}
    command = [sys.executable, "-m", "dpsweep.cli.memory", "predict", "--memory-model", str(model), "--json",
               "--gpu-memory", f"{device_memory_bytes(gpu) // 2**20}MiB",
               "--backend", "cuda" if gpu else "cpu-tensors", *case_overrides(case, data),
               f"dp.noise_multiplier={SIGMAS[0]}"]  # fmt: skip
    proc = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    stdout = proc.stdout
    try:
        peak = json.loads(stdout[stdout.index("[") :])[0]["peak_bytes"]
    except (ValueError, KeyError, IndexError):
        return {"error": f"predict exited {proc.returncode}: {(stdout + proc.stderr)[-1000:]}", "peak_bytes": None}
    return {"peak_bytes": peak, "probes": str(probes.relative_to(REPO) if probes.is_relative_to(REPO) else probes)}


def device_memory_bytes(gpu: bool) -> int:
    """The card's memory (a trial alone may plan against all of it), or on the CPU the machine's."""
    if gpu:
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def judge(rows: list[dict[str, Any]], alone: dict[float, dict[str, Any]], base: float | None, peak: Any) -> None:
    """Per row, against the K = 1 default-sharing row: the ratio of trials per hour; per trial, its
    slowdown, its peak memory over the prediction, and whether its ε equals its σ's ε alone."""
    for row in rows:
        row["vs_k1"] = round(row["trials_per_hour"] / base, 3) if base else None
        for r in row["runs"]:
            ref = alone.get(r["sigma"])
            r["slowdown"] = round(r["seconds"] / ref["seconds"], 3) if ref and ref["seconds"] else None
            r["epsilon_alone"] = ref["epsilon"] if ref else None
            r["epsilon_equal"] = bool(ref and r["epsilon"] is not None and ref["epsilon"] is not None
                                      and math.isclose(r["epsilon"], ref["epsilon"], rel_tol=1e-9))  # fmt: skip
            r["peak_over_predicted"] = (round(r["peak_mib"] * 2**20 / peak, 3) if r.get("peak_mib") and peak
                                        else None)  # fmt: skip
        slow = [r["slowdown"] for r in row["runs"] if r["slowdown"]]
        row["median_slowdown"] = sorted(slow)[len(slow) // 2] if slow else None
        row["epsilon_all_equal"] = all(r["epsilon_equal"] for r in row["runs"]) and bool(row["runs"])


def measure_case(case: Case, args: argparse.Namespace, gpu: bool, save: Any) -> dict[str, Any]:
    """Every K under each sharing for one case; rows saved as they are measured."""
    section: dict[str, Any] = {"overrides": case.overrides, "n_train": case.n_train, "n_test": case.n_test,
                               "batch_size": case.batch_size, "epochs": case.epochs, "assumed_step_s": case.step_s,
                               "step_source": case.step_source, **case.extra, "rows": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix=f"packing-long-{case.name}-") as d:
        data = Path(d)
        fabricate(data, case.n_train, case.n_test)
        section["prediction"] = predicted_peak(case, data, args.probes, data, gpu)
        if case.warm_up:  # build the feature cache once, untimed
            warm = Case(**{**case.__dict__, "epochs": 1})
            section["warm_up"] = {k: v for k, v in sweep_row(warm, data, 1, None, gpu).items() if k != "runs"}
        for sharing in args.sharing:
            section["rows"][sharing] = rows = []
            with contextlib.ExitStack() as stack:
                env: dict[str, str] | None = None
                if sharing == "mps":
                    env, why = stack.enter_context(mps(data / "mps")) if gpu else (None, "no GPU")
                    if env is None:
                        section.setdefault("skipped", {})["mps"] = why
                        print(f"{case.name}: MPS skipped: {why}")
                        continue
                for k in args.ks:
                    if sharing == "mps" and k == 1:
                        continue
                    rows.append(sweep_row(case, data, k, env, gpu) | {"sharing": sharing})
                    report(case.name, rows[-1])
                    finish(section, case.name, quiet=True)  # a run cut short keeps its ratios
                    save(case.name, section)
    return section


def report(name: str, row: dict[str, Any]) -> None:
    busy = f"{row['busy_share']:.0%}" if row["busy_share"] is not None else "n/a"
    print(f"{name} {row['sharing']:>7} K={row['k']:>2}: {row['finished']}/{row['trials']} finished in "
          f"{row['wall_s']:8.1f} s, {row['trials_per_hour']:9.1f} trials/h, GPU busy {busy}", flush=True)  # fmt: skip


def finish(section: dict[str, Any], name: str, quiet: bool = False) -> None:
    """The ratios, slowdowns, ε and memory checks, once every row of ``section`` is in; printed."""
    base_rows = [r for r in section["rows"].get("default", []) if r["k"] == 1]
    base = base_rows[0]["trials_per_hour"] if base_rows else None
    alone = {r["sigma"]: r for r in (base_rows[0]["runs"] if base_rows else []) if r["status"] == "FINISHED"}
    for rows in section["rows"].values():
        judge(rows, alone, base, section["prediction"].get("peak_bytes"))
        for r in [] if quiet else rows:
            peaks = [x["peak_over_predicted"] for x in r["runs"] if x["peak_over_predicted"]]
            print(f"{name} {r['sharing']:>7} K={r['k']:>2}: {r['vs_k1']}x the trials per hour of K=1, "
                  f"median slowdown {r['median_slowdown']}, ε equal alone: {r['epsilon_all_equal']}, "
                  f"peak / predicted {min(peaks, default=None)}..{max(peaks, default=None)}")  # fmt: skip
    every = [r["vs_k1"] or 0.0 for rows in section["rows"].values() for r in rows]
    section["best_vs_k1"] = max(every, default=None)


def parse(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU: tiny cnn trials, K = 1 and 2, default sharing")
    p.add_argument("--cases", default=None, help="cnn32,head224 (default: both; --quick: cnn32)")
    p.add_argument("--ks", default=None, help="trials per device: 1 or even (default 1,2,4,8,16; --quick 1,2)")
    p.add_argument("--sharing", default=None, help="default,mps (default: both on a GPU; --quick: default)")
    p.add_argument("--trial-seconds", type=float, default=60.0, help="training alone per trial, planned")
    p.add_argument("--probes", type=Path, default=None, help="probe table the memory model is fitted on")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.cases = (args.cases or ("cnn32" if args.quick else "cnn32,head224")).split(",")
    args.sharing = (args.sharing or ("default" if args.quick else "default,mps")).split(",")
    try:
        args.ks = [int(k) for k in (args.ks or ("1,2" if args.quick else "1,2,4,8,16")).split(",")]
    except ValueError:
        p.exit(ERROR_EXIT, f"--ks: {args.ks!r} is not a list of integers; allowed: 1 or even numbers, e.g. 1,2,4\n")
    known = cases(args.quick)
    for key, values, allowed in (("--cases", args.cases, set(known)), ("--sharing", args.sharing, {"default", "mps"})):
        if bad := [v for v in values if v not in allowed]:
            p.exit(ERROR_EXIT, f"{key}: {bad} not allowed; allowed: {sorted(allowed)}\n")
    if bad_k := [k for k in args.ks if k < 1 or (k > 1 and k % 2)]:
        p.exit(ERROR_EXIT, f"--ks: {bad_k} not allowed; allowed: 1 or even numbers (σ x K/2 seeds)\n")
    if "default" not in args.sharing or 1 not in args.ks:
        p.exit(ERROR_EXIT, "--ks/--sharing: the default sharing's K = 1 is every ratio's baseline: include both\n")
    if args.probes is None:
        args.probes = REPO / "analysis/data" / ("cpu_probes_digits.csv" if args.quick else "gpu_probes_h100.csv")
    return args


def default_json(env: dict[str, Any], quick: bool) -> Path:
    if quick:
        return REPO / "analysis/data/packing_long_cpu_quick.json"
    words = env["device"].lower().replace("nvidia", "").split()  # "NVIDIA H200" -> h200
    model = "".join(w for w in words if w[:1].isalpha() and w[1:2].isdigit()) or "_".join(words)
    return REPO / f"analysis/data/packing_long_{model}.json"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    gpu = torch.cuda.is_available()
    env = environment() | {"cpu_model": cpu_model(), "platform": platform.platform()}
    out = args.json or default_json(env, args.quick)
    result: dict[str, Any] = {"environment": env, "date": time.strftime("%Y-%m-%d"), "command": sys.argv,
                              "quick": args.quick, "sigmas": list(SIGMAS), "ks": args.ks, "sharing": args.sharing,
                              "trial_seconds": args.trial_seconds, "cases": {}}  # fmt: skip

    def save(name: str, value: Any) -> None:
        result["cases"][name] = value
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    known = cases(args.quick)
    for name in args.cases:
        plan_epochs(known[name], args.trial_seconds)
    for name in args.cases:
        section = measure_case(known[name], args, gpu, save)
        finish(section, name)
        save(name, section)
    print(f"wrote {out}")
    return 0


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    raise SystemExit(main())
