"""The privacy cost of a mechanism's configuration, before training: ``dpsweep-epsilon``'s work.

    q = Query("dpsgd", Setting(60000, 150, 15, 1e-5), noise_multiplier=1.3)
    price(get("dpsgd"), q, described_digits=4)["epsilon"]          # ε after 15 epochs
    price(get("dpsgd"), replace(q, noise_multiplier=None, target_epsilon=2.0), described_digits=4)  # σ for ε <= 2

The ledger priced is the one a run of the same N, B, σ, length, δ and clipping records (the mechanism's
own, :meth:`Mechanism.ledger`), so the ε is the ε ``dpsweep`` logs at the end of such a run; σ is
calibrated by the mechanism (one bisection over σ -> ledger), the epochs by
:func:`dpsweep.privacy.calibrate.largest_count`. A quantile clipping norm adds its release
(:func:`dpsweep.privacy.clipping.release`, Andrew et al. 2021), amplified by the mechanism's q. The
certainty figures are :mod:`dpsweep.privacy.certainty`'s, and a tuning's ε that of releasing the best of
K runs, K random (Papernot & Steinke 2022, "Hyperparameter Tuning with Renyi Differential Privacy";
dp-accounting's RepeatAndSelectDpEvent: :func:`dpsweep.privacy.ledger.tuning_epsilon`).

Bad input is raised as InputError naming the config key (``dp.target_epsilon``, ``dp.accountant``): a
command names its own flags for them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dpsweep.errors import InputError
from dpsweep.mechanisms.base import Mechanism, Setting
from dpsweep.privacy import calibrate, certainty, clipping, ledger, schedule
from dpsweep.units import rounded_up

EPOCHS_MAX = 100_000  # the epochs calibration looks no further


@dataclass(frozen=True)
class Tuning:
    """A private tuning: the best of K runs released, K with mean ``mean_trials`` drawn from
    ``distribution`` (a name of :data:`dpsweep.privacy.ledger.TUNING_SHAPES`; ``eta``: the shape η of
    ``tnb``, the truncated negative binomial)."""

    mean_trials: float
    distribution: str = "poisson"
    eta: float = 0.5

    @property
    def shape(self) -> float:
        """The shape :func:`dpsweep.privacy.ledger.tuning_epsilon` takes (∞: Poisson, 1: geometric)."""
        return self.eta if self.distribution == "tnb" else ledger.TUNING_SHAPES.get(self.distribution)


@dataclass(frozen=True)
class Query:
    """What is asked of a mechanism registered as ``mechanism``: its ``setting`` (N, B, the length, δ,
    the accounting, its options and step convention) at σ = ``noise_multiplier``; or σ (no
    ``noise_multiplier``) or the epochs (with one) calibrated for ε <= ``target_epsilon``; with the
    quantile release of the clipping norm at ``clip_epsilon`` (None: a fixed or adaptive C, which
    releases nothing besides the steps) and a private tuning's ε."""

    mechanism: str
    setting: Setting
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    clip_epsilon: float | None = None
    tuning: Tuning | None = None


def price(mechanism: Mechanism, query: Query, described_digits: int) -> dict[str, Any]:
    """ε of ``query`` (and the releases and tuning asked for), or σ or the epochs calibrated, as one JSON
    object. Its ``description`` shows a calibrated σ to ``described_digits`` significant digits, rounded
    up (a run at that σ spends at most the ε); ``noise_multiplier`` keeps it whole."""
    s = with_clipping_release(mechanism, query.setting, query.clip_epsilon)
    mechanism.check(s)
    sigma, calibrated = query.noise_multiplier, None
    if query.target_epsilon is not None and sigma is None:
        sigma, calibrated = calibrated_sigma(mechanism, s, query.target_epsilon), "noise_multiplier"
    elif query.target_epsilon is not None and sigma is not None:
        s = replace(s, epochs=calibrated_epochs(mechanism, s, sigma, query.target_epsilon))
        calibrated = "epochs"
    assert sigma is not None, "a noise multiplier, or a target ε to calibrate it for"
    bill = mechanism.ledger(s, sigma)
    why = ledger.not_computed(bill, s.delta, s.accounting, "here")
    if why is not None:
        raise InputError("dp.accountant", s.accounting.accountant, why)
    spent = ledger.epsilon(bill, s.delta, s.accounting)
    shown = float(rounded_up(sigma, described_digits)) if calibrated == "noise_multiplier" else sigma
    out: dict[str, Any] = {
        "mechanism": query.mechanism, "epsilon": spent.epsilon, "delta": s.delta, "alpha": spent.order,
        "steps": mechanism.steps(s), "sample_rate": mechanism.sample_rate(s), "noise_multiplier": sigma,
        "accountant": spent.accountant, "conversion": spent.conversion, "neighbours": mechanism.neighbours,
        "description": mechanism.describe(s, shown),
    }  # fmt: skip
    out |= mechanism.details(s) | certain(bill, s.delta)
    if s.convention != schedule.TRAINED:
        out["convention"] = s.convention
    if s.epochs is not None:
        out["epochs"] = s.epochs
    if calibrated:
        out |= {"target_epsilon": query.target_epsilon, "calibrated": calibrated}
    if query.clip_epsilon is not None:
        out |= {"clipping": "quantile", "clip_epsilon": query.clip_epsilon}
    if query.tuning is not None:
        out |= tuning_figures(bill, s.delta, query.tuning, s.accounting.orders)
    return out


