"""The planted synthetic ratings set and the held-out users' split (dpsweep.data.ratings)."""

from __future__ import annotations

import numpy as np

from dpsweep.data.ratings import PlantedSpec, planted_ratings, split_users

SMALL = PlantedSpec(users=600, items=200, mean_ratings=20.0)


def test_the_planted_set_is_a_pure_function_of_its_spec_and_seed() -> None:
    a, b, c = planted_ratings(SMALL, seed=3), planted_ratings(SMALL, seed=3), planted_ratings(SMALL, seed=4)
    assert np.array_equal(a.items, b.items) and np.array_equal(a.values, b.values)
    assert a.item_features is not None and b.item_features is not None
    assert np.array_equal(a.item_features, b.item_features)
    assert not np.array_equal(a.items, c.items)


def test_each_user_rates_distinct_items_on_a_five_star_scale_with_popular_items_rated_most() -> None:
    data = planted_ratings(SMALL, seed=0)
    assert data.n_users == 600 and data.n_items == 200
    assert data.counts.min() >= SMALL.min_ratings and data.counts.max() <= SMALL.items
    for u in range(data.n_users):
        row, _ = data.row(u)
        assert len(set(row.tolist())) == len(row) and (row >= 0).all() and (row < 200).all()
        assert (row[:-1] < row[1:]).all()  # in item order, not in order of taste
    stars = data.values
    assert set(np.unique(stars).tolist()) <= {1.0, 2.0, 3.0, 4.0, 5.0} and len(np.unique(stars)) >= 4
    per_item = np.sort(np.bincount(data.items, minlength=200))[::-1]
    assert per_item[0] > 4 * np.median(per_item)  # Zipf popularity: a head of popular items


def test_held_out_users_are_split_into_history_and_target_and_never_train() -> None:
    data = planted_ratings(SMALL, seed=0)
    train, held = split_users(data, held_out=60, target_fraction=0.2, seed=0)
    assert train.n_users + held.history.n_users == data.n_users and held.history.n_users == 60
    assert held.target.n_users == 60 and (held.target.counts >= 1).all() and (held.history.counts >= 1).all()
    train_rows = {tuple(train.row(u)[0]) for u in range(train.n_users)}
    all_rows = [tuple(data.row(u)[0]) for u in range(data.n_users)]
    for u in range(held.history.n_users):
        h, t = held.history.row(u)[0], held.target.row(u)[0]
        assert not set(h) & set(t)
        whole = tuple(sorted([*h.tolist(), *t.tolist()]))
        assert whole in all_rows and whole not in train_rows  # one user's whole row, not a training user's
