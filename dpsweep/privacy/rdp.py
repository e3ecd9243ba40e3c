"""Rényi DP (Mironov 2017, "Rényi Differential Privacy") of the mechanisms a run's ledger holds, the
RDP orders they are evaluated at, and the conversions of an RDP curve to (ε, δ). Pure numpy/scipy:
no torch, no Opacus.

    >>> from dpsweep import rdp
    >>> curve = 100 * rdp.subsampled_gaussian(sample_rate=0.01, noise_multiplier=1.0, orders=rdp.DEFAULT_ORDERS)
    >>> rdp.CONVERSIONS.get("improved")(rdp.DEFAULT_ORDERS, curve, 1e-5)[0]  # (ε, optimal order)

Mechanisms:

- :func:`subsampled_gaussian`: the Poisson-subsampled Gaussian mechanism (DP-SGD's step), exactly:
  Mironov, Talwar & Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian Mechanism",
  Sec. 3.3 (integer orders: the binomial expansion; fractional orders: the two-sided series with the
  signs of the generalised binomial coefficients). These are the values of Opacus's
  ``opacus.accountants.analysis.rdp.compute_rdp`` and TF Privacy's original code (tested to 1e-9).
  dp-accounting 0.6's ``_compute_log_a_frac`` adds every term of the fractional series as positive,
  which bounds it from above (up to 21% more RDP at α = 1.1, σ = 0.5, q = 0.01), so dpsweep does not
  use it for these events: its ε would be higher than the published figures Opacus reproduces.
- :func:`pure_dp`: any ε-DP mechanism. Its output distributions on neighbouring datasets are a
  post-processing of the randomized-response pair P = (p, 1 - p), Q = (1 - p, p) with
  p = e^ε / (1 + e^ε) (Kairouz, Oh & Viswanath 2015, "The Composition Theorem for Differential
  Privacy", Thm. 2.1), and Rényi divergence only shrinks under post-processing, so
  D_α(P || Q) = log((e^{αε} + e^{(1-α)ε}) / (1 + e^ε)) / (α - 1) is the tightest RDP bound that holds
  for every ε-DP mechanism (it is below both ε and αε²/2 of Bun & Steinke 2016, Prop. 1.4).

Orders: :data:`DEFAULT_ORDERS` reach 1024, with a dense fractional grid below 11, and contain every
order of :data:`OPACUS_ORDERS` (Opacus's and TF Privacy's grid, which stops at 63). The ε of a
curve is a minimum over the orders, so on the larger grid ε can only go down, and only where the
best order lies outside Opacus's grid (small ε: many steps at large σ).

Conversions (RDP curve -> (ε, δ)):

- ``improved`` (default, what Opacus reports): Balle et al. 2020, "Hypothesis Testing Interpretations
  and Renyi Differential Privacy", Prop. 12, as Opacus's ``get_privacy_spent`` computes it;
- ``classic``: Mironov 2017, Prop. 3: ε = min_α rdp(α) + log(1/δ) / (α - 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import special

from dpsweep.registry import Registry

# Opacus's RDPAccountant.DEFAULT_ALPHAS (and TF Privacy's), stated here so that nothing imports
# torch to account; a test checks they are Opacus's.
OPACUS_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])

# Opacus's grid, plus: fractional orders 1.02 to 1.09 and every 0.05 up to 11, the integers 11 to 64,
# and a geometric grid of integers from 64 to 1024 (8 per doubling).
_EXTRA = (
    [1 + x / 100 for x in range(2, 10)]
    + [1 + x / 20 for x in range(2, 201)]
    + [float(a) for a in range(11, 65)]
    + [float(round(64 * 2 ** (k / 8))) for k in range(1, 33)]
)
DEFAULT_ORDERS: tuple[float, ...] = tuple(sorted({round(a, 10) for a in [*OPACUS_ORDERS, *_EXTRA]}))

ORDER_GRIDS: Registry[tuple[float, ...]] = Registry("RDP order grid")
ORDER_GRIDS.register("default")(DEFAULT_ORDERS)
ORDER_GRIDS.register("opacus")(OPACUS_ORDERS)

# The fractional series stops when both its terms fall below exp(-30) (as Opacus's does).
_SERIES_CUTOFF = -30.0
_SERIES_MAX_TERMS = 100_000


def subsampled_gaussian(sample_rate: float, noise_multiplier: float, orders: Sequence[float]) -> np.ndarray:
    """RDP of one step of the Poisson-subsampled Gaussian mechanism (sensitivity 1, noise std σ, each
    example included with probability q), at each order; add/remove-one neighbours. Mironov, Talwar
    & Zhang 2019, Sec. 3.3 (see the module docstring)."""
    q, sigma = float(sample_rate), float(noise_multiplier)
    if not 0 <= q <= 1:
        raise ValueError(f"sample_rate must be in [0, 1], got {q}")
    if sigma < 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {sigma}")
    a = np.asarray(orders, dtype=float)
    if q == 0:
        return np.zeros(len(a))
    if sigma == 0:
        return np.full(len(a), math.inf)
    if q == 1:
        return a / (2 * sigma**2)  # the Gaussian mechanism's RDP (Mironov 2017, Prop. 7)
    out = np.full(len(a), math.inf)  # α = inf
    integer = np.isfinite(a) & (a == np.floor(a))
    fractional = np.isfinite(a) & ~integer
    out[integer] = _log_a_int(q, sigma, a[integer]) / (a[integer] - 1)
    out[fractional] = _log_a_frac(q, sigma, a[fractional]) / (a[fractional] - 1)
    return out


def _log_a_int(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A_α for each integer α: log Σ_{i<=α} C(α, i) (1-q)^(α-i) q^i exp((i² - i) / (2σ²))."""
    if len(alphas) == 0:
        return np.empty(0)
    alpha = np.asarray(alphas, dtype=float)[:, None]
    i = np.arange(int(alpha.max()) + 1, dtype=float)[None, :]
    with np.errstate(invalid="ignore"):  # i > α: left out below
        log_terms = (
            special.gammaln(alpha + 1) - special.gammaln(i + 1) - special.gammaln(alpha - i + 1)
            + i * math.log(q) + (alpha - i) * math.log1p(-q) + (i * i - i) / (2 * sigma**2)
        )  # fmt: skip
    return np.asarray(special.logsumexp(np.where(i <= alpha, log_terms, -math.inf), axis=1))


