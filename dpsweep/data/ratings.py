"""Ratings of items by users, for factorized models (issue 35): a seeded synthetic planted low-rank set
that needs nothing downloaded, and held-out users with a history/target split for fold-in. No torch.

    data = planted_ratings(PlantedSpec(users=6000, items=1000), seed=0)
    train, held_out = split_users(data, held_out=600, target_fraction=0.2, seed=0)
    items, stars = train.row(u)                 # the items user u rated, and their stars

The planted set (our own design, after the synthetic "planted" low-rank sets of the matrix completion
literature): user factors u*_i ~ N(0, I_r) and item factors v*_j = F_j B + e_j, where F_j are the item's
public features (d binary "genres", each on with probability 0.15, standardised) and B ~ N(0, I/d) a
public map, so that the features explain half of each item factor's variance (e_j ~ N(0, I/(2r)) and
F_j B ~ N(0, I/(2r))): ⟨u*_i, v*_j⟩ has variance about 1. Which items a user rates follows both the
items' popularity and the user's taste: user i rates n_i items drawn without replacement with weights
p_j exp(β ⟨u*_i, v*_j⟩), p_j ∝ (rank_j + 1)^(−zipf) (Zipf popularity over a seeded random order of
the items), by the Gumbel top-k trick (Vieira 2014, "Gumbel-max trick and weighted reservoir
sampling"; Kool, van Hoof & Welling 2019, ICML, "Stochastic Beams and Where to Find Them", Sec. 3);
n_i = clip(round(exp(N(log mean_ratings, 0.6²))), min_ratings, items), and a user's row lists them in
item order (not in order of taste). The rating is clip(round(3 + 1.2 ⟨u*_i, v*_j⟩ + N(0, 0.5²)), 1, 5).

Stable across machines: numpy's legacy ``RandomState`` distributions (streams fixed across numpy
versions, NEP 19) on a PCG64 seeded through ``SeedSequence``, as :mod:`dpsweep.data.users` does, and the
selection keys rounded to 1e-9 before they are ranked, so that a last-bit difference of a BLAS cannot
reorder them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Ratings:
    """Users' ratings, row by row (compressed sparse rows): user u rated ``items[indptr[u]:indptr[u+1]]``
    with ``values[indptr[u]:indptr[u+1]]`` (stars), in the order of the user's row. ``n_items`` counts
    every item of the catalogue (items no one here rated included); ``item_features`` (n_items × d,
    public) describe them, or are None."""

    indptr: np.ndarray  # int64, users + 1
    items: np.ndarray  # int64, ratings
    values: np.ndarray  # float32, ratings
    n_items: int
    item_features: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.items.shape != self.values.shape or int(self.indptr[-1]) != len(self.items):
            raise ValueError(f"items {self.items.shape}, values {self.values.shape}, indptr ends at {self.indptr[-1]}")

    @property
    def n_users(self) -> int:
        return len(self.indptr) - 1

    @property
    def n_ratings(self) -> int:
        return len(self.items)

    @property
    def counts(self) -> np.ndarray:
        """Each user's number of ratings."""
        return np.diff(self.indptr)

    @property
    def users(self) -> np.ndarray:
        """The user (row) of each rating."""
        return np.repeat(np.arange(self.n_users), self.counts)

    @property
    def slots(self) -> np.ndarray:
        """Each rating's place in its user's row (0 for the first)."""
        return np.arange(self.n_ratings) - np.repeat(self.indptr[:-1], self.counts)

    def row(self, user: int) -> tuple[np.ndarray, np.ndarray]:
        """User ``user``'s items and stars."""
        a, b = self.indptr[user], self.indptr[user + 1]
        return self.items[a:b], self.values[a:b]

    def rows(self, users: np.ndarray) -> Ratings:
        """These users' ratings, in this order."""
        rows = [self.row(int(u)) for u in users]
        return from_lists([i for i, _ in rows], [v for _, v in rows], self.n_items, self.item_features)


def from_lists(
    items: list[np.ndarray], values: list[np.ndarray], n_items: int, features: np.ndarray | None = None
) -> Ratings:
    """:class:`Ratings` from one array of items and one of values per user."""
    indptr = np.zeros(len(items) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(i) for i in items])
    flat_items = np.concatenate([np.zeros(0, np.int64), *(np.asarray(i, dtype=np.int64) for i in items)])
    flat_values = np.concatenate([np.zeros(0, np.float32), *(np.asarray(v, dtype=np.float32) for v in values)])
    return Ratings(indptr, flat_items, flat_values, n_items, features)


@dataclass(frozen=True)
class PlantedSpec:
    """The synthetic set's shape (see the module's docstring)."""

    users: int = 6000
    items: int = 1000
    rank: int = 8  # r, of the planted factors
    features: int = 16  # d, public item features
    mean_ratings: float = 30.0  # the median of n_i
    min_ratings: int = 5
    zipf: float = 0.8  # popularity exponent
    taste: float = 1.5  # β: how much a user's taste decides what they rate


