"""Privacy accounting as pure functions over Opacus's accountants (no model, no data).

    >>> from dpsweep.privacy import epsilon, poisson_schedule
    >>> epsilon(poisson_schedule(60000, 150), noise_multiplier=1.3, delta=1e-5, epochs=15).epsilon
    0.7242234026109339

``epsilon``, ``calibrate_noise``, ``calibrate_epochs`` and ``epsilon_curve`` take the sampling
schedule (:func:`poisson_schedule`) first (``epsilon_grid`` takes N and its :class:`GridAxes`), then
Opacus's and dp-accounting's quantities (``noise_multiplier``, ``delta``, ``epochs`` or ``steps``);
how ε is computed (accountant, conversion, RDP orders) travels as one :class:`Accounting`.

Step-count convention (shared by the trainer and every ε dpsweep prints). It is the one Opacus's
Poisson loader defines, ``DPDataLoader.from_data_loader`` and ``PrivacyEngine.make_private``:

- an ordinary ``DataLoader(batch_size=B, drop_last=False)`` has ``k = ceil(N / B)`` batches;
- the Poisson loader includes each example in a step independently with probability ``1 / k``
  and yields ``steps_per_epoch = int(1 / (1 / k))`` steps per epoch (one fewer than ``k`` when
  floating point rounds ``1 / (1 / k)`` below ``k``, e.g. ``k = 93``);
- the accountant records every optimizer step with ``sample_rate = 1 / steps_per_epoch``, which
  is never below the true inclusion probability, so ε is never under-stated;
- ``steps = epochs * steps_per_epoch``.

Accountants: ``rdp`` (Mironov 2017, "Rényi Differential Privacy", with the subsampled-Gaussian
bound of Mironov, Talwar & Zhang 2019) and ``prv`` (Gopi, Lee & Wutschitz 2021, "Numerical
Composition of Differential Privacy"). RDP -> (ε, δ) conversions:

- ``improved`` (default, what Opacus reports): Balle et al. 2020, "Hypothesis Testing
  Interpretations and Renyi Differential Privacy", Prop. 12:
  ε = min_α rdp(α) + log((α-1)/α) - (log δ + log α) / (α - 1);
- ``classic``: Mironov 2017, Prop. 3: ε = min_α rdp(α) + log(1/δ) / (α - 1).
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from dpsweep.registry import Registry

# Opacus's RDPAccountant.DEFAULT_ALPHAS, stated here so that importing this module (and --help of the
# commands) does not import opacus and torch; a test checks they are the same. Opacus is imported by
# the functions that compute.
DEFAULT_ALPHAS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))

# Opacus's accountant history: (noise_multiplier, sample_rate, steps) per constant segment.
History = Sequence[tuple[float, float, int]]


@dataclass(frozen=True)
class PoissonSchedule:
    """Sampling and step counts for a training set of N examples and logical batch size B."""

    n: int
    batch_size: int
    inclusion_probability: float  # 1 / ceil(N/B): the probability the sampler uses
    steps_per_epoch: int  # len(DPDataLoader)
    sample_rate: float  # q the accountant records per step: 1 / steps_per_epoch

    def steps(self, epochs: int) -> int:
        return epochs * self.steps_per_epoch


def poisson_schedule(n: int, batch_size: int) -> PoissonSchedule:
    """The Opacus Poisson-loader convention (see the module docstring)."""
    if n <= 0 or batch_size <= 0:
        raise ValueError(f"need N > 0 and B > 0, got N={n}, B={batch_size}")
    k = math.ceil(n / batch_size)
    inclusion = 1 / k
    steps_per_epoch = int(1 / inclusion)  # UniformWithReplacementSampler.__len__
    return PoissonSchedule(n, batch_size, inclusion, steps_per_epoch, 1 / steps_per_epoch)


def max_poisson_batch(n: int, batch_size: int | np.ndarray, epochs: int, tail: float = 1e-6) -> np.ndarray:
    """Batch sizes that no Poisson batch of a run exceeds, except with probability <= ``tail``.

    For each logical batch size B (an int or an array), with the trainer's sample rate q and
    T = epochs x steps per epoch (:func:`poisson_schedule`'s convention): each batch is
    Binomial(N, q), so by the union bound P[some batch > b] <= T * P[Binomial(N, q) > b], and b is
    the Binomial's upper (tail / T) quantile. Memory must be planned for b, not for B: N=60,000,
    B=256 and 10 epochs (2,350 steps) give b=359. Opacus's BatchMemoryManager caps passes instead."""
    from scipy.stats import binom  # only planners need it

    b = np.asarray(batch_size, dtype=np.int64)
    k = np.ceil(n / b)
    steps_per_epoch = np.floor(1 / (1 / k))  # int(1/(1/k)) as in poisson_schedule
    steps = np.maximum(steps_per_epoch * epochs, 1)
    return np.minimum(binom.isf(tail / steps, n, 1 / steps_per_epoch).astype(np.int64), n)


# ---------------------------------------------------------------------------------------------
# RDP -> (ε, δ) conversions and accountants
# ---------------------------------------------------------------------------------------------
Conversion = Callable[[np.ndarray, np.ndarray, float], tuple[float, float]]
CONVERSIONS: Registry[Conversion] = Registry("RDP conversion")


@CONVERSIONS.register("improved")
def _improved(orders: np.ndarray, rdp: np.ndarray, delta: float) -> tuple[float, float]:
    from opacus.accountants.analysis import rdp as rdp_analysis

    eps, alpha = rdp_analysis.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    return float(eps), float(alpha)


@CONVERSIONS.register("classic")
def _classic(orders: np.ndarray, rdp: np.ndarray, delta: float) -> tuple[float, float]:
    eps = rdp + math.log(1 / delta) / (orders - 1)
    if np.isnan(eps).all():
        return math.inf, math.nan
    i = int(np.nanargmin(eps))
    return float(eps[i]), float(orders[i])


def rdp_curve(history: History, orders: Sequence[float] | np.ndarray = DEFAULT_ALPHAS) -> np.ndarray:
    """Total RDP at each order, summed over the history's segments."""
    from opacus.accountants.analysis import rdp as rdp_analysis

    total = np.zeros(len(orders))
    for sigma, q, steps in history:
        total += np.asarray(rdp_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders))
    return total


