"""The risk columns of a report (``dpsweep-report --risk``, issue 58) and the analysis behind a private
tuning's ε: how certain each row's ε is, and what it means for an attacker.

    dpsweep-report --experiment demo --risk     # adds: ε interval, μ, TPR@1% (%)

Each figure is a metric a DP run logs (:mod:`dpsweep.privacy.certainty` computes them from the run's
ledger):

- ``ε interval``: ``epsilon_lower`` .. the row's ε. The lower end is a sound lower bound on the ε of the
  mechanism the ledger analyses (a mean-preserving discretisation whose rounding error Bernstein's
  inequality bounds, cf. Gopi, Lee & Wutschitz 2021); the upper end is the row's ε itself, an upper
  bound under any of dpsweep's accountants (the PLD's is dp-accounting's pessimistic PLD: Doroshenko
  et al. 2022). So the true ε lies between them.
- ``μ``: ``mu_gdp``, the smallest μ for which the run is certified μ-GDP (Dong, Roth & Su 2022) from the
  same pessimistic privacy profile, down to a δ allowance of about 2e-12 (``certainty.is_gdp``).
- ``TPR@1%``: ``tpr_at_1pct``, the largest true-positive rate of any membership-inference test at a
  false-positive rate of 1 % (Kairouz, Oh & Viswanath 2015, Thm. 2.1; Kulynych et al. 2024).

A row's figures are its runs' worst: the least lower end (so the interval holds every run's ε), the
largest μ and TPR. Runs from before these metrics, non-private rows, and a private tuning's rows show
a dash: a tuning trial's figures are of one run, not of the whole procedure whose ε the row shows.

A private tuning's procedure ε comes from one of :data:`dpsweep.privacy.tuning.ANALYSES`, named by the
released trial's tag ``tuning.analysis``; runs from before that tag had the only analysis there was,
``papernot_steinke`` (:data:`dpsweep.tracking.sweeps.BEFORE_ANALYSES`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pandas as pd

from dpsweep.analysis.report.cells import PERCENT
from dpsweep.analysis.report.columns import column
from dpsweep.tracking.sweeps import ANALYSIS_TAG, BEFORE_ANALYSES
from dpsweep.units import rounded_up

# the report's column -> the metric a DP run logs (dpsweep.privacy.certainty)
RISK_METRICS: dict[str, str] = {
    "epsilon_lower": "metrics.epsilon_lower",
    "mu_gdp": "metrics.mu_gdp",
    "tpr_at_1pct": "metrics.tpr_at_1pct",
}
# how a row pools its runs' figures: the worst run's (the interval then holds every run's ε)
RISK_POOLING: dict[str, str] = {"epsilon_lower": "min", "mu_gdp": "max", "tpr_at_1pct": "max"}
RISK_DIGITS = 4  # significant digits of the interval's ends, the lower rounded down, the upper up

RISK_NOTE = (
    "ε interval: a sound lower bound on each row's ε (epsilon_lower: a mean-preserving discretisation of the "
    "privacy loss whose rounding error Bernstein's inequality bounds, cf. Gopi, Lee & Wutschitz 2021) .. the "
    "row's ε (an upper bound; PLD: dp-accounting's pessimistic PLD, Doroshenko et al. 2022): the true ε lies "
    "between. μ: the row is μ-GDP (mu_gdp; Dong, Roth & Su 2022), certified from the pessimistic privacy profile "
    "down to δ ≈ 2e-12. TPR@1%: the largest true-positive rate of any membership-inference attack at 1% "
    "false-positive rate (tpr_at_1pct; Kairouz, Oh & Viswanath 2015; Kulynych et al. 2024). Each is the worst "
    "of the row's runs; — where the runs logged none (dpsweep before issue 58, a non-private row, or a private "
    "tuning's row, whose runs' figures are one trial's, not the procedure's)."
)

Cell = Callable[[pd.Series], str]


def run_risks(done: pd.DataFrame) -> dict[str, pd.Series]:
    """Each run's risk figures (:data:`RISK_METRICS`), NaN where it logged none and for a private
    tuning's trials (their figures are one trial's, not those of the procedure whose ε they show)."""
    tuned = column(done, "metrics.epsilon_tuning").notna()
    return {name: column(done, key).astype(float).where(~tuned) for name, key in RISK_METRICS.items()}


def pooled_risks(grouped: Any) -> dict[str, pd.Series]:
    """A row's risk figures from its runs' (a groupby of a frame with :data:`RISK_METRICS`' columns)."""
    return {name: getattr(grouped[name], how)() for name, how in RISK_POOLING.items()}


def rounded_down(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits, never more than it (the lower end of an interval)."""
    if not math.isfinite(value) or value <= 0:
        return f"{value:g}"
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(value)))
    steps = math.floor(round(value * scale, 6))
    while float(f"{steps / scale:.{digits}g}") > value:
        steps -= 1
    return f"{steps / scale:.{digits}g}"


def interval_text(row: pd.Series) -> str:
    """``2.285 .. 2.296``: the row's lower bound rounded down, its ε rounded up; a dash where either is missing."""
    lower, upper = row.get("epsilon_lower"), row.get("epsilon")
    if lower is None or upper is None or pd.isna(lower) or pd.isna(upper) or not row["private"]:
        return "—"
    return f"{rounded_down(float(lower), RISK_DIGITS)} .. {rounded_up(float(upper), RISK_DIGITS)}"


def _upper_text(name: str, scale: float = 1.0) -> Cell:
    """A figure that bounds from above, in 3 significant digits rounded up; a dash where missing."""

    def cell(row: pd.Series) -> str:
        value = row.get(name)
        if value is None or pd.isna(value) or not row["private"]:
            return "—"
        if not math.isfinite(value):
            return "∞"
        # a percentage: 0.0315 * 100 is 3.1500000000000004, which would round up to 3.16
        return rounded_up(round(float(value) * scale, 12) if scale != 1 else float(value), 3)

    return cell


def risk_columns() -> list[tuple[str, str, Cell]]:
    """(header, LaTeX header, cell) of the risk columns, after ε."""
    return [
        ("ε interval", r"$\varepsilon$ interval", interval_text),
        ("μ", r"$\mu$", _upper_text("mu_gdp")),
        ("TPR@1% (%)", r"TPR@1\% (\%)", _upper_text("tpr_at_1pct", PERCENT)),
    ]


RISK_HEADERS = tuple(header for header, _, _ in risk_columns())


def tuning_analyses(rows: pd.DataFrame) -> list[str]:
    """The analyses behind the private tuning rows' ε (column ``tuning_analysis``), sorted."""
    return sorted({str(a) for a in column(rows, "tuning_analysis").dropna()}) or [BEFORE_ANALYSES]


def run_tuning_analyses(first: pd.DataFrame) -> pd.Series:
    """Each run's tuning analysis: its tag ``tuning.analysis``, else papernot_steinke for a private
    tuning's trial (one with ``epsilon_tuning``) from before the tag; None for other runs."""
    tuned = column(first, "metrics.epsilon_tuning").notna()
    tagged = column(first, f"tags.{ANALYSIS_TAG}").astype(object).fillna(BEFORE_ANALYSES)
    return tagged.where(tuned, None)


def analysis_text(analyses: list[str]) -> str:
    """``the papernot_steinke analysis (Papernot & Steinke 2022, ...)``: the analyses and what each cites."""
    from dpsweep.privacy.tuning import ANALYSES  # dp-accounting: only where a report has a private tuning

    return " and ".join(f"the {a} analysis" + (f" ({ANALYSES[a]})" if a in ANALYSES else "") for a in analyses)
