"""DP alternating least squares (DPALS) for a factorized model of ratings, written as the design's roles.

    bounds = Bounds(max_ratings=50, max_user_norm=0.3, max_abs_rating=1.0)  # dpsweep.mechanisms.dpals
    reg = ALSRegularization(user=1.0, item=30.0, unobserved=0.2)
    train = Batch.of(ratings, implicit=True)                  # dpsweep.data.ratings.Ratings, on a device
    aggregator = Aggregator(bounds, noise_multiplier=2.0, implicit=True, generator=torch.Generator().manual_seed(0))
    model = ItemModel.initial(n_items=1000, rank=8, seed=0)   # public: a seeded random start
    for _ in range(rounds):
        model = dpals_round(model, train, aggregator, Server(reg))
    recall_at(model, history, target, reg)                    # held-out users, folded in on their side

Following Chien et al. 2021 (ICML), "Private Alternating Least Squares: Practical Private Matrix
Completion with Tighter Rates", Alg. 1 (DPALS), and Jain et al. 2021 (NeurIPS), "Differentially Private
Model Personalization" (the billboard model: joint DP), in our own code. Each round:

1. **Clients** (each user, on their device): the user's embedding is the exact ridge solution
   u_i = argmin_u Σ_{j∈Ω_i} (r_ij − ⟨u, v_j⟩)² + λ_u ‖u‖² against the broadcast item embeddings V
   (:func:`client_embeddings`). It is local: never released, logged or checkpointed, and a function of
   V and the user's own ratings, so it is recomputed (folded in) rather than stored.
2. **The trusted aggregator** (:class:`Aggregator`) bounds each user's contribution (at most
   ``max_ratings`` ratings, ‖u_i‖ ≤ Γ = ``max_user_norm``, centred ratings clipped to [−R, R]), sums the
   item side's sufficient statistics A_j = Σ_{i∈Ω_j} u_i u_iᵀ (upper triangle) and b_j = Σ_{i∈Ω_j} r_ij u_i,
   and adds Gaussian noise N(0, (σΔ)²) to every released coordinate, Δ = :func:`sensitivity`.
3. **The server** (:class:`Server`, untrusted) receives only the aggregator's noisy statistics
   (:class:`NoisyStatistics`) and solves each item's row: v_j = (PSD(Ã_j) + λ_v I)⁻¹ b̃_j, PSD(·) the
   projection onto the positive semidefinite cone (post-processing), as Chien et al. do.

**Privacy.** The unit is a user (add or remove one user and all their ratings). One round releases
(Ã_j, b̃_j)_j, a Gaussian mechanism whose L2 sensitivity is Δ = √(k (Γ⁴ + R²Γ²)): a user enters at most
k items' statistics, each by ‖u uᵀ‖_F = ‖u‖² ≤ Γ² (the upper triangle is at most that) and ‖r u‖ ≤ RΓ.
With noise of standard deviation σΔ it is dp-accounting's ``GaussianDpEvent(σ)``; T rounds compose to
``SelfComposedDpEvent(GaussianDpEvent(σ), T)``, no sampling and so no amplification: the privacy side,
bounds, Δ and events, is ``dp.mechanism=dpals`` (:mod:`dpsweep.mechanisms.dpals`). The user
embeddings, though computed from each user's data, stay with the user: by the billboard lemma
(Hsu et al. 2014; Jain et al. 2021, Lemma 2.1) the released V together with each user's
own output is jointly DP. The google-research reference (``dp_alternating_minimization/dpam.py``,
``DPALSOptimizer.get_dp_event_training``) accounts its rounds the same way, with separate σ for its
Gramians and right-hand sides; here one σ covers both.

Feedback is explicit (a rating, centred by :data:`CENTRE`, 3 stars, a public constant; scored by RMSE)
or implicit (1 for every rated item, and every unrated item counted as a 0 with weight w₀, as in
weighted ALS: Hu, Koren & Volinsky 2008, "Collaborative Filtering for Implicit Feedback Datasets"; scored
by Recall@20). Implicit feedback adds the users' Gramian G = Σ_i u_i u_iᵀ to the release (each user moves
it by at most Γ², counted in Δ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dpsweep.data.ratings import Ratings
from dpsweep.mechanisms.dpals import Bounds, sensitivity

CENTRE = 3.0  # stars subtracted from every rating: public, not computed from the data


@dataclass(frozen=True)
class ALSRegularization:
    """λ_u of the users' solves and λ_v of the items' (added to Ã_j)."""

    user: float = 1.0
    item: float = 1.0
    unobserved: float = 0.0  # w₀: the weight of every unrated item as a 0 (implicit feedback; 0: explicit)


@dataclass(frozen=True)
class ItemModel:
    """The shared, released part of the factorized model: one embedding per item (n_items × rank)."""

    item_embeddings: torch.Tensor

    @staticmethod
    def initial(n_items: int, rank: int, seed: int, device: torch.device | str = "cpu") -> ItemModel:
        """A public start: N(0, 1/rank) entries from a seeded generator (no data)."""
        g = torch.Generator().manual_seed(int(seed))
        return ItemModel((torch.randn(n_items, rank, generator=g) / math.sqrt(rank)).to(device))

    def scores(self, users: torch.Tensor) -> torch.Tensor:
        """Predicted centred ratings of every item for each user embedding (users × n_items)."""
        return users @ self.item_embeddings.T


@dataclass(frozen=True)
class Batch:
    """Ratings on a device, one entry per rating: its user (row), item, value and slot in the user's
    row (the aggregator keeps the first k). ``value`` is the centred rating (explicit feedback) or 1
    (implicit: that the user rated the item)."""

    users: torch.Tensor
    items: torch.Tensor
    values: torch.Tensor
    slots: torch.Tensor
    n_users: int
    n_items: int
    # what is derived from these entries (sparse matrices, the bounded entries), made once: a run's
    # batches are the same every round
    derived: dict[tuple[Any, ...], Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(r: Ratings, implicit: bool = False, device: torch.device | str = "cpu") -> Batch:
        """The ratings of ``r``, at most one per user and item (the aggregators' sensitivities and the
        closed-form gradient norms of :mod:`dpsweep.tasks.recommender.sgd` count each item once a user)."""
        pairs = r.users.astype(np.int64) * r.n_items + r.items
        if len(np.unique(pairs)) != len(pairs):
            raise ValueError("a user rates an item twice: one rating per user and item")
        values = np.ones(r.n_ratings, np.float32) if implicit else r.values - CENTRE
        t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device)  # noqa: E731
        return Batch(t(r.users), t(r.items), t(values), t(r.slots), r.n_users, r.n_items)

    def matrix(self, dtype: torch.dtype, weighted: bool = False) -> torch.Tensor:
        """The users × items sparse matrix of these entries (ones, or their values where ``weighted``), of
        ``dtype``."""
        key = ("matrix", dtype, weighted)
        if key not in self.derived:
            data = (self.values if weighted else torch.ones_like(self.values)).to(dtype)
            index = torch.stack([self.users, self.items])
            shape = (self.n_users, self.n_items)  # the indices are in range by construction: no invariant checks
            self.derived[key] = torch.sparse_coo_tensor(index, data, shape, check_invariants=False).coalesce()
        matrix: torch.Tensor = self.derived[key]
        return matrix

    def first(self, k: int, bound: float) -> Batch:
        """Each user's first ``k`` entries, their values clipped to [−bound, bound]."""
        key = ("first", k, bound)
        if key not in self.derived:
            keep = self.slots < k
            values = self.values[keep].clamp(-bound, bound)
            self.derived[key] = Batch(self.users[keep], self.items[keep], values, self.slots[keep], self.n_users,
                                      self.n_items)  # fmt: skip
        first: Batch = self.derived[key]
        return first


