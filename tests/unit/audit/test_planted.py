"""The bugs tests plant to check the audit (tests/planted.py) live with the tests, attached through the
private-step protocol: shipped code holds no switch that breaks a run, and replaces no optimizer's method
on the instance; each planted wrapper breaks a release as its name says."""

from __future__ import annotations

import re
from pathlib import Path

import planted
import pytest
import torch

from dpsweep.mechanisms.private_step import Release

PACKAGE = Path(__file__).resolve().parents[3] / "dpsweep"
# an optimizer's method replaced by assignment on the instance (what the audit and the planted bugs once did)
ASSIGNED = re.compile(
    r"\w*optimizer\w*\.(clip_and_accumulate|add_noise|scale_grad|pre_step|step|zero_grad)\s*=(?!=)|method-assign"
)


def _sources() -> list[tuple[Path, str]]:
    return [(path, path.read_text(encoding="utf-8")) for path in sorted(PACKAGE.rglob("*.py"))]


def test_no_environment_variable_in_shipped_code_plants_a_bug() -> None:
    found = [str(p) for p, text in _sources() if "DPSWEEP_TEST" in text or "planted_bug" in text]
    assert not found, found
    assert not (PACKAGE / "audit" / "planted.py").exists()


def test_shipped_code_replaces_no_optimizer_method_by_assignment() -> None:
    found = [f"{p}:{m.group(0)}" for p, text in _sources() for m in ASSIGNED.finditer(text)]
    assert not found, found


def _release(noise: float, clipped: float = 1.0, units: torch.Tensor | None = None) -> Release:
    clip = {"w": torch.full((3,), clipped)}
    shown = None if units is None else {"w": units}
    return Release(0, clip, {"w": torch.full((3,), clipped + noise)}, 2.0, shown)


def test_a_planted_tenth_of_the_noise_keeps_the_clipped_sum() -> None:
    release = _release(noise=5.0)
    planted.NoiseTenth().released(release)
    assert torch.allclose(release.noisy["w"], torch.full((3,), 1.5))


def test_planted_reused_noise_adds_the_first_releases_noise_at_every_step() -> None:
    bug = planted.ReusedNoise()
    first, second = _release(noise=0.5), _release(noise=-2.0, clipped=3.0)
    bug.released(first)
    bug.released(second)
    assert torch.allclose(second.noisy["w"], torch.full((3,), 3.5))


def test_planted_no_clipping_releases_the_unclipped_sum_where_the_step_shows_its_units() -> None:
    units = torch.full((2, 3), 10.0)  # two units of norm far above C, their clipped sum over 2 was 1.0
    release = _release(noise=0.25, units=units)
    planted.UnclippedSum().released(release)
    assert torch.allclose(release.noisy["w"], torch.full((3,), 10.25))  # 20 / 2, plus the same noise
    hidden = _release(noise=0.25)
    planted.UnclippedSum().released(hidden)
    assert torch.allclose(hidden.noisy["w"], torch.full((3,), 1.25))  # no units shown: left to clips_nothing


def test_an_unknown_bug_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="slow_noise: one of noise_tenth, no_clipping, reused_noise"):
        planted.bug("slow_noise", monkeypatch)
