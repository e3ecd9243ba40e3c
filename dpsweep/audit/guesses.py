"""A one-run audit's guesses, and the metrics an audit run logs (both modes)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dpsweep.audit import bound


def right_guesses(scores: Tensor, included: Tensor, guesses: int) -> int:
    """Of ``guesses`` guesses, half the highest ``scores`` guessed included and half the lowest excluded,
    the right ones (``included``: each canary's inclusion bit)."""
    order = torch.argsort(scores)
    half = guesses // 2
    return int((~included[order[:half]]).sum()) + int(included[order[len(order) - half :]].sum())


def tags(mode: str, canaries: int) -> dict[str, str]:
    """What an audit run is tagged: its canaries are extra training units, so its model is not a plain
    run's and not for release; its ledger is the run's."""
    return {
        "dp.release": "not-for-release",
        "audit.note": f"{mode} one-run audit: {canaries} canaries, about half trained on; ledger unchanged",
    }


def metrics(
    tests: Mapping[str, tuple[int, int]], canaries: int, guesses: int, delta: float, confidence: float
) -> dict[str, float]:
    """What an audit run logs: each test's right guesses (``{metric: (guesses, right)}``, the tests fixed
    before training), ``audit.guesses``, ``audit.tests``, and the ε lower bound at δ, the largest of the
    tests' under a union bound (:func:`dpsweep.audit.bound.best_bound`)."""
    lower = bound.best_bound(tests, canaries, delta, confidence)
    logged = {key: float(right) for key, (_, right) in tests.items()}
    return logged | {"audit.guesses": float(guesses), "audit.tests": float(len(tests)), "audit.epsilon_lower": lower}
