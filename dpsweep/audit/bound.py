"""The ε lower bound of a one-run privacy audit (no torch).

    epsilon_lower(canaries=1000, guesses=100, correct=97, delta=1e-5, confidence=0.95)

Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run" (NeurIPS), Theorem 5.2
and their algorithm for its p-value, in our own code. m canaries are each included in training
independently with probability ½; after training the auditor guesses, for r of them, whether each
was included (abstaining on the other m − r), and v guesses are right. If training is (ε, δ)-DP with
respect to each canary, then

    P[at least v right] ≤ β + 2mδ·α,   q = e^ε / (1 + e^ε),
    β = P[Bin(r, q) ≥ v],   α = max_{1 ≤ i ≤ v} P[v − i ≤ Bin(r, q) < v] / i.

That p-value grows with ε. The audit's lower bound is the largest ε it rejects at level
1 − ``confidence``: training is not (ε', δ)-DP for any ε' below it, with that confidence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from scipy.stats import binom

BISECTIONS = 40  # halvings of the bracket: ε to about 1e-11 of its width


def p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """The probability of at least ``correct`` right guesses out of ``guesses`` under (ε, δ)-DP."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}")
    if epsilon < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need epsilon >= 0 and 0 <= delta <= 1, got {epsilon}, {delta}")
    q = 1 / (1 + math.exp(-epsilon))  # the accuracy of ε-DP randomised response
    beta = float(binom.sf(correct - 1, guesses, q))
    if correct == 0:
        return min(1.0, beta)
    below = binom.pmf(np.arange(correct - 1, -1, -1), guesses, q)  # P[Bin = v − i], i = 1 .. v
    alpha = float(np.max(np.cumsum(below) / np.arange(1, correct + 1)))
    return min(1.0, beta + 2 * canaries * delta * alpha)


def epsilon_lower(canaries: int, guesses: int, correct: int, delta: float, confidence: float) -> float:
    """The largest ε that ``correct`` right guesses reject at ``confidence`` (0: none rejected)."""
    if not 0 < confidence < 1:
        raise ValueError(f"need 0 < confidence < 1, got {confidence}")
    level = 1 - confidence

    def rejected(eps: float) -> bool:
        return p_value(canaries, guesses, correct, eps, delta) < level

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):
        low, high = high, 2 * high
        if high > 1e3:  # every guess right with many guesses: beyond what a run's ε ever is
            return low
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low


def best_bound(tests: Mapping[str, tuple[int, int]], canaries: int, delta: float, confidence: float) -> float:
    """The largest bound of several tests fixed before the run (``{name: (guesses, right guesses)}``),
    each taken at confidence 1 − (1 − ``confidence``)/k for k tests, so that together they hold at
    ``confidence`` (a union bound)."""
    each = 1 - (1 - confidence) / len(tests)
    return max(epsilon_lower(canaries, r, right, delta, each) for r, right in tests.values())
