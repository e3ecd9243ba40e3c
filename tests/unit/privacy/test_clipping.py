"""dp.clipping=quantile: C is a private quantile of the per-example gradient norms at initialisation,
released before training and charged in the run's ledger; the plan prices it, calibration spends the
whole target with it, and bad input is refused before any work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import Composer, runs_of
from mlflow.tracking import MlflowClient

from dpsweep.config import ConfigError, to_config, validate
from dpsweep.data.facts import DatasetFacts
from dpsweep.plan import prepare
from dpsweep.privacy import clipping, ledger, schedule
from dpsweep.run.runner import train
from dpsweep.tasks.classifier.passes import per_example_grad_norms

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
    fixed = schedule.epsilon(schedule.poisson_schedule(1437, 64), 1.0, 1e-5, steps=result.steps)
    assert result.epsilons["rdp"] > fixed.epsilon and result.epsilons["pld"] > 0
    bill = json.loads(
        Path(client.download_artifacts(run.info.run_id, "privacy_ledger.json", str(tmp_path))).read_text()
    )
    assert [e["name"] for e in bill["events"]] == ["clip_quantile", "dpsgd"]
    assert bill["events"][0]["params"]["method"] == method and bill["epsilon"]["rdp"] == result.epsilons["rdp"]


def test_the_released_c_tracks_the_true_quantile_of_the_norms(make_cfg: Composer) -> None:
    # With a generous ε the private median is close to the true median of the same sample's norms.
    cfg = to_config(make_cfg("dp.clipping=quantile", "dp.clip_epsilon=50", "dp.clip_quantile_method=exponential"))
    from dpsweep.data import loaders
    from dpsweep.models import classifiers

    torch.manual_seed(0)
    splits = loaders.build(cfg.dataset)
    model = classifiers.build(cfg.model, splits.input_shape, splits.num_classes)
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


# ---------------------------------------------------------------------------------------------
# dp.clipping=adaptive (Andrew et al. 2021)
# ---------------------------------------------------------------------------------------------
def _adaptive_optimizer(make_cfg: Composer, sigma: float, *overrides: str) -> tuple[Any, torch.nn.Linear]:
    """A private optimizer of adaptive clipping over a 200,000-weight linear layer (N = 640, B = 64)."""
    from torch.utils.data import DataLoader, TensorDataset

    from dpsweep.mechanisms import opacus_engine

    cfg = to_config(make_cfg("dp.clipping=adaptive", *overrides))
    layer = torch.nn.Linear(1000, 200)
    loader = DataLoader(TensorDataset(torch.zeros(640, 1000), torch.zeros(640, dtype=torch.long)), batch_size=64)
    _, _, optimizer, _, _ = opacus_engine.make_private(
        cfg.dp, sigma, 1.0, layer, torch.optim.SGD(layer.parameters(), lr=0.1), loader, torch.nn.MSELoss()
    )
    return optimizer, layer


def test_adaptive_gradient_noise_is_sigma_delta_and_the_ledger_charges_the_full_sigma(make_cfg: Composer) -> None:
    """The Opacus fix: gradient noise at σ_Δ = (σ^-2 - (2σ_b)^-2)^(-1/2) > σ, accounting at σ. Charging σ_Δ
    (the old Opacus accounting) would under-state ε."""
    from dpsweep.mechanisms import opacus_engine

    sigma, sigma_b = 1.0, 0.8
    optimizer, layer = _adaptive_optimizer(make_cfg, sigma, f"dp.clip_count_noise={sigma_b}")
    assert isinstance(optimizer, opacus_engine.ExpectedBatchAdaClip)
    assert optimizer.noise_multiplier == sigma  # what Opacus's accountant records: the full σ
    # the noise Opacus adds to a zero gradient sum: its std is σ_Δ·C (C = 1)
    for p in optimizer.params:
        p.summed_grad = torch.zeros_like(p)
    optimizer.unclipped_num = torch.tensor(0.0)
    optimizer.add_noise()
    param = layer.weight
    sigma_delta = clipping.gradient_noise(sigma, sigma_b)
    assert sigma_delta == pytest.approx((1 - 1 / 2.56) ** -0.5)
    assert float(param.grad.std()) == pytest.approx(sigma_delta, rel=0.01)
    entry = clipping.adaptive_steps(sigma, 0.05, 300, sigma_b)
    charged = ledger.epsilon(ledger.Ledger((entry,)), 1e-5).epsilon
    assert charged == ledger.epsilon(ledger.from_history([(sigma, 0.05, 300)]), 1e-5).epsilon
    assert charged > ledger.epsilon(ledger.from_history([(sigma_delta, 0.05, 300)]), 1e-5).epsilon


def test_adaptive_update_uses_the_centred_count_over_the_expected_batch(make_cfg: Composer) -> None:
    optimizer, _ = _adaptive_optimizer(make_cfg, 1.0, "dp.clip_quantile=0.5", "dp.clip_lr=0.2")
    expected = optimizer.expected_batch_size
    # 40 of an actual 70 examples unclipped, noise +1.5: the release is 41.5 - 35 = 6.5 (centred)
    optimizer.max_grad_norm, optimizer.sample_size, optimizer.unclipped_num = 1.0, 70, torch.tensor(41.5)
    optimizer.update_max_grad_norm()
    share = 6.5 / expected + 0.5
    assert optimizer.max_grad_norm == pytest.approx(float(np.exp(-0.2 * (share - 0.5))))
    optimizer.max_grad_norm, optimizer.sample_size, optimizer.unclipped_num = 9.9, 10, torch.tensor(0.0)
    optimizer.update_max_grad_norm()
    assert optimizer.max_grad_norm == 10.0  # clamped to dp.clip_high


def test_adaptive_counts_cover_every_physical_pass_of_a_logical_batch(make_cfg: Composer) -> None:
    """Issue 33, item 3: with train.physical_batch_size, Opacus's AdaClip reset its counts at each pass's
    zero_grad, so the update divided the last pass's count by the whole expected batch (C barely moved)."""
    from torch.utils.data import DataLoader, TensorDataset

    from dpsweep.mechanisms import opacus_engine

    cfg = to_config(make_cfg("dp.clipping=adaptive", "dp.clip_count_noise=5"))
    layer = torch.nn.Linear(10, 2)
    loader = DataLoader(TensorDataset(torch.zeros(640, 10), torch.zeros(640, dtype=torch.long)), batch_size=64)
    _, model, optimizer, _, _ = opacus_engine.make_private(
        cfg.dp, 1.0, 1.0, layer, torch.optim.SGD(layer.parameters(), lr=0.1), loader, torch.nn.MSELoss()
    )
    counted = []
    for rows, last in ((30, False), (34, True)):  # one logical batch in two physical passes
        model(torch.randn(rows, 10)).sum().backward()
        optimizer.signal_skip_step(do_skip=not last)
        optimizer.step()
        counted.append(optimizer.sample_size)
        optimizer.zero_grad()
    assert counted == [30, 64]  # the update saw both passes (Opacus's own: 34)
    assert optimizer.sample_size == 0  # and the next logical batch starts afresh


