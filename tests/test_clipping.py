"""dp.clipping=quantile: C is a private quantile of the per-example gradient norms at initialisation,
released before training and charged in the run's ledger; the plan prices it, calibration spends the
whole target with it, and bad input is refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Composer, runs_of
from mlflow.tracking import MlflowClient

from dpsweep import clipping, ledger, privacy
from dpsweep.config import ConfigError, to_config, validate
from dpsweep.facts import DatasetFacts
from dpsweep.plan import prepare
from dpsweep.tasks.classifier import per_example_grad_norms
from dpsweep.train import train

DIGITS = DatasetFacts(1437, (1, 28, 28), 10)


@pytest.mark.parametrize("method", ["histogram", "exponential"])
def test_a_quantile_clipped_run_charges_its_release_and_logs_c(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, tmp_path: Path, method: str
) -> None:
    cfg = make_cfg("dp.clipping=quantile", f"dp.clip_quantile_method={method}", "dp.clip_epsilon=0.5")
    plan = prepare(to_config(cfg), DIGITS)
    result = train(cfg)
    [run] = runs_of(client, experiment_name)
    release, steps = result.ledger.entries
    assert release.name == "clip_quantile" and steps.name == "dpsgd"
    chosen = release.params["max_grad_norm_chosen"]
    assert 0 < chosen <= 10.0 and run.data.params["dp.max_grad_norm_chosen"] == str(chosen)
    # the release, amplified by its Poisson sample, is in the logged ε; the planner priced it exactly
    assert release.event.epsilon == pytest.approx(ledger.amplified_by_poisson(0.5, plan.privacy.sample_rate))
    assert plan.privacy is not None and result.epsilon == plan.privacy.epsilon
    fixed = privacy.epsilon(privacy.poisson_schedule(1437, 64), 1.0, 1e-5, steps=result.steps)
    assert result.epsilons["rdp"] > fixed.epsilon and result.epsilons["pld"] > 0
    bill = json.loads(
        Path(client.download_artifacts(run.info.run_id, "privacy_ledger.json", str(tmp_path))).read_text()
    )
    assert [e["name"] for e in bill["events"]] == ["clip_quantile", "dpsgd"]
    assert bill["events"][0]["params"]["method"] == method and bill["epsilon"]["rdp"] == result.epsilons["rdp"]


def test_the_released_c_tracks_the_true_quantile_of_the_norms(make_cfg: Composer) -> None:
    # With a generous ε the private median is close to the true median of the same sample's norms.
    cfg = to_config(make_cfg("dp.clipping=quantile", "dp.clip_epsilon=50", "dp.clip_quantile_method=exponential"))
    from dpsweep import data
    from dpsweep import models as zoo

    torch.manual_seed(0)
    splits = data.build(cfg.dataset)
    model = zoo.build(cfg.model, splits.input_shape, splits.num_classes)
    norms = per_example_grad_norms(
        model, torch.nn.CrossEntropyLoss(), splits.train, list(range(300)), torch.device("cpu")
    )
    assert norms.shape == (300,) and np.all(norms > 0)
    chosen = clipping.choose(norms, cfg.dp, seed=0)
    assert abs(chosen - float(np.median(norms))) < 0.1 * float(np.median(norms))
    # the per-example norms are those of each example's own gradient
    x, y = splits.train[5]
    model.zero_grad()
    torch.nn.CrossEntropyLoss()(model(x.unsqueeze(0)), torch.as_tensor([y])).backward()
    own = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None))
    assert norms[5] == pytest.approx(float(own), rel=1e-4)


def test_calibration_spends_the_whole_target_with_the_release(make_cfg: Composer) -> None:
    target = 3.0
    release = ("dp.clipping=quantile", "dp.clip_epsilon=2", f"dp.target_epsilon={target}")
    with_release = prepare(to_config(make_cfg(*release)), DIGITS)
    without = prepare(to_config(make_cfg(f"dp.target_epsilon={target}")), DIGITS)
    assert with_release.privacy is not None and without.privacy is not None
    assert with_release.privacy.epsilon <= target and target - with_release.privacy.epsilon <= 0.01
    assert with_release.noise_multiplier > without.noise_multiplier  # the release takes part of the budget


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["dp.clip_low=2", "dp.clip_high=1"], "dp.clip_high", "a norm above dp.clip_low=2"),
        (["dp.clip_quantile=1.0"], "dp.clip_quantile", r"a quantile in \(0, 1\)"),
        (["dp.clip_quantile=0"], "dp.clip_quantile", r"a quantile in \(0, 1\)"),
        (["dp.clip_epsilon=0"], "dp.clip_epsilon", "a positive ε"),
        (["dp.clip_steps=1"], "dp.clip_steps", "2 or more"),
    ],
)
def test_bad_clipping_input_is_refused_naming_the_key(
    make_cfg: Composer, overrides: list[str], key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError, match=allowed) as info:
        validate(to_config(make_cfg("dp.clipping=quantile", *overrides)))
    assert info.value.key == key


def test_a_target_below_the_release_alone_is_refused(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("dp.clipping=quantile", "dp.clip_epsilon=5", "dp.target_epsilon=0.01"))
    with pytest.raises(ConfigError, match="more than the clipping release alone") as info:
        prepare(cfg, DIGITS)
    assert info.value.key == "dp.target_epsilon"
