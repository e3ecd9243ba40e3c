"""The one-run audit's ε lower bound (dpsweep.audit.bound, Steinke, Nasr & Jagielski 2023): against a
closed form, monotone in the evidence, and sound on guesses that an ε-DP mechanism could make."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpsweep.audit.bound import epsilon_lower, p_value


@pytest.mark.parametrize("guesses", [20, 100, 600])
def test_with_delta_zero_all_right_guesses_give_the_randomised_response_closed_form(guesses: int) -> None:
    """δ = 0: the p-value is P[Bin(r, q) ≥ r] = q^r, so r right guesses of r reject every ε whose
    q = e^ε/(1 + e^ε) is below 0.05^(1/r)."""
    q = 0.05 ** (1 / guesses)
    assert epsilon_lower(1000, guesses, guesses, 0.0, 0.95) == pytest.approx(math.log(q / (1 - q)), rel=1e-6)


def test_the_bound_grows_with_right_guesses_and_falls_with_delta_and_confidence() -> None:
    bounds = [epsilon_lower(1000, 100, v, 1e-5, 0.95) for v in (50, 70, 90, 100)]
    assert bounds[0] == 0.0 and bounds == sorted(bounds) and bounds[-1] > bounds[-2] > 0
    assert epsilon_lower(1000, 100, 90, 1e-3, 0.95) < epsilon_lower(1000, 100, 90, 0.0, 0.95)
    assert epsilon_lower(1000, 100, 90, 1e-5, 0.99) < epsilon_lower(1000, 100, 90, 1e-5, 0.95)


def test_the_p_value_grows_with_epsilon_and_is_one_at_chance() -> None:
    values = [p_value(1000, 100, 80, eps, 1e-5) for eps in (0.0, 0.5, 1.0, 2.0, 4.0)]
    assert values == sorted(values) and values[0] < 1e-3 and values[-1] > 0.5
    assert p_value(1000, 100, 0, 1.0, 1e-5) == 1.0


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_guesses_an_epsilon_dp_mechanism_allows_are_rejected_at_most_five_percent_of_the_time(epsilon: float) -> None:
    """Randomised response at ε is ε-DP and makes each guess right with probability e^ε/(1 + e^ε), the
    most an ε-DP mechanism allows: over 4,000 audits the bound exceeds ε in at most 5% (plus sampling)."""
    rng = np.random.default_rng(0)
    q = 1 / (1 + math.exp(-epsilon))
    right = rng.binomial(100, q, size=4000)
    cache = {v: epsilon_lower(1000, 100, int(v), 0.0, 0.95) for v in np.unique(right)}
    flagged = np.mean([cache[v] > epsilon for v in right])
    assert flagged <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 4000), flagged
    assert flagged > 0.005  # the test is not vacuous: near the claim it does reject sometimes


@pytest.mark.parametrize(
    ("args", "message"),
    [((10, 20, 5, 1.0, 1e-5), "guesses <= canaries"), ((100, 20, 21, 1.0, 1e-5), "correct <= guesses")],
)
def test_impossible_counts_are_refused(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match="need 0 <= correct <= guesses <= canaries"):
        p_value(*args)
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower(100, 20, 10, 1e-5, 1.0)
