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
95%); and the same at m = 5,000, the canaries of Steinke et al.'s white-box CIFAR-10 audit, to set
their published figure against its ideal. An audited run's bounds (``benchmarks/audit.py``) can be
set against these: a real run's canaries see a subsampled mechanism through other units' gradients,
so its bounds sit below the ideal ones.

**DP-SGD as its canaries see it.** The same guesses on the digits run's own mechanism (N = 1,437,
B = 64, 10 epochs: q = 1/23, 230 steps, σ calibrated to each claim by the plan), each canary an
independent Poisson-subsampled Gaussian over the steps with nothing else at its coordinate, scored by
the audit's own score (:class:`dpsweep.audit.white_box.DiracCanaries`, at the claimed q and σ) and
read against the run's ledger: for a correct run (sampled at q) and for the planted "sample rate
reported at half" (sampled at 2q, ledger at q), with m = 1,000 canaries (the audit's default), 1,437
(digits' training examples, the most ``audit.canaries`` allows there) and 10,000 (a larger training
set's). It is the most a white-box audit of that run can show: a real run's canaries also carry the
other examples' gradients.

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

from dpsweep.audit import guesses, white_box
from dpsweep.privacy import ledger, schedule

CLAIMS = (1.0, 4.0, 8.0)
DELTA = 1e-5
CANARIES = 1000
GUESSES = 100
# The white-box CIFAR-10 audit of Steinke, Nasr & Jagielski 2023 used m = 5,000 canaries (as restated by
# Mahloujifar, Melis & Chaudhuri 2025, Section 6); it showed ε ≥ about 1.8 at a claimed ε of about 4.
PUBLISHED_CANARIES = 5000


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


def game(rng: np.random.Generator, mu: float, canaries: int = CANARIES) -> dict[str, tuple[int, int]]:
    included = rng.random(canaries) < 0.5
    scores = rng.normal(size=canaries) + mu * included
    return audit_tests(torch.as_tensor(scores), torch.as_tensor(included))


def audit_tests(scores: torch.Tensor, included: torch.Tensor) -> dict[str, tuple[int, int]]:
    """The white-box audit's raw tests on these scores: ``GUESSES`` guesses, and one on every canary."""
    top = guesses.right_guesses(scores, included, GUESSES)
    return {"top": (GUESSES, top), "every": (len(scores), guesses.split_guesses(scores, included))}


DIGITS_TRAIN, BATCH, EPOCHS = 1437, 64, 10  # the audit benchmark's digits run (benchmarks/audit.py)
SUBSAMPLED_CANARIES = (1000, 1437, 10_000)


def subsampled_game(
    rng: np.random.Generator, canaries: int, rate: float, claimed: tuple[float, float], steps: int
) -> dict[str, tuple[int, int]]:
    """The audit's two tests on ``canaries`` Dirac canaries, each included with probability ½ and then in
    each of ``steps`` steps with probability ``rate``, released with N(0, σ²) noise in units of C and
    scored at the ``claimed`` (q, σ) as the audit scores them."""
    q, sigma = claimed
    included = rng.random(canaries) < 0.5
    scores = torch.zeros(canaries, dtype=torch.float64)
    for _ in range(steps):
        x = rng.normal(scale=sigma, size=canaries) + (included & (rng.random(canaries) < rate))
        scores += white_box.log_ratio(torch.from_numpy(x), q, sigma)
    return audit_tests(scores, torch.from_numpy(included))


def subsampled(rng: np.random.Generator, draws: int) -> dict[str, object]:
    """For each claim: the mean bounds of the subsampled game, correct and at twice the claimed rate."""
    plan = schedule.poisson_schedule(DIGITS_TRAIN, BATCH)
    steps, q = plan.steps(EPOCHS), plan.sample_rate
    record: dict[str, object] = {"n_train": DIGITS_TRAIN, "batch_size": BATCH, "steps": steps, "sample_rate": q}
    for claim in CLAIMS:
        sigma = schedule.calibrate_noise(plan, claim, DELTA, epochs=EPOCHS, accounting=ledger.Accounting("pld"))
        claimed = schedule.run_ledger(plan, sigma, steps)
        true_at_twice = ledger.epsilon(schedule.run_ledger(
            schedule.PoissonSchedule(plan.n, plan.batch_size, 2 * q, plan.steps_per_epoch, 2 * q), sigma, steps
        ), DELTA, ledger.Accounting("pld")).epsilon  # fmt: skip
        cell: dict[str, object] = {"sigma": sigma, "epsilon_at_twice_the_rate": true_at_twice}
        for name, rate in (("correct", q), ("half_sample_rate", 2 * q)):
            for m in SUBSAMPLED_CANARIES:
                st, fd = [], []
                for _ in range(draws):
                    tests = subsampled_game(rng, m, rate, (q, sigma), steps)
                    got = guesses.metrics(tests, m, GUESSES, DELTA, 0.95, claimed)
                    st.append(got["audit.epsilon_lower"])
                    fd.append(got["audit.epsilon_lower_fdp"])
                cell[f"{name}_{m}"] = {"steinke": statistics.fmean(st), "fdp": statistics.fmean(fd), "fdp_max": max(fd)}
                print(f"claimed ε={claim:g} (σ={sigma:.3f}), {name}, m={m}: Steinke et al. "
                      f"{statistics.fmean(st):.3f}, f-DP {statistics.fmean(fd):.3f} (largest {max(fd):.3f}; "
                      f"mean of {draws})", flush=True)  # fmt: skip
        record[f"{claim:g}"] = cell
    return record


def ideal(rng: np.random.Generator, canaries: int, draws: int) -> dict[str, object]:
    """For each claim: both bounds of ``draws`` ideal games with ``canaries`` canaries."""
    record: dict[str, object] = {"canaries": canaries}
    for claim in CLAIMS:
        sigma = calibrated(claim)
        steinke, fdp_bounds = [], []
        for _ in range(draws):
            m = guesses.metrics(game(rng, 1 / sigma, canaries), canaries, GUESSES, DELTA, 0.95, gaussian(sigma))
            steinke.append(m["audit.epsilon_lower"])
            fdp_bounds.append(m["audit.epsilon_lower_fdp"])
        record[f"{claim:g}"] = {
            "mu": 1 / sigma, "steinke": {"bounds": steinke, "mean": statistics.fmean(steinke)},
            "fdp": {"bounds": fdp_bounds, "mean": statistics.fmean(fdp_bounds)},
        }  # fmt: skip
        print(f"claimed ε={claim:g} (μ={1 / sigma:.3f}), m={canaries}: ideal bounds, Steinke et al. "
              f"{statistics.fmean(steinke):.3f}, f-DP {statistics.fmean(fdp_bounds):.3f} (mean of {draws})",
              flush=True)  # fmt: skip
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--subsampled-draws", type=int, default=5)
    parser.add_argument("--json", default="analysis/data/audit_ideal.json")
    args = parser.parse_args()
    started = time.monotonic()
    rng = np.random.default_rng(0)
    record: dict[str, object] = {"claims": ideal(rng, CANARIES, args.draws)}
    record["subsampled"] = subsampled(rng, args.subsampled_draws)
    record["claims_at_published_m"] = ideal(np.random.default_rng(1), PUBLISHED_CANARIES, args.draws)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    record |= {"machine": machine, "seconds": time.monotonic() - started, "draws": args.draws}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{machine}; {record['seconds']:.0f} s; wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
