"""Benchmark: an independent recomputation of the Poisson-subsampled Gaussian's privacy profile, set
beside :mod:`dpsweep.privacy.certainty` (issue 58): the ε interval, μ-GDP and the attack risk.

    .venv/bin/python benchmarks/certainty_check.py            # about a minute on 2 cores
    .venv/bin/python benchmarks/certainty_check.py --json /tmp/certainty_check.json

The independent figures use numpy alone, not dpsweep's code and not dp-accounting's: the method of
Koskela, Jälkö & Honkela 2020 ("Computing Tight Differential Privacy Guarantees Using FFT", AISTATS):

1. one step's privacy loss distribution, for each neighbour direction (remove: x ~ (1 - q)N(0, σ²) +
   qN(1, σ²) against N(0, σ²); add: the reverse), by numerical integration over the output x (the
   midpoint rule on a fine grid of x), each x's mass put on the nearest point of a grid of losses;
2. k steps by FFT on a periodic grid of losses [-L, L) (Koskela et al.'s Alg. 1: the k-th power of
   the step's transform);
3. δ(ε) = Σ_{l > ε} p_l (1 - e^{ε - l}), ε(δ) by bisection, the larger of the two directions;
4. the trade-off curve directly by Neyman–Pearson (the most powerful test at FPR α rejects on the
   largest losses; Q's mass at loss l is p_l e^{-l}), not from (ε, δ) pairs as dpsweep bounds it;
5. μ: the smallest μ whose Gaussian profile lies above this profile (down to δ = 1e-12) on its grid.

Its numerical error is stated as the change of each figure when the grid of losses is halved
(nearest rounding is not a bound either way; this is the estimate Koskela et al. use in practice).
The check: the independent ε lies inside dpsweep's interval, allowing that error; dpsweep's μ, TPRs
and advantage are at least the independent ones (they are upper bounds), allowing it too.
Writes ``--json`` (default ``analysis/data/certainty_check.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from scipy import special

from dpsweep.privacy import certainty, ledger

CASES = {  # name: (q, σ, steps, δ)
    "opacus_mnist": (240 / 60000, 1.1, 60 * 60000 // 240, 1e-5),
    "small": (0.05, 1.0, 200, 1e-5),
}
FPRS = (0.01, 0.10)
X_POINTS = 4_000_000  # the midpoint rule's grid of outputs x
HALF_WIDTH = 16.0  # L: the periodic grid of losses is [-L, L)
FLOOR = 1e-12  # μ is certified down to this δ, as dpsweep's (certainty.DELTA_FLOOR)


def step_pmf(q: float, sigma: float, remove: bool, spacing: float, size: int) -> np.ndarray:
    """One step's loss distribution on the periodic grid: index j mod ``size`` holds loss j·spacing."""
    lo, hi = -12 * sigma, (1 if remove else 0) + 12 * sigma
    dx = (hi - lo) / X_POINTS
    x = lo + dx * (np.arange(X_POINTS) + 0.5)
    z = (2 * x - 1) / (2 * sigma**2)  # log N(1, σ²)/N(0, σ²) at x
    log_ratio = np.log1p(q * np.expm1(z)) if q < 1 else z  # log((1 - q) + q e^z)
    density = np.exp(-(x**2) / (2 * sigma**2)) / (sigma * math.sqrt(2 * math.pi))
    if remove:
        density = density * np.exp(log_ratio)  # (1 - q)N(0, σ²) + qN(1, σ²) = N(0, σ²)(1 - q + q e^z)
    loss = log_ratio if remove else -log_ratio
    index = np.rint(loss / spacing).astype(np.int64) % size
    return np.bincount(index, weights=density * dx, minlength=size)


