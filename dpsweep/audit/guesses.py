"""A one-run audit's guesses, and the metrics an audit run logs (both modes)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dpsweep.audit import bound, fdp
from dpsweep.privacy.ledger import Ledger


def right_guesses(scores: Tensor, included: Tensor, guesses: int) -> int:
    """Of ``guesses`` guesses, half the highest ``scores`` guessed included and half the lowest excluded,
    the right ones (``included``: each canary's inclusion bit)."""
    order = torch.argsort(scores)
    half = guesses // 2
    return int((~included[order[:half]]).sum()) + int(included[order[len(order) - half :]].sum())


SPLIT_WINDOW = 0.1  # split_guesses looks for its gap within this share of m either side of the middle


def split_guesses(scores: Tensor, included: Tensor) -> int:
    """Of a guess on every canary, "excluded" for the k lowest scores and "included" for the others, the
    right ones, k where the gap between the k-th and the (k+1)-th lowest score is the widest of the
    middle (k within :data:`SPLIT_WINDOW`·m of m/2, where about half of the canaries are included:
    Bin(m, ½) strays by √m/2). k is a function of the scores alone: where a bug separates the included
    canaries from the others, k falls in their gap and every guess can be right, where half and half
    would err by the imbalance of the draw."""
    x = torch.sort(scores.to(torch.float64)).values
    m = len(x)
    reach = max(1, int(SPLIT_WINDOW * m))
    first, last = max(1, m // 2 - reach), min(m - 1, m // 2 + reach)
    if first > last:  # too few canaries for a window: half and half
        return right_guesses(scores, included, m - m % 2)
    gaps = x[first : last + 1] - x[first - 1 : last]
    threshold = x[first + int(torch.argmax(gaps))]  # the lowest score guessed included
    above = scores >= threshold
    return int((above & included).sum()) + int((~above & ~included).sum())


def tags(mode: str, canaries: int) -> dict[str, str]:
    """What an audit run is tagged: its canaries are extra training units, so its model is not a plain
    run's and not for release; its ledger is the run's."""
    return {
        "dp.release": "not-for-release",
        "audit.note": f"{mode} one-run audit: {canaries} canaries, about half trained on; ledger unchanged",
    }


def metrics(
    tests: Mapping[str, tuple[int, int]],
    canaries: int,
    guesses: int,
    delta: float,
    confidence: float,
    claim: Ledger | None = None,
) -> dict[str, float]:
    """What an audit run logs: each test's right guesses (``{metric: (guesses, right)}``, the tests fixed
    before training), ``audit.guesses``, ``audit.tests``, and the ε lower bound at δ, the largest of the
    tests' under a union bound (:func:`dpsweep.audit.bound.best_bound`). With the run's ``claim`` (its
    ledger), each test is also read against it by the f-DP analysis (:mod:`dpsweep.audit.fdp`):
    ``audit.epsilon_lower_fdp``, and ``audit.claim_rejected`` (1 where a test rejects the run's own
    ledger: the run is flagged), the two analyses sharing 1 − ``confidence`` equally."""
    logged = {key: float(right) for key, (_, right) in tests.items()}
    if claim is None:
        lower = bound.best_bound(tests, canaries, delta, confidence)
        return logged | {
            "audit.guesses": float(guesses),
            "audit.tests": float(len(tests)),
            "audit.epsilon_lower": lower,
        }
    each = 1 - (1 - confidence) / 2
    lower_fdp, rejected = fdp.read(claim, tests, canaries, delta, each)
    return logged | {
        "audit.guesses": float(guesses),
        "audit.tests": float(2 * len(tests)),
        "audit.epsilon_lower": bound.best_bound(tests, canaries, delta, each),
        "audit.epsilon_lower_fdp": lower_fdp,
        "audit.claim_rejected": float(rejected),
    }