def _outer(x: torch.Tensor) -> torch.Tensor:
    """Each row's outer product with itself, flattened (rows × rank²)."""
    return (x.unsqueeze(2) * x.unsqueeze(1)).reshape(x.shape[0], -1)


# ---------------------------------------------------------------------------------------------
# the roles
# ---------------------------------------------------------------------------------------------
def client_embeddings(model: ItemModel, ratings: Batch, reg: ALSRegularization) -> torch.Tensor:
    """Each user's exact solution against the broadcast item embeddings V (users × rank), computed on
    the user's side: u = (V_Ωᵀ V_Ω + w₀ VᵀV + λ_u I)⁻¹ V_Ωᵀ r, w₀ = ``reg.unobserved`` (0 for explicit
    feedback). Users are solved independently (the sums over a user's items are done for all users
    at once, as a sparse product). The same solve folds in a held-out user."""
    v = model.item_embeddings
    rank = v.shape[1]
    gram = torch.sparse.mm(ratings.matrix(v.dtype), _outer(v)).reshape(-1, rank, rank)
    eye = torch.eye(rank, device=v.device, dtype=v.dtype)
    gram = gram + reg.unobserved * (v.T @ v) + reg.user * eye
    rhs = torch.sparse.mm(ratings.matrix(v.dtype, weighted=True), v)
    return torch.linalg.solve(gram, rhs)


