"""Benchmark: what a one-run audit's analyses can show at best, in the idealised game (no training).

    .venv/bin/python benchmarks/audit_ideal.py            # about a minute on 2 cores

A Gaussian mechanism at claimed ε = 1, 4 and 8 (δ = 1e-5; one Gaussian of noise σ calibrated by PLD,
i.e. μ-GDP with μ = 1/σ) with m = 1,000 canaries, each included with probability ½: an included
canary's score is N(μ, 1), an excluded one's N(0, 1), the most a guesser can learn of a mechanism
that meets its claim exactly. The guesses are the audit's (:mod:`dpsweep.audit.white_box`): 100 on
the highest and lowest scores, and one on every canary split at the scores' widest middle gap. For
each claim, over 20 draws, it records the mean of both bounds (:mod:`dpsweep.audit.bound`, Steinke,
Nasr & Jagielski 2023; :mod:`dpsweep.audit.fdp`, Mahloujifar, Melis & Chaudhuri 2025), read as the
audit reads them (:func:`dpsweep.audit.guesses.metrics`: both analyses of both tests together at
95%). An audited run's bounds (``benchmarks/audit.py``) can be set against these: a real run's
canaries see a subsampled mechanism through other units' gradients, so its bounds sit below the
ideal ones.

Writes ``--json`` (default ``analysis/data/audit_ideal.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from dp_accounting import dp_event

from dpsweep.audit import guesses
from dpsweep.privacy import ledger

CLAIMS = (1.0, 4.0, 8.0)
DELTA = 1e-5
CANARIES = 1000
GUESSES = 100


def gaussian(sigma: float) -> ledger.Ledger:
    return ledger.Ledger((ledger.Entry("gaussian", dp_event.GaussianDpEvent(sigma)),))


def calibrated(claim: float) -> float:
    """σ of one Gaussian mechanism (sensitivity 1) at ε = ``claim`` and δ, by bisection on its PLD ε."""
    low, high = 0.05, 50.0
    for _ in range(50):
        middle = (low * high) ** 0.5
        eps = ledger.epsilon(gaussian(middle), DELTA, ledger.Accounting("pld")).epsilon
        low, high = (middle, high) if eps > claim else (low, middle)
    return high


def game(rng: np.random.Generator, mu: float) -> dict[str, tuple[int, int]]:
    included = rng.random(CANARIES) < 0.5
    scores = rng.normal(size=CANARIES) + mu * included
    order = np.argsort(scores)
    half = GUESSES // 2
    top = int(included[order[-half:]].sum()) + int((~included[order[:half]]).sum())
    every = guesses.split_guesses(torch.as_tensor(scores), torch.as_tensor(included))
    return {"top": (GUESSES, top), "every": (CANARIES, every)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--json", default="analysis/data/audit_ideal.json")
    args = parser.parse_args()
    started = time.monotonic()
    rng = np.random.default_rng(0)
    record: dict[str, object] = {"claims": {}}
    for claim in CLAIMS:
        sigma = calibrated(claim)
        steinke, fdp_bounds = [], []
        for _ in range(args.draws):
            m = guesses.metrics(game(rng, 1 / sigma), CANARIES, GUESSES, DELTA, 0.95, gaussian(sigma))
            steinke.append(m["audit.epsilon_lower"])
            fdp_bounds.append(m["audit.epsilon_lower_fdp"])
        record["claims"][f"{claim:g}"] = {  # type: ignore[index]
            "mu": 1 / sigma, "steinke": {"bounds": steinke, "mean": statistics.fmean(steinke)},
            "fdp": {"bounds": fdp_bounds, "mean": statistics.fmean(fdp_bounds)},
        }  # fmt: skip
        print(f"claimed ε={claim:g} (μ={1 / sigma:.3f}): ideal bounds, Steinke et al. {statistics.fmean(steinke):.3f}, "
              f"f-DP {statistics.fmean(fdp_bounds):.3f} (mean of {args.draws})", flush=True)  # fmt: skip
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    record |= {"machine": machine, "seconds": time.monotonic() - started, "draws": args.draws}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{machine}; {record['seconds']:.0f} s; wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
