"""DPALS through public item features: the item embeddings are V = F W, F the items' public features
(rows scaled to norm at most 1, a public transformation) and W (d × rank) the shared parameters, so
the aggregator releases the statistics of W, (rank·d)² + rank·d numbers, instead of every item's.

After Krichene et al. 2023, "Private Learning with Public Features" (AISTATS 2024; arXiv:2310.15454):
public features need no protection, and fewer private parameters means less noise. Our own code and
our own form of it: W solves

    min_W Σ_(i,j)∈Ω (r_ij − f_jᵀ W u_i)² + w₀ Σ_i Σ_j (f_jᵀ W u_i)² + λ ‖W‖²,

whose normal equations in w = vec(W) (x_ij = u_i ⊗ f_j, f_jᵀ W u_i = x_ijᵀ w) are
(Σ_i (u_i u_iᵀ) ⊗ X_i + w₀ G ⊗ FᵀF + λ I) w = Σ_i u_i ⊗ Σ_j r_ij f_j, X_i = Σ_j∈Ω_i f_j f_jᵀ and
G = Σ_i u_i u_iᵀ. The aggregator bounds and noises (Σ_i (u_i u_iᵀ) ⊗ X_i, Σ_i u_i ⊗ Σ_j r_ij f_j, G) with the
sensitivity of :func:`dpsweep.mechanisms.dpals.sensitivity` (``through_features=True``); the server
solves W from them alone. The users' side is unchanged (:func:`dpsweep.tasks.recommender.als.client_embeddings`).
"""

from __future__ import annotations

import torch

from dpsweep.mechanisms.dpals import sensitivity
from dpsweep.tasks.recommender.als import Aggregator, ALSRegularization, Batch, ItemModel, NoisyStatistics, Server, psd


def unit_rows(features: torch.Tensor) -> torch.Tensor:
    """Each item's features scaled to norm at most 1 (public: no data)."""
    return features / features.norm(dim=1, keepdim=True).clamp_min(1.0)


class FeatureAggregator(Aggregator):
    """The trusted aggregator of W's statistics: released as ``gram`` ((rank·d) × (rank·d), one matrix),
    ``rhs`` (rank·d) and ``users_gram`` (implicit feedback)."""

    def __init__(self, features: torch.Tensor, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.features = unit_rows(features)

    def sums(self, users: torch.Tensor, ratings: Batch) -> NoisyStatistics:
        f = self.features.to(users.dtype)
        rank, d = users.shape[1], f.shape[1]
        per_user = torch.sparse.mm(ratings.matrix(users.dtype), (f.unsqueeze(2) * f.unsqueeze(1)).reshape(-1, d * d))
        gram = torch.einsum("ia,ib,icd->acbd", users, users, per_user.reshape(-1, d, d)).reshape(rank * d, rank * d)
        weighted = torch.sparse.mm(ratings.matrix(users.dtype, weighted=True), f)  # Σ_j r_ij f_j per user
        rhs = torch.einsum("ia,ic->ac", users, weighted).reshape(rank * d)
        return NoisyStatistics(gram.unsqueeze(0), rhs.unsqueeze(0), users.T @ users if self.implicit else None)

    def sensitivity(self) -> float:
        assert self.bounds is not None
        return sensitivity(self.bounds, self.implicit, through_features=True)


class FeatureServer(Server):
    """The untrusted server: W from the aggregator's noisy statistics alone, then V = F W."""

    def __init__(self, reg: ALSRegularization, features: torch.Tensor) -> None:
        super().__init__(reg)
        self.features = unit_rows(features)

    def update(self, stats: NoisyStatistics) -> ItemModel:
        f = self.features.to(stats.rhs.dtype)
        d = f.shape[1]
        lhs = psd(stats.gram)[0]
        if stats.users_gram is not None:
            lhs = lhs + self.reg.unobserved * torch.kron(psd(stats.users_gram.unsqueeze(0))[0], f.T @ f)
        eye = torch.eye(lhs.shape[-1], device=lhs.device, dtype=lhs.dtype)
        w = torch.linalg.solve(lhs + self.reg.item * eye, stats.rhs[0])
        mapping = w.reshape(-1, d).T  # w[(a, c)] = W[c, a]: W is d × rank
        return ItemModel(f @ mapping)
