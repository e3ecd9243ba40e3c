"""Profile: where a training step's time goes, for the speed goals of ``benchmarks/training_speed.py``.

    .venv/bin/python benchmarks/profile_step.py                         # cuda if available, else the CPU twin
    .venv/bin/python benchmarks/profile_step.py --steps 200 --json profile.json
    .venv/bin/python benchmarks/profile_step.py --only cnn-hooks,cnn-off --trace-dir traces/   # Chrome traces

Settings (those of the speed benchmark, built from dpsweep's own parts as it builds them):

- ``cnn-off``, ``cnn-hooks``, ``cnn-ghost``: the Opacus MNIST example CNN on 28 px digits, B=256 rows per step
  drawn on the device (the DP/non-DP goal);
- ``head-off``, ``head-ghost``: the vgg16_frozen head (128 units) on cached 56 px maps, B=256 (the ghost goal);
- ``loader-hooks``, ``resident-hooks``: the cnn with DP on 28 px digits, B=64, through the DataLoader with
  Opacus's Poisson sampler and through ``device_data.PoissonBatches`` (the device-resident goal).

Per setting it prints, per optimizer step:

- ``synced ms``: each step timed alone, with a device sync after it (as training_speed.py times steps);
- ``b2b ms``: steps back to back, one sync at the end (as training runs since its loss stays on the device);
- ``gpu ms`` and ``busy``: the summed time of the CUDA kernels (torch.profiler) and its share of b2b. A
  share far below 1 means the GPU waits for the host: the step is bound by Python and kernel launches,
  not by arithmetic, and a faster GPU would not make it faster;
- ``host ms by package``: self time on the host by where the code lives (cProfile): ``torch`` (its
  Python layers), ``opacus``, ``dpsweep``, ``C`` (calls into compiled code, mostly torch ops launching
  kernels) and ``other``. What is under ``dpsweep`` is ours to cut; the rest is the libraries';
- the costliest functions of opacus and dpsweep, and the top ops by self host time (torch.profiler).

Run it on a GPU; on the CPU twin the figures are of the CPU (no ``gpu ms``).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import training_speed as ts

from dpsweep.config import CNNConfig, DigitsConfig, DPConfig, GradSampleMode, SGDConfig, VGG16FrozenConfig
from dpsweep.data import loaders, resident
from dpsweep.mechanisms.opacus_engine import make_private
from dpsweep.memory import stages
from dpsweep.models import classifiers, feature_cache
from dpsweep.models.optimizers import build_optimizer
from dpsweep.tasks.classifier.passes import Trainer, train_pass
from dpsweep.tasks.classifier.task import EXTRACT_BATCH_SIZE

Batch = tuple[torch.Tensor, torch.Tensor]
PACKAGES = ("opacus", "dpsweep", "torch")  # host time is grouped by the first of these in a file's path
HEAD_UNITS = 128


@dataclass(frozen=True)
class Setting:
    model: str  # cnn | head
    dp: str  # off | hooks | ghost
    data: str  # fixed (B rows drawn on the device) | loader (DataLoader + Opacus) | resident (device_data)
    batch_size: int


SETTINGS: dict[str, Setting] = {
    "cnn-off": Setting("cnn", "off", "fixed", 256),
    "cnn-hooks": Setting("cnn", "hooks", "fixed", 256),
    "cnn-ghost": Setting("cnn", "ghost", "fixed", 256),
    "head-off": Setting("head", "off", "fixed", 256),
    "head-ghost": Setting("head", "ghost", "fixed", 256),
    "loader-hooks": Setting("cnn", "hooks", "loader", 64),
    "resident-hooks": Setting("cnn", "hooks", "resident", 64),
}


def _datasets(device: torch.device, work: Path) -> dict[str, tuple[Callable[[], nn.Module], TensorDataset]]:
    """model -> (a factory of it, its training data): the cnn on 28 px digits, the head on cached maps."""
    digits28 = loaders.build(DigitsConfig(image_size=28))
    assert isinstance(digits28.train, TensorDataset)
    small = loaders.build(DigitsConfig(image_size=ts.CACHE_IMAGE_SIZE))
    torch.manual_seed(ts.SEED)
    vgg = classifiers.build(VGG16FrozenConfig(hidden_units=HEAD_UNITS, pretrained=False), small.input_shape,
                          small.num_classes)  # fmt: skip
    assert isinstance(vgg, classifiers.FrozenVGG16)
    cached = feature_cache.cached_splits(
        vgg, small, {"profile": ts.CACHE_IMAGE_SIZE}, root=work, batch_size=EXTRACT_BATCH_SIZE, device=device
    )
    head = cached.head(vgg).cpu()
    assert isinstance(cached.train, TensorDataset)
    return {
        "cnn": (lambda: classifiers.build(CNNConfig(), digits28.input_shape, digits28.num_classes), digits28.train),
        "head": (lambda: copy.deepcopy(head), cached.train),
    }


def build(setting: Setting, factory: Callable[[], nn.Module], dataset: TensorDataset, device: torch.device
          ) -> tuple[Trainer, Iterator[Batch]]:  # fmt: skip
    """The setting's trainer and an endless stream of its batches, as training_speed.measure builds them."""
    torch.manual_seed(ts.SEED)
    model = factory().to(device)
    optimizer = build_optimizer(SGDConfig(), model)
    generator = torch.Generator().manual_seed(ts.SEED)
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=setting.batch_size, shuffle=setting.dp == "off",
                                         generator=generator)  # fmt: skip
    criterion: nn.Module = nn.CrossEntropyLoss()
    if setting.dp != "off":
        dp = DPConfig(noise_multiplier=ts.SIGMA, max_grad_norm=ts.MAX_GRAD_NORM,
                      grad_sample_mode=GradSampleMode(setting.dp))  # fmt: skip
        _, model, optimizer, criterion, loader = make_private(
            dp, ts.SIGMA, dp.max_grad_norm, model, optimizer, loader, criterion
        )
    model.train()
    if setting.data == "fixed":
        x, y = dataset.tensors[0].to(device), dataset.tensors[1].to(device)
        stream: Iterator[Batch] = iter(ts.FixedBatches(x, y, setting.batch_size, device))
    elif setting.data == "resident":
        x, y = resident.materialize(dataset)
        batches = resident.PoissonBatches(x, y, sample_rate=float(loader.sample_rate), device=device,  # type: ignore[attr-defined]
                                             generator=resident.device_generator(device, ts.SEED))  # fmt: skip
        stream = ts._cycle(batches)
    else:
        stream = ts._cycle(loader)
    return Trainer(model, optimizer, criterion, device), stream


