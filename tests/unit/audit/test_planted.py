"""The test-only switch that plants bugs in DP-SGD (dpsweep.audit.planted)."""

from __future__ import annotations

import pytest

from dpsweep.audit import planted


def test_the_switch_names_a_known_bug_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(planted.PLANTED_BUG_ENV, raising=False)
    assert planted.planted_bug() is None
    monkeypatch.setenv(planted.PLANTED_BUG_ENV, "no_clipping")
    assert planted.planted_bug() == "no_clipping"
    monkeypatch.setenv(planted.PLANTED_BUG_ENV, "slow_noise")
    with pytest.raises(ValueError, match="DPSWEEP_TEST_PLANTED_BUG=slow_noise: one of noise_tenth, no_clipping"):
        planted.planted_bug()
