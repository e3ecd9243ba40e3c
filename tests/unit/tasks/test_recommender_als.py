"""DPALS's roles, its contribution bounds and sensitivity, its accounting, and what it learns
(dpsweep.tasks.recommender.als) on small planted ratings sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpsweep.data.ratings import PlantedSpec, from_lists, planted_ratings, split_users
from dpsweep.mechanisms import dpals
from dpsweep.tasks.recommender import als, features

SMALL = PlantedSpec(users=1500, items=300, mean_ratings=25.0)


@pytest.fixture(scope="module")
def planted() -> tuple[als.Batch, als.Batch, als.Batch, int]:
    data = planted_ratings(SMALL, seed=0)
    train, held = split_users(data, held_out=150, target_fraction=0.2, seed=0)
    return als.Batch.of(train, True), als.Batch.of(held.history, True), als.Batch.of(held.target, True), data.n_items


def _trained(
    train: als.Batch, n_items: int, sigma: float, bounds: dpals.Bounds | None, reg: als.ALSRegularization
) -> als.ItemModel:
    model = als.ItemModel.initial(n_items, 8, seed=0)
    aggregator = als.Aggregator(bounds, sigma, True, torch.Generator().manual_seed(0))
    for _ in range(8):
        model = als.dpals_round(model, train, aggregator, als.Server(reg))
    return model


def test_client_embeddings_are_each_users_exact_ridge_solution() -> None:
    rng = np.random.default_rng(0)
    v = rng.standard_normal((7, 3))
    items = [np.array([0, 2, 5]), np.array([1]), np.array([3, 4, 5, 6])]
    values = [np.array([4.0, 1.0, 5.0]), np.array([2.0]), np.array([3.0, 5.0, 1.0, 4.0])]
    ratings = als.Batch.of(from_lists(items, values, n_items=7))
    reg = als.ALSRegularization(user=0.7, unobserved=0.3)
    got = als.client_embeddings(als.ItemModel(torch.tensor(v)), ratings, reg).numpy()
    for u, (i, r) in enumerate(zip(items, values, strict=True)):
        lhs = v[i].T @ v[i] + 0.3 * v.T @ v + 0.7 * np.eye(3)
        assert np.allclose(got[u], np.linalg.solve(lhs, v[i].T @ (r - als.CENTRE)))


def test_without_noise_the_item_side_is_each_items_exact_ridge_solution() -> None:
    """The sparse sums equal a dense, item by item computation (bounds that do not bind)."""
    rng = np.random.default_rng(1)
    users, ranks = rng.standard_normal((5, 2)) * 0.3, 2
    items = [np.array([0, 1]), np.array([1, 2, 3]), np.array([0]), np.array([2, 3]), np.array([0, 3])]
    values = [rng.integers(1, 6, len(i)).astype(float) for i in items]
    ratings = als.Batch.of(from_lists(items, values, n_items=4))
    reg = als.ALSRegularization(item=0.5, unobserved=0.2)
    aggregator = als.Aggregator(dpals.Bounds(10, 10.0, 10.0), 0.0, True, torch.Generator())
    got = als.Server(reg).update(aggregator(torch.tensor(users), ratings)).item_embeddings.numpy()
    for j in range(4):
        raters = [u for u in range(5) if j in items[u]]
        lhs = sum(np.outer(users[u], users[u]) for u in raters) + 0.2 * users.T @ users + 0.5 * np.eye(ranks)
        rhs = sum((values[u][list(items[u]).index(j)] - als.CENTRE) * users[u] for u in raters)
        assert np.allclose(got[j], np.linalg.solve(lhs, rhs))


@pytest.mark.parametrize("implicit", [False, True])
def test_one_users_contribution_moves_the_released_statistics_by_at_most_the_sensitivity(implicit: bool) -> None:
    """Removing a user (with more ratings than k, a large embedding and out-of-range ratings) changes
    the exact sums the aggregator noises by at most Δ in L2 (the released upper triangles)."""
    rng = np.random.default_rng(2)
    bounds = dpals.Bounds(4, max_user_norm=0.5, max_abs_rating=1.0 if implicit else 2.0)  # implicit: values are 1
    items = [rng.choice(30, size=n, replace=False) for n in (12, 3, 8, 5)]
    values = [rng.integers(1, 6, len(i)).astype(float) for i in items]
    values[0][:] = 5.0  # the removed user's: each at the bound R once centred
    users = torch.tensor(rng.standard_normal((4, 3)) * 5.0)
    aggregator = als.Aggregator(bounds, 0.0, implicit, torch.Generator())
    whole = aggregator(users, als.Batch.of(from_lists(items, values, 30), implicit))
    without = aggregator(users[1:], als.Batch.of(from_lists(items[1:], values[1:], 30), implicit))

    def flat(s: als.NoisyStatistics) -> torch.Tensor:
        parts = [torch.triu(s.gram).flatten(), s.rhs.flatten()]
        return torch.cat(parts + ([torch.triu(s.users_gram).flatten()] if s.users_gram is not None else []))

    moved = float((flat(whole) - flat(without)).norm())
    assert 0.5 * dpals.sensitivity(bounds, implicit) < moved <= dpals.sensitivity(bounds, implicit) + 1e-9


def test_the_server_receives_only_the_aggregators_noised_statistics(planted: tuple) -> None:
    train, _, _, n_items = planted
    received: list[als.NoisyStatistics] = []

    class Watched(als.Server):
        def update(self, stats: als.NoisyStatistics) -> als.ItemModel:
            received.append(stats)
            return super().update(stats)

    bounds, sigma = dpals.Bounds(20, 0.3, 1.0), 1.5
    released: list[als.NoisyStatistics] = []

    class Recorded(als.Aggregator):
        def __call__(self, users: torch.Tensor, ratings: als.Batch) -> als.NoisyStatistics:
            released.append(super().__call__(users, ratings))
            self.exact = self.sums(*self.clip(users, ratings))
            return released[-1]

    aggregator = Recorded(bounds, sigma, True, torch.Generator().manual_seed(0))
    als.dpals_round(als.ItemModel.initial(n_items, 8, seed=0), train, aggregator, Watched(als.ALSRegularization()))
    assert len(received) == 1 and received[0] is released[0]
    noise = torch.cat(
        [
            torch.triu(received[0].gram - aggregator.exact.gram).flatten(),
            (received[0].rhs - aggregator.exact.rhs).flatten(),
        ]
    )
    upper = torch.triu(torch.ones(8, 8, dtype=torch.bool)).flatten().repeat(n_items)
    drawn = torch.cat([noise[: upper.numel()][upper], noise[upper.numel() :]])
    assert abs(float(drawn.std()) / (sigma * dpals.sensitivity(bounds, True)) - 1) < 0.03
    assert abs(float(drawn.mean())) < 0.05 * sigma * dpals.sensitivity(bounds, True)


def test_dpals_learns_taste_beyond_popularity_and_loses_little_with_little_noise(planted: tuple) -> None:
    train, history, target, n_items = planted
    counts = torch.bincount(train.items, minlength=n_items).to(torch.float64)
    popularity = als.ItemModel(torch.stack([counts, torch.zeros_like(counts)], 1))
    ones = als.Batch(
        history.users, history.items, torch.ones_like(history.values), history.slots, history.n_users, n_items
    )
    baseline = als.recall_at(popularity, ones, target, als.ALSRegularization(user=1e9))
    reg = als.ALSRegularization(unobserved=0.1)
    loose = None  # non-private: nothing bounded
    exact = als.recall_at(_trained(train, n_items, 0.0, loose, reg), history, target, reg)
    bounds = dpals.Bounds(50, 0.3, 1.0)
    quiet_reg = als.ALSRegularization(item=10 * 0.05 * dpals.sensitivity(bounds, True), unobserved=0.1)
    quiet = als.recall_at(_trained(train, n_items, 0.05, bounds, quiet_reg), history, target, quiet_reg)
    assert exact > baseline + 0.05, (exact, baseline)
    assert quiet > 0.85 * exact, (quiet, exact)


# ---------------------------------------------------------------------------------------------
# through public item features (dpsweep.tasks.recommender.features)
# ---------------------------------------------------------------------------------------------
def test_without_noise_the_feature_map_is_the_exact_least_squares_solution() -> None:
    """V = F W with W the exact solution of the weighted least squares over every (user, item) pair,
    written densely here: x_ij = u_i ⊗ f_j, observed pairs at weight 1 + w₀, the others at w₀."""
    rng = np.random.default_rng(0)
    n_items, d, rank, n_users = 7, 3, 2, 5
    f = torch.tensor(rng.standard_normal((n_items, d)) * 0.4)
    users = torch.tensor(rng.standard_normal((n_users, rank)))
    items = [rng.choice(n_items, size=3, replace=False) for _ in range(n_users)]
    ratings = als.Batch.of(from_lists(items, [np.ones(3)] * n_users, n_items), implicit=True)
    reg = als.ALSRegularization(item=0.3, unobserved=0.2)
    aggregator = features.FeatureAggregator(f, None, 0.0, True, torch.Generator())
    got = features.FeatureServer(reg, f).update(aggregator(users, ratings)).item_embeddings
    unit = features.unit_rows(f)
    x = torch.stack([torch.kron(users[i], unit[j]) for i in range(n_users) for j in range(n_items)])
    observed = torch.tensor([float(j in items[i]) for i in range(n_users) for j in range(n_items)], dtype=x.dtype)
    lhs = (x.T * observed) @ x + 0.2 * x.T @ x + 0.3 * torch.eye(d * rank, dtype=x.dtype)
    w = torch.linalg.solve(lhs, x.T @ observed)
    assert torch.allclose(got, unit @ w.reshape(rank, d).T, atol=1e-10)


def test_one_user_moves_the_feature_statistics_by_at_most_their_sensitivity() -> None:
    """The worst user: k items of one feature vector of norm 1, an embedding at the clip: A moves by
    k Γ², b by k R Γ, G by Γ² (the bound is reached, up to the upper triangle's share)."""
    bounds = dpals.Bounds(max_ratings=4, max_user_norm=0.5, max_abs_rating=1.0)
    f = torch.zeros(30, 3, dtype=torch.float64)
    f[:, 0] = 1.0  # every item the same public features: the worst case of ‖X_i‖_F = k
    rng = np.random.default_rng(1)
    items = [np.arange(10), *(rng.choice(30, size=5, replace=False) for _ in range(3))]
    ratings = [np.ones(len(i)) for i in items]
    users = torch.tensor(rng.standard_normal((4, 2)) * 5.0)
    aggregator = features.FeatureAggregator(f, bounds, 0.0, True, torch.Generator())
    whole = aggregator.sums(*aggregator.clip(users, als.Batch.of(from_lists(items, ratings, 30), True)))
    without = aggregator.sums(*aggregator.clip(users[1:], als.Batch.of(from_lists(items[1:], ratings[1:], 30), True)))

    def flat(s: als.NoisyStatistics) -> torch.Tensor:
        assert s.users_gram is not None
        return torch.cat([torch.triu(s.gram[0]).flatten(), s.rhs.flatten(), torch.triu(s.users_gram).flatten()])

    moved = float((flat(whole) - flat(without)).norm())
    delta = dpals.sensitivity(bounds, True, through_features=True)
    assert 0.7 * delta < moved <= delta + 1e-9 and delta > dpals.sensitivity(bounds, True)


def test_a_user_rating_an_item_twice_is_refused() -> None:
    """The sensitivities and the closed-form gradient norms count each of a user's items once."""
    with pytest.raises(ValueError, match="one rating per user and item"):
        als.Batch.of(from_lists([np.array([0, 3, 0])], [np.array([5.0, 4.0, 2.0])], 5))
