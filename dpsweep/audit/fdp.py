"""The f-DP analysis of a one-run audit's guesses, against the run's own claimed mechanism (no torch).

    lower = epsilon_lower(claimed, {"raw_100": (100, 97)}, canaries=1000, delta=1e-5, confidence=0.95)

Steinke, Nasr & Jagielski's bound (:mod:`dpsweep.audit.bound`) asks only that training be (ε, δ)-DP for
one (ε, δ): the guesses must then beat randomised response, whose every guess is right with
probability e^ε/(1 + e^ε). A Gaussian mechanism at the same (ε, δ) lets far fewer guesses be right, so
that bound stays well below the ε of a DP-SGD run, and it can never exceed about log(m) for m
canaries. Mahloujifar, Melis & Chaudhuri, "Auditing f-Differential Privacy in One Run" (ICML 2025,
arXiv:2410.22235), test instead a whole trade-off curve f: training is f-DP with respect to each
canary when no test of "included" against "excluded" has type II error below f(its type I error).

**The claim tested** is the run's own: the trade-off curve of the run's ledger (its privacy loss
distribution, dp-accounting's pessimistic PLD over both directions of add/remove-one), from its privacy
profile δ(ε) by the duality of Dong, Roth & Su 2022 ("Gaussian Differential Privacy", JRSS-B,
Proposition 2.12): a mechanism that is (ε, δ(ε))-DP for every ε ≥ 0 is f-DP with

    f(α) = sup_ε max(0, 1 − δ(ε) − e^ε·α, e^{−ε}·(1 − δ(ε) − α)),

here over a grid of ε (a sup over fewer ε: a smaller f, a weaker claim, still implied by the ledger).
f is symmetric, so a share x of right "included" guesses needs a share f(1 − x) of wrong ones.

**The test** (:func:`rejects`): with r guesses of which v are right, at level a, the recursion of
Mahloujifar et al. for guesses with abstentions (their ``audit_rh_with_cap``; as jax_privacy's
``auditing`` module computes it for a Gaussian f, here for the ledger's f), in our own code: start
from a·v/m right and a·(r − v)/m wrong, and for i = v − 1 down to 0 raise the wrong share to what f
asks of the right one and the right share by i/(r − i) of that rise. If the shares come to more than
r/m, at least v right guesses have probability below a under f-DP: the claim is rejected. A larger
f (a more private claim) only raises the shares: rejecting a claim rejects every more private one.

**The bound** (:func:`epsilon_lower`): the run's ledger with its Gaussian noise scaled by t
(:func:`dpsweep.privacy.ledger.scaled_noise`) is a family of claims, t = 1 the run's own, less private
as t falls. The bound is the ε at δ of the least private claim some test rejects (a bisection over
log t); 0 where none is. It exceeds the run's ε exactly when the run's own claim is rejected, which
for a run that does what its ledger says happens with probability at most 1 − confidence. Its
meaning is narrower than Steinke et al.'s: "the run is not as private as its mechanism at ε would
be", not "no (ε, δ)-DP mechanism could give these guesses".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dpsweep.privacy import ledger

# The ε at which the privacy profile is read: every 0.025 up to 10, every 0.1 beyond. With PLD_INTERVAL
# and BISECTIONS, a bound takes about 0.2 s on digits' DP-SGD (230 steps) on the 2-core VM, against 4 s
# on a grid 4x as fine, PLD's coarser interval and 12 halvings, within 3% of their bound.
EPSILON_GRID = np.concatenate([np.linspace(0.0, 10.0, 401), np.linspace(10.1, 60.0, 500)])
# The privacy losses' interval: pessimistic whatever it is (an upper bound on each δ(ε), so a smaller
# f: a weaker claim, still implied by the ledger), coarser being looser and faster.
PLD_INTERVAL = 1e-2
SCALE_RANGE = 64.0  # the claims searched: noise scaled by 1/64 .. 64 of the run's
BISECTIONS = 6  # halvings of log t within a factor 2: t to within 2^(1/64), about 1.1%
TradeOff = Callable[[float], float]


def tradeoff(epsilons: np.ndarray, deltas: np.ndarray) -> TradeOff:
    """The trade-off curve f of a privacy profile ``deltas`` = δ(ε) at ``epsilons`` (module doc)."""
    eps, delta = np.asarray(epsilons, dtype=np.float64), np.clip(np.asarray(deltas, dtype=np.float64), 0.0, 1.0)
    grow, shrink = np.exp(eps), np.exp(-eps)

    def f(alpha: float) -> float:
        a = min(max(alpha, 0.0), 1.0)
        return float(np.max(np.maximum(np.maximum(1 - delta - grow * a, shrink * (1 - delta - a)), 0.0)))

    return f


def claimed_tradeoff(claim: ledger.Ledger) -> TradeOff:
    """f of a ledger: its privacy profile from its PLD (dp-accounting, pessimistic, on :data:`PLD_INTERVAL`)."""
    return _tradeoff_of(ledger.pld_of(claim, PLD_INTERVAL))


def _tradeoff_of(pld: Any) -> TradeOff:
    if pld is None:  # nothing released: perfectly private, f(α) = 1 − α
        return lambda alpha: 1.0 - min(max(alpha, 0.0), 1.0)
    return tradeoff(EPSILON_GRID, np.asarray(pld.get_delta_for_epsilon(EPSILON_GRID)))


def rejects(f: TradeOff, canaries: int, guesses: int, correct: int, significance: float) -> bool:
    """Whether ``correct`` right guesses of ``guesses`` reject f-DP at level ``significance`` (module doc)."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}")
    right, wrong = significance * correct / canaries, significance * (guesses - correct) / canaries
    for i in range(correct - 1, -1, -1):
        needed = max(wrong, f(1 - right))
        if needed == wrong:  # neither share moves again
            break
        right, wrong = min(right + i / (guesses - i) * (needed - wrong), 1.0), needed
    return right + wrong > guesses / canaries


