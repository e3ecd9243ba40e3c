"""Benchmark: the one-run privacy audit (issue 36) on digits, at claimed ε = 1, 4 and 8.

    .venv/bin/python benchmarks/audit.py                  # 20 seeds (about 7 minutes on 2 cores)
    .venv/bin/python benchmarks/audit.py --seeds 5 --json /tmp/audit.json

Each run is the default digits/cnn DP-SGD run (B = 64, 10 epochs, C = 1, δ = 1e-5, PLD; σ calibrated
to the claim) with ``audit.mode=white_box``: 1,000 Dirac gradient canaries, 100 guesses, 95%
confidence (:mod:`dpsweep.audit`). For each claimed ε it records:

- correct runs, seeds 0 .. n − 1 (the audit's seed with them): their lower bounds (mean, largest,
  and how many exceed the claim: soundness wants none), and the share of the claim the mean reaches;
- one run with each bug of ``dpsweep.audit.planted.PLANTED_BUGS`` planted (seed 0): its bound, and
  whether it exceeds the claim (a detection);
- the cost: the median wall time of 3 audit runs against 3 plain runs of the same config (MLflow
  included, in this process);
- correct runs with ``audit.mode=black_box`` (1,000 mislabelled training examples as canaries, about
  half left out, scored by the final model's loss), the same seeds: their bounds.

Writes ``--json`` (default ``analysis/data/audit_cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dpsweep.audit import planted

CLAIMS = (1.0, 4.0, 8.0)


def run(store: str, overrides: list[str], bug: str | None = None) -> tuple[dict[str, float], float]:
    """One run's metrics and its wall time."""
    from hydra import compose, initialize_config_module

    from dpsweep.run.runner import train

    if bug is None:
        os.environ.pop(planted.PLANTED_BUG_ENV, None)
    else:
        os.environ[planted.PLANTED_BUG_ENV] = bug
    with initialize_config_module("dpsweep.conf", version_base="1.3"):
        cfg = compose("config", overrides=[
            f"tracking.uri={store}", "tracking.experiment_name=audit", "tracking.log_model=false",
            "train.progress=false", *overrides,
        ])  # fmt: skip
    started = time.perf_counter()
    result = train(cfg)
    seconds = time.perf_counter() - started
    os.environ.pop(planted.PLANTED_BUG_ENV, None)
    from mlflow.tracking import MlflowClient

    return dict(MlflowClient(store).get_run(result.run_id).data.metrics), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--json", default="analysis/data/audit_cpu.json")
    args = parser.parse_args()
    started = time.monotonic()
    record: dict[str, Any] = {"claims": {}}
    with tempfile.TemporaryDirectory(prefix="dpsweep-audit-") as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        for claim in CLAIMS:
            base = [f"dp.target_epsilon={claim:g}"]
            audit = [*base, "audit.mode=white_box"]
            bounds = [run(store, [*audit, f"train.seed={s}", f"audit.seed={s}"])[0] for s in range(args.seeds)]
            lower = [m["audit.epsilon_lower"] for m in bounds]
            bugs = {bug: run(store, audit, bug)[0]["audit.epsilon_lower"] for bug in planted.PLANTED_BUGS}
            blind = [run(store, [*base, "audit.mode=black_box", f"train.seed={s}", f"audit.seed={s}"])[0]
                     for s in range(args.seeds)]  # fmt: skip
            black = [m["audit.epsilon_lower"] for m in blind]
            black_bugs = {
                bug: run(store, [*base, "audit.mode=black_box"], bug)[0]["audit.epsilon_lower"]
                for bug in planted.PLANTED_BUGS
            }
            audit_s = [run(store, [*audit, "train.seed=100"])[1] for _ in range(3)]
            plain_s = [run(store, [*base, "train.seed=100"])[1] for _ in range(3)]
            cost = statistics.median(audit_s) / statistics.median(plain_s)
            record["claims"][f"{claim:g}"] = {
                "correct": {"bounds": lower, "mean": statistics.fmean(lower), "max": max(lower),
                            "flagged": sum(b > claim for b in lower),
                            "share_of_claim": statistics.fmean(lower) / claim},
                "planted": {bug: {"bound": b, "detected": b > claim} for bug, b in bugs.items()},
                "black_box": {"bounds": black, "mean": statistics.fmean(black), "max": max(black),
                              "flagged": sum(b > claim for b in black),
                              "planted": {bug: {"bound": b, "detected": b > claim} for bug, b in black_bugs.items()}},
                "seconds": {"audit": audit_s, "plain": plain_s, "ratio": cost},
            }  # fmt: skip
            print(f"claimed ε={claim:g}: correct runs' bound mean {statistics.fmean(lower):.3f} "
                  f"(max {max(lower):.3f}, {sum(b > claim for b in lower)} of {len(lower)} above the claim; "
                  f"{statistics.fmean(lower) / claim:.0%} of it); planted: "
                  + ", ".join(f"{bug} {b:.3f}{' DETECTED' if b > claim else ''}" for bug, b in bugs.items())
                  + f"; audit run / plain run: {cost:.2f}x; black box: mean {statistics.fmean(black):.3f} "
                  f"(max {max(black):.3f}, {sum(b > claim for b in black)} above), planted: "
                  + ", ".join(f"{bug} {b:.3f}{' DETECTED' if b > claim else ''}" for bug, b in black_bugs.items()),
                  flush=True)  # fmt: skip
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    )
    record |= {"machine": machine, "seconds": time.monotonic() - started, "seeds": args.seeds}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{machine}; {record['seconds']:.0f} s; wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