Accountant = Callable[[History, float, str, Sequence[float]], tuple[float, float | None]]
ACCOUNTANTS: Registry[Accountant] = Registry("accountant")


@ACCOUNTANTS.register("rdp")
def _rdp(history: History, delta: float, conversion: str, orders: Sequence[float]) -> tuple[float, float | None]:
    return CONVERSIONS.get(conversion)(np.asarray(orders, dtype=float), rdp_curve(history, orders), delta)


@ACCOUNTANTS.register("prv")
def _prv(history: History, delta: float, conversion: str, orders: Sequence[float]) -> tuple[float, float | None]:
    from opacus.accountants import PRVAccountant

    accountant = PRVAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta=delta)), None


def epsilon_from_history(
    history: History,
    delta: float,
    accountant: str = "rdp",
    conversion: str = "improved",
    alphas: Sequence[float] = DEFAULT_ALPHAS,
) -> tuple[float, float | None]:
    """(ε, optimal α) for an Opacus accountant history; α is None for PRV; ε is 0 for no steps.

    The ε returned is never negative and never NaN: (ε, δ)-DP implies (ε', δ)-DP for every ε' >= ε
    (Dwork & Roth 2014, Def. 2.4), so a negative bound (the improved conversion gives one for large δ,
    e.g. δ = 0.5) is reported as 0; a bound that could not be computed (NaN) is reported as +inf, which
    no budget admits."""
    if not history or sum(s for _, _, s in history) == 0:
        return 0.0, None
    eps, alpha = ACCOUNTANTS.get(accountant)(history, delta, conversion, alphas)
    return sound_epsilon(eps), alpha


def sound_epsilon(eps: float) -> float:
    """A computed ε as a guarantee: negative -> 0, NaN -> +inf (see :func:`epsilon_from_history`)."""
    return math.inf if math.isnan(eps) else max(0.0, eps)


@dataclass(frozen=True)
class Accounting:
    """How ε is computed: an accountant of :data:`ACCOUNTANTS` and, for ``rdp``, a conversion of
    :data:`CONVERSIONS` over the RDP orders ``alphas`` (``prv`` uses neither). The names are checked
    against those registries where they are looked up; an unknown one lists the valid ones. The default
    is what Opacus reports: RDP, improved conversion, Opacus's orders."""

    accountant: str = "rdp"
    conversion: str = "improved"
    alphas: tuple[float, ...] = DEFAULT_ALPHAS


# Calibration stops once the bracket's ε is within this of the target (Opacus's default).
CALIBRATION_TOLERANCE = 0.01


@dataclass(frozen=True)
class EpsilonResult:
    epsilon: float
    delta: float
    alpha: float | None  # optimal RDP order; None for PRV
    steps: int
    sample_rate: float
    noise_multiplier: float
    accountant: str
    conversion: str | None  # None for PRV


def epsilon(
    schedule: PoissonSchedule,
    noise_multiplier: float,
    delta: float,
    *,
    epochs: int | None = None,
    steps: int | None = None,
    accounting: Accounting = Accounting(),
) -> EpsilonResult:
    """ε after ``epochs`` (or ``steps``) of DP-SGD with this Poisson ``schedule`` (N examples, batch B)."""
    total = _steps(schedule, epochs, steps)
    a = accounting
    eps, alpha = epsilon_from_history(
        [(noise_multiplier, schedule.sample_rate, total)], delta, a.accountant, a.conversion, a.alphas
    )
    return EpsilonResult(
        eps, delta, alpha, total, schedule.sample_rate, noise_multiplier, a.accountant,
        a.conversion if a.accountant == "rdp" else None,
    )  # fmt: skip


def _steps(schedule: PoissonSchedule, epochs: int | None, steps: int | None) -> int:
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs and steps")
    return schedule.steps(epochs) if epochs is not None else int(steps)  # type: ignore[arg-type]


