"""Issue 58, item 5: every constant a release is normalised by must be public (cf. arXiv 2605.15648 on
Opacus's ``expected_batch_size``, computed from the dataset's size).

What each engine divided its noisy sum by before: a function of the training set's size N, with q =
1/ceil(N/B) the ledger's inclusion probability (``dpsweep.privacy.schedule.poisson_schedule``): Opacus's
``make_private`` int(N·q) (62 at N = 1437, B = 64; 64 at N = 1472; 61 at N = 1473), which its adaptive
clipping's count shared and a black-box audit's set kept at the plan's N; the fused step int(N·q); user
level U·q; ``task=gan``'s critic q·N_train; the recommender's aggregator q·U. Each now divides by the
config's ``train.batch_size`` B (examples, or users at ``dp.unit=user``), whatever N and whatever set the
step samples from (a black-box audit's canaries in it): a public constant, so the division is
post-processing, and the sample rate q, what the ledger prices, is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import Composer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpsweep.config import to_config
from dpsweep.privacy.schedule import poisson_schedule
from dpsweep.privacy.streams import Streams

B = 64
N = 1437  # the digits split's size: B does not divide it (q·N = 62.48)
CANARIES = 10  # a black-box audit's: in the set the loader holds, not in the N the plan priced


def _loader(n: int) -> DataLoader[Any]:
    data = TensorDataset(torch.zeros(n, 4), torch.zeros(n, dtype=torch.long))
    return DataLoader(data, batch_size=B)


def _opacus_divisor(make_cfg: Composer, n: int, planned: int | None = None) -> float:
    """The divisor of the Opacus engine's release over a loader of ``n`` examples; with ``planned``, after
    a black-box audit's :func:`keep_planned_sampling` to the plan's N."""
    from dpsweep.mechanisms import opacus_engine
    from dpsweep.tasks.classifier.private import keep_planned_sampling

    cfg = to_config(make_cfg(f"train.batch_size={B}"))
    layer = nn.Linear(4, 2)
    engine, _, optimizer, _, loader = opacus_engine.make_private(
        cfg.dp, 1.0, 1.0, layer, torch.optim.SGD(layer.parameters(), lr=0.1), _loader(n), nn.CrossEntropyLoss()
    )
    if planned is not None:
        s = poisson_schedule(planned, B)
        keep_planned_sampling(engine, optimizer, loader, s.inclusion_probability, s.steps_per_epoch)
    return float(optimizer.expected_batch_size)


def _fused_divisor(make_cfg: Composer, n: int, planned: int | None) -> float:
    """The divisor of the fused engine's release (``FusedPoisson.setup``) over ``n`` examples, the plan's N
    ``planned``."""
    from dpsweep.mechanisms.functional import FusedPoisson, OwnRun

    cfg = to_config(make_cfg(f"train.batch_size={B}", "dp.engine=fused"))
    x, y = torch.zeros(n, 4), torch.zeros(n, dtype=torch.long)
    exact: Any = None  # the fixed order's batches: not read by the setup
    run = OwnRun(
        cfg, nn.Linear(4, 2), nn.CrossEntropyLoss(), (x, y, None), exact, 1.0, torch.device("cpu"),
        Streams.of_run(0, "ab"), planned,
    )  # fmt: skip
    return FusedPoisson().setup(run).expected_units


def _user_divisor(users: int, planned: int | None) -> float:
    """The divisor of a user-level release (``UserBatches.expected_users``) over ``users`` users."""
    from dpsweep.data.users import UserBatches

    ids = torch.arange(users).repeat_interleave(2)
    x, y = torch.zeros(len(ids), 4), torch.zeros(len(ids), dtype=torch.long)
    batches = UserBatches(
        x, y, ids, expected_users_per_step=B, max_examples_per_user=2, device="cpu",
        generator=torch.Generator().manual_seed(0), priced_users=planned,
    )  # fmt: skip
    return batches.expected_users


def test_a_releases_divisor_is_the_configs_batch_size_not_the_expected_batch_of_n(make_cfg: Composer) -> None:
    """Every engine divides by the config's B, not by the expected batch of the N the ledger priced (q·N, or
    Opacus's int(q·N)), with a black-box audit's canaries in the sampled set as without; the sample rate
    stays the plan's q."""
    q = poisson_schedule(N, B).inclusion_probability
    assert int(N * q) != B  # the case that tells the conventions apart
    assert _opacus_divisor(make_cfg, N) == B  # a plain run: the set is the plan's
    assert _opacus_divisor(make_cfg, N + CANARIES, planned=N) == B
    assert _fused_divisor(make_cfg, N, None) == _fused_divisor(make_cfg, N + CANARIES, N) == B
    assert _user_divisor(N, None) == _user_divisor(N + CANARIES, N) == B


