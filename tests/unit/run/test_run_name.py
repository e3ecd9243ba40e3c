"""Run names (issue 33, item 6): MLflow's runs table cuts a name at about 20 characters, so what a
sweep varies (σ, C, B, the seed) comes first."""

from __future__ import annotations

from helpers import Composer

from dpsweep.config import to_config
from dpsweep.run.records import run_name


def test_a_run_name_shows_sigma_b_and_the_seed_in_its_first_20_characters(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("train.batch_size=128", "train.seed=3", "dp.max_grad_norm=0.5"))
    name = run_name(cfg, 1.1)
    assert name[:20].startswith("σ1.1-C0.5-B128-s3-"), name
    assert name.endswith(f"-{cfg.dataset.name}-{cfg.model.name}"), name
    off = run_name(to_config(make_cfg("dp=off", "train.batch_size=32", "train.seed=1")), None)
    assert off.startswith("nodp-B32-s1-"), off
    trial = run_name(to_config(make_cfg("sweep.trial=7")), 1.0)
    assert trial.startswith("trial7-σ1-C"), trial