fold_in = client_embeddings  # at inference: a user's embedding from their own history


@dataclass(frozen=True)
class NoisyStatistics:
    """What the aggregator releases to the server each round: Ã (n_items × rank × rank, symmetric),
    b̃ (n_items × rank) and, for implicit feedback, the users' Gramian G̃ = Σ_i u_i u_iᵀ (rank × rank),
    noised."""

    gram: torch.Tensor
    rhs: torch.Tensor
    users_gram: torch.Tensor | None


class Aggregator:
    """The trusted aggregator: bounds each user's contribution, sums the item side's sufficient
    statistics and noises them (σΔ per released coordinate)."""

    def __init__(
        self, bounds: Bounds | None, noise_multiplier: float, implicit: bool, generator: torch.Generator
    ) -> None:
        """``bounds`` None: a non-private aggregator (nothing bounded, no noise: ``noise_multiplier`` 0)."""
        if bounds is None and noise_multiplier != 0:
            raise ValueError(f"noise multiplier {noise_multiplier} without bounds: its noise would have no scale")
        self.bounds, self.noise_multiplier, self.implicit = bounds, noise_multiplier, implicit
        self.generator = generator

    def clip(self, users: torch.Tensor, ratings: Batch) -> tuple[torch.Tensor, Batch]:
        """Each user's embedding clipped to Γ, values to [−R, R], and each user's first k ratings kept."""
        b = self.bounds
        if b is None:
            return users, ratings
        users = users * torch.clamp(b.max_user_norm / users.norm(dim=1, keepdim=True).clamp_min(1e-12), max=1.0)
        return users, ratings.first(b.max_ratings, b.max_abs_rating)

    def sums(self, users: torch.Tensor, ratings: Batch) -> NoisyStatistics:
        """The exact sums A_j, b_j (and G) over the given contributions, before noise."""
        rank = users.shape[1]
        gram = torch.sparse.mm(ratings.matrix(users.dtype).T, _outer(users)).reshape(-1, rank, rank)
        rhs = torch.sparse.mm(ratings.matrix(users.dtype, weighted=True).T, users)
        return NoisyStatistics(gram, rhs, users.T @ users if self.implicit else None)

    def __call__(self, users: torch.Tensor, ratings: Batch) -> NoisyStatistics:
        exact = self.sums(*self.clip(users, ratings))
        if self.bounds is None or self.noise_multiplier == 0:
            return exact
        std = self.std()
        noisy_gram = exact.gram + std * self._symmetric_noise(exact.gram.shape)
        noisy_rhs = exact.rhs + std * self._noise(exact.rhs.shape)
        g = exact.users_gram
        noisy_users_gram = None if g is None else g + std * self._symmetric_noise((1, *g.shape))[0]
        return NoisyStatistics(noisy_gram, noisy_rhs, noisy_users_gram)

    def sensitivity(self) -> float:
        """Δ of this aggregator's release to one user (:func:`dpsweep.mechanisms.dpals.sensitivity`)."""
        assert self.bounds is not None
        return sensitivity(self.bounds, self.implicit)

    def std(self) -> float:
        """σΔ: the standard deviation of the noise on every released coordinate."""
        return self.noise_multiplier * self.sensitivity()

    def _noise(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        g = self.generator
        return torch.randn(tuple(shape), generator=g, device=g.device)

    def _symmetric_noise(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """One draw per coordinate of the upper triangle (the diagonal included), mirrored below."""
        upper = torch.triu(self._noise(shape))
        return upper + torch.triu(upper, diagonal=1).transpose(-1, -2)


class Server:
    """The untrusted server: from the aggregator's noisy statistics only, each item's ridge solution
    v_j = (PSD(Ã_j) + w₀ PSD(G̃) + λ_v I)⁻¹ b̃_j."""

    def __init__(self, reg: ALSRegularization) -> None:
        self.reg = reg

    def update(self, stats: NoisyStatistics) -> ItemModel:
        lhs = psd(stats.gram)
        if stats.users_gram is not None:
            lhs = lhs + self.reg.unobserved * psd(stats.users_gram.unsqueeze(0))
        eye = torch.eye(lhs.shape[-1], device=lhs.device, dtype=lhs.dtype)
        return ItemModel(torch.linalg.solve(lhs + self.reg.item * eye, stats.rhs.unsqueeze(-1)).squeeze(-1))


def psd(m: torch.Tensor) -> torch.Tensor:
    """The projection of symmetric matrices onto the positive semidefinite cone (negative eigenvalues
    set to 0): post-processing of a noisy Gramian, as Chien et al. 2021 do."""
    eigenvalues, vectors = torch.linalg.eigh(m)
    return (vectors * eigenvalues.clamp_min(0).unsqueeze(-2)) @ vectors.transpose(-1, -2)


def dpals_round(model: ItemModel, ratings: Batch, aggregator: Aggregator, server: Server) -> ItemModel:
    """One round: clients solve their embeddings, the aggregator releases noisy statistics, the server
    solves the items from them alone."""
    users = client_embeddings(model, ratings, server.reg)
    return server.update(aggregator(users, ratings))


# ---------------------------------------------------------------------------------------------
# scores on held-out users (their embeddings folded in from their history)
# ---------------------------------------------------------------------------------------------
def recall_at(model: ItemModel, history: Batch, target: Batch, reg: ALSRegularization, k: int = 20) -> float:
    """Recall@k: per held-out user, the share of their target items among the k best-scored items they
    have not rated in their history (divided by min(k, |target|), as google-research's DPAM evaluation
    does), averaged over users."""
    return recall_of(model.scores(fold_in(model, history, reg)), history, target, k)


def recall_of(scores: torch.Tensor, history: Batch, target: Batch, k: int = 20) -> float:
    """Recall@k of these scores (held-out users × items; see :func:`recall_at`)."""
    scores = scores.masked_fill(history.matrix(torch.float32).to_dense() > 0, -torch.inf)
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices
    hits = (target.matrix(torch.float32).to_dense() > 0).gather(1, top).sum(1).to(scores.dtype)
    sizes = torch.bincount(target.users, minlength=target.n_users).clamp(max=k).to(scores.dtype)
    return float((hits / sizes).mean())


def rmse(model: ItemModel, history: Batch, target: Batch, reg: ALSRegularization) -> float:
    """The root mean squared error, in stars, of the held-out users' target ratings (explicit feedback;
    their embeddings folded in from their history; a prediction clipped to the 1-5 scale)."""
    users = fold_in(model, history, reg)
    predicted = (users[target.users] * model.item_embeddings[target.items]).sum(1)
    predicted = (predicted + CENTRE).clamp(1.0, 5.0) - CENTRE
    return float(torch.sqrt(((predicted - target.values) ** 2).mean()))
