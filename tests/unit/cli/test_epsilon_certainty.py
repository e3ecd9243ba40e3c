"""``dpsweep-epsilon`` states how certain its ε is: the PLD's sound interval, μ-GDP and the attack risk
beside ε (issue 58, items 1 and 2)."""

from __future__ import annotations

import json
import re

import pytest

from dpsweep.cli.epsilon import certainty_text, run

# Opacus's MNIST preset: q = 240/60000, σ = 1.1, 60 epochs, δ = 1e-5. Its true ε lies in [2.2854, 2.3054]
# and dp-accounting's PLD gives 2.2955 (issue 58).
MNIST = ["-s", "60000", "-b", "240", "-n", "1.1", "-e", "60"]
NUMBER = r"([0-9.e+-]+)"


def test_the_mnist_preset_prints_its_interval_mu_and_tpr(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(MNIST)
    text = capsys.readouterr().out
    found = re.search(rf"The true ε at δ = 1e-05 lies in \[{NUMBER}, {NUMBER}\]", text)
    assert found is not None, text
    lower, upper = float(found.group(1)), float(found.group(2))
    assert 2.2854 <= lower < upper and round(upper, 4) == 2.2955, text  # 2.2955: the figure, to 4 places
    assert upper == pytest.approx(out["epsilon"], rel=1e-5)  # the upper end is the ε printed (pld)
    mu = re.search(rf"μ-GDP with μ = {NUMBER} \(up to δ = {NUMBER}\)", text)
    tpr = re.search(rf"TPR is at most {NUMBER} at 1 % FPR and {NUMBER} at 10 % FPR", text)
    assert mu is not None and tpr is not None, text
    assert float(mu.group(1)) == pytest.approx(out["mu_gdp"], rel=1e-3) and 0 < float(mu.group(1)) < 1
    assert 0.01 < float(tpr.group(1)) < float(tpr.group(2)) < 1
    assert "width" not in text  # 0.2 %: printed only above 1 %


def test_json_carries_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    run([*MNIST, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert 2.2854 <= out["epsilon_lower"] < out["epsilon_upper"] == out["epsilon"]
    assert round(out["epsilon_upper"], 4) == 2.2955
    # a Gaussian of μ-GDP: TPR at FPR α is Φ(Φ⁻¹(α) + μ) (Dong, Roth & Su 2022), which bounds the run's
    # from above where its μ certifies it
    from scipy.stats import norm

    assert out["tpr_at_1pct"] <= norm.cdf(norm.ppf(0.01) + out["mu_gdp"]) + out["gdp_delta_allowance"]
    assert 0 < out["gdp_delta_allowance"] < 1e-9
    assert 0.01 < out["tpr_at_1pct"] < out["tpr_at_10pct"] and 0 < out["mia_advantage"] < 1


def test_another_accountants_interval_is_said_to_be_the_plds(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(["-s", "60000", "-b", "150", "-n", "1.3", "-e", "15", "--accountant", "rdp"])
    text = capsys.readouterr().out
    assert "(the interval is the PLD's: its upper end is the PLD accountant's ε)" in text, text
    assert out["epsilon_upper"] < out["epsilon"]  # the PLD's upper end is below RDP's ε


def test_a_wide_interval_prints_its_width() -> None:
    o = {"epsilon_lower": 0.9, "epsilon_upper": 1.0, "accountant": "pld", "delta": 1e-5, "mu_gdp": 0.5,
         "gdp_delta_allowance": 2e-12, "tpr_at_1pct": 0.03, "tpr_at_10pct": 0.2, "mia_advantage": 0.2}  # fmt: skip
    assert "its width is 10 % of ε" in certainty_text(o)
    assert "width" not in certainty_text(o | {"epsilon_lower": 0.995})


def test_where_the_pld_computes_nothing_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(["-s", "60000", "-b", "150", "-n", "0.3", "-e", "150", "--accountant", "rdp"])
    assert "does not compute this ε" in capsys.readouterr().out and out["epsilon_upper"] == float("inf")
