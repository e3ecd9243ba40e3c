"""``dpsweep-epsilon --target-epsilon``: the calibrated σ is shown in 4 significant digits, rounded up, so
that a run at the σ shown spends at most the target; --json keeps it whole (issue 56, item 9d)."""

from __future__ import annotations

import re

import pytest

from dpsweep.cli.epsilon import run

SETTING = ["-s", "1437", "-b", "64", "-e", "8"]  # digits' training split, the default B, 8 epochs


@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
def test_a_calibrated_sigma_is_shown_in_four_digits_rounded_up(
    target: float, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = run([*SETTING, "--target-epsilon", str(target), "--json"])["noise_multiplier"]
    capsys.readouterr()
    run([*SETTING, "--target-epsilon", str(target)])
    text = capsys.readouterr().out
    found = re.search(r"noise multiplier σ = ([0-9.e+-]+),", text)
    assert found is not None, text
    digits = found.group(1).replace(".", "").lstrip("0")
    assert len(digits) <= 4, text  # not a float's six digits
    shown = float(found.group(1))
    assert whole <= shown <= whole * 1.001, (whole, text)  # rounded up, by less than a thousandth
    assert "rounded up to 4 significant digits" in text and "--json gives it whole" in text, text
    again = run([*SETTING, "-n", found.group(1), "--json"])  # the σ shown, given back: within the target
    assert again["epsilon"] <= target
