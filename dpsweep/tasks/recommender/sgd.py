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
sums, adds N(0, σ²C²) to every coordinate and divides by the expected number of users qU, as Opacus
does for examples; the untrusted server (:class:`GradientServer`) adds the gradient of the public
regulariser λ_v ‖V‖² / U and steps its optimizer. G_i is never formed: its norm has the closed form
‖G_i‖² = 4 ‖u‖² (Σ_j e_ij² − 2 w₀ Σ_j e_ij ⟨u, v_j⟩ + w₀² ‖V u‖²) (the items of Ω_i are distinct), and the
clipped sum is a sparse sum over the ratings plus 2 w₀ V Σ_i f_i u_i u_iᵀ, f_i the clip factors.

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


def gradient_norms(items: torch.Tensor, users: torch.Tensor, ratings: Batch, unobserved: float) -> torch.Tensor:
    """‖G_i‖_F of each user's gradient with respect to V (closed form, see the module's docstring)."""
    e = residuals(items, users, ratings)
    predicted = (users[ratings.users] * items[ratings.items]).sum(1)
    per_user = torch.zeros(users.shape[0], dtype=items.dtype, device=items.device)
    per_user.index_add_(0, ratings.users, e * e - 2 * unobserved * e * predicted)
    per_user = per_user + unobserved**2 * (users @ items.T).pow(2).sum(1)
    return 2 * users.norm(dim=1) * per_user.clamp_min(0).sqrt()


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
    """What the aggregator releases to the server each step: (Σ_i clip(G_i) + N(0, σ²C²)) / (qU)."""

    mean: torch.Tensor


class GradientAggregator:
    """The trusted aggregator of a DP-SGD step: clips each sampled user's gradient as a whole to C,
    sums them, adds N(0, σ²C²) per coordinate and divides by the expected number of users. Without
    DP (``max_grad_norm`` None) it only averages."""

    def __init__(
        self,
        max_grad_norm: float | None,
        noise_multiplier: float,
        expected_users: float,
        unobserved: float,
        generator: torch.Generator,
    ) -> None:
        if max_grad_norm is None and noise_multiplier != 0:
            raise ValueError(f"noise multiplier {noise_multiplier} without a clipping norm: its noise has no scale")
        self.max_grad_norm, self.noise_multiplier = max_grad_norm, noise_multiplier
        self.expected_users, self.unobserved, self.generator = expected_users, unobserved, generator

    def clip_factors(self, items: torch.Tensor, users: torch.Tensor, ratings: Batch) -> torch.Tensor:
        """min(1, C/‖G_i‖) of each user (ones without DP)."""
        if self.max_grad_norm is None:
            return torch.ones(users.shape[0], dtype=items.dtype, device=items.device)
        norms = gradient_norms(items, users, ratings, self.unobserved)
        return (self.max_grad_norm / norms.clamp_min(1e-12)).clamp(max=1.0)

    def __call__(self, items: torch.Tensor, users: torch.Tensor, ratings: Batch) -> NoisyGradient:
        factors = self.clip_factors(items, users, ratings)
        total = gradient_sum(items, users, ratings, self.unobserved, factors)
        if self.max_grad_norm is not None and self.noise_multiplier != 0:
            g = self.generator
            noise = torch.randn(tuple(total.shape), generator=g, device=g.device, dtype=total.dtype)
            total = total + self.noise_multiplier * self.max_grad_norm * noise.to(total.device)
        return NoisyGradient(total / self.expected_users)


class GradientServer:
    """The untrusted server of a DP-SGD step: from the released gradient alone, adds the public
    regulariser's gradient 2 λ_v V / U and steps the optimizer of V."""

    def __init__(self, items: torch.nn.Parameter, optimizer: torch.optim.Optimizer, item_reg: float, n_users: int):
        self.items, self.optimizer, self.reg_scale = items, optimizer, 2 * item_reg / n_users

    def update(self, released: NoisyGradient) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.items.grad = released.mean + self.reg_scale * self.items.detach()
        self.optimizer.step()
