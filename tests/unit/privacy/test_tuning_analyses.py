"""The two analyses of a private tuning's ε (dpsweep.privacy.tuning.ANALYSES): the mixture's RDP against
a numerical integration of the Rényi divergence of a trial's output, the repeat-and-select bound against
dp-accounting's event, and the mixture analysis beside Papernot–Steinke's on the dominant candidate."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
from scipy import integrate, stats

from dpsweep.errors import InputError
from dpsweep.privacy import ledger, rdp, tuning

ORDERS = rdp.DEFAULT_ORDERS
HOW = ledger.Accounting("rdp", orders=ORDERS)


def _run(sigma: float, steps: int = 500, sample_rate: float = 0.01) -> ledger.Ledger:
    return ledger.Ledger((ledger.dpsgd(sigma, sample_rate, steps),))


@pytest.mark.parametrize("alpha", [1.5, 2.0, 4.0, 10.0])
def test_the_mixtures_rdp_is_the_renyi_divergence_of_a_trials_output(alpha: float) -> None:
    # a trial draws σ ∈ {1, 2} uniformly and releases (σ, y), y ~ N(1, σ²) against N(0, σ²): its Rényi
    # divergence integrated numerically, against the log-mean-exp of the Gaussian curves α / (2σ²)
    sigmas = (1.0, 2.0)

    def part(s: float) -> float:  # ∫ p^α q^(1-α), in logarithms; the integrand peaks at y = α
        p, q = stats.norm(1, s), stats.norm(0, s)
        return integrate.quad(
            lambda y: math.exp(alpha * p.logpdf(y) + (1 - alpha) * q.logpdf(y)), alpha - 20 * s, alpha + 20 * s,
            points=[alpha], limit=200,
        )[0]  # fmt: skip

    numeric = math.log(sum(part(s) for s in sigmas) / len(sigmas)) / (alpha - 1)
    curves = np.array([[a / (2 * s**2) for a in (1.0, alpha)] for s in sigmas])
    assert tuning.mixture_rdp(curves, (1.0, alpha))[1] == pytest.approx(numeric, rel=1e-8)
    assert tuning.mixture_rdp(curves, (1.0, alpha))[0] == pytest.approx(np.mean(curves[:, 0]))  # KL at α = 1


def test_dp_accountings_private_repeat_and_select_is_still_there() -> None:
    from dpsweep.interop import dp_accounting_private

    module, name = "dp_accounting.rdp.rdp_privacy_accountant", "_compute_rdp_repeat_and_select"
    assert (module, name) in dp_accounting_private.PRIVATE_NAMES  # the door names it (the others: tests/unit/interop)
    assert callable(getattr(importlib.import_module(module), name)), f"{module}.{name} moved"


def test_repeat_and_select_is_dp_accountings_event_given_the_same_curve() -> None:
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp

    bill = _run(1.0)
    accountant = dp_rdp.RdpAccountant(list(ORDERS))
    accountant.compose(bill.event())
    eps, _ = tuning.repeat_and_select(accountant.rdp, ORDERS, 1e-5, 8.0, 0.5)
    assert eps == ledger.tuning_epsilon(bill, 1e-5, 8.0, 0.5, ORDERS).epsilon
    assert isinstance(bill.event(), dp_event.DpEvent)


@pytest.mark.parametrize(("distribution", "eta"), [("tnb", 0.5), ("poisson", 0.5), ("geometric", 1.0)])
def test_identical_candidates_cost_what_papernot_steinke_says_on_dpsweeps_exact_curve(
    distribution: str, eta: float
) -> None:
    bills = [_run(1.0)] * 3
    ps = tuning.procedure(bills, 1e-5, HOW, distribution, 8.0, eta)
    mix = tuning.procedure(bills, 1e-5, HOW, distribution, 8.0, eta, analysis="mixture")
    one = tuning.repeat_and_select(
        ledger.rdp_curve(bills[0], ORDERS), ORDERS, 1e-5, 8.0, tuning.shape(distribution, eta)
    )
    assert mix.epsilon == pytest.approx(one[0], rel=1e-12)
    assert mix.epsilon <= ps.epsilon + 1e-9  # dp-accounting's fractional-order RDP is an upper bound on the exact
    assert (ps.analysis, mix.analysis) == ("papernot_steinke", "mixture")
    assert "Papernot & Steinke" in mix.reference and "uniformly" in mix.reference


def test_candidates_of_different_cost_are_cheaper_as_the_mixture_they_are() -> None:
    bills = [_run(s) for s in (0.8, 1.2, 1.6, 2.0)]  # σ swept: the smallest dominates
    ps = tuning.procedure(bills, 1e-5, HOW, "tnb", 10.0, 0.5)
    mix = tuning.procedure(bills, 1e-5, HOW, "tnb", 10.0, 0.5, analysis="mixture")
    assert mix.epsilon < 0.95 * ps.epsilon
    assert (mix.dominant, mix.single_run_epsilon) == (ps.dominant, pytest.approx(ps.single_run_epsilon))


def test_candidates_whose_costs_cross_are_priced_by_the_mixture_between_their_own_bounds() -> None:
    # few steps at a large batch against many at a small one: RDP curves that cross
    bills = [_run(1.0, steps=20, sample_rate=0.5), _run(1.0, steps=4000, sample_rate=0.005)]
    with pytest.raises(InputError, match=r"sweep\.private_tuning"):
        tuning.procedure(bills, 1e-5, HOW, "tnb", 8.0, 0.5)
    mix = tuning.procedure(bills, 1e-5, HOW, "tnb", 8.0, 0.5, analysis="mixture")
    curves = np.array([ledger.rdp_curve(b, ORDERS) for b in bills])
    low = tuning.repeat_and_select(curves.min(axis=0), ORDERS, 1e-5, 8.0, 0.5)[0]
    high = tuning.repeat_and_select(curves.max(axis=0), ORDERS, 1e-5, 8.0, 0.5)[0]
    assert low <= mix.epsilon <= high
    assert math.isfinite(mix.epsilon)


def test_an_unknown_analysis_is_named() -> None:
    with pytest.raises(InputError, match=r"sweep\.tuning_analysis='fdp' is invalid: one of papernot_steinke, mixture"):
        tuning.procedure([_run(1.0)], 1e-5, HOW, "tnb", 8.0, 0.5, analysis="fdp")
