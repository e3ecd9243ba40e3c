"""dp-accounting's private names: the door to them.

A private tuning's ε under the ``mixture`` analysis (:mod:`dpsweep.privacy.tuning`) applies Papernot &
Steinke's repeat-and-select bound to an RDP curve that no dp-accounting event describes (a uniform
draw over candidates whose costs differ).

A run's privacy profile (:func:`dpsweep.privacy.certainty.profile`: δ at 4,001 values of ε, behind its
interval, μ-GDP and attack risk) reads the PLD's probability mass function in numpy: dp-accounting's own
vectorised read walks the PMF's 10^5 points in a Python loop, 0.5 CPU-s of a 10 CPU-s default run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.rdp import rdp_privacy_accountant

PRIVATE_NAMES = (  # (module, attribute path): what tests/unit/interop checks still exists
    ("dp_accounting.rdp.rdp_privacy_accountant", "_compute_rdp_repeat_and_select"),
    ("dp_accounting.pld.privacy_loss_distribution", "PrivacyLossDistribution.__init__:_pmf_remove"),
    ("dp_accounting.pld.privacy_loss_distribution", "PrivacyLossDistribution.__init__:_pmf_add"),
    ("dp_accounting.pld.privacy_loss_distribution", "PrivacyLossDistribution.__init__:_symmetric"),
    ("dp_accounting.pld.pld_pmf", "DensePLDPmf.__init__:_lower_loss"),
    ("dp_accounting.pld.pld_pmf", "DensePLDPmf.__init__:_probs"),
    ("dp_accounting.pld.pld_pmf", "PLDPmf.__init__:_discretization"),
    ("dp_accounting.pld.pld_pmf", "PLDPmf.__init__:_infinity_mass"),
)


def repeat_and_select_rdp(orders: Sequence[float], rdp: Sequence[float], mean: float, shape: float) -> list[float]:
    """The RDP at ``orders`` of running a mechanism of RDP ``rdp`` K times (K of mean ``mean``, shape
    ``shape``: ∞ Poisson, 1 geometric, else truncated negative binomial) and releasing the best run:
    Papernot & Steinke 2022, Thms. 2 and 6, as dp-accounting's ``RdpAccountant`` computes them for a
    ``RepeatAndSelectDpEvent``.

    Private name: ``dp_accounting.rdp.rdp_privacy_accountant._compute_rdp_repeat_and_select``. The
    public way is the event, whose inner mechanism must be a dp-accounting event; a mixture of
    candidates with different costs is none, so the function is given the curve directly."""
    return list(rdp_privacy_accountant._compute_rdp_repeat_and_select(orders, rdp, mean, shape))


def deltas_for_epsilons(pld: Any, epsilons: np.ndarray) -> np.ndarray:
    """``pld.get_delta_for_epsilon(epsilons)`` for ascending ``epsilons``: the hockey-stick divergence
    δ(ε) = m_∞ + Σ_{l > ε} p_l (1 − e^{ε − l}) of each direction's PMF (Meiser & Mohammadi 2018; Sommer,
    Meiser & Mohammadi 2019, Thm. 1), the larger of the two, as dp-accounting computes it
    (``pld_pmf._get_delta_for_epsilon_vectorized``: the sums over losses above ε accumulated from the
    largest loss down, m_∞ first), with the sums taken by ``numpy.cumsum`` in that same order instead of a
    Python loop over the PMF. A sparse PMF (a few points) is read through dp-accounting's public method.

    Private names: ``PrivacyLossDistribution._pmf_remove``, ``._pmf_add`` and ``._symmetric``;
    ``DensePLDPmf._lower_loss``, ``._probs``, ``._discretization`` and ``._infinity_mass``."""
    epsilons = np.atleast_1d(np.asarray(epsilons, dtype=float))
    if not np.all(np.diff(epsilons) >= 0):  # dp-accounting's own check (a NaN fails it too)
        raise ValueError("epsilons must be in ascending order, as dp-accounting requires")
    removed = _pmf_deltas(pld._pmf_remove, epsilons)
    return removed if pld._symmetric else np.maximum(removed, _pmf_deltas(pld._pmf_add, epsilons))


def _pmf_deltas(pmf: Any, epsilons: np.ndarray) -> np.ndarray:
    if not isinstance(pmf, pld_pmf.DensePLDPmf):
        return np.asarray(pmf.get_delta_for_epsilon(epsilons), dtype=float)
    probs = np.asarray(pmf._probs, dtype=float)
    losses = (np.arange(probs.size) + pmf._lower_loss) * pmf._discretization
    top_down = probs[::-1]
    upper = np.cumsum(np.concatenate(([pmf._infinity_mass], top_down)))  # upper[k]: m_∞ + the k largest losses' p
    lower = np.cumsum(np.concatenate(([0.0], top_down * np.exp(-losses[::-1]))))  # their p·e^{−l}
    above = probs.size - np.searchsorted(losses, epsilons, side="right")  # how many losses exceed each ε
    with np.errstate(over="ignore", invalid="ignore"):
        deltas = upper[above] - np.exp(epsilons) * lower[above]
    return np.where(np.isposinf(epsilons), pmf._infinity_mass, deltas)
