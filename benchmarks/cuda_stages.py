"""Check: dpsweep's logged memory stages against an independent reading taken in a separate process.

    .venv/bin/python benchmarks/cuda_stages.py                     # cnn and vgg16_frozen on cuda
    .venv/bin/python benchmarks/cuda_stages.py --device cpu        # the CPU twin (checks the script only)
    .venv/bin/python benchmarks/cuda_stages.py --json stages.json  # also write every figure as JSON

For each config (``--case``: the Opacus CNN with DP hooks and ghost clipping, and VGG16 with random weights,
no feature cache, DP ghost clipping and non-private):

1. ``dpsweep train.probe=true train.device=<device>`` runs the config's first training iteration in a
   process of its own and logs the four stages (``system/memory/<stage>_mib``), the iteration peak and the
   reserved peak to a temporary sqlite MLflow store, tagged ``memory.backend``.
2. This script then starts itself again (``--independent``, another fresh process) and rebuilds the same
   iteration from dpsweep's building blocks (dataset, model, optimizer, ``dpsgd.make_private``), reading
   ``torch.cuda.memory_allocated()`` directly after the model is on the device, after the batch is, after
   ``loss.backward()`` and after ``optimizer.step()``: the points at which dpsweep marks its stages.
   It does not use ``dpsweep.memory.stages``.

It prints both levels per stage and their difference, and exits 1 when a logged figure is missing, the
backend is not the one expected (``cuda`` on a GPU), or a level differs from the independent reading by
more than ``--tolerance`` (relative; default 1%).

The CPU twin (``--device cpu``) reads ``dpsweep.memory.stages.live_tensor_bytes`` in step 2 instead, so it is not
independent: it only checks that this script and the CPU path run (the test suite runs it that way).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dpsweep.memory import tables
from dpsweep.memory.tables import metric

STAGES = ("model_load", "batch_load", "backward", "optimizer_step")
# name -> dpsweep overrides of one config (digits served at 224 px: VGG16's input size)
CASES: dict[str, list[str]] = {
    "cnn_hooks": ["model=cnn", "model.hidden_units=512", "dataset.image_size=112", "train.batch_size=256",
                  "dp=dpsgd", "dp.noise_multiplier=1.0", "dp.grad_sample_mode=hooks"],
    "cnn_ghost": ["model=cnn", "model.hidden_units=512", "dataset.image_size=112", "train.batch_size=256",
                  "dp=dpsgd", "dp.noise_multiplier=1.0", "dp.grad_sample_mode=ghost"],
    "vgg16_ghost": ["model=vgg16_frozen", "model.pretrained=false", "model.feature_cache=false",
                    "model.hidden_units=256", "dataset.image_size=224", "train.batch_size=64",
                    "dp=dpsgd", "dp.noise_multiplier=1.0", "dp.grad_sample_mode=ghost"],
    "vgg16_off": ["model=vgg16_frozen", "model.pretrained=false", "model.feature_cache=false",
                  "model.hidden_units=256", "dataset.image_size=224", "train.batch_size=64", "dp=off"],
}  # fmt: skip
# the figures checked, by name in bytes (a run logs them in MiB: dpsweep.memory.tables.metric, read back by logged)
LOGGED = (*(f"{s}_bytes" for s in STAGES), "iteration_peak_bytes", "reserved_peak_bytes")


# ---------------------------------------------------------------------------------------------
# the independent reading (a fresh process: --independent)
# ---------------------------------------------------------------------------------------------
def _reader(device_type: str) -> Callable[[], int]:
    import torch

    if device_type == "cuda":

        def read() -> int:
            torch.cuda.synchronize()
            return int(torch.cuda.memory_allocated())

        return read
    from dpsweep.memory.stages import live_tensor_bytes  # CPU twin: not independent (see the module doc)

    device = torch.device("cpu")
    baseline = live_tensor_bytes(device)
    return lambda: live_tensor_bytes(device) - baseline


def independent_levels(overrides: list[str], device_type: str) -> dict[str, int]:
    """The allocated bytes at the four stage points of the first iteration of ``overrides``."""
    import torch
    from hydra import compose, initialize_config_module
    from torch.utils.data import DataLoader, Subset

    from dpsweep.config import to_config
    from dpsweep.data import loaders
    from dpsweep.mechanisms import opacus_engine
    from dpsweep.models import classifiers
    from dpsweep.models.optimizers import build_optimizer

    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        cfg = to_config(compose("config", overrides=overrides))
    torch.manual_seed(cfg.train.seed)
    device = torch.device(device_type)
    data = loaders.build(cfg.dataset)
    read = _reader(device_type)  # after the data are built, as dpsweep's monitor is
    model = classifiers.build(cfg.model, data.input_shape, data.num_classes).to(device)
    optimizer = build_optimizer(cfg.optimizer, model)
    criterion: torch.nn.Module = torch.nn.CrossEntropyLoss()
    loader: DataLoader[Any] = DataLoader(data.train, batch_size=cfg.train.batch_size)
    if cfg.dp.enabled:
        assert cfg.dp.noise_multiplier is not None, "give the cases an explicit dp.noise_multiplier"
        _, model, optimizer, criterion, _ = opacus_engine.make_private(
            cfg.dp, cfg.dp.noise_multiplier, cfg.dp.max_grad_norm, model, optimizer, loader, criterion
        )
    levels = {"model_load": read()}
    pick = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))[: cfg.train.batch_size]  # type: ignore[arg-type]
    x, y = next(iter(DataLoader(Subset(data.train, pick.tolist()), batch_size=len(pick))))
    x, y = x.to(device), y.to(device)
    levels["batch_load"] = read()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    criterion(model(x), y).backward()
    levels["backward"] = read()
    optimizer.step()
    levels["optimizer_step"] = read()
    return levels


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------
def _run(command: list[str], cwd: Path) -> str:
    """Run ``command``; its output is shown in full when it fails."""
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def logged_figures(overrides: list[str], device_type: str, workdir: Path) -> tuple[str, dict[str, float]]:
    """Run dpsweep's probe of ``overrides`` and return its memory backend tag and memory metrics."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    extra = [f"tracking.uri={uri}", "tracking.experiment_name=cuda_stages", "train.probe=true",
             f"train.device={device_type}", f"hydra.run.dir={workdir / 'hydra'}"]  # fmt: skip
    _run([sys.executable, "-m", "dpsweep", *overrides, *extra], workdir)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("cuda_stages")
    assert experiment is not None
    run = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]
    return run.data.tags.get("memory.backend", ""), dict(run.data.metrics)