def rejects_claim(claim: ledger.Ledger, tests: Mapping[str, tuple[int, int]], canaries: int, confidence: float) -> bool:
    """Whether one of the ``tests`` (each at level (1 − ``confidence``)/k) rejects the run's own claim,
    its ledger's f: the run is then not as private as its ledger says. Where it does, the bound of
    :func:`epsilon_lower` is at least the claim's ε, and can equal it (the least private claim rejected
    lies within a bisection step of the run's own)."""
    return _any_rejects(claimed_tradeoff(claim), tests, canaries, confidence)


def _any_rejects(f: TradeOff, tests: Mapping[str, tuple[int, int]], canaries: int, confidence: float) -> bool:
    """Whether one of the ``tests`` rejects f, each at level (1 − ``confidence``)/k for k tests."""
    level = (1 - confidence) / len(tests)
    return any(rejects(f, canaries, r, right, level) for r, right in tests.values())


def epsilon_lower(
    claim: ledger.Ledger, tests: Mapping[str, tuple[int, int]], canaries: int, delta: float, confidence: float
) -> float:
    """The ε at ``delta`` of the least private claim along the run's noise (module doc) that one of the
    ``tests`` (``{name: (guesses, right)}``, each at level (1 − ``confidence``)/k for k tests) rejects."""
    return read(claim, tests, canaries, delta, confidence)[0]


def read(
    claim: ledger.Ledger, tests: Mapping[str, tuple[int, int]], canaries: int, delta: float, confidence: float
) -> tuple[float, bool]:
    """:func:`epsilon_lower` and :func:`rejects_claim` from one search: the search starts at the run's own
    claim (t = 1), so whether it is rejected comes with the bound, its PLD built once."""

    @functools.cache
    def pld(t: float) -> Any:  # built once per claim: the bound's ε reads the last one rejected
        return ledger.pld_of(ledger.scaled_noise(claim, t), PLD_INTERVAL)

    def rejected(t: float) -> bool:
        return _any_rejects(_tradeoff_of(pld(t)), tests, canaries, confidence)

    def epsilon(t: float) -> float:
        return 0.0 if pld(t) is None else float(pld(t).get_epsilon_for_delta(delta))

    # Bracket by halving or doubling t from the run's claim: the PLD of a nearly noiseless run is slow
    # to build, and m canaries reject no claim much beyond what all m guesses right can show.
    own = rejected(1.0)
    step = 0.5 if own else 2.0
    t = 1.0
    for _ in range(int(math.log2(SCALE_RANGE))):
        if rejected(t * step) != (step < 1):  # the claim crossed: rejected going up, accepted going down
            break
        t *= step
    else:  # rejected down to t / SCALE_RANGE (a bound beyond any run's), or nothing rejected up to t·SCALE_RANGE
        return (epsilon(t) if step < 1 else 0.0), own
    low, high = (t * step, t) if step < 1 else (t, t * step)  # low not rejected, high rejected
    for _ in range(BISECTIONS):
        middle = math.sqrt(low * high)
        low, high = (low, middle) if rejected(middle) else (middle, high)
    return epsilon(high), own
