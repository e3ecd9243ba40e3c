"""Benchmark: task=gan's synthetic data on digits, scored by TSTR accuracy (issue 16).

    .venv/bin/python benchmarks/gan.py                              # 3 seeds (about 35 min on 2 cores)
    .venv/bin/python benchmarks/gan.py --seeds 1 --epochs 30        # a quick look
    .venv/bin/python benchmarks/gan.py --json gan.json --grids grids/   # the figures and the final sample grids

Rows, each a mean ± std over ``--seeds`` seeds of the accuracy on the real digits test split of the
``cnn`` classifier trained with the fixed TSTR recipe (``gan.tstr_*``), its epoch chosen on a
held-out synthetic split (never on real data):

- ``real data``: the classifier trained on the real training split (the non-private GAN runs'
  ``real_accuracy``: the same recipe, the epoch chosen on a held-out real training split);
- ``non-private GAN``: ``task=gan dp=off`` with the task's defaults (B = 64, 5 critic steps per
  generator step, critic width 32), ``--epochs`` epochs;
- ``DP GAN ε≈10`` and ``DP GAN ε≈3``: ``experiment=dpgan_digits dp.target_epsilon=…`` (B = 512, one
  critic step per generator step, critic width 16, 100 epochs, the synthetic set a mixture of the
  generator's last 10 snapshots 5 epochs apart; σ calibrated over every critic step; RDP, δ = 1e-5,
  per example);
- ``private Gaussian ε≈10``: the simple private baseline: per class, a Gaussian with the class's
  mean and per-pixel variance, both released with one Gaussian mechanism (below), sampled to a
  synthetic set of N examples and scored with the same recipe.

The private Gaussian: pixels u ∈ [0, 1]^d are clipped to L2 norm R (``--gaussian-norm``; by default
√d / 2 = 14, half the largest possible norm: chosen without looking at the data);
each example adds v = [1, u/R, (u∘u)/R] to its class's sums, so ‖v‖ ≤ √3 (‖u∘u‖ ≤ ‖u‖ for u ∈ [0, 1]),
and one example added or removed changes one class's sums by at most √3 in L2. Every class's sums
get N(0, 3σ² I): one Gaussian mechanism with noise multiplier σ (Dwork & Roth 2014, Thm. A.1 for
the mechanism; its ε here is exact, from dp-accounting's PLD accountant, with no sampling and hence
no amplification), σ calibrated to ``--gaussian-epsilon`` at δ = 1e-5.

Goals (printed as PASS or FAIL; the exit code is 1 when one fails): the non-private GAN within 10
points of real data; DP at ε≈10 above the private Gaussian at the same ε. It also prints seconds
per epoch (from the metric timestamps of epochs 1 and the last), DP against non-private.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GOAL_NONPRIVATE_POINTS = 10.0
DELTA = 1e-5


@dataclass
class Row:
    name: str
    accuracies: list[float] = field(default_factory=list)
    epsilon: float | None = None
    seconds_per_epoch: list[float] = field(default_factory=list)

    def mean(self) -> float:
        return 100 * statistics.mean(self.accuracies)

    def std(self) -> float:
        return 100 * statistics.stdev(self.accuracies) if len(self.accuracies) > 1 else float("nan")


def gan_runs(name: str, overrides: list[str], seeds: int, store: str, grids: Path | None) -> tuple[Row, list[float]]:
    """task=gan runs over seeds 0..seeds-1: their TSTR row and their real_accuracy (non-private runs)."""
    from hydra import compose, initialize_config_module
    from mlflow.tracking import MlflowClient

    from dpsweep.run.runner import train

    row, real = Row(name), []
    client = MlflowClient(store)
    for seed in range(seeds):
        with initialize_config_module("dpsweep.conf", version_base="1.3"):
            cfg = compose("config", overrides=[
                "task=gan", f"tracking.uri={store}", "tracking.experiment_name=gan_benchmark", "train.progress=false",
                "tracking.log_model=false", f"train.seed={seed}", *overrides,
            ])  # fmt: skip
        result = train(cfg)
        row.accuracies.append(result.score)
        row.epsilon = result.epsilon
        run = client.get_run(result.run_id)
        if "real_accuracy" in run.data.metrics:
            real.append(run.data.metrics["real_accuracy"])
        stamps = sorted((m.step, m.timestamp) for m in client.get_metric_history(result.run_id, "critic_steps"))
        if len(stamps) > 1:  # epochs 2..last: training, grids every task.grid_every epochs, no final evaluation
            row.seconds_per_epoch.append((stamps[-2][1] - stamps[0][1]) / 1000 / max(len(stamps) - 2, 1))
        if grids is not None and seed == 0:
            grids.mkdir(parents=True, exist_ok=True)
            last = max(a.path for a in client.list_artifacts(result.run_id, "samples"))
            target = grids / f"{name.replace(' ', '_').replace('≈', '')}.png"
            target.write_bytes(Path(client.download_artifacts(result.run_id, last)).read_bytes())
    return row, real


def gaussian_sigma(target_epsilon: float) -> float:
    """The smallest σ (to 1e-3) of one Gaussian mechanism whose ε at δ is within the target (PLD)."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    def eps(sigma: float) -> float:
        accountant = pld_privacy_accountant.PLDAccountant()
        return float(accountant.compose(dp_event.GaussianDpEvent(sigma)).get_epsilon(DELTA))

    low, high = 0.01, 100.0
    while high - low > 1e-3:
        mid = (low + high) / 2
        low, high = (low, mid) if eps(mid) <= target_epsilon else (mid, high)
    return high


