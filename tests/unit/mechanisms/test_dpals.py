"""dp.mechanism=dpals's privacy: its ledger, calibration and pricing by dpsweep-epsilon, and its refusal
by tasks that do not train by sufficient statistics (dpsweep.mechanisms.dpals)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import Composer
from scipy.optimize import brentq
from scipy.stats import norm

from dpsweep.cli.epsilon import run
from dpsweep.config import ConfigError, to_config
from dpsweep.data.facts import DatasetFacts
from dpsweep.mechanisms import MECHANISMS, Setting
from dpsweep.plan import prepare
from dpsweep.privacy import ledger

DPALS = MECHANISMS.get("dpals")


def _exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """ε of one Gaussian mechanism of sensitivity 1 and noise σ at δ, exactly (Balle & Wang 2018,
    "Improving the Gaussian Mechanism for Differential Privacy", Thm. 8)."""

    def excess(eps: float) -> float:
        return norm.cdf(-eps * sigma + 0.5 / sigma) - math.exp(eps) * norm.cdf(-eps * sigma - 0.5 / sigma) - delta

    return float(brentq(excess, 0.0, 500.0))


@pytest.mark.parametrize(("sigma", "rounds"), [(2.0, 10), (5.0, 25)])
def test_the_ledgers_epsilon_is_that_of_the_rounds_composed_as_one_gaussian(sigma: float, rounds: int) -> None:
    """T rounds of a Gaussian mechanism at σ, every user in each (no sampling), compose to one at σ/√T:
    the ledger's PLD ε is that exact ε up to its discretisation (an upper bound); RDP's is above it."""
    s = Setting(population=5000, batch_size=5000, epochs=rounds, delta=1e-5)
    bill = DPALS.ledger(s, sigma)
    assert DPALS.steps(s) == rounds and DPALS.sample_rate(s) is None
    exact = _exact_gaussian_epsilon(sigma / math.sqrt(rounds), 1e-5)
    pld = ledger.epsilon(bill, 1e-5, ledger.Accounting("pld")).epsilon
    rdp = ledger.epsilon(bill, 1e-5, ledger.Accounting("rdp")).epsilon
    assert exact <= pld <= exact * 1.01 and rdp > pld
    taken = DPALS.ledger_taken(s, sigma, 4)  # a run stopped after 4 rounds: the ε of 4
    assert ledger.epsilon(taken, 1e-5, ledger.Accounting("pld")).epsilon == pytest.approx(
        _exact_gaussian_epsilon(sigma / 2, 1e-5), rel=0.01
    )


def test_dpsweep_epsilon_prices_and_calibrates_dpals(capsys: pytest.CaptureFixture[str]) -> None:
    run(["--mechanism", "dpals", "-s", "5400", "-b", "5400", "-e", "10", "--target-epsilon", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["mechanism"] == "dpals" and out["steps"] == 10 and out["sample_rate"] is None
    assert 2.97 <= out["epsilon"] <= 3.0 and "no amplification" in out["description"]
    exact = _exact_gaussian_epsilon(out["noise_multiplier"] / math.sqrt(10), 1e-5)
    assert exact <= out["epsilon"] <= exact * 1.01


def test_a_task_that_does_not_train_by_sufficient_statistics_refuses_dpals(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("dp.mechanism=dpals"))
    with pytest.raises(ConfigError) as err:
        prepare(cfg, DatasetFacts(1437, (1, 28, 28), 10))
    message = str(err.value)  # the mechanisms the classifier takes (a test may have registered one more)
    assert err.value.key == "dp.mechanism" and "dpsgd" in message and "with image classification" in message
    assert "dpals or" not in message and "or dpals" not in message
