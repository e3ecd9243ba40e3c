"""The sampling check (dpsweep.privacy.sampling): Poisson batches pass it, batches at twice the rate and
fixed-size batches fail it, and its p-values are calibrated under the null."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from dpsweep.privacy import sampling

N, Q, T = 1437, 64 / 1437, 66  # the default digits run's training units, rate and steps (3 epochs)


def test_poisson_batches_pass_and_batches_at_twice_the_rate_fail() -> None:
    rng = np.random.default_rng(0)
    honest = sampling.check(rng.binomial(N, Q, T).tolist(), [Q] * T, N)
    assert honest.p_value > 1e-3 and not honest.refused()
    doubled = sampling.check(rng.binomial(N, 2 * Q, T).tolist(), [Q] * T, N)
    assert doubled.refused() and doubled.test == "count" and doubled.statistic > 10
    assert "count test" in doubled.why() and "\n" not in doubled.why()


def test_fixed_size_batches_fail_the_dispersion_test() -> None:
    fixed = sampling.check([round(N * Q)] * T, [Q] * T, N)
    assert fixed.count_p_value > 0.5  # the right number of units, drawn too regularly
    assert fixed.refused() and fixed.test == "dispersion" and fixed.dispersion < 1
    assert "varied less" in fixed.why()


def test_the_p_values_are_uniform_under_poisson_sampling() -> None:
    """Over many honest runs (here with a rate that changes half-way, the normal count test), each
    test's p-values are uniform: the check refuses an honest run at its nominal rate, not more."""
    rng = np.random.default_rng(1)
    rates = [Q] * (T // 2) + [Q / 2] * (T - T // 2)
    runs = [sampling.check(rng.binomial(N, rates).tolist(), rates, N) for _ in range(400)]
    for p in ([r.count_p_value for r in runs], [r.dispersion_p_value for r in runs]):
        assert stats.kstest(p, "uniform").pvalue > 1e-3


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="one rate per step"):
        sampling.check([1, 2], [Q], N)
    with pytest.raises(ValueError, match="rates must lie in"):
        sampling.check([1], [0.0], N)
