"""Planning DP-FTRL's privacy: the L2 sensitivity of its tree-aggregation noise to one example (or one
user), its ε at δ, and calibration of σ to a target ε. Pure NumPy and dp-accounting: no torch.

    >>> from dpsweep.mechanisms import dpftrl_accounting
    >>> dpftrl_accounting.ftrl_epsilon(46.3, steps_per_epoch=100, epochs=100, delta=1e-5, restart_every=20,
    ...                                tree_completion=True)
    >>> dpftrl_accounting.calibrate_ftrl_noise(8.0, steps_per_epoch=100, epochs=100, delta=1e-5,
    ...                                        restart_every=20, tree_completion=True)

DP-FTRL (Kairouz, McMahan, Song, Thakkar, Thakurta & Xu, ICML 2021, "Practical and Private (Deep)
Learning without Sampling or Shuffling", arXiv:2103.00039) releases the prefix sums of the clipped
gradients through tree aggregation: every node of a binary tree over the steps is the sum of the
clipped gradients of its steps plus N(0, σ²C²) noise, drawn once (:mod:`dpsweep.mechanisms.ftrl` is the
mechanism). Nothing is sampled or shuffled: the batches come in a fixed order, each example (or user)
in one batch per epoch, so there is **no amplification by sampling** and no ``PoissonSampledDpEvent``.
The whole run is one Gaussian mechanism (adaptively composed; Appendix D of the paper)
whose L2 sensitivity Δ (in units of C) is that of all the tree nodes one example touches.

The formula (what ``privacy.py`` of google-research/DP-FTRL computes, the version after the errata of
the paper: ``get_total_sensitivity_sq_same_order`` and
``compute_epsilon_tree_restart_rdp_same_order_extra``; the paper's Appendix D.2.1 and D.3, as the
repository's README names them). With b steps (batches) per epoch, E epochs and a restart every R
epochs:

- the trees: the run is cut into trees of e_1, ..., e_m epochs, e_i = R except the last one, which
  holds the E mod R epochs left over (when there are any): [R] * (E // R) + [E mod R]; without
  restarts one tree of E epochs (:func:`tree_segments`). A restart follows epoch k when k is a
  multiple of R and k < E (the reference's ``main.py``; :func:`restart_after_epoch`).
- tree completion: before each restart (every tree but the last), the tree of L = e_i·b real steps is
  completed with X = 2^⌈log2 L⌉ − L virtual steps (no data, noise only), so that the noise folded into
  the next tree is that of one root; the last tree is never completed (``tree_completion`` of the
  reference). Virtual steps hold no example, but the nodes over both real and virtual steps count.
- the nodes of a tree of L + X leaves (steps 0, 1, ... in order) are the complete dyadic intervals
  I_{h,j} = [j·2^h, (j+1)·2^h) with (j+1)·2^h <= L + X, h = 0, 1, ...: the reference builds them by
  merging consecutive pairs level by level and dropping an unpaired last node; they are exactly the
  nodes tree aggregation ever draws noise for (node I_{h,j} is drawn at its last step).
- within a tree the batch order is the same in every epoch, so the example of batch s (0 <= s < b) is
  in the leaves s + k·b, k = 0..e−1, and node I_{h,j} holds it c_{h,j}(s) = F_s((j+1)·2^h) −
  F_s(j·2^h) times, with F_s(x) = min(e, max(0, ⌈(x − s)/b⌉)) its leaves below x. Changing the example
  changes that node's sum by at most c_{h,j}(s)·C in L2 norm (add/remove its clipped gradient in each
  of its steps; at worst all aligned), so the tree's squared sensitivity is

      S(b, e, X) = max_s  Σ_{h,j} c_{h,j}(s)²

  (:func:`tree_sensitivity_squared`; S(b, 1, 0) = ⌊log2 b⌋ + 1, the depth of dp-accounting's
  ``SingleEpochTreeAggregationDpEvent``).
- trees have independent noise and the order may be reshuffled at a restart (the reference does), so
  the run's squared sensitivity is the sum of each tree's worst case:

      Δ² = Σ_i S(b, e_i, X_i)                                       (:func:`ftrl_sensitivity_squared`)

- the run is a Gaussian mechanism with noise multiplier σ/Δ: ρ-zCDP with ρ = Δ²/(2σ²), RDP
  α·Δ²/(2σ²) at every order α (Mironov 2017, Prop. 7; Bun & Steinke 2016). Its event is
  ``GaussianDpEvent(σ / Δ)`` (:func:`ftrl_event`), accounted by dp-accounting's ``RdpAccountant`` (at
  :data:`dpsweep.privacy.rdp.DEFAULT_ORDERS`, the improved conversion of Balle et al. 2020, Prop. 12, which is
  also the reference's ``convert_gaussian_renyi_to_dp`` on a finer grid of orders) or ``PLDAccountant``
  (tight for one Gaussian mechanism up to its discretisation).

The first version of the reference's ``privacy.py`` used ⌈log2(b·E)⌉·E (or ⌈log2 b⌉·E with a restart
every epoch) for Δ², which the errata of the paper corrected; this module follows the corrected one.

What the formula assumes of the trainer: a fixed batch order within a tree, the same in every epoch of
that tree (it may change at a restart); each example (a user, for user-level DP, its contribution
clipped to C as a unit) in exactly one batch per epoch; the noise std σ·C on the *sum* of the clipped
gradients of a step (σ·C/B when they are averaged over a batch of B, as the reference does).

Neighbours: the paper's Definition 1.1, dp-accounting's ``NeighboringRelation.REPLACE_SPECIAL``: one
example replaced by a special "zero" record (gradient 0) at its place in the fixed order, every other
batch unchanged. Add/remove-one does not fit a fixed order (removing an example would shift every later
one into another batch); dp-accounting itself accepts its ``SingleEpochTreeAggregationDpEvent`` only
under REPLACE_SPECIAL. Both accountants here run under REPLACE_SPECIAL; for a Gaussian mechanism their ε
is the same number as under add/remove-one, so :func:`dpsweep.privacy.ledger.epsilon` of :func:`ftrl_entry`
gives this ε too, but the ledger's label for its unit (``NEIGHBOURS = "add_or_remove_one"``) does not
describe a DP-FTRL run.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import numpy as np
from dp_accounting import dp_event, privacy_accountant

from dpsweep.errors import InputError
from dpsweep.privacy import calibrate, ledger, rdp

ACCOUNTANTS = ("rdp", "pld")  # dp-accounting's RdpAccountant and PLDAccountant


# ---------------------------------------------------------------------------------------------
# the schedule of trees
# ---------------------------------------------------------------------------------------------
def tree_segments(epochs: int, restart_every: int | None) -> tuple[int, ...]:
    """Epochs in each tree: ``restart_every`` epochs each, and the epochs left over in the last one;
    one tree of ``epochs`` epochs without restarts. ``tree_segments(5, 2) == (2, 2, 1)``."""
    _check_schedule(epochs, restart_every)
    if restart_every is None:
        return (epochs,)
    full, rest = divmod(epochs, restart_every)
    return (restart_every,) * full + ((rest,) if rest else ())


def restart_after_epoch(epoch: int, epochs: int, restart_every: int | None) -> bool:
    """Whether the tree restarts after ``epoch`` (1-based: the number of epochs done), of ``epochs``:
    after every ``restart_every``-th epoch but the last (the reference's ``main.py``)."""
    _check_schedule(epochs, restart_every)
    return restart_every is not None and epoch % restart_every == 0 and epoch < epochs


def completion_steps(steps: int) -> int:
    """Virtual steps that complete a tree of ``steps`` leaves: up to the next power of two (0 if it is one)."""
    if steps <= 0:
        return 0
    return (1 << (steps - 1).bit_length()) - steps


# ---------------------------------------------------------------------------------------------
# sensitivity
# ---------------------------------------------------------------------------------------------
def tree_sensitivity_squared(steps_per_epoch: int, epochs: int, virtual_steps: int = 0) -> int:
    """S(b, e, X): squared L2 sensitivity (units of C) of one tree's nodes to one example, for ``epochs``
    epochs of ``steps_per_epoch`` steps in the same order, then ``virtual_steps`` steps without data
    (see the module docstring). Exact; O(b·e) memory and O(b·e·log(b·e)) time at most."""
    _check_positive_int("steps_per_epoch", steps_per_epoch, "a positive number of steps (batches) per epoch")
    _check_positive_int("train.epochs", epochs, "a positive number of epochs in the tree")
    if virtual_steps < 0:
        raise InputError("virtual_steps", virtual_steps, "a number of virtual steps >= 0")
    return _tree_sensitivity_squared(int(steps_per_epoch), int(epochs), int(virtual_steps))


@functools.lru_cache(maxsize=1024)
def _tree_sensitivity_squared(b: int, e: int, x: int) -> int:
    leaves = b * e + x
    s = np.arange(b, dtype=np.int64)[:, None]  # the batch of the example, 0..b-1

    def below(edges: np.ndarray) -> np.ndarray:  # F_s(x): the example's leaves s + k·b (k < e) below x
        return np.clip(-((s - edges[None, :]) // b), 0, e)  # ceil((x - s) / b), clipped to [0, e]

    total = np.zeros(b, dtype=np.int64)
    h = 0
    while (1 << h) <= leaves:
        width, nodes = 1 << h, leaves >> h
        if width <= b:
            # The example's leaves are b apart: a node this narrow holds at most one, so Σ c² = Σ c,
            # the example's leaves under the level's complete nodes.
            total += below(np.array([nodes * width], dtype=np.int64))[:, 0]
        else:  # fewer than 2e nodes here (leaves < 2·b·e)
            counts = np.diff(below(np.arange(nodes + 1, dtype=np.int64) * width), axis=1)
            total += (counts * counts).sum(axis=1)
        h += 1
    return int(total.max())


def ftrl_sensitivity_squared(
    steps_per_epoch: int, epochs: int, restart_every: int | None = None, tree_completion: bool = False
) -> int:
    """Δ²: the squared L2 sensitivity (units of the clipping norm C) of every noisy tree node of a DP-FTRL
    run to one example, or one user (same: a user's contribution is clipped to C as a unit):
    Σ over trees of S(b, e_i, X_i) (see the module docstring). ``tree_completion`` completes every tree
    but the last; it does nothing without restarts (as in the reference)."""
    _check_positive_int("steps_per_epoch", steps_per_epoch, "a positive number of steps (batches) per epoch")
    segments = tree_segments(epochs, restart_every)
    total = 0
    for i, e in enumerate(segments):
        last = i == len(segments) - 1
        extra = completion_steps(int(steps_per_epoch) * e) if tree_completion and not last else 0
        total += _tree_sensitivity_squared(int(steps_per_epoch), e, extra)
    return total


# ---------------------------------------------------------------------------------------------
# events and ε
# ---------------------------------------------------------------------------------------------
def ftrl_event(
    noise_multiplier: float,
    steps_per_epoch: int,
    epochs: int,
    restart_every: int | None = None,
    tree_completion: bool = False,
) -> dp_event.DpEvent:
    """The whole DP-FTRL run as one dp-accounting event: ``GaussianDpEvent(σ / Δ)`` (a Gaussian mechanism
    of sensitivity Δ and noise σ·C is a unit-sensitivity one with noise multiplier σ/Δ). No sampling."""
    _check_noise(noise_multiplier)
    s2 = ftrl_sensitivity_squared(steps_per_epoch, epochs, restart_every, tree_completion)
    return dp_event.GaussianDpEvent(float(noise_multiplier) / math.sqrt(s2))


def ftrl_entry(
    noise_multiplier: float,
    steps_per_epoch: int,
    epochs: int,
    restart_every: int | None = None,
    tree_completion: bool = False,
) -> ledger.Entry:
    """The run as a line of the project's ledger (:mod:`dpsweep.privacy.ledger`), its event :func:`ftrl_event`."""
    s2 = ftrl_sensitivity_squared(steps_per_epoch, epochs, restart_every, tree_completion)
    params: dict[str, Any] = {
        "noise_multiplier": float(noise_multiplier),
        "steps_per_epoch": int(steps_per_epoch),
        "epochs": int(epochs),
        "restart_every": restart_every,
        "tree_completion": bool(tree_completion),
        "sensitivity_squared": s2,
    }
    return ledger.Entry(
        "dpftrl",
        ftrl_event(noise_multiplier, steps_per_epoch, epochs, restart_every, tree_completion),
        params,
        "DP-FTRL tree aggregation (Kairouz et al. 2021): one Gaussian mechanism of noise multiplier σ/Δ, "
        "Δ² the squared sensitivity of all tree nodes to one example; no sampling, no amplification",
    )


def ftrl_epsilon(
    noise_multiplier: float,
    steps_per_epoch: int,
    epochs: int,
    delta: float,
    restart_every: int | None = None,
    tree_completion: bool = False,
    *,
    accountant: str = "rdp",
) -> float:
    """ε at ``delta`` of a DP-FTRL run with node noise σ·C (σ = ``noise_multiplier``): its
    :func:`ftrl_event` under dp-accounting's ``RdpAccountant`` (``accountant="rdp"``, at
    :data:`dpsweep.privacy.rdp.DEFAULT_ORDERS`) or ``PLDAccountant`` (``"pld"``), both for replace-special
    neighbours (see the module docstring). +inf at σ = 0."""
    _check_delta(delta)
    if accountant not in ACCOUNTANTS:
        raise InputError("dp.accountant", accountant, f"one of {', '.join(ACCOUNTANTS)} for DP-FTRL")
    event = ftrl_event(noise_multiplier, steps_per_epoch, epochs, restart_every, tree_completion)
    if noise_multiplier == 0:
        return math.inf
    relation = privacy_accountant.NeighboringRelation.REPLACE_SPECIAL  # the paper's Definition 1.1
    if accountant == "rdp":
        from dp_accounting import rdp as dp_rdp

        acc: privacy_accountant.PrivacyAccountant = dp_rdp.RdpAccountant(list(rdp.DEFAULT_ORDERS), relation)
    else:
        from dp_accounting.pld import pld_privacy_accountant

        acc = pld_privacy_accountant.PLDAccountant(relation, value_discretization_interval=ledger.PLD_DISCRETIZATION)
    acc.compose(event)
    return ledger.sound_epsilon(float(acc.get_epsilon(delta)))


def zcdp_sigma(sensitivity_squared: float, target_epsilon: float, delta: float) -> float:
    """The σ of the zCDP bound ε <= ρ + 2·sqrt(ρ·log(1/δ)) (Bun & Steinke 2016, Prop. 1.3) with
    ρ = Δ²/(2σ²): where calibration starts, close to the answer (far below it, the PLD accountant is
    slow: a wide loss range)."""
    log_inv_delta = math.log(1 / delta)
    rho = (math.sqrt(log_inv_delta + target_epsilon) - math.sqrt(log_inv_delta)) ** 2
    return math.sqrt(sensitivity_squared / (2 * rho))


def calibrate_ftrl_noise(
    target_epsilon: float,
    steps_per_epoch: int,
    epochs: int,
    delta: float,
    restart_every: int | None = None,
    tree_completion: bool = False,
    *,
    accountant: str = "rdp",
) -> float:
    """The smallest σ (to ``calibrate.RTOL``, relative) whose :func:`ftrl_epsilon` does not exceed
    ``target_epsilon``. Bisection that always keeps the upper end, whose ε is <= target, so the result
    never lands above the target (:func:`dpsweep.privacy.calibrate.smallest_sigma`, the one bisection);
    InputError when even σ = ``calibrate.SIGMA_MAX`` is not enough."""
    if not (isinstance(target_epsilon, numbers.Real) and 0 < target_epsilon < math.inf):
        raise InputError("dp.target_epsilon", target_epsilon, "a positive, finite privacy budget ε")

    def eps(sigma: float) -> float:
        return ftrl_epsilon(
            sigma, steps_per_epoch, epochs, delta, restart_every, tree_completion, accountant=accountant
        )

    s2 = ftrl_sensitivity_squared(steps_per_epoch, epochs, restart_every, tree_completion)
    _check_delta(delta)
    try:
        return calibrate.smallest_sigma(eps, target_epsilon, guess=zcdp_sigma(s2, target_epsilon, delta))
    except ValueError as err:
        raise InputError(
            "dp.target_epsilon", target_epsilon, f"a budget that σ <= {calibrate.SIGMA_MAX:g} reaches for DP-FTRL"
        ) from err


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------
def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_positive_int(key: str, value: object, allowed: str) -> None:
    if not (_is_int(value) and int(value) >= 1):  # type: ignore[call-overload]
        raise InputError(key, value, allowed)


def _check_schedule(epochs: int, restart_every: int | None) -> None:
    _check_positive_int("train.epochs", epochs, "a positive number of epochs")
    if restart_every is None:
        return
    if not (_is_int(restart_every) and 1 <= int(restart_every) <= int(epochs)):
        raise InputError(
            "dp.ftrl_restart_every",
            restart_every,
            f"a whole number of epochs between restarts of the tree, from 1 to the run's {epochs} epochs, "
            "or null for one tree",
        )


def _check_noise(noise_multiplier: float) -> None:
    if not (isinstance(noise_multiplier, numbers.Real) and 0 <= noise_multiplier < math.inf):
        raise InputError("dp.noise_multiplier", noise_multiplier, "a finite noise multiplier σ >= 0")


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, numbers.Real) and 0 < delta < 1):
        raise InputError("dp.delta", delta, "a δ in (0, 1)")