_SERIES_CHUNK = 64  # terms computed at once, for every fractional order still summing


def _log_a_frac(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A_α for each fractional α: the integrals over (-inf, z0] and [z0, inf) as two series whose
    terms carry the sign of the generalised binomial coefficient C(α, i). Each order's series stops
    at the first term i where both terms fall below exp(-30) (that term included). The terms of every
    order still summing are computed together, a chunk of i at a time, and added to two running signed
    sums per order (kept as log-magnitude and sign)."""
    alpha = np.asarray(alphas, dtype=float)
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_q, log_1mq = math.log(q), math.log1p(-q)
    log_sum = np.full((2, len(alpha)), -math.inf)  # each series' running sum: log |S| ...
    sign = np.ones((2, len(alpha)))  # ... and the sign of S
    summing = np.ones(len(alpha), dtype=bool)
    for start in range(0, _SERIES_MAX_TERMS, _SERIES_CHUNK):
        rows = np.flatnonzero(summing)
        if rows.size == 0:
            break
        i = np.arange(start, start + _SERIES_CHUNK, dtype=float)[None, :]
        a = alpha[rows, None]
        j = a - i
        coef = special.binom(a, i)
        with np.errstate(divide="ignore"):  # C(α, i) underflows to 0 far past the cut-off
            log_coef = np.log(np.abs(coef))
        log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s = np.stack([
            log_coef + i * log_q + j * log_1mq + (i * i - i) / (2 * sigma**2) + log_e0,
            log_coef + j * log_q + i * log_1mq + (j * j - j) / (2 * sigma**2) + log_e1,
        ])  # fmt: skip
        below = np.maximum(log_s[0], log_s[1]) < _SERIES_CUTOFF
        ends = below.any(axis=1)
        last = np.where(ends, below.argmax(axis=1), _SERIES_CHUNK - 1)  # each row's last term in this chunk
        kept = np.arange(_SERIES_CHUNK)[None, :] <= last[:, None]
        # the chunk's terms and the running sum, added as signed values in log space
        terms = np.concatenate([np.where(kept, log_s, -math.inf), log_sum[:, rows, None]], axis=2)
        signs = np.concatenate([np.broadcast_to(np.sign(coef) * kept, log_s.shape), sign[:, rows, None]], axis=2)
        with np.errstate(divide="ignore"):  # a sum of exactly 0
            log_sum[:, rows], sign[:, rows] = special.logsumexp(terms, axis=2, b=signs, return_sign=True)
        summing[rows[ends]] = False
    if summing.any():
        raise ArithmeticError(f"RDP series did not converge: q={q}, σ={sigma}, α={alpha[summing]}")
    total = np.where(sign > 0, log_sum, -math.inf)
    return np.asarray(np.logaddexp(total[0], total[1]))


def _log_erfc(x: np.ndarray) -> np.ndarray:
    return math.log(2) + special.log_ndtr(-x * math.sqrt(2))


def pure_dp(epsilon: float, orders: Sequence[float]) -> np.ndarray:
    """The tightest RDP of any ε-DP mechanism: that of the randomized-response pair (see the
    module docstring), at each order."""
    a: np.ndarray = np.asarray(orders, dtype=float)
    if epsilon == 0:
        return np.zeros(len(a))
    log_num = np.logaddexp(a * epsilon, (1 - a) * epsilon)
    return np.asarray((log_num - np.logaddexp(0.0, epsilon)) / (a - 1))


# ---------------------------------------------------------------------------------------------
# RDP -> (ε, δ)
# ---------------------------------------------------------------------------------------------
Conversion = Callable[[Sequence[float], np.ndarray, float], tuple[float, float]]
CONVERSIONS: Registry[Conversion] = Registry("RDP conversion")


@CONVERSIONS.register("improved")
def _improved(orders: Sequence[float], curve: np.ndarray, delta: float) -> tuple[float, float]:
    # ε = rdp(α) + log((α-1)/α) - (log δ + log α)/(α-1), minimised over α: Opacus's get_privacy_spent.
    # Not dp-accounting's compute_epsilon, which also reports ε = 0 wherever rdp(α) < about δ² (a KL
    # bound): sound for exact RDP, but a value that rounding in a series puts below 0 would trip it.
    a = np.asarray(orders, dtype=float)
    eps = curve - (math.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    if np.isnan(eps).all():
        return math.inf, math.nan
    i = int(np.nanargmin(eps))
    return float(eps[i]), float(a[i])


@CONVERSIONS.register("classic")
def _classic(orders: Sequence[float], curve: np.ndarray, delta: float) -> tuple[float, float]:
    a = np.asarray(orders, dtype=float)
    eps = curve + math.log(1 / delta) / (a - 1)
    if np.isnan(eps).all():
        return math.inf, math.nan
    i = int(np.nanargmin(eps))
    return float(eps[i]), float(a[i])