def private_gaussian(target_epsilon: float, norm: float, seeds: int, tstr: dict[str, Any]) -> Row:
    """The private class-conditional Gaussian baseline (see the module docstring), scored by TSTR."""
    import torch

    from dpsweep.config import CNNConfig, DigitsConfig
    from dpsweep.data import loaders, resident
    from dpsweep.models import classifiers
    from dpsweep.tasks.gan import synthetic

    splits = loaders.build(DigitsConfig())
    x, y = resident.materialize(splits.train)
    test = resident.materialize(splits.test)
    low, high = loaders.value_range("digits")
    sigma = gaussian_sigma(target_epsilon)
    row = Row(f"private Gaussian ε≈{target_epsilon:g}", epsilon=target_epsilon)
    u = ((x - low) / (high - low)).flatten(1)
    u = u * (norm / u.norm(dim=1, keepdim=True).clamp(min=norm)).clamp(max=1.0)  # clip to ‖u‖ <= R
    v = torch.cat([torch.ones(len(u), 1), u / norm, u * u / norm], dim=1)  # ‖v‖ <= √3
    d = u.shape[1]
    for seed in range(seeds):
        rng = torch.Generator().manual_seed(seed)
        images, labels = [], []
        for c in range(splits.num_classes):
            sums = v[y == c].sum(0) + 3**0.5 * sigma * torch.randn(v.shape[1], generator=rng)
            count = float(sums[0].clamp(min=1.0))
            mean = (sums[1 : d + 1] * norm / count).clamp(0, 1)
            var = (sums[d + 1 :] * norm / count - mean**2).clamp(1e-4, 0.25)
            n_c = len(y) // splits.num_classes + (1 if c < len(y) % splits.num_classes else 0)
            sample = (mean + var.sqrt() * torch.randn(n_c, d, generator=rng)).clamp(0, 1)
            images.append((low + (high - low) * sample).view(n_c, *splits.input_shape))
            labels.append(torch.full((n_c,), c))
        recipe = synthetic.Recipe(tstr["epochs"], tstr["lr"], tstr["batch_size"], tstr["val_fraction"])

        def classifier() -> torch.nn.Module:
            return classifiers.build(CNNConfig(), splits.input_shape, splits.num_classes)

        result = synthetic.tstr_accuracy(
            classifier, (torch.cat(images), torch.cat(labels)), test, recipe, seed, torch.device("cpu")
        )
        row.accuracies.append(result.accuracy)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[10.0, 3.0], help="DP GAN targets")
    parser.add_argument("--gaussian-epsilon", type=float, default=10.0)
    parser.add_argument(
        "--gaussian-norm", type=float, default=14.0,
        help="R: the L2 bound on pixels in [0, 1]; default sqrt(28*28)/2, half the largest norm (data-independent)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the figures here as JSON")
    parser.add_argument("--grids", type=Path, help="copy seed 0's final sample grid of each GAN row here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from dpsweep.config import GanTaskConfig

    g = GanTaskConfig()
    tstr = {
        "epochs": g.tstr_epochs,
        "lr": g.tstr_lr,
        "batch_size": g.tstr_batch_size,
        "val_fraction": g.tstr_val_fraction,
    }
    grids = f"task.grid_every={max(args.epochs // 4, 1)}"
    with tempfile.TemporaryDirectory(prefix="dpsweep-gan-") as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        nonprivate, real = gan_runs(
            "non-private GAN", [f"train.epochs={args.epochs}", grids, "dp=off"], args.seeds, store, args.grids
        )
        rows = [Row("real data", real), nonprivate]
        for eps in args.epsilons:
            overrides = ["experiment=dpgan_digits", grids, f"dp.target_epsilon={eps}"]
            row, _ = gan_runs(f"DP GAN ε≈{eps:g}", overrides, args.seeds, store, args.grids)
            rows.append(row)
    rows.append(private_gaussian(args.gaussian_epsilon, args.gaussian_norm, args.seeds, tstr))
    print(f"digits, TSTR accuracy on the real test split (%), {args.seeds} seeds, {args.epochs} epochs, δ = {DELTA:g}")
    for row in rows:
        eps = f"ε={row.epsilon:.3f}" if row.epsilon is not None else "non-private"
        speed = f"  {statistics.mean(row.seconds_per_epoch):.2f} s/epoch" if row.seconds_per_epoch else ""
        print(f"  {row.name:<26} {row.mean():6.2f} ± {row.std():5.2f}  {eps}{speed}")
    by_name = {r.name: r for r in rows}
    gap = by_name["real data"].mean() - nonprivate.mean()
    checks = [(f"non-private GAN within {GOAL_NONPRIVATE_POINTS:g} points of real data ({gap:+.2f})",
               gap <= GOAL_NONPRIVATE_POINTS)]  # fmt: skip
    dp10 = by_name.get(f"DP GAN ε≈{args.gaussian_epsilon:g}")
    gaussian = rows[-1]
    if dp10 is not None:
        margin = dp10.mean() - gaussian.mean()
        checks.append((f"DP GAN above the private Gaussian at ε≈{args.gaussian_epsilon:g} ({margin:+.2f})", margin > 0))
    if dp10 is not None and dp10.seconds_per_epoch and nonprivate.seconds_per_epoch:
        ratio = statistics.mean(dp10.seconds_per_epoch) / statistics.mean(nonprivate.seconds_per_epoch)
        print(f"  seconds per epoch, DP / non-private: {ratio:.2f}x")
    for text, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}: {text}")
    if args.json:
        figures = {r.name: {"accuracies": r.accuracies, "epsilon": r.epsilon, "seconds_per_epoch": r.seconds_per_epoch}
                   for r in rows}  # fmt: skip
        args.json.write_text(json.dumps({"epochs": args.epochs, "seeds": args.seeds, "rows": figures}, indent=1))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
