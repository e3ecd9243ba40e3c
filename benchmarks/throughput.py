"""Benchmark: the fused DP step (``dp.engine=fused``) against the non-private step and Opacus's hooks
and ghost clipping, in one run, for the ``cnn`` and the cached VGG16 head.

    .venv/bin/python benchmarks/throughput.py                         # cuda if available, else cpu
    .venv/bin/python benchmarks/throughput.py --quick                 # fewer timed steps
    .venv/bin/python benchmarks/throughput.py --json analysis/data/throughput_cpu.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/throughput.py       # on a CPU shared with other jobs

Every mode trains the same model from the same initialisation on the same batches of exactly B rows
(drawn with replacement from device-resident data, as a memory probe does), with SGD:

- ``off``: forward, loss, backward, step (no privacy);
- ``hooks`` and ``ghost``: Opacus's ``make_private`` (``dpsweep.mechanisms.opacus_engine``) and the classifier
  task's ``train_pass``, as a run with those modes trains;
- ``fused`` (eager) and ``fused+compile`` (``torch.compile``; mode ``reduce-overhead``, CUDA graphs, on a GPU):
  :class:`dpsweep.mechanisms.fused.FusedStep` in passes of ``default_pad_to(B)`` rows (the padding is part of
  the cost), noise and the optimizer's step, as a run with ``dp.engine=fused`` trains.

After warm-up steps (compilation happens there and is reported on its own), each step is timed alone
(``cuda.synchronize`` around it on a GPU); a mode's figure is the median. Ratios are of medians measured
in this one run. Settings: the cnn on 28 px inputs at B = 64 and 256; the VGG16 head (Linear(25088 → 128),
ReLU, Linear(128 → 102), 3.2 M parameters) on cached 512 x 7 x 7 maps (VGG16 at 224 px, Flowers-102's
classes) at B = 64 and 256. Inputs are random: speed does not depend on the values.

Goals (issue 34; exit status 1 if one is missed): fused / off at most 1.3 (cnn) and 1.2 (head) at every B,
on a GPU; on every device, the fused step no slower than today's path (hooks for the cnn, ghost for the head:
what ``training_speed.py`` judges each by) where a compiled step is the run's default (``dp.compile``
unset: on a GPU), eager elsewhere.

--profile: where a goal fails, torch.profiler tables of the fused and the non-private step (self CPU time; on a GPU
also self device time).

--trials-per-device 1,2,4,8,16: in the same run, trials per hour of the 16-trial ``cnn`` grid (σ × C × seed) at each
K (``launcher.trials_per_device``): real ``dpsweep -m launcher=local`` sweeps, one job at a time, by the
``throughput`` section of ``benchmarks/packing.py`` (which also measures ``auto`` and the next K out of memory).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from dpsweep.config import CNNConfig, DPConfig, GradSampleMode, SGDConfig, VGG16FrozenConfig
from dpsweep.data import gathered, resident
from dpsweep.mechanisms import fused
from dpsweep.mechanisms.opacus_engine import make_private
from dpsweep.memory import stages
from dpsweep.models import classifiers
from dpsweep.models.optimizers import build_optimizer
from dpsweep.tasks.classifier.passes import Trainer, train_pass
from dpsweep.tracking.environment import device_name

FUSED_CNN_MAX = 1.3  # goal: fused / off step time, cnn (on a GPU)
FUSED_HEAD_MAX = 1.2  # goal: fused / off step time, cached VGG16 head (on a GPU)
SIGMA, MAX_GRAD_NORM, SEED = 1.0, 1.0, 0
MODES = ("off", "hooks", "ghost", "fused", "fused+compile")
TODAY = {"cnn": "hooks", "head": "ghost"}  # today's path each setting is judged against
HEAD_CLASSES, HEAD_UNITS, HEAD_MAP = 102, 128, (512, 7, 7)
PROFILE_ROWS = 15  # ops shown per profile
POOL_ROWS = 2048  # device-resident rows the batches are drawn from

Step = Callable[[Tensor, Tensor], None]


@dataclass
class Timing:
    setting: str
    mode: str
    batch_size: int
    pad_to: int | None
    median_s: float
    warmup_s: float  # the warm-up steps together (compilation for fused+compile)
    steps_timed: int
    peak_bytes: int | None  # CUDA: max_memory_allocated above the level before the model; else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _opacus_step(model: nn.Module, mode: str, batch_size: int, device: torch.device) -> Step:
    """A step as a run with ``dp.grad_sample_mode=mode`` (Opacus) trains: make_private, then train_pass."""
    optimizer = build_optimizer(SGDConfig(), model)
    criterion: nn.Module = nn.CrossEntropyLoss()
    if mode != "off":
        rows = TensorDataset(torch.zeros(POOL_ROWS, 1), torch.zeros(POOL_ROWS, dtype=torch.long))
        loader = gathered.loader(rows, batch_size, shuffle=False, generator=torch.Generator().manual_seed(SEED))
        dp = DPConfig(noise_multiplier=SIGMA, max_grad_norm=MAX_GRAD_NORM, grad_sample_mode=GradSampleMode(mode))
        _, model, optimizer, criterion, _ = make_private(dp, SIGMA, MAX_GRAD_NORM, model, optimizer, loader, criterion)
    trainer = Trainer(model, optimizer, criterion, device)
    idle = stages.StageRecorder(stages.monitor_for(device), active=False)

    def step(x: Tensor, y: Tensor) -> None:
        train_pass(trainer, (x, y), idle)

    return step


def _fused_step(model: nn.Module, batch_size: int, device: torch.device, compiled: bool) -> tuple[Step, int]:
    """A step as a run with ``dp.engine=fused`` trains (``FusedPoisson`` and ``OwnSteps``)."""
    optimizer = build_optimizer(SGDConfig(), model)
    pad_to = fused.default_pad_to(batch_size)
    mode = fused.compile_mode(device, compiled)
    one = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=MAX_GRAD_NORM, pad_to=pad_to, mode=mode)
    generator = resident.device_generator(device, SEED)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}

    def step(x: Tensor, y: Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        grads = one.gradient(x, y, noise_multiplier=SIGMA, divisor=float(batch_size), generator=generator)
        for name, p in params.items():
            p.grad = grads[name]
        optimizer.step()

    return step, pad_to


def build(setting: str, make: Callable[[], nn.Module], x_pool: Tensor, mode: str, b: int,
          device: torch.device) -> tuple[Step, Callable[[], tuple[Tensor, Tensor]], int | None]:  # fmt: skip
    """A mode's step on a fresh model (seeded), a source of batches of exactly B rows, and its pad bound."""
    torch.manual_seed(SEED)
    model = make().to(device)
    pad_to = None
    if mode.startswith("fused"):
        step, pad_to = _fused_step(model, b, device, compiled=mode == "fused+compile")
    else:
        step = _opacus_step(model, mode, b, device)
    g = resident.device_generator(device, SEED)
    y_pool = torch.randint(0, 10 if setting == "cnn" else HEAD_CLASSES, (len(x_pool),), generator=g, device=device)

    def batch() -> tuple[Tensor, Tensor]:
        index = torch.randint(len(x_pool), (b,), generator=g, device=device)
        return x_pool[index], y_pool[index]

    return step, batch, pad_to