def _rng(seed: int, stream: int) -> np.random.RandomState:
    return np.random.RandomState(np.random.PCG64(np.random.SeedSequence([int(seed), stream])))


def planted_ratings(spec: PlantedSpec = PlantedSpec(), seed: int = 0) -> Ratings:
    """The planted low-rank ratings set of ``spec``, a pure function of (spec, seed)."""
    r, d = spec.rank, spec.features
    rng = _rng(seed, 0)
    genres = (rng.random_sample((spec.items, d)) < 0.15).astype(np.float64)
    features = (genres - genres.mean(0)) / np.maximum(genres.std(0), 1e-12)
    mapping = rng.standard_normal((d, r)) / np.sqrt(d)
    explained = features @ mapping
    explained /= np.sqrt(2 * r * max(float(explained.var()), 1e-12))
    item_factors = explained + rng.standard_normal((spec.items, r)) / np.sqrt(2 * r)
    user_factors = rng.standard_normal((spec.users, r))
    order = rng.permutation(spec.items)
    popularity = np.empty(spec.items)
    popularity[order] = -spec.zipf * np.log(np.arange(spec.items) + 1.0)  # log p_j, up to a constant
    counts = np.clip(np.rint(np.exp(rng.normal(np.log(spec.mean_ratings), 0.6, spec.users))), spec.min_ratings,
                     spec.items).astype(np.int64)  # fmt: skip
    width = int(counts.max())
    items = np.full((spec.users, width), -1, dtype=np.int64)  # padded rows while they are drawn
    values = np.zeros((spec.users, width), dtype=np.float32)
    for start in range(0, spec.users, 1024):  # in blocks: users × items keys at once would be large
        stop = min(start + 1024, spec.users)
        affinity = user_factors[start:stop] @ item_factors.T
        gumbel = -np.log(-np.log(rng.random_sample(affinity.shape).clip(1e-300, None)))
        keys = np.round(popularity[None, :] + spec.taste * affinity + gumbel, 9)
        ranked = np.argsort(-keys, axis=1, kind="stable")[:, :width]
        noise = rng.normal(0.0, 0.5, (stop - start, width))
        chosen_affinity = np.take_along_axis(affinity, ranked, axis=1)
        stars = np.clip(np.rint(3.0 + 1.2 * chosen_affinity + noise), 1, 5)
        keep = np.arange(width)[None, :] < counts[start:stop, None]
        chosen = np.where(keep, ranked, np.iinfo(np.int64).max)
        by_item = np.argsort(chosen, axis=1, kind="stable")  # a row in item order, not in order of taste
        items[start:stop] = np.where(keep, np.take_along_axis(chosen, by_item, axis=1), -1)
        values[start:stop] = np.where(keep, np.take_along_axis(stars, by_item, axis=1), 0.0)
    mask = np.arange(width)[None, :] < counts[:, None]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Ratings(indptr, items[mask], values[mask], spec.items, features.astype(np.float32))


@dataclass(frozen=True)
class HeldOut:
    """Users kept out of training: each one's ratings cut into a ``history`` (their embedding is folded in
    from it, at inference, on their side) and a ``target`` (what the model is scored on)."""

    history: Ratings
    target: Ratings


def split_users(data: Ratings, held_out: int, target_fraction: float, seed: int) -> tuple[Ratings, HeldOut]:
    """The training users' ratings, and the held-out users' (``held_out`` users drawn at random, at least
    one; each one's ratings split at random, a ``target_fraction`` of them, at least one, into the target
    and the rest, at least one, into the history). Users with a single rating always train."""
    if not 0 < target_fraction < 1:
        raise ValueError(f"a target fraction in (0, 1): {target_fraction}")
    rng = _rng(seed, 1)
    eligible = np.flatnonzero(data.counts >= 2)
    n_out = min(len(eligible), max(1, held_out))
    out = np.sort(rng.permutation(eligible)[:n_out])
    train = np.setdiff1d(np.arange(data.n_users), out)
    history_items, history_values, target_items, target_values = [], [], [], []
    for u in out:
        items, values = data.row(int(u))
        n = len(items)
        order = rng.permutation(n)
        n_target = min(n - 1, max(1, round(target_fraction * n)))
        target, history = np.sort(order[:n_target]), np.sort(order[n_target:])
        history_items.append(items[history])
        history_values.append(values[history])
        target_items.append(items[target])
        target_values.append(values[target])
    split = HeldOut(
        from_lists(history_items, history_values, data.n_items, data.item_features),
        from_lists(target_items, target_values, data.n_items, data.item_features),
    )
    return data.rows(train), split
