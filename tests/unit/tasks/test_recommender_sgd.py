"""The user-level DP-SGD step of the factorized model (dpsweep.tasks.recommender.sgd): its closed-form
gradients against autograd, each user's contribution bounded by C, the server fed the aggregator's
release alone, Poisson sampling, and what DPAM learns on a small planted set."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpsweep.data.ratings import PlantedSpec, from_lists, planted_ratings, split_users
from dpsweep.tasks.recommender import als, sgd


def _ratings(implicit: bool, seed: int = 0) -> tuple[als.Batch, torch.Tensor, torch.Tensor]:
    """Five users rating 3 to 12 of 40 items, their embeddings and the items' (float64)."""
    rng = np.random.default_rng(seed)
    items = [rng.choice(40, size=n, replace=False) for n in (12, 3, 8, 5, 7)]
    values = [rng.integers(1, 6, len(i)).astype(float) for i in items]
    batch = als.Batch.of(from_lists(items, values, 40), implicit)
    batch = als.Batch(batch.users, batch.items, batch.values.double(), batch.slots, batch.n_users, batch.n_items)
    return batch, torch.tensor(rng.standard_normal((5, 4))), torch.tensor(rng.standard_normal((40, 4)) * 0.5)


def _autograd(items: torch.Tensor, users: torch.Tensor, ratings: als.Batch, w0: float, reg: float, i: int):
    """∂L_i/∂V and ∂L_i/∂u_i by autograd, L_i = Σ_j (r_ij − ⟨u, v_j⟩)² + w₀‖V u‖² + λ_u‖u‖²."""
    v, u = items.clone().requires_grad_(True), users[i].clone().requires_grad_(True)
    mine = ratings.users == i
    e = ratings.values[mine] - (u * v[ratings.items[mine]]).sum(1)
    loss = (e**2).sum() + w0 * (v @ u).pow(2).sum() + reg * u.pow(2).sum()
    gv, gu = torch.autograd.grad(loss, (v, u))
    return gv, gu


@pytest.mark.parametrize(("implicit", "w0"), [(True, 0.2), (False, 0.0)])
def test_the_closed_form_gradients_are_autograds(implicit: bool, w0: float) -> None:
    ratings, users, items = _ratings(implicit)
    grads = [_autograd(items, users, ratings, w0, 0.7, i) for i in range(5)]
    norms = sgd.gradient_norms(items, users, ratings, w0)
    assert torch.allclose(norms, torch.stack([gv.norm() for gv, _ in grads]), rtol=1e-9)
    weights = torch.tensor([0.5, 1.0, 0.0, 2.0, 0.25], dtype=torch.float64)
    expected = sum(w * gv for w, (gv, _) in zip(weights, grads, strict=True))
    assert torch.allclose(sgd.gradient_sum(items, users, ratings, w0, weights), expected)
    own = sgd.user_gradients(items, users, ratings, w0, 0.7)
    assert torch.allclose(own, torch.stack([gu for _, gu in grads]))


def test_with_public_features_the_gradients_of_both_parts_are_autograds() -> None:
    """V = E + F W: each user's gradient of (E, W) by autograd, its norm as one vector, and the sums
    the aggregator releases for both parts."""
    ratings, users, per_item = _ratings(True, seed=4)
    rng = np.random.default_rng(5)
    f = torch.tensor(rng.standard_normal((40, 6))) / 3
    w = torch.tensor(rng.standard_normal((6, 4))) * 0.3
    items = per_item + f @ w
    grads = []
    for i in range(5):
        e_, w_ = per_item.clone().requires_grad_(True), w.clone().requires_grad_(True)
        v, mine = e_ + f @ w_, ratings.users == i
        err = ratings.values[mine] - (users[i] * v[ratings.items[mine]]).sum(1)
        grads.append(torch.autograd.grad((err**2).sum() + 0.2 * (v @ users[i]).pow(2).sum(), (e_, w_)))
    whole = torch.stack([torch.cat([ge.flatten(), gw.flatten()]).norm() for ge, gw in grads])
    assert torch.allclose(sgd.gradient_norms(items, users, ratings, 0.2, f), whole, rtol=1e-9)
    aggregator = sgd.GradientAggregator(0.5, 0.0, 2.0, 0.2, torch.Generator(), f)
    released = aggregator(items, users, ratings)
    factors = (0.5 / whole).clamp(max=1.0)
    assert released.feature_mean is not None
    assert torch.allclose(released.mean, sum(k * ge for k, (ge, _) in zip(factors, grads, strict=True)) / 2)
    assert torch.allclose(released.feature_mean, sum(k * gw for k, (_, gw) in zip(factors, grads, strict=True)) / 2)


def test_one_users_contribution_moves_the_clipped_sum_by_at_most_c() -> None:
    """Removing a user (a large embedding: their gradient far above C) moves the sum the aggregator
    noises by at most C, and by exactly C when their gradient is clipped."""
    ratings, users, items = _ratings(True, seed=3)
    users[0] *= 10
    aggregator = sgd.GradientAggregator(0.5, 0.0, 1.0, 0.2, torch.Generator())
    whole = aggregator(items, users, ratings).mean
    rest = sgd.users_of(ratings, torch.arange(1, 5))
    without = aggregator(items, users[1:], rest).mean
    assert float((whole - without).norm()) == pytest.approx(0.5, rel=1e-9)
    assert float(sgd.gradient_norms(items, users, ratings, 0.2)[0]) > 5