def calibrate_noise(
    schedule: PoissonSchedule,
    target_epsilon: float,
    delta: float,
    *,
    epochs: int | None = None,
    steps: int | None = None,
    accountant: str = "rdp",
) -> float:
    """Smallest σ found (to :data:`CALIBRATION_TOLERANCE`) whose ε does not exceed ``target_epsilon``.

    Opacus's bisection (``get_noise_multiplier``) keeps the upper end of the bracket, whose ε is
    always <= target, so the result never lands over the target.
    """
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=schedule.sample_rate,
            steps=_steps(schedule, epochs, steps),
            accountant=accountant,
            epsilon_tolerance=CALIBRATION_TOLERANCE,
        )
    )


def calibrate_epochs(
    schedule: PoissonSchedule,
    target_epsilon: float,
    noise_multiplier: float,
    delta: float,
    *,
    accountant: str = "rdp",
    max_epochs: int = 100_000,
) -> int:
    """Most epochs whose ε stays <= ``target_epsilon`` at this σ (0 if even one epoch exceeds it).

    ε grows monotonically with the number of steps, so this is a bisection over whole epochs.
    """
    accounting = Accounting(accountant)

    def eps(e: int) -> float:
        return epsilon(schedule, noise_multiplier, delta, epochs=e, accounting=accounting).epsilon

    if eps(1) > target_epsilon:
        return 0
    lo, hi = 1, 2
    while hi <= max_epochs and eps(hi) <= target_epsilon:
        lo, hi = hi, hi * 2
    hi = min(hi, max_epochs + 1)
    while hi - lo > 1:  # invariant: eps(lo) <= target < eps(hi) (or hi past max_epochs)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if eps(mid) <= target_epsilon else (lo, mid)
    return lo


def epsilon_curve(
    schedule: PoissonSchedule,
    noise_multiplier: float,
    delta: float,
    epochs: int,
    *,
    accounting: Accounting = Accounting(),
) -> list[float]:
    """RDP ε after each epoch 1..``epochs`` (one RDP evaluation: RDP is linear in steps)."""
    axes = GridAxes([schedule.batch_size], [noise_multiplier], range(1, epochs + 1))
    return epsilon_grid(schedule.n, axes, delta, accounting=accounting)[0, 0, :].tolist()


@dataclass(frozen=True)
class GridAxes:
    """The axes of an :func:`epsilon_grid`: logical batch sizes B, noise multipliers σ and epochs."""

    batch_sizes: Sequence[int]
    noise_multipliers: Sequence[float]
    epochs: Sequence[int]


def epsilon_grid(
    n: int,
    grid: GridAxes,
    delta: float,
    *,
    accounting: Accounting = Accounting(),
    workers: int | None = None,
) -> np.ndarray:
    """RDP ε for every (B, σ, epochs) of ``grid`` on N examples, shape (len(B), len(σ), len(epochs)).

    RDP composes linearly in the number of steps, so one Opacus ``compute_rdp`` per (q, σ) pair
    gives the per-step curve over all orders; each grid point scales it and converts to ε.
    Only the ``rdp`` accountant has this shortcut: another one raises ValueError.
    """
    ACCOUNTANTS.get(accounting.accountant)  # an unknown name lists the valid ones
    if accounting.accountant != "rdp":
        raise ValueError(f"epsilon_grid computes RDP ε only, not accountant={accounting.accountant!r}")
    orders = np.asarray(accounting.alphas, dtype=float)
    convert = CONVERSIONS.get(accounting.conversion)
    epochs_arr = np.asarray(grid.epochs, dtype=int)
    schedules = [poisson_schedule(n, b) for b in grid.batch_sizes]
    pairs = [(s.sample_rate, float(sigma)) for s in schedules for sigma in grid.noise_multipliers]
    per_step = iter(_per_step_rdp(pairs, orders, workers))
    out = np.empty((len(schedules), len(grid.noise_multipliers), len(epochs_arr)))
    for i, schedule in enumerate(schedules):
        for j in range(len(grid.noise_multipliers)):
            rdp1 = next(per_step)
            for k, e in enumerate(epochs_arr):
                out[i, j, k] = sound_epsilon(convert(orders, rdp1 * schedule.steps(int(e)), delta)[0])
    return out


def _rdp_one(pair: tuple[float, float], orders: np.ndarray) -> np.ndarray:
    q, sigma = pair
    return rdp_curve([(sigma, q, 1)], orders)


def _per_step_rdp(pairs: list[tuple[float, float]], orders: np.ndarray, workers: int | None) -> list[np.ndarray]:
    """Per-step RDP curves for (q, σ) pairs; independent pure computations, spread over processes
    (fork, Linux) when there are many. The values are the same as computed serially."""
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers <= 1 or len(pairs) < 8 * workers or "fork" not in multiprocessing.get_all_start_methods():
        return [_rdp_one(p, orders) for p in pairs]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_rdp_one, pairs, itertools.repeat(orders), chunksize=max(1, len(pairs) // (4 * workers))))
