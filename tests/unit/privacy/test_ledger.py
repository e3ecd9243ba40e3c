"""dpsweep.privacy.ledger and dpsweep.privacy.rdp: the ledger's RDP equals Opacus's for plain DP-SGD, the exact
subsampled-Gaussian RDP against numerical integration, the larger order grid only lowers ε, pure-DP
releases, the three accountants, the JSON bill and the ε of tuning."""

from __future__ import annotations

import math

import numpy as np
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp
from scipy import integrate, stats

from dpsweep.privacy import ledger, rdp
from dpsweep.privacy.ledger import Accounting, Ledger

CASES = [(0.5, 0.0102, 490), (0.8, 0.0357, 280), (1.1, 0.004, 10_000), (2.0, 0.1, 50), (0.3, 0.5, 3)]


@pytest.mark.parametrize(("sigma", "q", "steps"), CASES)
def test_ledger_rdp_equals_opacus_for_plain_dpsgd(sigma: float, q: float, steps: int) -> None:
    ours = ledger.rdp_curve(ledger.from_history([(sigma, q, steps)]), rdp.OPACUS_ORDERS)
    theirs = np.asarray(opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=rdp.OPACUS_ORDERS))
    assert np.max(np.abs(ours - theirs) / np.maximum(1.0, np.abs(theirs))) < 1e-9


@pytest.mark.parametrize(
    ("sigma", "q", "alpha"), [(0.5, 0.0102, 1.1), (0.5, 0.0102, 2.5), (1.0, 0.1, 7.3), (2.0, 0.01, 12)]
)
def test_subsampled_gaussian_rdp_is_the_renyi_divergence(sigma: float, q: float, alpha: float) -> None:
    # Mironov, Talwar & Zhang 2019: A_α = E_{z~N(0,σ²)}[((1-q) + q·exp((2z-1)/(2σ²)))^α], RDP = log A_α/(α-1)
    def integrand(z: float) -> float:
        return float(stats.norm.pdf(z, scale=sigma) * ((1 - q) + q * math.exp((2 * z - 1) / (2 * sigma**2))) ** alpha)

    a = integrate.quad(integrand, -30 * sigma, 30 * sigma, points=[0.0, 0.5, 1.0], limit=500, epsabs=0, epsrel=1e-12)[0]
    assert rdp.subsampled_gaussian(q, sigma, [alpha])[0] == pytest.approx(math.log(a) / (alpha - 1), rel=1e-7)


@pytest.mark.parametrize(("sigma", "q"), [(0.8, 64 / 1437), (0.5, 0.0102), (20.0, 1e-4), (1.0, 0.9)])
def test_subsampled_gaussian_rdp_of_many_orders_is_each_order_alone(sigma: float, q: float) -> None:
    # the orders are summed together (integer and fractional series, in chunks): each equals its own call
    orders = [*rdp.DEFAULT_ORDERS, math.inf]
    together = rdp.subsampled_gaussian(q, sigma, orders)
    alone = np.array([rdp.subsampled_gaussian(q, sigma, [a])[0] for a in orders])
    assert np.array_equal(np.isinf(together), np.isinf(alone)) and np.isinf(together[-1])
    finite = np.isfinite(alone)
    assert np.allclose(together[finite], alone[finite], rtol=1e-12, atol=1e-14)  # log A_α near 0: absolute
    assert rdp.subsampled_gaussian(q, sigma, []).shape == (0,)
    assert rdp.subsampled_gaussian(q, sigma, [2, 3]) == pytest.approx(
        rdp.subsampled_gaussian(q, sigma, [1.5, 2, 3])[1:]
    )


def test_the_default_grid_only_lowers_epsilon_and_only_where_the_optimum_moved() -> None:
    moved = 0
    for sigma, q, steps in [*CASES, (8.0, 0.001, 1000), (20.0, 0.01, 100), (1.3, 150 / 60000, 6000)]:
        bill = ledger.from_history([(sigma, q, steps)])
        old = ledger.epsilon(bill, 1e-5, Accounting(orders=rdp.OPACUS_ORDERS))
        new = ledger.epsilon(bill, 1e-5)
        assert new.epsilon <= old.epsilon
        if new.order in rdp.OPACUS_ORDERS:
            assert new.epsilon == old.epsilon
        else:
            moved += 1
            assert new.epsilon < old.epsilon
    assert moved >= 2  # small ε: the best order lies beyond Opacus's 63, or between its orders


