"""The privacy cost of tuning (``sweep.private_tuning``): a random number K of trials, each a config
drawn uniformly from the grid, and only the best run released. Papernot & Steinke 2022,
"Hyperparameter Tuning with Renyi Differential Privacy" (ICLR), Thms. 2 and 6.

    dpsweep -m sweep.private_tuning=true sweep.tuning_mean_trials=8 optimizer.lr=0.02,0.05,0.1 dp.max_grad_norm=0.5,1

- K ~ ``sweep.tuning_distribution``: ``poisson`` (mean μ; K = 0 releases nothing), ``geometric`` or
  ``tnb`` (truncated negative binomial with shape η > 0, on K >= 1, mean μ), from secret, fresh
  randomness (the operating system's): a K known in advance is a fixed K, whose cost is that of
  composing K runs, and so is a published K. Each trial draws its config and its ``train.seed``
  from the same source, so trials are independent runs.
- The cost is that of the candidate whose ledger dominates the others' at every RDP order (the
  mixture over candidates costs at most the pointwise maximum, by the quasi-convexity of Rényi
  divergence); a grid whose candidates' costs cross has no such bound here and is refused.
- ε of the whole procedure: dp-accounting's ``RepeatAndSelectDpEvent`` (:func:`dpsweep.privacy.ledger.tuning_epsilon`),
  which only its RDP accountant analyses (:data:`ACCOUNTANT`): the procedure's ε is an RDP figure, and a
  single run's ε to compare it with is the single run's RDP ε at the same orders (:func:`procedure`),
  not its PLD one (usually lower: beside the procedure's RDP ε it would overstate what tuning costs).

Two analyses of the same procedure (``analysis`` of :func:`procedure`, :data:`ANALYSES`; proposed key
``sweep.tuning_analysis``), both sound:

- ``papernot_steinke`` (the default): Papernot & Steinke's Thms. 2 and 6 on the dominant candidate's
  RDP, as above;
- ``mixture``: the same theorems on the exact RDP of one trial as it runs, a config drawn uniformly
  from the grid and released with its model (:func:`mixture_rdp`; cf. Koskela & Kulkarni 2023,
  "Practical Differentially Private Hyperparameter Tuning with Subsampling", NeurIPS, on candidates
  whose privacy costs differ). Never above ``papernot_steinke`` but for dpsweep's exact RDP curve,
  lower where the candidates' costs differ, and it prices grids whose costs cross. It is not the
  default while the plan, the sweeper and the report do not yet say which analysis priced a procedure.

Only the best trial (by the task's objective) may be published; the other trials and K stay in the
researcher's own tracking store: Papernot & Steinke's bound holds for a K that nobody outside learns
(a published K is a fixed K, whose cost is that of composing K runs), so no released output shows the
number of trials, the other trials, or a trial's ``train.seed``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpsweep.errors import InputError
from dpsweep.privacy import ledger, rdp
from dpsweep.privacy.ledger import Ledger

SEED_BITS = 31  # a trial's train.seed: secret, fresh
# The accountant of a tuning procedure's ε: dp-accounting analyses RepeatAndSelectDpEvent with its
# RdpAccountant only (Papernot & Steinke 2022, Thms. 2 and 6 are RDP bounds)
ACCOUNTANT = "rdp"


def shape(distribution: str, eta: float) -> float:
    """dp-accounting's shape of K's distribution: ∞ (Poisson), 1 (geometric), η (tnb)."""
    return eta if distribution == "tnb" else ledger.TUNING_SHAPES.get(distribution, key="sweep.tuning_distribution")


def draw_k(distribution: str, mean: float, eta: float, rng: np.random.Generator) -> int:
    """K, the number of trials: Poisson(μ), or the truncated negative binomial NB(η, γ) conditioned on
    K >= 1 with γ chosen so its mean is μ (geometric: η = 1, γ = 1/μ)."""
    from scipy import optimize, stats

    if distribution == "poisson":
        return int(rng.poisson(mean))
    s = shape(distribution, eta)
    if s == 1:
        gamma = 1 / mean
    else:  # mean of NB(η, γ) given K >= 1: η(1 - γ) / (γ(1 - γ^η))

        def gap(g: float) -> float:
            return s * (1 - g) / (g * (1 - g**s)) - mean

        gamma = float(optimize.brentq(gap, 1e-12, 1 - 1e-12))
    while True:
        k = int(stats.nbinom(s, gamma).rvs(random_state=rng))
        if k >= 1:
            return k


def secret_generator() -> np.random.Generator:
    """A generator seeded from the operating system's entropy (see the module docstring)."""
    return np.random.default_rng(secrets.randbits(128))


