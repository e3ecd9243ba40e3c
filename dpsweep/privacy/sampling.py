"""The sampling a run's ledger assumes, checked against the batches it really drew (issue 58, item 3).

A DP-SGD ledger claims Poisson sampling: each of N units joins each step independently with probability
q, so the size of step t's batch is b_t ~ Binomial(N, q_t), independently across steps. A run that drew
its batches otherwise (at another rate, as Opacus #813's sampler did, or fixed-size shuffled batches)
is not the mechanism its ε was computed for. Two tests of the realised sizes, each sensitive to one way
of failing, combined by Bonferroni (the smaller p-value times two, at most 1):

- **count** (too many or too few): S = Σ_t b_t ~ Binomial(N·T, q) when every step has the same q, by the
  exact two-sided binomial test (Clopper and Pearson 1934; ``scipy.stats.binomtest``, which sums the
  probabilities of the outcomes no more likely than S); with several rates, S is a sum of binomials,
  read by its normal approximation, z = (S − Σ N q_t) / √(Σ N q_t (1 − q_t)) (de Moivre–Laplace).
- **dispersion** (too regular or too irregular): D = Σ_t (b_t − N q_t)² / (N q_t (1 − q_t)), the binomial
  index of dispersion with known p (Cochran 1954, "Some methods for strengthening the common χ² tests",
  Biometrics 10, §2), about χ²_T under Poisson sampling; fixed-size batches make D ≈ 0. Two-sided. Its
  exact mean is T and its exact variance Σ_t (2 + (1 − 6 q_t (1 − q_t)) / (N q_t (1 − q_t))) (the
  binomial's fourth central moment), so D is read as c·χ²_ν with c and ν matching both (Satterthwaite
  1946, "An approximate distribution of estimates of variance components", Biometrics Bulletin 2),
  which is χ²_T as N q (1 − q) grows.

    checked = check(sizes=[61, 58, ...], rates=[0.03, 0.03, ...], population=1797)
    checked.p_value, checked.refused(), checked.why()
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

REFUSE_BELOW = 1e-6  # a run whose sampling test falls below this p-value is not for release


@dataclass(frozen=True)
class Checked:
    """The two tests of one run's batch sizes and their Bonferroni combination (module doc)."""

    steps: int
    population: int
    total: int  # Σ b_t
    expected_total: float  # Σ N q_t
    count_p_value: float
    dispersion: float  # D
    dispersion_p_value: float
    count_variance: float  # Σ N q_t (1 − q_t)

    @property
    def p_value(self) -> float:
        """Bonferroni over the two tests: twice the smaller p-value, at most 1."""
        return min(1.0, 2 * min(self.count_p_value, self.dispersion_p_value))

    @property
    def test(self) -> str:
        """The test with the smaller p-value, the one the statistic is of."""
        return "count" if self.count_p_value <= self.dispersion_p_value else "dispersion"

    @property
    def statistic(self) -> float:
        """Of :attr:`test`: the count's z-score (S − E S) / sd S, or D / T (1 under Poisson sampling)."""
        if self.test == "count":
            return self.count_z
        return self.dispersion / self.steps

    @property
    def count_z(self) -> float:
        spread = math.sqrt(max(self.count_variance, 1e-300))
        return (self.total - self.expected_total) / spread

    def refused(self, below: float = REFUSE_BELOW) -> bool:
        return self.p_value < below

    def why(self) -> str:
        """One line: what was found, against what the ledger claims."""
        per_step = self.total / max(self.steps, 1)
        expected = self.expected_total / max(self.steps, 1)
        if self.test == "count":
            return (
                f"the batches held {per_step:.1f} units a step on average over {self.steps} steps, the ledger's "
                f"Poisson sampling {expected:.1f} (N={self.population}); count test p={self.p_value:.2g}"
            )
        shape = "less" if self.dispersion < self.steps else "more"
        return (
            f"the batch sizes varied {shape} than Poisson sampling's over {self.steps} steps (dispersion "
            f"D/T={self.dispersion / self.steps:.3g}, 1 expected; N={self.population}); p={self.p_value:.2g}"
        )


def check(sizes: Sequence[int], rates: Sequence[float], population: int) -> Checked:
    """The realised batch sizes ``sizes`` (units per step) against Binomial(``population``, q_t) for the
    ledger's rate q_t of each step (``rates``, one a step, 0 < q_t < 1)."""
    if len(sizes) != len(rates) or not len(sizes):
        raise ValueError(f"need one rate per step and at least one step, got {len(sizes)} sizes, {len(rates)} rates")
    b = np.asarray(sizes, dtype=np.float64)
    q = np.asarray(rates, dtype=np.float64)
    if not np.all((q > 0) & (q < 1)):
        raise ValueError(f"rates must lie in (0, 1), got {sorted(set(q.tolist()))[:5]}")
    n, steps = int(population), len(b)
    mean, var = n * q, n * q * (1 - q)
    total, expected, spread = int(b.sum()), float(mean.sum()), float(var.sum())
    if np.all(q == q[0]):
        count_p = float(stats.binomtest(total, n * steps, float(q[0])).pvalue)
    else:
        count_p = float(2 * stats.norm.sf(abs(total - expected) / math.sqrt(spread)))
    dispersion = float(((b - mean) ** 2 / var).sum())
    d_var = float((2 + (1 - 6 * q * (1 - q)) / var).sum())  # Var D, exactly; E D = T
    scale, dof = d_var / (2 * steps), 2 * steps**2 / d_var
    below = float(stats.chi2.cdf(dispersion / scale, dof))
    above = float(stats.chi2.sf(dispersion / scale, dof))
    dispersion_p = min(1.0, 2 * min(below, above))
    return Checked(steps, n, total, expected, count_p, dispersion, dispersion_p, spread)
