"""How certain a run's ε is, and what it means for an attacker: a sound interval around the PLD ε,
the smallest μ of Gaussian DP, and a membership-inference attacker's largest true-positive rate.

    from dpsweep.privacy import certainty, ledger
    bill = ledger.Ledger((ledger.dpsgd(noise_multiplier=1.1, sample_rate=0.004, steps=15000),))
    certainty.epsilon_interval(bill, 1e-5)        # Interval(lower=2.29.., upper=2.29547): the true ε is inside
    certainty.mu_gdp(bill)                        # μ: the run is μ-GDP
    certainty.attack_risk(bill)                   # {"tpr_at_1pct": .., "tpr_at_10pct": .., "advantage": ..}

Every figure is a bound on the mechanism the ledger analyses (Poisson-subsampled Gaussian steps and
pure ε-DP releases, add/remove-one neighbours; :mod:`dpsweep.privacy.ledger`):

- the upper end of the interval is the run's ``epsilon_pld`` (:func:`dpsweep.privacy.ledger.epsilon`),
  the lower end a sound lower bound on the same mechanism's ε (:func:`epsilon_interval`);
- μ and the attack risk come from the pessimistic PLD's privacy profile δ(ε) (dp-accounting's
  ``pld``, the same distribution as ``epsilon_pld``), which bounds the mechanism's profile from above
  at every ε (Doroshenko et al., "Connect the Dots", PETS 2022), so both are upper bounds too.

No torch, no MLflow: numpy, scipy and dp-accounting only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from scipy import signal, special

from dpsweep.errors import InputError
from dpsweep.interop.dp_accounting_private import deltas_for_epsilons
from dpsweep.privacy import calibrate
from dpsweep.privacy.ledger import Accounting, Leaf, Ledger, beyond_discretised, coarse, epsilon, leaves, pld_of

# ---------------------------------------------------------------------------------------------
# the interval: a sound lower bound beside the PLD ε
# ---------------------------------------------------------------------------------------------
INTERVAL_RTOL = 2e-3  # the lower end's rounding allowance t, relative to the upper end (it sets the grid)
ETA_FRACTION = 1e-3  # η: the probability given to the rounding error's tail, relative to δ
TAIL_Z = 9.0  # a Gaussian output farther than 9 σ is dropped (dropping mass only lowers δ)
MAX_BINS = 1 << 21  # a step's grid is never finer than this many points (memory and time)
TRUNCATION = 1e-15  # dp-accounting's self-convolution: mass outside its window, which may wrap into it
ROUNDOFF_FLOOR = 1e-12  # the least allowance for the FFT's floating-point round-off in δ
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(8)


class Interval(NamedTuple):
    """The true ε of the analysed mechanism at δ lies in [lower, upper]."""

    lower: float
    upper: float

    @property
    def relative_width(self) -> float:
        """(upper - lower) / upper: what dpsweep prints where it exceeds 1 %."""
        return (self.upper - self.lower) / self.upper if self.upper > 0 else 0.0


def epsilon_interval(ledger: Ledger, delta: float, rtol: float = INTERVAL_RTOL) -> Interval:
    """A sound interval around the ledger's ε at δ.

    ``upper`` is the run's ``epsilon_pld`` itself (:func:`dpsweep.privacy.ledger.epsilon` under ``pld``):
    dp-accounting's pessimistic (connect-the-dots) PLD, an upper bound (Doroshenko et al. 2022).

    ``lower`` is a lower bound on the ε of the same mechanism (both neighbour directions, the max of
    the two), by the argument of Gopi, Lee & Wutschitz 2021 ("Numerical Composition of Differential
    Privacy", NeurIPS 2021: a mean-preserving discretisation, its error bounded by a
    concentration inequality), in this form (see :func:`_lower_one_direction`):

    1. a step's privacy loss L (under the first distribution of the dominating pair, Koskela, Jälkö &
       Honkela 2020, "Computing Tight Differential Privacy Guarantees Using FFT", AISTATS) is
       rounded at random to a neighbouring point of a grid of spacing Δ with E[L̃ | L] = L, so the
       rounding errors e_i = L̃_i - L_i of k steps are independent, mean zero, |e_i| <= Δ, Var <= Δ²/4;
       Bernstein's inequality gives P(Σe_i > t) <= η for t = bΛ/3 + sqrt((bΛ/3)² + 2VΛ), Λ = log(1/η),
       b = Δ, V = kΔ²/4;
    2. δ(ε) = E[(1 - e^{ε - ΣL})_+] is nondecreasing in ΣL and at most 1, so
       δ(ε) >= δ̃(ε + t) - η, with δ̃ the profile of the rounded losses' sum (outputs beyond
       :data:`TAIL_Z` standard deviations are dropped, which only lowers δ̃);
    3. so ε(δ) >= ε̃(δ + η + err) - t, where err bounds dp-accounting's self-convolution's window
       (:data:`TRUNCATION` per convolution) and the FFT's round-off (measured: the largest negative
       entry, the noise floor of masses that are 0, times the number of entries; at least
       :data:`ROUNDOFF_FLOOR`).

    Not bounded rigorously: the Gauss-Legendre quadrature (8 points) of each grid interval's mean loss,
    on intervals where the loss varies by at most Δ, and the FFT's round-off, which is measured, not
    bounded (as in dp-accounting and Gopi et al.'s code). ``rtol`` sets Δ so that t = rtol · upper, or
    coarser where a step's grid would pass :data:`MAX_BINS` points. 0 is the lower end where the PLD is
    not computed (ε = inf beyond :data:`dpsweep.privacy.ledger.DISCRETISED_MAX_EPSILON`)."""
    upper = epsilon(ledger, delta, Accounting("pld")).epsilon
    if upper == 0.0 or not math.isfinite(upper):
        return Interval(0.0, upper)
    parts = [leaf for e in ledger.entries for leaf in leaves(e.event) if leaf.count > 0]
    steps = sum(leaf.count for leaf in parts)
    eta = ETA_FRACTION * delta
    spacing = rtol * upper / math.sqrt(steps * math.log(1 / eta) / 2)
    while True:  # a grid too fine for MAX_BINS is coarsened: a looser lower bound, as sound
        try:
            lower = max(_lower_one_direction(parts, delta, eta, spacing, remove) for remove in (True, False))
        except _TooFine:
            spacing *= 2
            continue
        return Interval(min(max(lower, 0.0), upper), upper)


class _TooFine(ValueError):
    """A step's grid would have more than :data:`MAX_BINS` points."""


def rounding_allowance(steps: int, spacing: float, eta: float) -> float:
    """t with P(Σ e_i > t) <= η for ``steps`` independent mean-zero errors |e_i| <= Δ, Var e_i <= Δ²/4:
    Bernstein's inequality, P(Σe > t) <= exp(-t² / (2(V + bt/3))) (Boucheron, Lugosi & Massart 2013,
    "Concentration Inequalities", Cor. 2.11), solved for t."""
    log_inv = math.log(1 / eta)
    third = spacing * log_inv / 3
    return third + math.sqrt(third**2 + 2 * steps * spacing**2 / 4 * log_inv)


def _lower_one_direction(parts: Sequence[Leaf], delta: float, eta: float, spacing: float, remove: bool) -> float:
    """The lower bound of :func:`epsilon_interval` for one neighbour direction (remove or add)."""
    low, probs, convolutions = 0, np.ones(1), 0
    for leaf in parts:
        first, one = _rounded_step(leaf, spacing, remove)
        if leaf.count > 1:
            from dp_accounting.pld import common

            shift, many = common.self_convolve(one, leaf.count, tail_mass_truncation=TRUNCATION)
            first, one, convolutions = first * leaf.count + shift, np.asarray(many), convolutions + 1
        low, probs = low + first, signal.fftconvolve(probs, one) if len(probs) > 1 else probs[0] * one
    roundoff = max(ROUNDOFF_FLOOR, float(-np.minimum(probs, 0.0).min()) * len(probs))
    err = convolutions * TRUNCATION + roundoff
    t = rounding_allowance(sum(leaf.count for leaf in parts), spacing, eta)
    return rounded_epsilon(low, probs, spacing, delta + eta + err) - t


def _rounded_step(leaf: Leaf, spacing: float, remove: bool) -> tuple[int, np.ndarray]:
    """One step's privacy loss, rounded at random to the grid of ``spacing`` with its mean kept: the
    first grid index and the masses (see :func:`epsilon_interval`)."""
    if leaf.kind == "pure":  # the randomized-response pair: losses ±ε (Kairouz, Oh & Viswanath 2015)
        p_plus = 1 / (1 + math.exp(-leaf.epsilon))
        return _spread(np.array([-leaf.epsilon, leaf.epsilon]), np.array([1 - p_plus, p_plus]), spacing)
    return _rounded_gaussian(leaf.noise_multiplier, leaf.sample_rate, spacing, remove)


def _spread(losses: np.ndarray, masses: np.ndarray, spacing: float) -> tuple[int, np.ndarray]:
    """Point masses at ``losses``, each split between its two grid neighbours with its mean kept."""
    below = np.floor(losses / spacing).astype(np.int64)
    up = losses / spacing - below
    first = int(below.min())
    probs = np.zeros(int(below.max()) - first + 2)
    np.add.at(probs, below - first, masses * (1 - up))
    np.add.at(probs, below - first + 1, masses * up)
    return first, probs


def _rounded_gaussian(sigma: float, q: float, spacing: float, remove: bool) -> tuple[int, np.ndarray]:
    """The Poisson-subsampled Gaussian's step: x ~ P, L(x) = ±log(1 - q + q exp((2x - 1) / (2σ²))), with
    P = (1 - q)N(0, σ²) + qN(1, σ²) for ``remove`` and P = N(0, σ²) otherwise (the dominating pairs of
    Koskela et al. 2020; Zhu, Dong & Wang 2022, "Optimal Accounting of Differential Privacy via
    Characteristic Function", AISTATS), rounded as :func:`_spread` does
    but per interval of the grid: the mass of each interval by the normal CDF, its mean loss by
    Gauss-Legendre quadrature."""
    s2, sign = sigma**2, 1.0 if remove else -1.0

    def loss(x: np.ndarray) -> np.ndarray:
        z = (2 * x - 1) / (2 * s2)
        return sign * (z if q >= 1 else np.logaddexp(math.log1p(-q), math.log(q) + z))

    def x_of(loss_value: np.ndarray) -> np.ndarray:  # the inverse of loss(x)
        rem = sign * loss_value
        return s2 * (np.log(np.expm1(rem) + q) - math.log(q)) + 0.5

    ends = np.array([-TAIL_Z * sigma, (1 if remove else 0) + TAIL_Z * sigma])
    l_ends = np.sort(loss(ends))
    j_lo, j_hi = math.floor(l_ends[0] / spacing), math.ceil(l_ends[1] / spacing)
    if j_hi - j_lo > MAX_BINS:
        raise _TooFine(f"a grid of {j_hi - j_lo} points for σ={sigma}, q={q}: above {MAX_BINS}")
    inner = np.arange(j_lo + 1, j_hi) * spacing
    x_inner = x_of(inner) if remove else x_of(inner)[::-1]
    x = np.concatenate([ends[:1], x_inner, ends[1:]])
    mass, mean = _interval_moments(x, sigma, q, remove, loss)
    if not remove:  # intervals in x run from high loss to low: put them in loss order
        mass, mean = mass[::-1], mean[::-1]
    below = np.arange(j_lo, j_hi) * spacing
    up = np.clip((mean - below) / spacing, 0.0, 1.0)
    probs = np.zeros(j_hi - j_lo + 1)
    probs[:-1] += mass * (1 - up)
    probs[1:] += mass * up
    return j_lo, probs


def _interval_moments(
    x: np.ndarray, sigma: float, q: float, remove: bool, loss: Callable[[np.ndarray], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """P's mass on each interval [x_i, x_{i+1}] and the mean loss on it (8-point Gauss-Legendre)."""

    def between(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # Φ(b) - Φ(a), without cancellation
        return np.where(a > 0, special.ndtr(-a) - special.ndtr(-b), special.ndtr(b) - special.ndtr(a))

    a, b = x[:-1], x[1:]
    mass = between(a / sigma, b / sigma)
    if remove:
        mass = (1 - q) * mass + q * between((a - 1) / sigma, (b - 1) / sigma)
    nodes = (a + b)[:, None] / 2 + (b - a)[:, None] / 2 * _NODES[None, :]
    log_density = -(nodes**2) / (2 * sigma**2)
    if remove:
        log_density = np.logaddexp(
            math.log1p(-q) if q < 1 else -np.inf, math.log(q) + log_density + (2 * nodes - 1) / (2 * sigma**2)
        )
    weight = _WEIGHTS[None, :] * np.exp(log_density - log_density.max(axis=1, keepdims=True))
    mean = (weight * loss(nodes)).sum(axis=1) / weight.sum(axis=1)
    return mass, mean


def rounded_epsilon(first: int, probs: np.ndarray, spacing: float, delta: float) -> float:
    """ε̃(δ) = inf{ε >= 0: Σ_{l > ε} p_l (1 - e^{ε - l}) <= δ} of masses ``probs`` at losses
    (first + i)·spacing: exactly, as dp-accounting's ``_get_epsilon_for_delta`` does, on each interval
    between two losses where the sum is U - e^ε W (Koskela et al. 2020)."""
    losses = (first + np.arange(len(probs))) * spacing
    keep = losses > 0
    losses, probs = losses[keep], probs[keep]
    upper_mass = np.cumsum(probs[::-1])[::-1]  # U_i = Σ_{j >= i} p_j
    lower_mass = np.cumsum((probs * np.exp(-losses))[::-1])[::-1]  # W_i = Σ_{j >= i} p_j e^{-l_j}
    if len(losses) == 0 or upper_mass[0] - lower_mass[0] <= delta:
        return 0.0
    at = np.append(upper_mass[1:] - np.exp(losses[:-1]) * lower_mass[1:], 0.0)  # δ̃(l_i)
    i = int(np.argmax(at <= delta))
    if at[i] > delta:
        return math.inf
    eps = math.log((upper_mass[i] - delta) / lower_mass[i]) if upper_mass[i] > delta else 0.0
    return min(max(eps, losses[i - 1] if i > 0 else 0.0), float(losses[i]))


# ---------------------------------------------------------------------------------------------
# the privacy profile, μ-GDP and attack risk
# ---------------------------------------------------------------------------------------------
# the ε grid the pessimistic profile is read on, from 0 to where it ends: a coarser grid is sound and looser
# (20001 points: μ 0.04 % lower, twice the time at a run's end)
PROFILE_POINTS = 4001
MU_MAX = 1e4  # μ beyond this is reported as inf (the run is no better than no privacy)
FPRS = (0.01, 0.10)  # the false-positive rates the attack risk is reported at
RISK_KEYS = {0.01: "tpr_at_1pct", 0.10: "tpr_at_10pct"}
REFERENCE_DELTA = 1e-5  # where "is the PLD computed at all" is asked (ledger.beyond_discretised)


@dataclass(frozen=True)
class Profile:
    """An upper bound on the mechanism's privacy profile: δ(ε) <= ``deltas[i]`` + ``tail`` at
    ``epsilons[i]`` (and at every ε >= ``epsilons[i]``, δ being nonincreasing), from 0 to the last grid
    point, beyond which δ(ε) <= ``tail``: the pessimistic PLD's mass at infinite loss (dp-accounting's
    truncations, about 1e-15) or the floor below which its figures are round-off, whichever is larger
    (:data:`DELTA_FLOOR`, or the largest rise of the computed profile, which a true one never has)."""

    epsilons: np.ndarray
    deltas: np.ndarray
    tail: float


# dp-accounting's FFT leaves round-off of about 1e-15 in δ (its computed profile rises by that much in
# places, and dips below its own mass at infinity): figures below this are not resolved
DELTA_FLOOR = 1e-12


def profile(
    ledger: Ledger, interval: float | None = None, points: int = PROFILE_POINTS, floor: float = DELTA_FLOOR
) -> Profile | None:
    """The pessimistic PLD's profile (the distribution behind ``epsilon_pld``,
    :func:`dpsweep.privacy.ledger.pld_of`, on ``interval``) on ``points`` values of ε from 0 to where δ(ε)
    falls to ``floor`` (:data:`DELTA_FLOOR`) or to the PLD's mass at infinity. None for an empty ledger; the trivial
    profile δ = 1 where the PLD is not computed (its RDP ε at :data:`REFERENCE_DELTA` beyond
    :data:`dpsweep.privacy.ledger.DISCRETISED_MAX_EPSILON`). A pessimistic PLD bounds δ(ε) from above at
    every ε (Doroshenko et al. 2022; Koskela, Jälkö & Honkela 2020)."""
    if ledger.empty:
        return None
    if beyond_discretised(ledger, REFERENCE_DELTA):  # no PLD (minutes and gigabytes): the trivial bound
        return Profile(np.zeros(1), np.ones(1), 1.0)
    pld: Any = pld_of(ledger) if interval is None else pld_of(ledger, interval)
    floor = max(floor, float(pld.get_delta_for_epsilon(math.inf)))
    end = 1.0
    while float(pld.get_delta_for_epsilon(end)) > floor:
        end *= 2
    epsilons = np.linspace(0.0, end, points)
    deltas = deltas_for_epsilons(pld, epsilons)  # dp-accounting's figures, read in numpy (its loop: 0.5 s)
    rise = float(np.max(deltas - np.minimum.accumulate(deltas)))
    return Profile(epsilons, deltas, max(floor, 10 * rise))


def gaussian_delta(mu: float, eps: np.ndarray) -> np.ndarray:
    """δ(ε) of μ-GDP: Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) (Dong, Roth & Su 2022, "Gaussian Differential
    Privacy", JRSS-B, Cor. 2.13; Balle & Wang 2018, Thm. 8), in logarithms so that it stays accurate
    where both terms are tiny."""
    eps = np.asarray(eps, dtype=float)
    first = special.log_ndtr(-eps / mu + mu / 2)
    second = eps + special.log_ndtr(-eps / mu - mu / 2)
    return np.exp(first) * -np.expm1(np.minimum(second - first, 0.0))


def is_gdp(found: Profile, mu: float) -> bool:
    """Whether the profile's mechanism is μ-GDP, up to 2·``found.tail`` in δ. By Dong, Roth & Su 2022,
    Cor. 2.13, μ-GDP holds iff δ_mech(ε) <= δ_μ(ε) for every ε >= 0 (the add/remove profile is the max of
    both directions, so one curve covers both orders of a neighbouring pair). Between grid points
    ε_i <= ε <= ε_{i+1} both profiles are nonincreasing, so δ_mech(ε) <= deltas[i] + tail and
    δ_μ(ε) >= δ_μ(ε_{i+1}): requiring δ_μ(ε_{i+1}) + tail >= deltas[i] at every i covers every ε up to
    the last point, and beyond it δ_mech <= deltas[-1] + tail <= 2·tail. So the mechanism is
    (ε, δ_μ(ε) + 2·tail)-DP for every ε >= 0, tail being about 1e-12 (:data:`DELTA_FLOOR`).

    The allowance matters for subsampled mechanisms: k Poisson-subsampled steps include the event
    (probability q^k) that the example is in every batch, whose loss is that of √k/σ-GDP, so no μ much
    below √k/σ bounds their profile at every δ down to 0. Their μ is a statement down to δ = 2·tail:
    Opacus's MNIST preset is 0.58-GDP up to 2e-12, 0.94-GDP up to 2e-15."""
    return bool(np.all(gaussian_delta(mu, found.epsilons[1:]) + found.tail >= found.deltas[:-1]))


def mu_gdp(ledger: Ledger, found: Profile | None = None, rtol: float = 1e-6) -> float:
    """The smallest μ (bisection, to ``rtol`` above it) for which :func:`is_gdp` certifies the ledger's
    mechanism from its pessimistic profile: a bound, not a fit (Gomez et al. 2025, arXiv 2503.10945,
    ask for μ beside ε). 0 for an empty ledger; inf beyond :data:`MU_MAX`. The Gaussian mechanism of
    noise σ run k times is μ-GDP with μ = √k/σ exactly (Dong, Roth & Su 2022, Cor. 3.3)."""
    found = found if found is not None else profile(ledger)
    if found is None:
        return 0.0
    if found.tail >= 1:
        return math.inf
    high = 1.0
    while not is_gdp(found, high):
        if high >= MU_MAX:
            return math.inf
        high *= 2
    low = 0.0
    while high - low > rtol * high:
        mid = (low + high) / 2
        low, high = (low, mid) if is_gdp(found, mid) else (mid, high)
    return high


def tpr_bound(found: Profile | None, fpr: float) -> float:
    """The largest true-positive rate of any membership-inference test at false-positive rate α: each
    (ε, δ(ε)) the profile guarantees gives TPR <= min(1, e^ε α + δ(ε), 1 - e^{-ε}(1 - α - δ(ε)))
    (Kairouz, Oh & Viswanath 2015, Thm. 2.1, the hypothesis-testing view of (ε, δ)-DP), and the
    mechanism's trade-off curve is the envelope of these over ε >= 0 (Dong, Roth & Su 2022, Prop. 2.12;
    Kulynych et al. 2024, "Attack-Aware Noise Calibration for Differential Privacy", NeurIPS, Sec. 2):
    the minimum over the grid is a sound bound at every grid point, and tight as the grid gets fine.
    The Gaussian mechanism's is Φ(Φ⁻¹(α) + μ) = 1 - G_μ(α) (Dong, Roth & Su 2022, the definition of G_μ)."""
    if found is None:
        return fpr
    eps, deltas = found.epsilons, found.deltas + found.tail
    bounds = np.minimum(np.exp(eps) * fpr + deltas, 1 - np.exp(-eps) * (1 - fpr - deltas))
    return float(min(1.0, max(fpr, float(bounds.min()))))


def attack_risk(ledger: Ledger, found: Profile | None = None, fpr: Sequence[float] = FPRS) -> dict[str, float]:
    """A membership-inference attacker's largest TPR at each FPR of ``fpr`` (:func:`tpr_bound`; named
    ``tpr_at_1pct`` and ``tpr_at_10pct`` for 1 % and 10 %, else ``tpr_at_<α>``) and its largest
    advantage max_α(TPR - FPR), which is the total variation distance between the two output
    distributions, δ(0) (Kairouz, Oh & Viswanath 2015, Thm. 2.1 at ε = 0: TPR <= FPR + δ(0), and δ(0) is the
    total variation; the advantage of Yeom et al. 2018, CSF)."""
    found = found if found is not None else profile(ledger)
    risk = {RISK_KEYS.get(a, f"tpr_at_{a:g}"): tpr_bound(found, a) for a in fpr}
    risk["advantage"] = 0.0 if found is None else float(min(1.0, found.deltas[0] + found.tail))
    return risk


def delta_allowance(found: Profile | None) -> float:
    """The δ down to which :func:`mu_gdp`'s μ holds, 2·``found.tail`` (:func:`is_gdp`), at most 1; 0 without
    a profile (an empty ledger)."""
    return min(1.0, 2 * found.tail) if found is not None else 0.0


# the figures beside a ledger's ε, by the names a run logs them under (:func:`figures`)
FIGURES = ("epsilon_lower", "mu_gdp", "gdp_delta_allowance", "tpr_at_1pct", "tpr_at_10pct", "mia_advantage")


def figures(ledger: Ledger, delta: float, found: Profile | None = None) -> dict[str, float]:
    """How certain the ledger's ε at δ is and what it means for an attacker, by name (:data:`FIGURES`): the
    interval's sound lower end (:func:`epsilon_interval`; its upper end is the PLD ε), μ of Gaussian DP down
    to its δ allowance (:func:`mu_gdp`, :func:`delta_allowance`), and a membership-inference attacker's
    largest TPR at 1 % and 10 % FPR and largest advantage (:func:`attack_risk`); the profile (``found``, or
    :func:`profile`'s) read once for all of them."""
    found = found if found is not None else profile(ledger)
    risk = attack_risk(ledger, found=found)
    return {
        "epsilon_lower": epsilon_interval(ledger, delta).lower, "mu_gdp": mu_gdp(ledger, found=found),
        "gdp_delta_allowance": delta_allowance(found), "tpr_at_1pct": risk["tpr_at_1pct"],
        "tpr_at_10pct": risk["tpr_at_10pct"], "mia_advantage": risk["advantage"],
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# calibration to a risk target
# ---------------------------------------------------------------------------------------------
RISK_TARGET_KEY = "dp.target_tpr_at_1pct"  # proposed: beside dp.target_epsilon


def noise_for_risk(
    ledger_of: Callable[[float], Ledger],
    target_tpr: float,
    fpr: float = 0.01,
    guess: float = 1.0,
    key: str = RISK_TARGET_KEY,
) -> float:
    """The smallest σ (to :data:`dpsweep.privacy.calibrate.RTOL`) whose ``ledger_of(σ)`` lets no
    membership-inference test reach a TPR above ``target_tpr`` at FPR ``fpr`` (:func:`tpr_bound`), in the
    manner of Kulynych et al. 2024 (calibrating noise to attack risk rather than to ε). The bisection is
    dpsweep's own for ``dp.target_epsilon`` (:func:`dpsweep.privacy.calibrate.smallest_sigma`) on the
    map σ -> TPR bound, which does not grow with σ (more noise, a dominating trade-off curve). As for ε,
    the search runs on the coarser PLD (a pessimistic bound too) and its σ is kept only where the run's
    own PLD confirms it. InputError names ``key`` for a target outside (fpr, 1)."""
    if not fpr < target_tpr < 1:
        raise InputError(key, target_tpr, f"a true-positive rate above the false-positive rate {fpr:g} and below 1")
    search = coarse(Accounting("pld")).pld_discretization

    def tpr_of(interval: float | None) -> Callable[[float], float]:
        return lambda sigma: tpr_bound(profile(ledger_of(sigma), interval), fpr)

    sigma = calibrate.smallest_sigma(tpr_of(search), target_tpr, guess)
    if tpr_of(None)(sigma) <= target_tpr:
        return sigma
    return calibrate.smallest_sigma(tpr_of(None), target_tpr, sigma)
