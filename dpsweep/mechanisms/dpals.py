"""``dp.mechanism=dpals``: DP alternating least squares (Chien et al. 2021, ICML, "Private Alternating
Least Squares", Alg. 1) for factorized models at user level: each round, a trusted aggregator releases
the item side's sufficient statistics with Gaussian noise of σ times their L2 sensitivity Δ; users are
not sampled, so there is no amplification. Its privacy (no torch); the rounds themselves are
:mod:`dpsweep.tasks.recommender.als`.

    dpsweep-epsilon --mechanism dpals -s 5400 -b 5400 -e 10 -n 2.0     # 10 rounds over 5,400 users
    dpsweep-epsilon --mechanism dpals -s 5400 -b 5400 -e 10 --target-epsilon 3

One round is one Gaussian mechanism (Dwork & Roth 2014, Thm. A.1) of noise multiplier σ; T rounds are
dp-accounting's ``SelfComposedDpEvent(GaussianDpEvent(σ), T)``, as google-research's
``dp_alternating_minimization`` (``DPALSAccountant``) accounts its ALS steps. The unit is a user: two
datasets are neighbours when one holds all the ratings of one user more. Δ follows from the bounds
each user's contribution is held to (:class:`Bounds`, :func:`sensitivity`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from dp_accounting import dp_event

from dpsweep.mechanisms.base import MECHANISMS, EngineTable, Mechanism, Setting
from dpsweep.privacy import ledger
from dpsweep.privacy.ledger import Ledger


@dataclass(frozen=True)
class Bounds:
    """Each user's contribution to a round, stated and enforced by the aggregator."""

    max_ratings: int  # k: ratings per user that enter the statistics (the first k of the user's row)
    max_user_norm: float  # Γ: a user embedding's L2 norm is clipped to it
    max_abs_rating: float  # R: a (centred) rating's value is clipped to [−R, R]

    def __post_init__(self) -> None:
        if self.max_ratings < 1 or self.max_user_norm <= 0 or self.max_abs_rating <= 0:
            raise ValueError(f"bounds must be positive: {self}")


def sensitivity(b: Bounds, implicit: bool = False, through_features: bool = False) -> float:
    """The L2 sensitivity Δ of one round's release to adding or removing one user.

    Item by item: the statistics A_j = Σ u uᵀ (upper triangle) and b_j = Σ r u over the at most k items
    the user rated (each moved by at most ‖u‖² ≤ Γ² and |r| ‖u‖ ≤ RΓ), and with implicit feedback the
    users' Gramian G = Σ u uᵀ (moved by at most Γ²): Δ = √(k (Γ⁴ + R²Γ²) + Γ⁴·[implicit]).

    Through public item features f_j (‖f_j‖ ≤ 1; the item embeddings are F W): the statistics of W,
    A = Σ_i (u_i u_iᵀ) ⊗ X_i with X_i = Σ_j f_j f_jᵀ over the user's k items, and b = Σ_i u_i ⊗ Σ_j r_ij f_j.
    ‖X_i‖_F ≤ tr X_i ≤ k and a Kronecker product's Frobenius norm is the product of its factors', so a
    user moves A by at most kΓ² and b by at most kRΓ: Δ = √(k²Γ⁴ + k²R²Γ² + Γ⁴·[implicit])."""
    gram, rhs = b.max_user_norm**2, b.max_abs_rating * b.max_user_norm
    users_gram = gram**2 if implicit else 0.0
    if through_features:
        return math.sqrt(b.max_ratings**2 * (gram**2 + rhs**2) + users_gram)
    return math.sqrt(b.max_ratings * (gram**2 + rhs**2) + users_gram)


def count_sensitivity(b: Bounds) -> float:
    """Δ of the items' counts over each user's first k ratings (the private popularity baseline): a user
    adds 1 to at most k counts, Δ = √k."""
    return math.sqrt(b.max_ratings)


def round_events(noise_multiplier: float, rounds: int) -> dp_event.DpEvent:
    """The dp-accounting event of ``rounds`` DPALS rounds at noise multiplier σ (no sampling)."""
    return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(noise_multiplier), rounds)


class DPALS(Mechanism):
    name = "dpals"
    label = "DPALS"
    neighbours = ledger.NEIGHBOURS  # add or remove one user, with all their ratings
    sampled = False
    note = "a Gaussian release of the item side's sufficient statistics per round, every user in it, no amplification"
    # task=recommender's ALS rounds (dpsweep.tasks.recommender.als): a user's ratings bound each round
    engines_at: ClassVar[EngineTable] = {"user": ("sufficient_statistics",)}
    # no gradient a canary could join, and no released score of a user (their embedding is never released)
    audits: ClassVar[tuple[str, ...]] = ()
    methods: ClassVar[tuple[str, ...]] = ("als", "popularity")  # task=recommender's ALS and popularity baseline
    citation = "Chien et al. 2021 (ICML), Alg. 1; google-research dp_alternating_minimization (DPALSAccountant)"

    def steps(self, s: Setting) -> int:
        """One round per epoch (every user in each), or ``s.steps`` rounds."""
        return s.steps if s.steps is not None else s.epochs or 0

    def ledger(self, s: Setting, noise_multiplier: float) -> Ledger:
        rounds = self.steps(s)
        entry = ledger.Entry(
            "dpals", round_events(noise_multiplier, rounds),
            {"noise_multiplier": noise_multiplier, "rounds": rounds},
            "each round: the item side's sufficient statistics, Gaussian noise of σ times their L2 sensitivity",
        )  # fmt: skip
        return s.extra + Ledger((entry,))

    def describe(self, s: Setting, noise_multiplier: float) -> str:
        return (
            f"{self.label}: {self.steps(s)} rounds, each one Gaussian release of the item side's sufficient "
            f"statistics with noise multiplier σ = {noise_multiplier:.6g} (standard deviation σΔ, Δ their L2 "
            "sensitivity to one user), over every user (no sampling, no amplification)"
        )


MECHANISMS.register(DPALS.name)(DPALS())