def composed(q: float, sigma: float, steps: int, remove: bool, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The k-step loss distribution on [-L, L): (losses, masses), by FFT (Koskela et al. 2020, Alg. 1)."""
    spacing = 2 * HALF_WIDTH / size
    pmf = np.fft.irfft(np.fft.rfft(step_pmf(q, sigma, remove, spacing, size)) ** steps, n=size)
    j = np.arange(size)
    j = np.where(j < size // 2, j, j - size)  # unwrap: indices past the middle are negative losses
    order = np.argsort(j)
    return j[order] * spacing, pmf[order]


def delta_of(losses: np.ndarray, masses: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """δ(ε) = Σ_{l > ε} p_l (1 - e^{ε - l}) at each ε."""
    keep = losses > 0
    lo, pm = losses[keep], masses[keep]
    return np.array([float(np.sum(pm[lo > e] * -np.expm1(e - lo[lo > e]))) for e in np.atleast_1d(eps)])


def epsilon_of(losses: np.ndarray, masses: np.ndarray, delta: float) -> float:
    """ε(δ) by bisection on the nonincreasing δ(ε)."""
    low, high = 0.0, 1.0
    while delta_of(losses, masses, np.array([high]))[0] > delta:
        low, high = high, 2 * high
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if delta_of(losses, masses, np.array([mid]))[0] > delta else (low, mid)
    return high


def tpr_at(losses: np.ndarray, masses: np.ndarray, fpr: float) -> float:
    """The most powerful test's TPR at FPR α: reject on the largest losses (Neyman–Pearson), the boundary
    loss rejected with the probability that spends α exactly."""
    order = np.argsort(-losses)
    p = np.maximum(masses[order], 0.0)
    qm = p * np.exp(-losses[order])
    q_cum = np.cumsum(qm)
    i = int(np.searchsorted(q_cum, fpr))
    before_q = q_cum[i - 1] if i > 0 else 0.0
    share = (fpr - before_q) / qm[i] if qm[i] > 0 else 0.0
    return float(np.sum(p[:i]) + share * p[i])


def gaussian_delta(mu: float, eps: np.ndarray) -> np.ndarray:
    """μ-GDP's δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) (Dong, Roth & Su 2022), with scipy's ndtr."""
    return special.ndtr(-eps / mu + mu / 2) - np.exp(eps) * special.ndtr(-eps / mu - mu / 2)


def smallest_mu(eps: np.ndarray, deltas: np.ndarray) -> float:
    """The smallest μ (bisection) with δ_μ(ε) + FLOOR >= δ(ε) at every grid point."""
    low, high = 0.0, 64.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (low, mid) if np.all(gaussian_delta(mid, eps) + FLOOR >= deltas) else (mid, high)
    return high


def independent(q: float, sigma: float, steps: int, delta: float, size: int) -> dict[str, Any]:
    """The case's figures at one grid size, the larger of the two directions for each."""
    eps_grid = np.linspace(0.0, 12.0, 1201)
    figures: dict[str, Any] = {"epsilon": 0.0, "mu": 0.0, "advantage": 0.0, **{f"tpr_at_{a:g}": 0.0 for a in FPRS}}
    for remove in (True, False):
        losses, masses = composed(q, sigma, steps, remove, size)
        deltas = delta_of(losses, masses, eps_grid)
        figures["epsilon"] = max(figures["epsilon"], epsilon_of(losses, masses, delta))
        figures["mu"] = max(figures["mu"], smallest_mu(eps_grid, deltas))
        figures["advantage"] = max(figures["advantage"], float(deltas[0]))
        for a in FPRS:
            figures[f"tpr_at_{a:g}"] = max(figures[f"tpr_at_{a:g}"], tpr_at(losses, masses, a))
    return figures


def check(name: str, q: float, sigma: float, steps: int, delta: float) -> dict[str, Any]:
    """dpsweep's figures and the independent ones for one case, and whether they agree."""
    bill = ledger.Ledger((ledger.dpsgd(sigma, q, steps),))
    start = time.perf_counter()
    interval = certainty.epsilon_interval(bill, delta)
    found = certainty.profile(bill)
    ours = {"epsilon_lower": interval.lower, "epsilon_upper": interval.upper, "mu": certainty.mu_gdp(bill, found),
            **certainty.attack_risk(bill, found, FPRS)}  # fmt: skip
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    coarse, fine = independent(q, sigma, steps, delta, 1 << 20), independent(q, sigma, steps, delta, 1 << 21)
    theirs_s = time.perf_counter() - start
    error = {k: abs(fine[k] - coarse[k]) for k in fine}
    pairs = {"tpr_at_0.01": "tpr_at_1pct", "tpr_at_0.1": "tpr_at_10pct", "mu": "mu", "advantage": "advantage"}
    slack = error["epsilon"]
    agrees = {
        "epsilon_inside_interval": interval.lower - slack <= fine["epsilon"] <= interval.upper + slack,
        **{f"{k}_bounds_independent": ours[v] >= fine[k] - error[k] - 1e-9 for k, v in pairs.items()},
    }  # fmt: skip
    return {"case": name, "q": q, "noise_multiplier": sigma, "steps": steps, "delta": delta,
            "dpsweep": ours, "dpsweep_s": round(ours_s, 2), "independent": fine, "independent_error": error,
            "independent_s": round(theirs_s, 2), "grid": {"x_points": X_POINTS, "loss_half_width": HALF_WIDTH,
            "loss_points": [1 << 20, 1 << 21]}, "checks": agrees}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("analysis/data/certainty_check.json"))
    args = parser.parse_args()
    results = []
    for name, (q, sigma, steps, delta) in CASES.items():
        r = check(name, q, sigma, steps, delta)
        results.append(r)
        print(f"{name}: q={q:g} σ={sigma:g} k={steps} δ={delta:g}")
        for key in r["dpsweep"]:
            twin = {"epsilon_lower": "epsilon", "epsilon_upper": "epsilon", "tpr_at_1pct": "tpr_at_0.01",
                    "tpr_at_10pct": "tpr_at_0.1"}.get(key, key)  # fmt: skip
            print(f"  {key:14s} dpsweep {r['dpsweep'][key]:.6g}   independent {r['independent'][twin]:.6g}"
                  f" ± {r['independent_error'][twin]:.2g}")  # fmt: skip
        print(f"  checks: {r['checks']}  ({r['dpsweep_s']} s dpsweep, {r['independent_s']} s independent)")
    ok = all(all(r["checks"].values()) for r in results)
    out = {"machine": f"2-core VM ({os.cpu_count()} cores seen), {platform.python_version()}", "cases": results,
           "passed": ok}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
