"""dpsweep.privacy.certainty: the sound interval around the PLD ε, μ-GDP and the attack risk, each
against a figure computed another way (the Gaussian mechanism's closed forms, the published interval
of the Opacus MNIST preset), and the calibration of σ to a risk target."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from dpsweep.errors import InputError
from dpsweep.privacy import certainty, ledger


def _gaussian(sigma: float, steps: int = 1, sample_rate: float = 1.0) -> ledger.Ledger:
    return ledger.Ledger((ledger.dpsgd(sigma, sample_rate, steps),))


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact ε of μ-GDP at δ (Balle & Wang 2018, Thm. 8): the root of δ_μ(ε) = δ."""
    return float(optimize.brentq(lambda e: float(certainty.gaussian_delta(mu, np.array([e]))[0]) - delta, 0, 100))


def test_the_mnist_presets_interval_holds_its_published_bounds_and_its_upper_end_is_epsilon_pld() -> None:
    # Opacus's MNIST example: N = 60000, B = 240, σ = 1.1, 60 epochs, δ = 1e-5 (issue 58: the true ε lies in
    # [2.2854, 2.3054], PRV's bounds; dp-accounting's pessimistic PLD gives 2.2955)
    bill = _gaussian(1.1, 60 * 60000 // 240, 240 / 60000)
    found = certainty.epsilon_interval(bill, 1e-5)
    assert found.upper == ledger.epsilon(bill, 1e-5, ledger.Accounting("pld")).epsilon
    assert found.upper == pytest.approx(2.2955, abs=1e-4)
    assert 2.2854 - 1e-9 <= found.lower <= found.upper
    assert found.relative_width < 0.01  # tighter than PRV's published interval


@pytest.mark.parametrize(("sigma", "steps"), [(1.0, 1), (0.7, 1), (3.0, 9)])
def test_the_interval_holds_the_gaussian_mechanisms_exact_epsilon(sigma: float, steps: int) -> None:
    exact = _gaussian_epsilon(math.sqrt(steps) / sigma, 1e-5)
    found = certainty.epsilon_interval(_gaussian(sigma, steps), 1e-5)
    assert found.lower <= exact <= found.upper
    assert found.upper - found.lower < 0.01 * exact


def test_the_interval_of_a_ledger_with_segments_and_a_pure_release_is_ordered() -> None:
    bill = ledger.Ledger((
        ledger.dpsgd(1.0, 0.05, 200), ledger.dpsgd(2.0, 0.1, 50),
        ledger.pure_release("quantile", 0.1, {}, "a private quantile"),
    ))  # fmt: skip
    found = certainty.epsilon_interval(bill, 1e-5)
    assert 0 < found.lower <= found.upper
    assert found.relative_width < 0.01


def test_an_empty_ledger_costs_nothing_and_risks_nothing() -> None:
    empty = ledger.Ledger()
    assert certainty.epsilon_interval(empty, 1e-5) == (0.0, 0.0)
    assert certainty.mu_gdp(empty) == 0.0
    assert certainty.attack_risk(empty) == {"tpr_at_1pct": 0.01, "tpr_at_10pct": 0.10, "advantage": 0.0}


@pytest.mark.parametrize(("sigma", "steps"), [(1.0, 1), (2.0, 1), (0.8, 1), (5.0, 16)])
def test_mu_is_the_gaussian_mechanisms_within_one_percent_above(sigma: float, steps: int) -> None:
    exact = math.sqrt(steps) / sigma  # k Gaussian steps of noise σ are √k/σ-GDP (Dong, Roth & Su 2022)
    mu = certainty.mu_gdp(_gaussian(sigma, steps))
    assert exact <= mu <= 1.01 * exact


def test_a_subsampled_gaussians_mu_bounds_its_profile_everywhere() -> None:
    bill = _gaussian(1.1, 2000, 0.004)
    found = certainty.profile(bill)
    assert found is not None
    mu = certainty.mu_gdp(bill, found)
    fine = np.linspace(0.0, 8.0, 40001)  # a grid twice as fine as the profile's, checked directly
    pessimistic = np.asarray(ledger.pld_of(bill).get_delta_for_epsilon(fine))
    assert np.all(certainty.gaussian_delta(mu, fine) + 2 * found.tail >= pessimistic)
    assert not certainty.is_gdp(found, 0.99 * mu)  # the smallest: 1 % less is not certified
    assert mu < math.sqrt(2000) / 1.1 / 10  # and subsampling amplifies: far below the unsampled √k/σ


@pytest.mark.parametrize(("sigma", "steps"), [(1.0, 1), (2.0, 4), (0.8, 1)])
def test_the_attack_risk_is_the_gaussian_trade_off_curve_from_above(sigma: float, steps: int) -> None:
    mu = math.sqrt(steps) / sigma
    risk = certainty.attack_risk(_gaussian(sigma, steps))
    for key, fpr in (("tpr_at_1pct", 0.01), ("tpr_at_10pct", 0.10)):
        exact = stats.norm.cdf(stats.norm.ppf(fpr) + mu)  # Dong, Roth & Su 2022: 1 - G_μ(α)
        assert exact - 1e-12 <= risk[key] <= exact + 1e-4
    advantage = 2 * stats.norm.cdf(mu / 2) - 1  # total variation of N(0, 1) and N(μ, 1)
    assert advantage - 1e-12 <= risk["advantage"] <= advantage + 1e-6


def test_a_run_beyond_the_discretised_range_gets_the_trivial_bounds() -> None:
    bill = _gaussian(0.05, 100, 0.5)
    assert certainty.mu_gdp(bill) == math.inf
    assert certainty.attack_risk(bill) == {"tpr_at_1pct": 1.0, "tpr_at_10pct": 1.0, "advantage": 1.0}


def test_sigma_calibrated_to_a_risk_target_meets_it_by_the_epsilon_bisection() -> None:
    target = 0.05  # TPR at 1 % FPR; one Gaussian release: Φ(Φ⁻¹(0.01) + 1/σ) = 0.05 at σ* below
    exact = 1 / (stats.norm.ppf(target) - stats.norm.ppf(0.01))
    sigma = certainty.noise_for_risk(_gaussian, target)
    assert certainty.tpr_bound(certainty.profile(_gaussian(sigma)), 0.01) <= target
    assert exact <= sigma <= 1.01 * exact


@pytest.mark.parametrize("target", [0.005, 1.0, float("nan")])
def test_a_risk_target_out_of_range_is_named(target: float) -> None:
    with pytest.raises(InputError, match=r"dp\.target_tpr_at_1pct=.*above the false-positive rate 0\.01"):
        certainty.noise_for_risk(_gaussian, target)
