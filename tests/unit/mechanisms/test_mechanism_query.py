"""``dpsweep.mechanisms.query``: a mechanism's configuration priced before training, called with plain
arguments (what ``dpsweep-epsilon`` builds from its command line)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dpsweep import mechanisms
from dpsweep.errors import InputError
from dpsweep.mechanisms.query import Query, Tuning, calibrated_epochs, price, with_clipping_release
from dpsweep.privacy import ledger
from dpsweep.units import rounded_up

DPSGD = mechanisms.get("dpsgd")
PLD = ledger.Accounting("pld")
SETTING = mechanisms.Setting(1000, 50, 3, 1e-5, PLD)


def test_the_price_is_the_epsilon_of_the_ledger_a_run_records() -> None:
    out = price(DPSGD, Query("dpsgd", SETTING, noise_multiplier=1.1), described_digits=4)
    expected = ledger.epsilon(DPSGD.ledger(SETTING, 1.1), 1e-5, PLD).epsilon
    assert out["epsilon"] == expected and out["epsilon_upper"] == pytest.approx(expected, rel=1e-9)
    assert out["mechanism"] == "dpsgd" and out["steps"] == DPSGD.steps(SETTING) and out["epochs"] == 3
    assert "calibrated" not in out and "clipping" not in out and "epsilon_tuning" not in out


def test_a_calibrated_sigma_is_whole_in_its_field_and_rounded_up_in_the_description() -> None:
    out = price(DPSGD, Query("dpsgd", SETTING, target_epsilon=2.0), described_digits=2)
    sigma = out["noise_multiplier"]
    assert out["calibrated"] == "noise_multiplier" and out["epsilon"] <= 2.0
    assert DPSGD.describe(SETTING, sigma) != out["description"]  # a bisection's σ has more than 2 digits
    assert out["description"] == DPSGD.describe(SETTING, float(rounded_up(sigma, 2)))


def test_the_calibrated_epochs_are_the_most_within_the_target() -> None:
    target = price(DPSGD, Query("dpsgd", SETTING, noise_multiplier=1.1), described_digits=4)["epsilon"]
    epochs = calibrated_epochs(DPSGD, replace(SETTING, epochs=None), 1.1, target)
    assert epochs == 3
    out = price(DPSGD, Query("dpsgd", replace(SETTING, epochs=None), 1.1, target_epsilon=target), described_digits=4)
    assert out["epochs"] == 3 and out["calibrated"] == "epochs"


def test_an_unreachable_target_names_the_config_key() -> None:
    with pytest.raises(InputError) as refused:
        price(DPSGD, Query("dpsgd", SETTING, noise_multiplier=0.3, target_epsilon=1e-3), described_digits=4)
    assert refused.value.key == "dp.target_epsilon" and refused.value.value == 1e-3


def test_the_quantile_release_and_a_tuning_add_to_the_price() -> None:
    fixed = price(DPSGD, Query("dpsgd", SETTING, noise_multiplier=1.1), described_digits=4)
    assert with_clipping_release(DPSGD, SETTING, None) is SETTING
    assert with_clipping_release(DPSGD, SETTING, 0.5).extra != SETTING.extra
    quantile = price(DPSGD, Query("dpsgd", SETTING, 1.1, clip_epsilon=0.5), described_digits=4)
    assert quantile["epsilon"] > fixed["epsilon"] and quantile["clip_epsilon"] == 0.5
    tuned = price(DPSGD, Query("dpsgd", SETTING, 1.1, tuning=Tuning(10, "tnb", 1.0)), described_digits=4)
    assert tuned["epsilon_tuning"] > tuned["epsilon"] and tuned["tuning_eta"] == 1.0
