"""``dpsweep-plan --risk``: μ-GDP and the attack's TPR at 1 % FPR beside each job's ε, computed once per
distinct ledger (issue 58, item 2)."""

from __future__ import annotations

import json

import pytest
from helpers import run_main

from dpsweep.cli.plan import main
from dpsweep.privacy import certainty, ledger

GRID = ["dp.noise_multiplier=0.8,1.6", "train.seed=0,1,2", "train.epochs=2"]


def test_risk_adds_mu_and_tpr_columns_each_ledger_priced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    profiles: list[ledger.Ledger] = []
    original = certainty.profile

    def counted(bill: ledger.Ledger, *args: object, **kwargs: object) -> certainty.Profile | None:
        profiles.append(bill)
        return original(bill, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(certainty, "profile", counted)
    done = run_main(main, *GRID, "--risk")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split()[10:12] == ["μ", "TPR@1%"], header
    assert len(profiles) == 2  # 6 jobs, 2 distinct ledgers (the seed changes no ledger)
    assert "μ: each job is μ-GDP" in done.stdout and "TPR@1%: the largest true-positive rate" in done.stdout
    figures = [(float(r.split()[10]), float(r.split()[11])) for r in rows[:6]]
    assert len(set(figures)) == 2 and figures[0][0] > figures[3][0]  # σ = 0.8: a larger μ than σ = 1.6
    found = original(profiles[0])
    assert figures[0] == (
        float(f"{certainty.mu_gdp(profiles[0], found=found):.3g}"),
        float(f"{certainty.tpr_bound(found, 0.01):.3g}"),
    )


def test_risk_in_json_and_absent_without_the_flag() -> None:
    done = run_main(main, *GRID, "--risk", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert all(0 < r["mu_gdp"] < 10 and 0.01 < r["tpr_at_1pct"] < 1 for r in rows)
    assert all(0 < r["gdp_delta_allowance"] < 1e-9 for r in rows)
    plain = run_main(main, *GRID)
    assert plain.returncode == 0, plain.stderr
    assert "μ" not in plain.stdout.splitlines()[0] and "TPR@1%" not in plain.stdout