def time_mode(setting: str, make: Callable[[], nn.Module], x_pool: Tensor, mode: str, b: int,
              device: torch.device, steps: int, warmup: int) -> Timing:  # fmt: skip
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    step, batch, pad_to = build(setting, make, x_pool, mode, b, device)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step(*batch())
    _sync(device)
    warmup_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        x, y = batch()
        _sync(device)
        t0 = time.perf_counter()
        step(x, y)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) - start_bytes if device.type == "cuda" else None
    return Timing(setting, mode, b, pad_to, statistics.median(times), warmup_s, steps, peak)


def profile(setting: str, make: Callable[[], nn.Module], x_pool: Tensor, mode: str, b: int,
            device: torch.device, warmup: int, steps: int = 10) -> str:  # fmt: skip
    """torch.profiler over ``steps`` steps after warm-up: the ops by self CPU time (host work) as a table, and
    on a GPU by self device time too (kernels, those replayed in a CUDA graph included)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    step, batch, _ = build(setting, make, x_pool, mode, b, device)
    for _ in range(warmup):
        step(*batch())
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profiler(activities=activities) as prof:
        for _ in range(steps):
            step(*batch())
        _sync(device)
    averages = prof.key_averages()
    table: str = averages.table(sort_by="self_cpu_time_total", row_limit=PROFILE_ROWS)
    if device.type == "cuda":
        table += "\nby device time:\n" + averages.table(sort_by="self_device_time_total", row_limit=PROFILE_ROWS)
    return f"{setting} B={b} {mode}, {steps} steps\n{table}"


Makers = dict[str, tuple[Callable[[], nn.Module], Tensor]]


def settings(device: torch.device) -> Makers:
    """Each setting's model factory and its pool of device-resident inputs."""
    g = torch.Generator().manual_seed(SEED)
    cnn_pool = torch.randn((POOL_ROWS, 1, 28, 28), generator=g).to(device)
    head_pool = torch.randn((POOL_ROWS, HEAD_MAP[0] * HEAD_MAP[1] * HEAD_MAP[2]), generator=g).to(device)
    vgg = classifiers.build(VGG16FrozenConfig(hidden_units=HEAD_UNITS, pretrained=False), (3, 224, 224), HEAD_CLASSES)
    assert isinstance(vgg, classifiers.FrozenVGG16)
    head_template = vgg.cached_head(HEAD_MAP).cpu()
    del vgg
    makers: dict[str, tuple[Callable[[], nn.Module], Tensor]] = {
        "cnn": (lambda: classifiers.build(CNNConfig(), (1, 28, 28), 10), cnn_pool),
        "head": (lambda: copy.deepcopy(head_template), head_pool),
    }
    return makers


