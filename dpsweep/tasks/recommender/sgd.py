"""User-level DP-SGD on the item side of the factorized model: DPAM's item step and the joint DP-SGD
baseline, written as the design's roles.

    aggregator = GradientAggregator(max_grad_norm=0.1, noise_multiplier=1.0, expected_users=500.0,
                                    unobserved=0.2, generator=torch.Generator().manual_seed(0))
    sampled = sample_users(train.n_users, 500 / train.n_users, generator)   # Poisson: each user alone
    part = users_of(train, sampled)                                         # their ratings (als.Batch)
    released = aggregator(items.detach(), users[sampled], part)             # clipped, summed, noised
    GradientServer(items, torch.optim.Adam([items], lr=0.03), item_reg=1.0, n_users=train.n_users).update(released)

Both train the ALS objective of :mod:`dpsweep.tasks.recommender.als` (implicit or explicit feedback),
user i's share of it being L_i(u, V) = Σ_{j∈Ω_i} (r_ij − ⟨u, v_j⟩)² + w₀ ‖V u‖² + λ_u ‖u‖², with each
user's embedding kept on the user's side (joint DP, Jain et al. 2021):

- **DPAM** (``task.method=dpam``; Jain et al. 2021, Alg. 1, and google-research's
  ``dp_alternating_minimization``, whose item encoder is trained by DP-SGD): a round first solves
  every user's u exactly against the released V (:func:`dpsweep.tasks.recommender.als.client_embeddings`,
  local), then takes one epoch of DP-SGD steps on V with the users' embeddings fixed.
- **Joint user-level DP-SGD** (``task.method=sgd``; McMahan et al. 2018, "Learning Differentially
  Private Recurrent Language Models", on the same model): no exact solve; at each step a sampled user
  takes one gradient step on their own u (:func:`user_gradients`, on their device, never released)
  while the aggregator releases the noisy gradient of V.

**One step.** Users are Poisson-sampled, each alone with probability q (:func:`sample_users`). A sampled
user's gradient of L_i with respect to V is G_i = −2 Σ_{j∈Ω_i} e_ij 1_j uᵀ + 2 w₀ V u uᵀ, e_ij = r_ij − ⟨u, v_j⟩
the residual, over the user's first ``task.max_ratings_per_user`` ratings. The trusted aggregator
(:class:`GradientAggregator`) clips each G_i **as a whole** to C = ``dp.max_grad_norm`` in Frobenius norm,
sums, adds N(0, σ²C²) to every coordinate and divides by B = ``train.batch_size``, the expected number
of users per step of the config (public; not qU, a function of U: issue 58, item 5, cf. arXiv 2605.15648);
the untrusted server (:class:`GradientServer`) adds the gradient of the public
regulariser λ_v ‖θ‖² / U of each part θ it trains (V, or E and W with features) and steps its optimizer.
G_i is never formed: its norm has the closed form
‖G_i‖² = 4 ‖u‖² (Σ_j e_ij² − 2 w₀ Σ_j e_ij ⟨u, v_j⟩ + w₀² ‖V u‖²) (the items of Ω_i are distinct), and the
clipped sum is a sparse sum over the ratings plus 2 w₀ V Σ_i f_i u_i u_iᵀ, f_i the clip factors.

**Public item features** (``task.item_features=true``; after Krichene et al. 2023, "Private Learning with
Public Features"): the item embeddings are V = E + F W, a per-item part E and the map W (d × rank) of the
items' public features F (rows of norm at most 1). A user's gradient is then (G_i, Fᵀ G_i), and
Fᵀ G_i = a_i uᵀ with a_i = −2 Σ_j e_ij f_j + 2 w₀ FᵀV u: rank one, of norm ‖a_i‖ ‖u‖. Both parts are clipped
together, as one vector of norm √(‖G_i‖² + ‖a_i‖²‖u‖²), and noised alike. W sees every user's ratings
of every item through few numbers, so it keeps more signal per unit of noise than E.

**Privacy.** Adding or removing a user changes the sum by one clipped G_i, norm at most C: each step is
a Poisson-subsampled Gaussian mechanism of noise multiplier σ, accounted as DP-SGD over the U training
users (``dp.mechanism=dpsgd`` at ``dp.unit=user``: q = 1/ceil(U/B), ceil(U/B) steps an epoch, B =
``train.batch_size`` users in expectation; :mod:`dpsweep.mechanisms.dpsgd`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpsweep.tasks.recommender.als import Batch


def sample_users(n_users: int, rate: float, generator: torch.Generator) -> torch.Tensor:
    """The indices of a Poisson sample: each user in it alone with probability ``rate``."""
    draws = torch.rand(n_users, generator=generator, device=generator.device)
    return torch.nonzero(draws < rate).flatten()


def users_of(ratings: Batch, sampled: torch.Tensor) -> Batch:
    """The ratings of the ``sampled`` users (indices), renumbered 0.. in the order of ``sampled``."""
    position = torch.full((ratings.n_users,), -1, dtype=torch.int64, device=ratings.users.device)
    position[sampled.to(position.device)] = torch.arange(len(sampled), device=position.device)
    keep = position[ratings.users] >= 0
    return Batch(position[ratings.users[keep]], ratings.items[keep], ratings.values[keep], ratings.slots[keep],
                 len(sampled), ratings.n_items)  # fmt: skip


def residuals(items: torch.Tensor, users: torch.Tensor, ratings: Batch) -> torch.Tensor:
    """e_ij = r_ij − ⟨u_i, v_j⟩ of every rating (its user's row of ``users``)."""
    return ratings.values.to(items.dtype) - (users[ratings.users] * items[ratings.items]).sum(1)


def gradient_norms(
    items: torch.Tensor, users: torch.Tensor, ratings: Batch, unobserved: float, features: torch.Tensor | None = None
) -> torch.Tensor:
    """The norm of each user's gradient (closed form, see the module's docstring): ‖G_i‖_F with respect
    to V, or with public ``features`` ‖(G_i, Fᵀ G_i)‖. In float64: the closed form subtracts terms, and a
    norm rounded low would clip too little."""
    items, users = items.double(), users.double()
    features = None if features is None else features.double()
    ratings = Batch(ratings.users, ratings.items, ratings.values.double(), ratings.slots, ratings.n_users,
                    ratings.n_items)  # fmt: skip
    e = residuals(items, users, ratings)
    predicted = ratings.values - e  # ⟨u_i, v_j⟩, from the residuals just computed
    per_user = torch.zeros(users.shape[0], dtype=items.dtype, device=items.device)
    per_user.index_add_(0, ratings.users, e * e - 2 * unobserved * e * predicted)
    per_user = per_user + unobserved**2 * (users @ items.T).pow(2).sum(1)
    user_norms = users.pow(2).sum(1)
    squared = 4 * user_norms * per_user.clamp_min(0)
    if features is not None:  # ‖a_i u_iᵀ‖² = ‖a_i‖² ‖u_i‖²
        squared = squared + feature_factors(items, users, ratings, unobserved, features).pow(2).sum(1) * user_norms
    return squared.sqrt()


def feature_factors(
    items: torch.Tensor, users: torch.Tensor, ratings: Batch, unobserved: float, features: torch.Tensor
) -> torch.Tensor:
    """a_i = −2 Σ_j e_ij f_j + 2 w₀ FᵀV u_i of each user (users × d): their gradient of W is a_i u_iᵀ."""
    e = residuals(items, users, ratings)
    total = torch.zeros(users.shape[0], features.shape[1], dtype=items.dtype, device=items.device)
    total.index_add_(0, ratings.users, (-2 * e).unsqueeze(1) * features[ratings.items])
    return total + 2 * unobserved * users @ (items.T @ features)


def gradient_sum(
    items: torch.Tensor, users: torch.Tensor, ratings: Batch, unobserved: float, weights: torch.Tensor
) -> torch.Tensor:
    """Σ_i weights_i G_i (n_items × rank), never forming a G_i."""
    e = residuals(items, users, ratings)
    total = torch.zeros_like(items)
    total.index_add_(0, ratings.items, (-2 * weights[ratings.users] * e).unsqueeze(1) * users[ratings.users])
    weighted_gram = (users * weights.unsqueeze(1)).T @ users
    return total + 2 * unobserved * items @ weighted_gram


def user_gradients(
    items: torch.Tensor, users: torch.Tensor, ratings: Batch, unobserved: float, user_reg: float
) -> torch.Tensor:
    """∂L_i/∂u_i of each user: −2 Σ_j e_ij v_j + 2 w₀ VᵀV u + 2 λ_u u (computed on each user's side)."""
    e = residuals(items, users, ratings)
    total = torch.zeros_like(users)
    total.index_add_(0, ratings.users, (-2 * e).unsqueeze(1) * items[ratings.items])
    return total + 2 * unobserved * users @ (items.T @ items) + 2 * user_reg * users


@dataclass(frozen=True)
class NoisyGradient:
    """What the aggregator releases to the server each step: (Σ_i clip(G_i) + N(0, σ²C²)) / B, of
    the per-item embeddings and, with public features, of their map W."""

    mean: torch.Tensor
    feature_mean: torch.Tensor | None = None


class GradientAggregator:
    """The trusted aggregator of a DP-SGD step: clips each sampled user's gradient as a whole to C,
    sums them, adds N(0, σ²C²) per coordinate and divides by the expected number of users (the config's B,
    public). Without
    DP (``max_grad_norm`` None) it only averages."""

    def __init__(
        self,
        max_grad_norm: float | None,
        noise_multiplier: float,
        expected_users: float,
        unobserved: float,
        generator: torch.Generator,
        features: torch.Tensor | None = None,
    ) -> None:
        """``features``: the items' public features F (V = E + F W), or None (V = E)."""
        if max_grad_norm is None and noise_multiplier != 0:
            raise ValueError(f"noise multiplier {noise_multiplier} without a clipping norm: its noise has no scale")
        self.max_grad_norm, self.noise_multiplier = max_grad_norm, noise_multiplier
        self.expected_users, self.unobserved, self.generator = expected_users, unobserved, generator
        self.features = features

    def clip_factors(self, items: torch.Tensor, users: torch.Tensor, ratings: Batch) -> torch.Tensor:
        """min(1, C/‖gradient_i‖) of each user (ones without DP)."""
        if self.max_grad_norm is None:
            return torch.ones(users.shape[0], dtype=items.dtype, device=items.device)
        norms = gradient_norms(items, users, ratings, self.unobserved, self.features)
        return (self.max_grad_norm / norms.clamp_min(1e-12)).clamp(max=1.0).to(items.dtype)

    def __call__(self, items: torch.Tensor, users: torch.Tensor, ratings: Batch) -> NoisyGradient:
        """The release of one step; ``items`` is V, the whole item embeddings."""
        factors = self.clip_factors(items, users, ratings)
        total = self._noised(gradient_sum(items, users, ratings, self.unobserved, factors))
        if self.features is None:
            return NoisyGradient(total / self.expected_users)
        a = feature_factors(items, users, ratings, self.unobserved, self.features)
        mapped = self._noised((a * factors.unsqueeze(1)).T @ users)  # Σ_i f_i a_i u_iᵀ (d × rank)
        return NoisyGradient(total / self.expected_users, mapped / self.expected_users)

    def _noised(self, total: torch.Tensor) -> torch.Tensor:
        """``total`` plus N(0, σ²C²) per coordinate (unchanged without DP)."""
        if self.max_grad_norm is None or self.noise_multiplier == 0:
            return total
        g = self.generator
        noise = torch.randn(tuple(total.shape), generator=g, device=g.device, dtype=total.dtype)
        return total + self.noise_multiplier * self.max_grad_norm * noise.to(total.device)


class GradientServer:
    """The untrusted server of a DP-SGD step: from the released gradient alone, adds the public
    regulariser's gradient 2 λ_v θ / U of each part θ (E, and W with features) and steps the optimizer."""

    def __init__(
        self,
        items: torch.nn.Parameter,
        optimizer: torch.optim.Optimizer,
        item_reg: float,
        n_users: int,
        feature_weights: torch.nn.Parameter | None = None,
    ) -> None:
        self.items, self.feature_weights, self.optimizer = items, feature_weights, optimizer
        self.reg_scale = 2 * item_reg / n_users

    def update(self, released: NoisyGradient) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.items.grad = released.mean + self.reg_scale * self.items.detach()
        if self.feature_weights is not None:
            assert released.feature_mean is not None, "a release without the features' part"
            self.feature_weights.grad = released.feature_mean + self.reg_scale * self.feature_weights.detach()
        self.optimizer.step()
