"""Planning DP-SGD's privacy before training: the sampling schedule, ε of a configuration, and
calibration of σ or the epochs to a target ε, all over the run's ledger (:mod:`dpsweep.privacy.ledger`),
so the ε planned here is the ε the run logs. No torch (``prv`` imports Opacus).

    >>> from dpsweep.privacy.schedule import epsilon, poisson_schedule
    >>> epsilon(poisson_schedule(60000, 150), noise_multiplier=1.3, delta=1e-5, epochs=15).epsilon

``epsilon``, ``calibrate_noise``, ``calibrate_epochs`` and ``epsilon_curve`` take the sampling
schedule (:func:`poisson_schedule`) first (``epsilon_grid`` takes N and its :class:`GridAxes`), then
Opacus's and dp-accounting's quantities (``noise_multiplier``, ``delta``, ``epochs`` or ``steps``);
how ε is computed (accountant, conversion, RDP orders) travels as one :class:`Accounting`, and the
releases a run makes besides its steps (a private clipping norm) as ``extra``, a :class:`Ledger`.

Step-count convention (shared by the trainer and every ε dpsweep prints). It is the one Opacus's
Poisson loader defines, ``DPDataLoader.from_data_loader`` and ``PrivacyEngine.make_private``:

- an ordinary ``DataLoader(batch_size=B, drop_last=False)`` has ``k = ceil(N / B)`` batches;
- the Poisson loader includes each example in a step independently with probability ``1 / k``
  and yields ``steps_per_epoch = int(1 / (1 / k))`` steps per epoch (one fewer than ``k`` when
  floating point rounds ``1 / (1 / k)`` below ``k``, e.g. ``k = 93``);
- the accountant records every optimizer step with ``sample_rate = 1 / steps_per_epoch``, which
  is never below the true inclusion probability, so ε is never under-stated;
- ``steps = epochs * steps_per_epoch``.
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

from dpsweep.privacy import calibrate, ledger, rdp
from dpsweep.privacy.ledger import Accounting, Ledger

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


class TfPrivacySchedule(PoissonSchedule):
    """TF Privacy's convention (its ``compute_dp_sgd_privacy``): q = B/N and ceil(epochs · N/B) steps.
    For reproducing a published TF Privacy figure with ``dpsweep-epsilon --convention tf_privacy``;
    no dpsweep run trains this way (its Poisson loader is Opacus's)."""

    def steps(self, epochs: int) -> int:
        return math.ceil(epochs * self.n / self.batch_size)


def tf_privacy_schedule(n: int, batch_size: int) -> PoissonSchedule:
    """:class:`TfPrivacySchedule` of N examples and batch size B."""
    if n <= 0 or batch_size <= 0:
        raise ValueError(f"need N > 0 and B > 0, got N={n}, B={batch_size}")
    q = batch_size / n
    return TfPrivacySchedule(n, batch_size, q, math.ceil(n / batch_size), q)


# step conventions by name: Opacus's, as runs train (TRAINED); TF Privacy's reproduces its published figures
TRAINED = "opacus"
CONVENTIONS: dict[str, Callable[[int, int], PoissonSchedule]] = {
    TRAINED: poisson_schedule,
    "tf_privacy": tf_privacy_schedule,
}


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


ACCOUNTANTS = ledger.ACCOUNTANTS
CONVERSIONS = rdp.CONVERSIONS
DEFAULT_ALPHAS = rdp.DEFAULT_ORDERS


@dataclass(frozen=True)
class EpsilonResult:
    epsilon: float
    delta: float
    alpha: float | None  # optimal RDP order; None for PRV and PLD
    steps: int
    sample_rate: float
    noise_multiplier: float
    accountant: str
    conversion: str | None  # None for PRV and PLD


def run_ledger(schedule: PoissonSchedule, noise_multiplier: float, steps: int, extra: Ledger = Ledger()) -> Ledger:
    """The ledger of a run: ``extra`` (releases before training) then its DP-SGD steps."""
    return extra + Ledger((ledger.dpsgd(noise_multiplier, schedule.sample_rate, steps),))


def epsilon(
    schedule: PoissonSchedule,
    noise_multiplier: float,
    delta: float,
    *,
    epochs: int | None = None,
    steps: int | None = None,
    accounting: Accounting = Accounting(),
    extra: Ledger = Ledger(),
) -> EpsilonResult:
    """ε after ``epochs`` (or ``steps``) of DP-SGD with this Poisson ``schedule`` (N examples, batch B),
    with the releases of ``extra``."""
    total = _steps(schedule, epochs, steps)
    spent = ledger.epsilon(run_ledger(schedule, noise_multiplier, total, extra), delta, accounting)
    return EpsilonResult(
        spent.epsilon, delta, spent.order, total, schedule.sample_rate, noise_multiplier, spent.accountant,
        spent.conversion,
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
    accounting: Accounting = Accounting(),
    extra: Ledger = Ledger(),
) -> float:
    """Smallest σ found (to ``calibrate.RTOL``, relative) whose ε, with ``extra``, does not exceed
    ``target_epsilon`` (:func:`dpsweep.privacy.calibrate.noise_multiplier`, the one bisection of every
    mechanism); ValueError when even σ = ``calibrate.SIGMA_MAX`` exceeds it."""
    total = _steps(schedule, epochs, steps)
    return calibrate.noise_multiplier(
        lambda sigma: run_ledger(schedule, sigma, total, extra), target_epsilon, delta, accounting
    )


def calibrate_epochs(
    schedule: PoissonSchedule,
    target_epsilon: float,
    noise_multiplier: float,
    delta: float,
    *,
    accounting: Accounting = Accounting(),
    extra: Ledger = Ledger(),
    max_epochs: int = 100_000,
) -> int:
    """Most epochs whose ε, with ``extra``, stays <= ``target_epsilon`` at this σ (0 if even one epoch
    exceeds it)."""

    def eps(e: int) -> float:
        return epsilon(schedule, noise_multiplier, delta, epochs=e, accounting=accounting, extra=extra).epsilon

    return calibrate.largest_count(eps, target_epsilon, max_epochs)


def calibrate_steps(
    schedule: PoissonSchedule,
    target_epsilon: float,
    noise_multiplier: float,
    delta: float,
    *,
    max_steps: int,
    accounting: Accounting = Accounting(),
    extra: Ledger = Ledger(),
) -> int:
    """Most steps (at most ``max_steps``) whose ε, with ``extra``, stays <= ``target_epsilon`` at this σ
    (0 if even one step exceeds it): where dp-GAN's rule (stop once the accountant's ε at δ would pass
    the budget) stops a run of ``max_steps`` steps."""

    def eps(k: int) -> float:
        return epsilon(schedule, noise_multiplier, delta, steps=k, accounting=accounting, extra=extra).epsilon

    return calibrate.largest_count(eps, target_epsilon, max_steps)


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
    extra: Ledger = Ledger(),
    workers: int | None = None,
) -> np.ndarray:
    """RDP ε for every (B, σ, epochs) of ``grid`` on N examples, with the releases of ``extra``, shape
    (len(B), len(σ), len(epochs)).

    RDP composes linearly in the number of steps, so one per-step curve per (q, σ) pair
    (:func:`dpsweep.privacy.rdp.subsampled_gaussian`) gives every grid point: scaled, plus ``extra``'s, converted.
    Only the ``rdp`` accountant has this shortcut: another one raises ValueError.
    """
    ACCOUNTANTS.get(accounting.accountant)  # an unknown name lists the valid ones
    if accounting.accountant != "rdp":
        raise ValueError(f"epsilon_grid computes RDP ε only, not accountant={accounting.accountant!r}")
    orders = np.asarray(accounting.orders, dtype=float)
    base = ledger.rdp_curve(extra, accounting.orders)
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
                curve = base + rdp1 * schedule.steps(int(e))
                out[i, j, k] = ledger.sound_epsilon(convert(accounting.orders, curve, delta)[0])
    return out


def _rdp_one(pair: tuple[float, float], orders: np.ndarray) -> np.ndarray:
    q, sigma = pair
    return rdp.subsampled_gaussian(q, sigma, orders.tolist())


def _per_step_rdp(pairs: list[tuple[float, float]], orders: np.ndarray, workers: int | None) -> list[np.ndarray]:
    """Per-step RDP curves for (q, σ) pairs; independent pure computations, spread over processes
    (fork, Linux) when there are many. The values are the same as computed serially."""
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers <= 1 or len(pairs) < 8 * workers or "fork" not in multiprocessing.get_all_start_methods():
        return [_rdp_one(p, orders) for p in pairs]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_rdp_one, pairs, itertools.repeat(orders), chunksize=max(1, len(pairs) // (4 * workers))))