def secret_seed() -> int:
    """A trial's ``train.seed``, fresh from the operating system's entropy: not an output of the
    generator that drew K, whose state a published seed would help recover."""
    return secrets.randbits(SEED_BITS)


def dominant(ledgers: Sequence[Ledger], orders: tuple[float, ...] = rdp.DEFAULT_ORDERS) -> int:
    """The index of a ledger whose RDP is at least every other's at every order; InputError if none is."""
    curves = np.array([ledger.rdp_curve(b, orders) for b in ledgers])
    top = curves.max(axis=0)
    for i, curve in enumerate(curves):
        if np.all(curve >= top - 1e-12 * np.maximum(1.0, np.abs(top))):
            return i
    raise InputError(
        "sweep.private_tuning", True,
        "a grid with one candidate whose privacy cost dominates the others' at every RDP order (e.g. sweep σ, "
        "C, lr or the seed, not both B and the epochs): these candidates' costs cross, and the tuning bound "
        "needs the largest",
    )  # fmt: skip


def check(distribution: str, mean: float, eta: float) -> None:
    """Bad tuning parameters, named (InputError)."""
    shape(distribution, eta)
    if not mean > 1 or not math.isfinite(mean):
        raise InputError("sweep.tuning_mean_trials", mean, "a finite mean number of trials above 1")
    if distribution == "tnb" and not (eta > 0 and math.isfinite(eta)):
        raise InputError("sweep.tuning_eta", eta, "a shape η > 0 of the truncated negative binomial (1: geometric)")


# The analyses of a tuning procedure's ε (see the module docstring), and what each cites
ANALYSES = {
    "papernot_steinke": "Papernot & Steinke 2022, Hyperparameter Tuning with Renyi Differential Privacy, Thms. 2 "
    "and 6 (dp-accounting's RepeatAndSelectDpEvent), on the dominant candidate's RDP",
    "mixture": "Papernot & Steinke 2022, Thms. 2 and 6 (dp-accounting's repeat-and-select RDP), on the exact RDP "
    "of one trial drawn uniformly from the candidates (cf. Koskela & Kulkarni 2023, NeurIPS)",
}
DEFAULT_ANALYSIS = "papernot_steinke"


@dataclass(frozen=True)
class Procedure:
    """The cost of a private tuning over a grid of candidate runs: both ε under ``accountant`` (RDP), and
    the analysis that gave the procedure's (:data:`ANALYSES`, its key and what it cites)."""

    epsilon: float  # of the whole procedure, releasing the best trial only
    delta: float
    single_run_epsilon: float  # of the dominant candidate alone, under the same accountant at the same orders
    dominant: int  # the candidate whose cost bounds every other's (mixture: the costliest alone)
    accountant: str = ACCOUNTANT
    analysis: str = DEFAULT_ANALYSIS

    @property
    def reference(self) -> str:
        """The papers behind :attr:`epsilon`, for the plan, the parent run and the report."""
        return ANALYSES[self.analysis]


def procedure(
    bills: Sequence[Ledger],
    delta: float,
    how: ledger.Accounting,
    distribution: str,
    mean_trials: float,
    eta: float,
    analysis: str = DEFAULT_ANALYSIS,
) -> Procedure:
    """The tuning ε of K ~ ``distribution`` (mean ``mean_trials``, shape ``eta``) trials drawn from these
    candidates' planned ledgers (the dominant one repeated, the best released; see the module
    docstring), and the dominant candidate's own ε to compare it with. Both are RDP's
    (:data:`ACCOUNTANT`), over ``how``'s orders, whatever ``how``'s accountant: the procedure's through
    dp-accounting's ``RepeatAndSelectDpEvent`` (Papernot & Steinke 2022, Thms. 2 and 6), the single
    run's by dpsweep's RDP accountant (the run's ``epsilon_rdp``), both converted to (ε, δ) by the improved conversion
    (Balle et al. 2020, Prop. 12; dp-accounting's is the same bound: Canonne, Kamath & Steinke 2020,
    Prop. 12). A single run's PLD ε is usually lower than its RDP ε, and no tuning bound starts from it: set
    beside the procedure's RDP ε it would overstate what tuning costs. InputError for what the bound
    does not cover, and for an ``analysis`` not in :data:`ANALYSES` (``mixture``: :func:`mixture_procedure`)."""
    check(distribution, mean_trials, eta)
    if analysis not in ANALYSES:
        raise InputError("sweep.tuning_analysis", analysis, f"one of {', '.join(ANALYSES)}")
    if analysis == "mixture":
        return mixture_procedure(bills, delta, how.orders, shape(distribution, eta), mean_trials)
    top = dominant(list(bills))
    eps = ledger.tuning_epsilon(bills[top], delta, mean_trials, shape(distribution, eta), how.orders)
    alone = ledger.epsilon(bills[top], delta, ledger.Accounting(ACCOUNTANT, orders=how.orders))
    return Procedure(eps.epsilon, delta, alone.epsilon, top)


