"""Benchmark: ε for a 10,000-point (B, σ, epochs) grid under RDP; the target is at most 2 s on 2 cores.

    .venv/bin/python benchmarks/epsilon_grid.py            # prints the figures, exits 1 if over target

RDP composes linearly in the number of steps, so ``dpsweep.privacy.schedule.epsilon_grid`` calls Opacus's
``compute_rdp`` once per (q, σ) pair over all orders, then scales and converts per grid point. The
script also times the point-by-point path (one full accountant call per point) on a subset and
prints the speed-up measured in this run.
"""

from __future__ import annotations

import os
import time
import warnings

import numpy as np

from dpsweep.privacy.schedule import GridAxes, epsilon, epsilon_grid, poisson_schedule

TARGET_S = 2.0
N = 60_000
DELTA = 1e-5
BATCH_SIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # 10
SIGMAS = list(np.round(np.linspace(0.5, 3.0, 10), 3))  # 10
EPOCHS = list(range(1, 101))  # 100 -> 10 x 10 x 100 = 10,000 points


def main() -> int:
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    points = len(BATCH_SIZES) * len(SIGMAS) * len(EPOCHS)
    start = time.perf_counter()
    axes = GridAxes(batch_sizes=BATCH_SIZES, noise_multipliers=SIGMAS, epochs=EPOCHS)
    grid = epsilon_grid(N, axes, delta=DELTA)
    grid_s = time.perf_counter() - start

    rng = np.random.default_rng(0)
    sample = [(int(rng.integers(len(BATCH_SIZES))), int(rng.integers(len(SIGMAS))), int(rng.integers(len(EPOCHS))))
              for _ in range(30)]  # fmt: skip
    start = time.perf_counter()
    for i, j, k in sample:
        schedule = poisson_schedule(N, BATCH_SIZES[i])
        r = epsilon(schedule, noise_multiplier=SIGMAS[j], delta=DELTA, epochs=EPOCHS[k])
        assert r.epsilon == grid[i, j, k], (r.epsilon, grid[i, j, k])  # the fast path is exact
    naive_per_point_s = (time.perf_counter() - start) / len(sample)

    print(f"machine: {os.cpu_count()} cores")
    print(f"grid: {len(BATCH_SIZES)} B x {len(SIGMAS)} σ x {len(EPOCHS)} epochs = {points} points, N={N}, δ={DELTA}")
    print(f"epsilon_grid: {grid_s:.3f} s ({points / grid_s:,.0f} points/s); target <= {TARGET_S} s")
    print(f"point by point: {naive_per_point_s * 1e3:.1f} ms/point -> {naive_per_point_s * points:.1f} s for the grid")
    print(f"speed-up (same run): {naive_per_point_s * points / grid_s:.0f}x; 30 sampled points equal exactly")
    ok = grid_s <= TARGET_S
    print("PASS" if ok else "FAIL: over target")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