def test_an_epsilon_over_opacus_grid_drops_where_the_best_order_is_beyond_63() -> None:
    bill = ledger.from_history([(8.0, 0.001, 1000)])
    old = ledger.epsilon(bill, 1e-5, Accounting(orders=rdp.OPACUS_ORDERS))
    new = ledger.epsilon(bill, 1e-5)
    assert old.order == 63 and new.order is not None and new.order > 63
    assert new.epsilon < 0.85 * old.epsilon


def test_pure_dp_rdp_is_within_the_known_bounds_and_tight_at_the_limits() -> None:
    orders = np.array(rdp.DEFAULT_ORDERS)
    for eps in (0.01, 0.5, 2.0):
        curve = rdp.pure_dp(eps, orders)
        assert np.all(curve <= eps + 1e-12) and np.all(curve <= orders * eps**2 / 2 + 1e-12)
        if eps >= 0.5:  # α -> ∞: the max divergence, ε
            assert curve[-1] == pytest.approx(eps, rel=0.01)


def test_a_pure_release_composes_under_every_accountant() -> None:
    steps = ledger.dpsgd(1.0, 0.01, 500)
    release = ledger.pure_release("clip_quantile", 0.1, {"quantile": 0.5}, "histogram method")
    alone = ledger.epsilons(Ledger((steps,)), 1e-5)
    both = ledger.epsilons(Ledger((release, steps)), 1e-5)
    assert all(both[name] > alone[name] for name in alone)
    assert both["prv"] == pytest.approx(alone["prv"] + 0.1)  # basic composition
    assert both["rdp"] - alone["rdp"] < 0.1 and both["pld"] - alone["pld"] < 0.1  # tighter than adding ε
    only = ledger.epsilons(Ledger((release,)), 1e-5)
    assert only["pld"] == pytest.approx(0.1, abs=1e-3) and only["prv"] == 0.1


def test_pld_and_prv_agree_and_are_tighter_than_rdp() -> None:
    bill = Ledger((ledger.dpsgd(0.8, 0.0357, 280),))
    e = ledger.epsilons(bill, 1e-5)
    assert e["pld"] < e["rdp"] and e["prv"] < e["rdp"]
    assert e["pld"] == pytest.approx(e["prv"], rel=0.02)


def test_poisson_amplification_of_a_pure_release() -> None:
    assert ledger.amplified_by_poisson(1.0, 1.0) == pytest.approx(1.0)
    assert ledger.amplified_by_poisson(1.0, 0.01) == pytest.approx(0.01 * (math.e - 1), rel=0.01)
    assert ledger.amplified_by_poisson(0.5, 0.1) < 0.5


def test_the_json_bill_lists_every_event_with_shares_that_sum_to_one() -> None:
    release = ledger.pure_release("clip_quantile", 0.2, {"quantile": 0.5}, "histogram method")
    bill = Ledger((release, ledger.dpsgd(1.0, 0.01, 500)))
    out = ledger.to_json(bill, 1e-5)
    assert out["unit"] == "example" and set(out["epsilon"]) == {"rdp", "prv", "pld"}
    assert [e["name"] for e in out["events"]] == ["clip_quantile", "dpsgd"]
    shares = [e["share_of_rdp"] for e in out["events"]]
    assert sum(shares) == pytest.approx(1.0) and 0 < shares[0] < shares[1]
    assert out["events"][1]["event"]["type"] == "SelfComposedDpEvent"
    assert out["events"][1]["event"]["event"]["event"]["noise_multiplier"] == 1.0


@pytest.mark.parametrize("distribution", ["poisson", "geometric", "tnb"])
def test_tuning_costs_more_than_one_run_and_more_with_more_trials(distribution: str) -> None:
    bill = Ledger((ledger.dpsgd(1.0, 0.01, 500),))
    one = ledger.epsilon(bill, 1e-5).epsilon
    shape = ledger.TUNING_SHAPES.get(distribution)
    few, many = (ledger.tuning_epsilon(bill, 1e-5, mean, shape).epsilon for mean in (3, 30))
    assert one < few < many < math.inf


def test_an_event_no_accountant_supports_is_named() -> None:
    from dp_accounting import dp_event

    bill = Ledger((ledger.Entry("odd", dp_event.LaplaceDpEvent(1.0)),))
    with pytest.raises(ValueError, match="LaplaceDpEvent"):
        ledger.epsilon(bill, 1e-5)


