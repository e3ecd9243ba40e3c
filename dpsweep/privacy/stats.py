"""Private statistics as pure functions with a seeded generator: AboveThreshold, quantiles by the
histogram method, and the exponential-mechanism quantile. Each is ε-DP for add/remove-one neighbours
(the unit of DP-SGD's accounting), and its release goes into the run's ledger (:mod:`dpsweep.privacy.ledger`).

    >>> import numpy as np
    >>> from dpsweep import mechanisms
    >>> rng = np.random.default_rng(0)
    >>> norms = rng.gamma(2.0, 0.5, size=500)
    >>> mechanisms.histogram_quantiles(norms, [0.5], low=0.0, high=5.0, steps=100, epsilon=1.0, rng=rng)
    >>> mechanisms.exponential_quantile(norms, 0.5, low=0.0, high=5.0, epsilon=1.0, rng=rng)

- :func:`above_threshold`: Dwork & Roth 2014, "The Algorithmic Foundations of Differential Privacy",
  Alg. 1 (AboveThreshold) and Thm. 3.23: Laplace(2/ε) noise on the threshold, Laplace(4/ε) on each
  query, the index of the first noisy answer at or above the noisy threshold; ε-DP for queries of
  sensitivity 1. It is (α, β)-accurate with α = 8(log k + log(2/β))/ε (Thm. 3.24), k the queries asked.
- :func:`histogram_quantiles`: the histogram method. [low, high] is split into ``steps`` equal bins;
  for each quantile γ, AboveThreshold with budget ε / (number of quantiles) runs on the queries
  f_i(x) = #{x < low + i(high - low)/steps} - γ·|x|, i = 1..steps, with threshold 0, and index i maps
  back to the bin's edge. This is the textbook form (counts against the threshold γ·n) with n moved
  into the query: under add/remove neighbours n is itself private, and each f_i changes by at most
  max(γ, 1 - γ) <= 1, so each AboveThreshold is ε/m-DP and the whole release ε-DP by composition.
- :func:`exponential_quantile`: Smith 2011, "Privacy-Preserving Statistical Estimation with Optimal
  Convergence Rates", Sec. 3; the exponential mechanism (McSherry & Talwar 2007) over t in [low, high]
  with utility u(t) = -|#{x < t} - γ·|x||, whose sensitivity is at most 1 (as above): density
  proportional to exp(ε·u(t)/2), piecewise constant between the sorted data, so an interval is drawn
  with probability proportional to its length times its weight, then a point uniformly in it. Usually
  more accurate than the histogram method (Gillenwater, Joseph & Kulesza 2021, "Differentially Private
  Quantiles").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def above_threshold(
    answers: Sequence[float] | np.ndarray, threshold: float, epsilon: float, rng: np.random.Generator
) -> int | None:
    """AboveThreshold over queries whose answers on the data are ``answers`` (each of sensitivity 1):
    the index of the first query whose noisy answer reaches the noisy threshold, or None when none does."""
    _check_epsilon(epsilon)
    noisy_threshold = threshold + rng.laplace(scale=2.0 / epsilon)
    for i, answer in enumerate(answers):
        if answer + rng.laplace(scale=4.0 / epsilon) >= noisy_threshold:
            return i
    return None


def above_threshold_alpha(k: int, beta: float, epsilon: float) -> float:
    """α of AboveThreshold's (α, β)-accuracy over k queries: 8(log k + log(2/β))/ε (Dwork & Roth, Thm. 3.24)."""
    return 8 * (math.log(k) + math.log(2 / beta)) / epsilon


def bin_edges(low: float, high: float, steps: int) -> np.ndarray:
    """The histogram method's candidate values: the right edges low + i(high - low)/steps, i = 1..steps."""
    return low + (high - low) * np.arange(1, steps + 1) / steps


def histogram_quantiles(
    values: np.ndarray,
    quantiles: Sequence[float],
    *,
    low: float,
    high: float,
    steps: int,
    epsilon: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """The ``quantiles`` of ``values`` by the histogram method, ε-DP in total (see the module docstring).
    A quantile whose AboveThreshold finds no bin is reported as ``high``."""
    _check_range(low, high)
    _check_epsilon(epsilon)
    x = np.sort(np.asarray(values, dtype=float))
    edges = bin_edges(low, high, steps)
    below = np.searchsorted(x, edges, side="left")  # #{x < edge}
    out = []
    for gamma in quantiles:
        _check_quantile(gamma)
        index = above_threshold(below - gamma * len(x), 0.0, epsilon / len(quantiles), rng)
        out.append(high if index is None else float(edges[index]))
    return np.asarray(out)


def exponential_intervals(
    values: np.ndarray, quantile: float, low: float, high: float, epsilon: float
) -> tuple[np.ndarray, np.ndarray]:
    """The exponential mechanism's intervals of [low, high] (their edges, len m + 1) and the probability
    of each (len m): the exact output distribution of :func:`exponential_quantile`."""
    _check_range(low, high)
    _check_epsilon(epsilon)
    _check_quantile(quantile)
    x = np.sort(np.clip(np.asarray(values, dtype=float), low, high))
    edges = np.concatenate([[low], x, [high]])
    lengths = np.diff(edges)
    rank = np.arange(len(x) + 1)  # #{x < t} for t inside interval i
    log_w = np.log(np.where(lengths > 0, lengths, 1.0)) - epsilon * np.abs(rank - quantile * len(x)) / 2
    log_w = np.where(lengths > 0, log_w, -np.inf)
    p = np.exp(log_w - log_w.max())
    return edges, p / p.sum()


def exponential_quantile(
    values: np.ndarray, quantile: float, *, low: float, high: float, epsilon: float, rng: np.random.Generator
) -> float:
    """The ``quantile`` of ``values`` by the exponential mechanism, ε-DP (see the module docstring)."""
    edges, p = exponential_intervals(values, quantile, low, high, epsilon)
    i = int(rng.choice(len(p), p=p))
    return float(rng.uniform(edges[i], edges[i + 1]))


def _check_epsilon(epsilon: float) -> None:
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")


def _check_range(low: float, high: float) -> None:
    if not low < high:
        raise ValueError(f"need low < high, got low={low}, high={high}")


def _check_quantile(q: float) -> None:
    if not 0 < q < 1:
        raise ValueError(f"a quantile must be in (0, 1), got {q}")