def with_clipping_release(mechanism: Mechanism, s: Setting, clip_epsilon: float | None) -> Setting:
    """``s`` with the quantile release of the clipping norm at ``clip_epsilon`` (a histogram on a Poisson
    sample at the mechanism's q: :func:`dpsweep.privacy.clipping.release`); ``s`` itself for a fixed or
    adaptive C (None) or a mechanism that samples nothing."""
    q = mechanism.sample_rate(s)
    if clip_epsilon is None or q is None:
        return s
    return replace(s, extra=ledger.Ledger((clipping.release(clip_epsilon, q, "histogram"),)))


def calibrated_sigma(mechanism: Mechanism, s: Setting, target_epsilon: float) -> float:
    """The mechanism's smallest σ with ε <= ``target_epsilon`` (its own calibration); InputError where none
    up to 1e6 reaches it."""
    try:
        return mechanism.calibrate(s, target_epsilon)
    except ValueError as err:
        if isinstance(err, InputError):
            raise
        raise InputError(
            "dp.target_epsilon", target_epsilon, "an ε that can be reached with σ <= 1e6 at this B, N and length"
        ) from err


def calibrated_epochs(mechanism: Mechanism, s: Setting, sigma: float, target_epsilon: float) -> int:
    """The most epochs (up to :data:`EPOCHS_MAX`) whose ε stays within ``target_epsilon`` at σ."""

    def eps(epochs: int) -> float:
        return ledger.epsilon(mechanism.ledger(replace(s, epochs=epochs), sigma), s.delta, s.accounting).epsilon

    epochs = calibrate.largest_count(eps, target_epsilon, EPOCHS_MAX)
    if epochs == 0:
        raise InputError("dp.target_epsilon", target_epsilon, f"an ε above that of one epoch at σ={sigma}")
    return epochs


def certain(bill: ledger.Ledger, delta: float) -> dict[str, float]:
    """How certain the ledger's ε is and what it means for an attacker (:mod:`dpsweep.privacy.certainty`):
    the PLD's sound interval [``epsilon_lower``, ``epsilon_upper``] (the upper end is ``epsilon`` under
    pld), μ of Gaussian DP down to δ = ``gdp_delta_allowance`` (Dong, Roth & Su 2022), and a
    membership-inference attacker's largest TPR at 1 % and 10 % FPR and largest advantage (Kairouz, Oh &
    Viswanath 2015). The PLD's profile is computed once (:func:`dpsweep.privacy.certainty.figures`)."""
    found = certainty.figures(bill, delta)
    upper = ledger.epsilon(bill, delta, ledger.Accounting("pld")).epsilon  # the interval's upper end (cached)
    return {"epsilon_lower": found["epsilon_lower"], "epsilon_upper": upper} | {
        k: v for k, v in found.items() if k != "epsilon_lower"
    }


def tuning_figures(bill: ledger.Ledger, delta: float, tuning: Tuning, orders: tuple[float, ...]) -> dict[str, Any]:
    """ε of releasing the best of K runs of this ledger (Papernot & Steinke 2022), with what was asked."""
    tuned = ledger.tuning_epsilon(bill, delta, tuning.mean_trials, tuning.shape, orders)
    out = {
        "epsilon_tuning": tuned.epsilon, "tuning_trials": tuning.mean_trials,
        "tuning_distribution": tuning.distribution, "tuning_alpha": tuned.order,
    }  # fmt: skip
    if tuning.distribution == "tnb":
        out["tuning_eta"] = tuning.eta
    return out
