"""The f-DP analysis of a one-run audit (dpsweep.audit.fdp): the trade-off curve of a ledger, the test of
a claim (sound on mechanisms that meet it, powerful on ones that do not), the bound along the run's
noise, and the guesses split where the scores' gap is (dpsweep.audit.guesses)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from scipy.stats import norm

from dpsweep.audit import bound, fdp, guesses
from dpsweep.privacy import ledger


def _gaussian(mu: float) -> ledger.Ledger:
    """μ-GDP: one Gaussian mechanism of sensitivity 1 and noise 1/μ."""
    return ledger.Ledger((ledger.Entry("gaussian", dp_event.GaussianDpEvent(1 / mu)),))


def test_the_trade_off_of_a_gaussian_ledger_is_the_gaussians_from_below() -> None:
    """Dong, Roth & Su's G_μ(α) = Φ(Φ⁻¹(1 − α) − μ); the profile's grid and the pessimistic PLD give a
    curve a little below it, never above."""
    f = fdp.claimed_tradeoff(_gaussian(1.0))
    for alpha in (1e-4, 0.01, 0.1, 0.3, 0.5, 0.9):
        exact = float(norm.cdf(norm.ppf(1 - alpha) - 1.0))
        assert exact - 0.02 <= f(alpha) <= exact + 1e-9, alpha
    assert f(0.0) == pytest.approx(1.0, abs=1e-3) and f(1.0) == 0.0


def _game(rng: np.random.Generator, mu: float, m: int = 1000) -> dict[str, tuple[int, int]]:
    """m canaries scored N(μ, 1) when included and N(0, 1) when not; 100 top and bottom guesses, and a
    guess on every one split at the scores' gap."""
    included = rng.random(m) < 0.5
    scores = rng.normal(size=m) + mu * included
    order = np.argsort(scores)
    top = int(included[order[-50:]].sum()) + int((~included[order[:50]]).sum())
    split = guesses.split_guesses(torch.as_tensor(scores), torch.as_tensor(included))
    return {"top": (100, top), "split": (m, split)}


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0])
def test_guesses_a_mechanism_meeting_its_claim_allows_are_rejected_at_most_five_percent_of_the_time(mu: float) -> None:
    rng = np.random.default_rng(int(mu * 10))
    f = fdp.claimed_tradeoff(_gaussian(mu))
    rejected = sum(any(fdp.rejects(f, 1000, r, v, 0.05 / 2) for r, v in _game(rng, mu).values()) for _ in range(100))
    assert rejected <= 5, rejected


def test_randomised_response_at_its_claimed_pure_epsilon_is_not_rejected() -> None:
    """The worst ε-DP mechanism for guessing: each guess right with probability e^ε/(1 + e^ε)."""
    rng = np.random.default_rng(0)
    claim = ledger.Ledger((ledger.pure_release("rr", 2.0, {}, ""),))
    f = fdp.claimed_tradeoff(claim)
    right = rng.binomial(1000, 1 / (1 + np.exp(-2.0)), size=200)
    assert sum(fdp.rejects(f, 1000, 1000, int(v), 0.05) for v in right) <= 10


def test_a_mechanism_twice_as_revealing_as_claimed_is_caught_and_the_bound_passes_the_claim() -> None:
    rng = np.random.default_rng(1)
    f = fdp.claimed_tradeoff(_gaussian(0.5))
    games = [_game(rng, 1.0) for _ in range(50)]
    assert sum(any(fdp.rejects(f, 1000, r, v, 0.05 / 2) for r, v in g.values()) for g in games) >= 25
    claimed = ledger.epsilon(_gaussian(0.5), 1e-5, ledger.Accounting("pld")).epsilon
    caught = next(g for g in games if any(fdp.rejects(f, 1000, r, v, 0.05 / 2) for r, v in g.values()))
    assert fdp.epsilon_lower(_gaussian(0.5), caught, 1000, 1e-5, 0.95) > claimed


def test_the_claim_is_rejected_exactly_where_a_test_rejects_its_trade_off_and_the_bound_then_reaches_it() -> None:
    rng = np.random.default_rng(3)
    f = fdp.claimed_tradeoff(_gaussian(0.5))
    claimed = ledger.epsilon(_gaussian(0.5), 1e-5, ledger.Accounting("pld")).epsilon
    for _ in range(20):
        tests = _game(rng, 1.0)
        rejected = any(fdp.rejects(f, 1000, r, v, 0.05 / 2) for r, v in tests.values())
        assert fdp.rejects_claim(_gaussian(0.5), tests, 1000, 0.95) == rejected
        if rejected:  # the least private claim rejected is the run's own or a less private one
            assert fdp.epsilon_lower(_gaussian(0.5), tests, 1000, 1e-5, 0.95) >= claimed * (1 - 1e-3)
    assert not fdp.rejects_claim(_gaussian(0.5), {"top": (100, 50)}, 1000, 0.95)


def test_the_f_dp_bound_is_tighter_than_steinke_et_als_and_stays_below_a_met_claim() -> None:
    rng = np.random.default_rng(2)
    tests = _game(rng, 2.0)
    claimed = ledger.epsilon(_gaussian(2.0), 1e-5, ledger.Accounting("pld")).epsilon  # about 10
    lower = fdp.epsilon_lower(_gaussian(2.0), tests, 1000, 1e-5, 0.95)
    assert bound.best_bound(tests, 1000, 1e-5, 0.95) < lower <= claimed


def test_no_right_guess_bounds_nothing_and_impossible_counts_are_refused() -> None:
    assert fdp.epsilon_lower(_gaussian(1.0), {"top": (100, 50)}, 1000, 1e-5, 0.95) == 0.0
    with pytest.raises(ValueError, match="need 0 <= correct <= guesses <= canaries"):
        fdp.rejects(fdp.claimed_tradeoff(_gaussian(1.0)), 100, 200, 10, 0.05)


def test_a_ledgers_noise_scales_and_its_other_releases_stay() -> None:
    run = ledger.Ledger((ledger.dpsgd(1.0, 0.01, 100), ledger.pure_release("quantile", 0.1, {}, "")))
    scaled = ledger.scaled_noise(run, 2.0)
    kinds = [(leaf.kind, leaf.noise_multiplier, leaf.sample_rate, leaf.epsilon, leaf.count)
             for e in scaled.entries for leaf in ledger.leaves(e.event)]  # fmt: skip
    assert kinds == [("gaussian", 2.0, 0.01, 0.0, 100), ("pure", 0.0, 1.0, 0.1, 1)]
    eps = [ledger.epsilon(ledger.scaled_noise(run, t), 1e-5).epsilon for t in (0.5, 1.0, 2.0)]
    assert eps[0] > eps[1] > eps[2]


def test_every_guess_is_split_at_the_scores_gap_whatever_the_share_included() -> None:
    included = torch.tensor([True] * 540 + [False] * 460)
    scores = torch.where(included, 5.0, 0.0) + torch.rand(1000, generator=torch.Generator().manual_seed(0))
    assert guesses.split_guesses(scores, included) == 1000
    assert guesses.right_guesses(scores, included, 1000) == 960  # half and half: 40 included guessed out
