"""``dp.target_tpr_at_1pct``: σ calibrated so that no membership-inference attack on the run reaches a TPR
above the target at 1 % FPR, beside ``dp.target_epsilon`` (issue 58, item 2)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import Composer

from dpsweep.config import ConfigError, flatten, identity, to_config, validate
from dpsweep.data.facts import DatasetFacts
from dpsweep.plan import config_hash, mechanism_of, prepare, setting
from dpsweep.privacy import certainty

DIGITS = DatasetFacts(1437, (1, 28, 28), 10)
TARGET = 0.1


def test_sigma_is_calibrated_to_the_attack_risk(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg(f"dp.target_tpr_at_1pct={TARGET}", "train.epochs=2"))
    plan = prepare(cfg, DIGITS)
    p = plan.privacy
    assert p is not None and p.calibrated and p.calibrated_to == f"TPR at 1 % FPR <= {TARGET:g}"
    assert p.noise_multiplier != cfg.dp.noise_multiplier
    assert certainty.tpr_bound(certainty.profile(p.ledger), 0.01) <= TARGET
    mechanism = mechanism_of(cfg)
    less = mechanism.ledger(replace(setting(cfg, DIGITS.n_train, mechanism), steps=p.steps), 0.99 * p.noise_multiplier)
    assert certainty.tpr_bound(certainty.profile(less), 0.01) > TARGET  # the smallest such σ, to 1 %


def test_epsilon_calibration_says_what_it_was_calibrated_to(make_cfg: Composer) -> None:
    p = prepare(to_config(make_cfg("dp.target_epsilon=3", "train.epochs=2")), DIGITS).privacy
    assert p is not None and p.calibrated_to == "ε <= 3"
    given = prepare(to_config(make_cfg("train.epochs=2")), DIGITS).privacy
    assert given is not None and given.calibrated_to is None and not given.calibrated


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["dp.target_tpr_at_1pct=0.1", "dp.target_epsilon=3"], "σ is calibrated to one target"),
        (["dp.target_tpr_at_1pct=0.01"], "(0.01, 1)"),
        (["dp.target_tpr_at_1pct=1"], "(0.01, 1)"),
        (["dp.target_tpr_at_1pct=nan"], "finite"),
    ],
)
def test_bad_targets_are_refused_naming_the_key(make_cfg: Composer, overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(to_config(make_cfg(*overrides)))
    assert err.value.key == "dp.target_tpr_at_1pct" and needle in str(err.value), str(err.value)


def test_the_new_key_leaves_the_config_hash_of_runs_before_it(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("train.epochs=2"))
    assert "dp.target_tpr_at_1pct" in flatten(cfg) and "dp.target_tpr_at_1pct" not in identity(flatten(cfg))
    risk = to_config(make_cfg("train.epochs=2", "dp.target_tpr_at_1pct=0.1"))
    assert config_hash(risk) != config_hash(cfg)