def _package(filename: str) -> str:
    if filename == "~" or filename.startswith("<"):
        return "C"
    for name in PACKAGES:
        if f"/{name}/" in filename:
            return name
    return "other"


def profile_setting(name: str, setting: Setting, model: tuple[Callable[[], nn.Module], TensorDataset],
                    device: torch.device, steps: int, trace_dir: Path | None) -> dict[str, Any]:  # fmt: skip
    trainer, stream = build(setting, *model, device)
    idle = stages.StageRecorder(stages.monitor_for(device), active=False)

    def run(n: int) -> None:
        for _ in range(n):
            train_pass(trainer, next(stream), idle)

    run(3)  # warm-up (cuDNN autotuning, Opacus's first-step set-up)
    synced = []
    for _ in range(steps):
        ts._sync(device)
        start = time.perf_counter()
        run(1)
        ts._sync(device)
        synced.append(time.perf_counter() - start)
    ts._sync(device)
    start = time.perf_counter()
    run(steps)
    ts._sync(device)
    b2b_s = (time.perf_counter() - start) / steps

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run(steps)
        ts._sync(device)
    averages = prof.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", 0.0) for e in averages) if device.type == "cuda" else 0.0
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_dir / f"{name}.json"))

    profiler = cProfile.Profile()
    profiler.enable()
    run(steps)
    ts._sync(device)
    profiler.disable()
    by_package: dict[str, float] = defaultdict(float)
    ours: list[tuple[float, str]] = []
    for (filename, line, function), (_, _, self_s, _, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        package = _package(filename)
        by_package[package] += self_s
        if package in ("opacus", "dpsweep"):
            ours.append((self_s, f"{package}: {Path(filename).name}:{line} {function}"))
    ours.sort(reverse=True)
    ms = 1000 / steps
    result = {
        "setting": name, **setting.__dict__,
        "synced_ms": statistics.median(synced) * 1000, "b2b_ms": b2b_s * 1000,
        "gpu_ms": gpu_us / 1000 / steps if device.type == "cuda" else None,
        "host_ms_by_package": {k: v * ms for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])},
        "top_library_functions": [f"{s * ms:.3f} ms  {what}" for s, what in ours[:8]],
        "top_ops": averages.table(sort_by="self_cpu_time_total", row_limit=10),
    }  # fmt: skip
    if result["gpu_ms"] is not None:
        result["busy_share"] = result["gpu_ms"] / result["b2b_ms"]
    ts._free(device)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=100, help="steps per measurement (default 100)")
    parser.add_argument("--only", help=f"comma-separated settings (default all: {', '.join(SETTINGS)})")
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument("--trace-dir", type=Path, help="write a Chrome trace per setting here")
    args = parser.parse_args()
    chosen = [s.strip() for s in args.only.split(",")] if args.only else list(SETTINGS)
    unknown = [s for s in chosen if s not in SETTINGS]
    if unknown:
        parser.error(f"--only={','.join(unknown)}: unknown setting; valid: {', '.join(SETTINGS)}")
    device = torch.device(args.device)
    print(f"profile on {device} ({ts.device_name(device)}), torch {torch.__version__}, {args.steps} steps each",
          flush=True)  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as work:
        models = _datasets(device, Path(work))
        for name in chosen:
            setting = SETTINGS[name]
            r = profile_setting(name, setting, models[setting.model], device, args.steps, args.trace_dir)
            results.append(r)
            gpu = f"gpu {r['gpu_ms']:.3f} ms (busy {r['busy_share']:.0%})" if r["gpu_ms"] is not None else ""
            host = ", ".join(f"{k} {v:.3f}" for k, v in r["host_ms_by_package"].items())
            print(f"\n== {name}: B={setting.batch_size} {setting.data}; synced {r['synced_ms']:.3f} ms/step, "
                  f"b2b {r['b2b_ms']:.3f} ms/step; {gpu}\n   host ms/step by package: {host}", flush=True)  # fmt: skip
            for line in r["top_library_functions"]:
                print(f"   {line}")
            print(r["top_ops"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