def check_case(name: str, device_type: str, tolerance: float, workdir: Path) -> dict[str, Any]:
    overrides = CASES[name]
    backend, metrics = logged_figures(overrides, device_type, workdir)
    out = _run([sys.executable, __file__, "--independent", "--device", device_type, "--case", name], workdir)
    independent: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    expected_backend = "cuda" if device_type == "cuda" else "cpu-tensors"
    problems = [f"memory.backend={backend!r}, expected {expected_backend!r}"] if backend != expected_backend else []
    problems += [f"{metric(name)} was not logged" for name in LOGGED if tables.logged(metrics, name) is None]
    rows = []
    for stage in STAGES:
        found = tables.logged(metrics, f"{stage}_bytes")
        logged = float("nan") if found is None else found
        ref = independent[stage]
        rel = abs(logged - ref) / max(ref, 1)
        rows.append({"stage": stage, "logged_bytes": logged, "independent_bytes": ref, "rel_difference": rel})
        if not rel <= tolerance:
            problems.append(f"{stage}: logged {logged:.0f} B vs independent {ref} B ({rel:.2%} > {tolerance:.0%})")
    peaks = {k: tables.logged(metrics, k) for k in LOGGED[-2:]}
    return {"case": name, "overrides": overrides, "backend": backend, "stages": rows, **peaks, "problems": problems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    parser.add_argument("--tolerance", type=float, default=0.01, help="relative (default 0.01)")
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument("--independent", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = args.case or list(CASES)
    if args.independent:  # the second process: one line of JSON
        print(json.dumps(independent_levels(CASES[cases[0]], args.device)))
        return
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    results = []
    for name in cases:
        with tempfile.TemporaryDirectory(prefix="cuda_stages_") as tmp:
            r = check_case(name, args.device, args.tolerance, Path(tmp))
        results.append(r)
        print(f"{name} (memory.backend={r['backend']}): {' '.join(r['overrides'])}")
        for row in r["stages"]:
            print(f"  {row['stage']:<15} logged {row['logged_bytes']:>14,.0f} B   independent "
                  f"{row['independent_bytes']:>14,} B   difference {row['rel_difference']:.3%}")  # fmt: skip
        print(f"  iteration peak {r['iteration_peak_bytes'] or math.nan:,.0f} B, reserved peak "
              f"{r['reserved_peak_bytes'] or math.nan:,.0f} B")  # fmt: skip
        for p in r["problems"]:
            print(f"  PROBLEM: {p}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    failed = [r["case"] for r in results if r["problems"]]
    print("cuda_stages: " + (f"FAIL ({', '.join(failed)})" if failed else "PASS"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