def test_each_epsilon_is_computed_once_per_process_and_only_for_the_same_mechanisms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The jobs of an inline sweep over seeds share their ε: an accountant runs once per set of
    mechanisms, δ and accounting; any difference in those is computed afresh."""
    calls: list[int] = []
    real = ledger.ACCOUNTANTS.get("pld")

    def counted(bill: Ledger, delta: float, a: Accounting) -> tuple[float, float | None]:
        calls.append(1)
        return real(bill, delta, a)

    monkeypatch.setitem(ledger.ACCOUNTANTS._entries, "pld", counted)
    monkeypatch.setattr(ledger, "_COMPUTED", {})
    pld = Accounting("pld")
    first = ledger.epsilon(Ledger((ledger.dpsgd(1.1, 0.01, 500),)), 1e-5, pld)
    again = ledger.epsilon(Ledger((ledger.dpsgd(1.1, 0.01, 500),)), 1e-5, pld)  # another run's equal ledger
    assert again == first and len(calls) == 1
    more = ledger.epsilon(Ledger((ledger.dpsgd(1.1, 0.01, 600),)), 1e-5, pld)
    other_delta = ledger.epsilon(Ledger((ledger.dpsgd(1.1, 0.01, 500),)), 1e-6, pld)
    assert len(calls) == 3 and more.epsilon > first.epsilon and other_delta.epsilon > first.epsilon
    assert ledger.epsilon(Ledger((ledger.dpsgd(1.1, 0.01, 500),)), 1e-5).accountant == "rdp"  # not pld's value


def test_a_steps_pld_is_built_once_and_composing_it_leaves_it_as_it_was() -> None:
    """A run's ε after each epoch composes the same step's PLD again (``ledger._one_pld``, kept): the
    ε of a ledger is the same built afresh, before and after longer compositions of the kept step."""

    def eps(steps: int) -> float:
        return float(ledger.pld_of(Ledger((ledger.dpsgd(0.9, 0.04, steps),)), 1e-3).get_epsilon_for_delta(1e-5))

    ledger._one_pld.cache_clear()
    ledger._composed_pld.cache_clear()
    fresh = eps(40)
    assert eps(400) > eps(80) > fresh
    assert ledger._one_pld.cache_info().misses == 1  # one step's PLD, composed 40, 400 and 80 times
    assert eps(40) == fresh
    ledger._one_pld.cache_clear()
    ledger._composed_pld.cache_clear()
    assert eps(40) == fresh


def test_a_ledgers_pld_is_composed_once_for_its_epsilon_and_its_certainty_figures() -> None:
    """A run's end reads ε and the certainty figures (its profile) off one composed PLD: the second
    reader gets the same distribution, not a recomposition."""
    bill = Ledger((ledger.dpsgd(0.95, 0.03, 70),))
    ledger._composed_pld.cache_clear()
    first = ledger.pld_of(bill)
    assert ledger.pld_of(Ledger((ledger.dpsgd(0.95, 0.03, 70),))) is first
    assert ledger._composed_pld.cache_info().misses == 1
    assert ledger.pld_of(Ledger()) is None


def test_beyond_its_cap_pld_and_prv_report_infinity_and_the_bill_says_why() -> None:
    """σ = 0.03 on digits' q for 184 steps: PLD ran over 2 minutes and PRV ran out of memory. Beyond
    an RDP ε of 100 they are not computed: +inf (sound: every ε' >= ε holds), and epsilons() has rdp only."""
    huge = ledger.from_history([(0.03, 64 / 1437, 184)])
    rdp_eps = ledger.epsilon(huge, 1e-5).epsilon
    assert ledger.DISCRETISED_MAX_EPSILON < rdp_eps < math.inf and ledger.beyond_discretised(huge, 1e-5)
    for name in ("pld", "prv"):
        assert ledger.epsilon(huge, 1e-5, Accounting(name)).epsilon == math.inf
    assert ledger.epsilons(huge, 1e-5) == {"rdp": rdp_eps}
    bill = ledger.to_json(huge, 1e-5)
    assert set(bill["not_computed"]) == {"pld", "prv"} and "exceeds 100" in bill["not_computed"]["pld"]
    assert bill["events"][0]["epsilon_alone"] == {"rdp": rdp_eps, "pld": None}
    within = ledger.from_history([(0.8, 64 / 1437, 184)])  # the demo's σ: every accountant, nothing left out
    assert not ledger.beyond_discretised(within, 1e-5)
    assert set(ledger.epsilons(within, 1e-5)) == {"rdp", "pld", "prv"}
    assert not ledger.to_json(within, 1e-5)["not_computed"]
