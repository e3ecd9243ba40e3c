"""Benchmark: DP-FTRL against DP-SGD on digits at matched ε, per example and per user (issue 17).

    .venv/bin/python benchmarks/mechanisms.py                   # 3 seeds, ε in {1, 3, 8} (about 15 min on 2 cores)
    .venv/bin/python benchmarks/mechanisms.py --seeds 1 --epsilons 8 --json mechanisms.json

Every run is ``dpsweep.run.runner.train`` in this process with the presets' settings, σ calibrated so that
the run's ε (RDP, δ = 1e-5) is the target:

- example level: ``experiment=ftrl_vs_sgd_digits`` (B = 64, 8 epochs, SGD/FTRL with momentum 0.9);
- user level: ``experiment=ftrl_vs_sgd_digits_users`` (``model=mlp`` on the native 8x8 digits, 50
  users with a Dirichlet(0.5) label skew, 10 users a step, at most 16 examples of a user per step,
  30 epochs).

DP-SGD's ε is amplified by its Poisson sampling; DP-FTRL samples nothing (a fixed order) and its ε
is that of its tree's Gaussian mechanism, so at one ε it needs a larger σ. It prints test accuracy
(mean ± std over the seeds) per mechanism, unit and ε, and seconds per epoch (from the timestamps of
the per-epoch ε: training and evaluation) of DP-FTRL against DP-SGD. Goal: DP-FTRL within 20% of
DP-SGD's time per epoch (PASS or FAIL; exit code 1 on FAIL).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

GOAL_TIME_RATIO = 1.2
PRESETS = {"example": "ftrl_vs_sgd_digits", "user": "ftrl_vs_sgd_digits_users"}


def runs(unit: str, mechanism: str, epsilon: float, seeds: int, store: str) -> dict[str, Any]:
    """Test accuracies and seconds per epoch over seeds 0..seeds-1."""
    from hydra import compose, initialize_config_module
    from mlflow.tracking import MlflowClient

    from dpsweep.run.runner import train

    client = MlflowClient(store)
    out: dict[str, Any] = {"accuracies": [], "seconds_per_epoch": [], "sigma": None}
    for seed in range(seeds):
        with initialize_config_module("dpsweep.conf", version_base="1.3"):
            cfg = compose("config", overrides=[
                f"experiment={PRESETS[unit]}", f"tracking.uri={store}", "tracking.log_model=false",
                "train.progress=false", f"train.seed={seed}", f"dp.mechanism={mechanism}",
                f"dp.target_epsilon={epsilon}",
            ])  # fmt: skip
        result = train(cfg)
        out["accuracies"].append(result.test_accuracy)
        out["sigma"] = result.noise_multiplier
        out["epsilon"] = result.epsilon
        stamps = sorted((m.step, m.timestamp) for m in client.get_metric_history(result.run_id, "epsilon"))
        if len(stamps) > 1:
            out["seconds_per_epoch"].append((stamps[-1][1] - stamps[0][1]) / 1000 / (len(stamps) - 1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--units", nargs="+", default=["example", "user"], choices=sorted(PRESETS))
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    figures: dict[str, Any] = {"seeds": args.seeds, "rows": []}
    with tempfile.TemporaryDirectory(prefix="dpsweep-mechanisms-") as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        for unit in args.units:
            for eps in args.epsilons:
                for mechanism in ("dpsgd", "dpftrl"):
                    row = runs(unit, mechanism, eps, args.seeds, store)
                    figures["rows"].append({"unit": unit, "mechanism": mechanism, "target_epsilon": eps, **row})
    print(f"digits, test accuracy (%) at matched ε (RDP, δ = 1e-5), mean ± std over {args.seeds} seeds")
    print(f"  {'unit':<8} {'ε':>4}  {'mechanism':<7} {'accuracy':>15}  {'σ':>8}  s/epoch")
    for r in figures["rows"]:
        accs = r["accuracies"]
        std = 100 * statistics.stdev(accs) if len(accs) > 1 else float("nan")
        speed = statistics.mean(r["seconds_per_epoch"]) if r["seconds_per_epoch"] else float("nan")
        print(f"  {r['unit']:<8} {r['target_epsilon']:>4g}  {r['mechanism']:<7} {100 * statistics.mean(accs):6.2f} ± "
              f"{std:5.2f}  {r['sigma']:8.3g}  {speed:.3f}")  # fmt: skip
    passed = True
    for unit in args.units:
        times = {m: [t for r in figures["rows"] if r["unit"] == unit and r["mechanism"] == m
                     for t in r["seconds_per_epoch"]] for m in ("dpsgd", "dpftrl")}  # fmt: skip
        if times["dpsgd"] and times["dpftrl"]:
            ratio = statistics.mean(times["dpftrl"]) / statistics.mean(times["dpsgd"])
            ok = ratio <= GOAL_TIME_RATIO
            passed = passed and ok
            figures[f"time_ratio_{unit}"] = ratio
            print(f"  {'PASS' if ok else 'FAIL'}: {unit} level, DP-FTRL / DP-SGD seconds per epoch {ratio:.2f}x "
                  f"(goal <= {GOAL_TIME_RATIO:g}x)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