def run(
    makers: Makers, device: torch.device, steps: int, warmup: int, batch_sizes: tuple[int, ...], modes: tuple[str, ...]
) -> list[Timing]:
    out = []
    for setting, (make, pool) in makers.items():
        for b in batch_sizes:
            for mode in modes:
                t = time_mode(setting, make, pool, mode, b, device, steps, warmup)
                out.append(t)
                peak = f"{t.peak_bytes / 2**20:8.1f} MiB" if t.peak_bytes is not None else "       -    "
                print(f"{setting:5s} B={b:<4d} {mode:14s} {t.median_s * 1e3:9.2f} ms/step  "
                      f"warm-up {t.warmup_s:6.1f} s  peak {peak}", flush=True)  # fmt: skip
    return out


def ratios(timings: list[Timing]) -> dict[str, float]:
    """``setting/B/mode`` → median step time over the non-private one (same setting and B, this run)."""
    base = {(t.setting, t.batch_size): t.median_s for t in timings if t.mode == "off"}
    return {
        f"{t.setting}/B={t.batch_size}/{t.mode}": t.median_s / base[(t.setting, t.batch_size)]
        for t in timings
        if t.mode != "off" and (t.setting, t.batch_size) in base
    }


def goals(r: dict[str, float], device: torch.device, batch_sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    fused_mode = "fused+compile" if device.type == "cuda" else "fused"  # what a run does with dp.compile unset
    out = []
    for setting, most in (("cnn", FUSED_CNN_MAX), ("head", FUSED_HEAD_MAX)):
        for b in batch_sizes:
            f, today = r.get(f"{setting}/B={b}/{fused_mode}"), r.get(f"{setting}/B={b}/{TODAY[setting]}")
            if f is None:
                continue
            if device.type == "cuda":
                name = f"{setting} B={b}: {fused_mode}/off <= {most}"
                out.append({"goal": name, "setting": setting, "batch_size": b, "value": f, "passed": f <= most})
            if today is not None:
                name = f"{setting} B={b}: {fused_mode} no slower than {TODAY[setting]}"
                out.append(
                    {"goal": name, "setting": setting, "batch_size": b, "value": f / today, "passed": f <= today}
                )
    return out


def _driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def main() -> int:
    doc = __doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="fewer timed steps")
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables where a goal fails")
    p.add_argument("--trials-per-device", help="K values, e.g. 1,2,4,8: trials per hour of the 16-trial cnn grid")
    p.add_argument("--epochs", type=int, default=2, help="each trial's epochs, with --trials-per-device")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    steps, warmup = (10, 3) if args.quick else (30, 5)
    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    modes = tuple(args.modes.split(","))
    name = device_name(device)
    cuda, driver = (torch.version.cuda, _driver()) if device.type == "cuda" else (None, None)
    print(f"device {device}: {name}; driver {driver}; torch {torch.__version__}; CUDA {cuda}; "
          f"threads {torch.get_num_threads()}")  # fmt: skip
    makers = settings(device)
    timings = run(makers, device, steps, warmup, batch_sizes, modes)
    r = ratios(timings)
    print("\nstep time over the non-private step (medians, this run):")
    for k, v in r.items():
        print(f"  {k:32s} {v:6.2f}x")
    judged = goals(r, device, batch_sizes)
    print("\ngoals:")
    for g in judged:
        print(f"  {'PASS' if g['passed'] else 'FAIL'}  {g['goal']}  ({g['value']:.2f})")
    profiles = []
    if args.profile:  # where a goal failed: the fused step and the non-private one, side by side
        failed = sorted({(g["setting"], g["batch_size"]) for g in judged if not g["passed"]})
        fused_mode = "fused+compile" if device.type == "cuda" else "fused"
        for setting, b in failed:
            for mode in ("off", fused_mode):
                profiles.append(profile(setting, makers[setting][0], makers[setting][1], mode, b, device, warmup))
                print("\n" + profiles[-1], flush=True)
    packed = None
    if args.trials_per_device:  # the sweeps' trials take the device this process has finished with
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from packing import throughput_section

        print("\ntrials per hour, 16-trial cnn grid (sigma x C x seed), K trials per device:", flush=True)
        packed = throughput_section([int(k) for k in args.trials_per_device.split(",")], 16, args.epochs)
        goal = {"setting": "cnn grid", "batch_size": 64, "goal": f"{packed['goal']} the trials per hour of K=1",
                "value": packed["best_vs_k1"], "passed": packed["met"]}  # fmt: skip
        if device.type == "cuda":  # a GPU's goal: judged on a GPU only
            judged.append(goal)
        verdict = ("PASS" if goal["passed"] else "FAIL") if device.type == "cuda" else "n/a (CPU)"
        print(f"  {verdict}  {goal['goal']}  ({goal['value']:.2f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"device": str(device), "device_name": name, "torch": torch.__version__, "cuda": cuda,
                  "driver": driver, "threads": torch.get_num_threads(), "steps_timed": steps,
                  "warmup_steps": warmup, "timings": [asdict(t) for t in timings], "ratios": r, "goals": judged,
                  "profiles": profiles, "packing": packed}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(g["passed"] for g in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