def test_an_adaptive_run_logs_c_per_epoch_and_charges_sigma(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    cfg = make_cfg("dp.clipping=adaptive", "train.epochs=2", "dp.clip_quantile=0.7")
    plan = prepare(to_config(cfg), DIGITS)
    result = train(cfg)
    [run] = runs_of(client, experiment_name)
    norms = [m.value for m in client.get_metric_history(run.info.run_id, "max_grad_norm")]
    assert len(norms) == 2 and all(0 < c <= 10 for c in norms) and norms[0] != 1.0  # it moved from C0 = 1
    [steps] = result.ledger.entries
    assert steps.params["clipping"] == "adaptive" and steps.params["count_noise"] == 64 / 20
    assert plan.privacy is not None and result.epsilon == plan.privacy.epsilon  # the plan's σ, every step


def test_adaptive_with_sigma_at_least_twice_the_count_noise_is_refused(make_cfg: Composer) -> None:
    cfg = to_config(make_cfg("dp.clipping=adaptive", "dp.noise_multiplier=2", "dp.clip_count_noise=1"))
    with pytest.raises(ConfigError, match="undefined") as info:
        prepare(cfg, DIGITS)
    assert info.value.key == "dp.clip_count_noise"
    with pytest.raises(ConfigError, match="ghost clipping has a fixed norm"):
        prepare(to_config(make_cfg("dp.clipping=adaptive", "dp.grad_sample_mode=ghost")), DIGITS)


def test_adaptive_c_is_in_the_optimizer_state_and_normalizing_divides_the_step_by_c(make_cfg: Composer) -> None:
    optimizer, layer = _adaptive_optimizer(make_cfg, 1.0, "dp.clip_count_noise=5")
    optimizer.max_grad_norm = 3.5
    saved = optimizer.state_dict()
    optimizer.max_grad_norm = 1.0
    optimizer.load_state_dict(saved)
    assert optimizer.max_grad_norm == 3.5  # a checkpoint (and the undone memory iteration) keep C
    assert optimizer.normalize  # dp.clip_normalize defaults to true
    for p in optimizer.params:
        p.summed_grad = torch.full_like(p, 7.0)
    optimizer.unclipped_num = torch.tensor(0.0)
    torch.manual_seed(0)
    optimizer.add_noise()
    normalized = layer.weight.grad.clone()
    optimizer.normalize = False
    for p in optimizer.params:
        p.summed_grad = torch.full_like(p, 7.0)
    torch.manual_seed(0)
    optimizer.add_noise()
    assert torch.allclose(normalized * 3.5, layer.weight.grad)  # the same noise, the step per unit of C