def test_adaptive_clippings_count_is_over_the_configs_batch_size(make_cfg: Composer) -> None:
    """Opacus's adaptive clipping (dpsweep's ``ExpectedBatchAdaClip``) divides its noisy unclipped count by the
    same public B as the gradient, and its loader samples at the ledger's q all the same."""
    from dpsweep.mechanisms import opacus_engine

    cfg = to_config(make_cfg(f"train.batch_size={B}", "dp.clipping=adaptive"))
    layer = nn.Linear(4, 2)
    _, _, optimizer, _, loader = opacus_engine.make_private(
        cfg.dp, 1.0, 1.0, layer, torch.optim.SGD(layer.parameters(), lr=0.1), _loader(N), nn.CrossEntropyLoss()
    )
    assert isinstance(optimizer, opacus_engine.ExpectedBatchAdaClip)
    assert optimizer.expected_batch_size == B
    assert loader.sample_rate == poisson_schedule(N, B).inclusion_probability  # type: ignore[attr-defined]


def test_the_divisor_is_the_configs_batch_size_whatever_n(make_cfg: Composer) -> None:
    """Datasets of different N, one config B: a release normalised by public constants alone divides by the
    same number, B, for each, where Opacus's own convention int(N / ceil(N/B)) gives 62, 64 and 61."""
    sizes = (N, 1472, 1473)
    assert {n: _opacus_divisor(make_cfg, n) for n in sizes} == dict.fromkeys(sizes, B)
    assert {n: _fused_divisor(make_cfg, n, None) for n in sizes} == dict.fromkeys(sizes, B)
    assert {n: _user_divisor(n, None) for n in sizes} == dict.fromkeys(sizes, B)


class _Built(Exception):
    """Raised by a spy once the divisor is built: the run stops there, before training."""


def _divisor_built(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, divisor: Callable[[Any], float]) -> Any:
    """Spy on ``module.name``'s construction: record its divisor, then stop the run (:class:`_Built`)."""
    built, seen = getattr(module, name), []

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(divisor(built(*args, **kwargs)))
        raise _Built

    monkeypatch.setattr(module, name, spy)
    return seen


def test_the_gan_critic_and_the_recommenders_aggregator_divide_by_the_configs_batch_size(
    make_cfg: Composer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``task=gan``'s critic (digits: N = 1437, q·N = 62.48 at B = 64) and the recommender's DP-SGD aggregator
    (400 users, B = 150: q·U = 133.3) divide their noisy sums by B, as each run builds them."""
    from dpsweep.run.runner import train
    from dpsweep.tasks.gan import task
    from dpsweep.tasks.recommender import sgd

    critic = _divisor_built(monkeypatch, task, "CriticStep", lambda step: step.expected_batch_size)
    with pytest.raises(_Built):
        train(make_cfg("task=gan", f"train.batch_size={B}", "dp.noise_multiplier=1.2", "task.critic_width=8"))
    aggregator = _divisor_built(monkeypatch, sgd, "GradientAggregator", lambda agg: agg.expected_users)
    with pytest.raises(_Built):
        train(make_cfg(
            "task=recommender", "dataset.num_users=400", "dataset.held_out_users=60", "dataset.items=150",
            "dataset.mean_ratings=15", "task.method=dpam", "dp.mechanism=dpsgd", "train.batch_size=150",
            "dp.max_grad_norm=0.1",
        ))  # fmt: skip
    assert (critic, aggregator) == ([B], [150])