def test_the_server_steps_with_the_aggregators_noised_release_alone() -> None:
    ratings, users, items = _ratings(True, seed=1)
    items = items.float()
    users, ratings = users.float(), als.Batch.of(from_lists([[0, 1]], [[1.0, 1.0]], 40), True)  # one user
    released: list[sgd.NoisyGradient] = []

    class Recorded(sgd.GradientAggregator):
        def __call__(self, items: torch.Tensor, users: torch.Tensor, ratings: als.Batch) -> sgd.NoisyGradient:
            released.append(super().__call__(items, users, ratings))
            return released[-1]

    received: list[sgd.NoisyGradient] = []

    class Watched(sgd.GradientServer):
        def update(self, released: sgd.NoisyGradient) -> None:
            received.append(released)
            super().update(released)

    sigma, c, expected = 2.0, 0.1, 4.0
    parameter = torch.nn.Parameter(items[:, :4].clone())
    server = Watched(parameter, torch.optim.SGD([parameter], lr=1.0), item_reg=0.0, n_users=10)
    aggregator = Recorded(c, sigma, expected, 0.2, torch.Generator().manual_seed(0))
    before = parameter.detach().clone()
    server.update(aggregator(before, users[:1], ratings))
    assert len(received) == 1 and received[0] is released[0]
    assert torch.equal(parameter.detach(), before - received[0].mean)  # plain SGD at lr 1: the release alone
    exact = sgd.gradient_sum(before, users[:1], ratings, 0.2, aggregator.clip_factors(before, users[:1], ratings))
    noise = (received[0].mean * expected - exact).flatten()  # 160 draws of N(0, (σC)²)
    assert abs(float(noise.std()) / (sigma * c) - 1) < 0.2 and abs(float(noise.mean())) < 0.1 * sigma * c


def test_users_are_poisson_sampled_each_alone() -> None:
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([torch.zeros(2000, dtype=torch.bool).index_fill(0, sgd.sample_users(2000, 0.1, g), True)
                         for _ in range(200)]).double()  # fmt: skip
    sizes = draws.sum(1)
    assert abs(float(sizes.mean()) - 200) < 3 and abs(float(sizes.std()) - math.sqrt(2000 * 0.1 * 0.9)) < 2.5
    first_two = draws[:, 0] * draws[:, 1]
    assert abs(float(first_two.mean()) - 0.01) < 0.02  # independent: P(both) = q², not q


def test_users_of_renumbers_the_sampled_users_ratings() -> None:
    batch = als.Batch.of(from_lists([[0, 1], [2], [3, 4, 5]], [[5.0, 4.0], [3.0], [1.0, 2.0, 3.0]], 6))
    part = sgd.users_of(batch, torch.tensor([2, 0]))
    assert part.n_users == 2 and part.users.tolist() == [1, 1, 0, 0, 0] and part.items.tolist() == [0, 1, 3, 4, 5]


def test_dpam_with_little_noise_learns_taste_beyond_popularity() -> None:
    """On 1,500 planted users: DPAM (users solved, items by clipped user-level DP-SGD at small σ) beats
    the exact popularity ranking."""
    data = planted_ratings(PlantedSpec(users=1500, items=300, mean_ratings=25.0), seed=0)
    train, held = split_users(data, held_out=150, target_fraction=0.2, seed=0)
    train_b, history, target = (als.Batch.of(r, True) for r in (train, held.history, held.target))
    reg = als.ALSRegularization(unobserved=0.2)
    g = torch.Generator().manual_seed(0)
    items = torch.nn.Parameter(als.ItemModel.initial(data.n_items, 8, seed=0).item_embeddings.clone())
    aggregator = sgd.GradientAggregator(0.1, 0.05, 300.0, 0.2, g)
    server = sgd.GradientServer(items, torch.optim.Adam([items], lr=0.03), 1.0, train_b.n_users)
    for _ in range(8):
        users = als.client_embeddings(als.ItemModel(items.detach()), train_b, reg)
        for _ in range(5):
            sampled = sgd.sample_users(train_b.n_users, 0.2, g)
            server.update(aggregator(items.detach(), users[sampled], sgd.users_of(train_b, sampled)))
    counts = torch.bincount(train_b.items, minlength=data.n_items).to(torch.float32)
    ones = als.Batch(history.users, history.items, torch.ones_like(history.values), history.slots,
                     history.n_users, data.n_items)  # fmt: skip
    popularity = als.recall_at(als.ItemModel(torch.stack([counts, torch.zeros_like(counts)], 1)), ones, target,
                               als.ALSRegularization(user=1e9))  # fmt: skip
    learned = als.recall_at(als.ItemModel(items.detach()), history, target, reg)
    assert learned > popularity + 0.03, (learned, popularity)