def mixture_rdp(curves: np.ndarray, orders: Sequence[float], weights: np.ndarray | None = None) -> np.ndarray:
    """The RDP at ``orders`` of one trial as the sweep runs it: candidate i drawn with probability w_i
    (uniform by default: ``launchers.sweeper.private_trials`` draws each trial's config uniformly from
    the grid, with fresh secret randomness), then run, and released with its config. On neighbouring
    datasets the output (i, model) has the distributions P = Σ w_i δ_i ⊗ P_i and Q = Σ w_i δ_i ⊗ Q_i, whose
    parts for different i have disjoint supports, so ∫ p^α q^{1-α} = Σ w_i ∫ p_i^α q_i^{1-α} exactly:

        ε(α) = log(Σ_i w_i exp((α - 1) ε_i(α))) / (α - 1),   and Σ_i w_i ε_i(1) at α = 1 (KL),

    a log-mean-exp of the candidates' RDP curves ``curves[i]`` (Mironov 2017, Def. 3), below their
    maximum wherever they differ (cf. Koskela & Kulkarni 2023, on random hyperparameters that change
    the privacy cost)."""
    curves = np.asarray(curves, dtype=float)
    w = np.full(len(curves), 1 / len(curves)) if weights is None else np.asarray(weights, dtype=float)
    a = np.asarray(orders, dtype=float)
    from scipy import special

    above = a > 1
    out = np.asarray(w @ curves, dtype=float)  # α = 1: the weighted mean of the KL divergences
    scaled = (a[above] - 1)[None, :] * curves[:, above]
    out[above] = special.logsumexp(scaled, axis=0, b=w[:, None]) / (a[above] - 1)
    return out


def repeat_and_select(
    curve: np.ndarray, orders: Sequence[float], delta: float, mean_trials: float, k_shape: float
) -> tuple[float, float]:
    """(ε, optimal order) at δ of repeating a mechanism with RDP ``curve`` K times (K of mean
    ``mean_trials`` and shape ``k_shape``, :func:`shape`) and releasing the best run: Papernot & Steinke
    2022, Thms. 2 and 6, as dp-accounting's RDP accountant computes them for a ``RepeatAndSelectDpEvent``
    (the same function, here given the curve directly: :mod:`dpsweep.interop.dp_accounting_private`),
    converted by dp-accounting's ``compute_epsilon``."""
    from dp_accounting.rdp import rdp_privacy_accountant as dp_rdp

    from dpsweep.interop import dp_accounting_private

    total = dp_accounting_private.repeat_and_select_rdp(list(orders), list(curve), float(mean_trials), float(k_shape))
    eps, order = dp_rdp.compute_epsilon(list(orders), total, delta)
    return ledger.sound_epsilon(float(eps)), float(order)


def mixture_procedure(
    bills: Sequence[Ledger], delta: float, orders: tuple[float, ...], k_shape: float, mean_trials: float
) -> Procedure:
    """The tuning ε under the ``mixture`` analysis: :func:`repeat_and_select` on :func:`mixture_rdp` of the
    candidates' RDP curves (dpsweep's exact curves, :func:`dpsweep.privacy.ledger.rdp_curve`). Candidates
    whose costs cross are priced, not refused. The single run to compare with is the costliest
    candidate alone (its RDP ε at the same orders)."""
    curves = np.array([ledger.rdp_curve(b, orders) for b in bills])
    eps, _ = repeat_and_select(mixture_rdp(curves, orders), orders, delta, mean_trials, k_shape)
    alone = [ledger.epsilon(b, delta, ledger.Accounting(ACCOUNTANT, orders=orders)).epsilon for b in bills]
    top = int(np.argmax(alone))
    return Procedure(eps, delta, alone[top], top, ACCOUNTANT, "mixture")
