"""A run's privacy ledger: every release that spent privacy, as a dp-accounting ``DpEvent``, and the
ε of all of them together under the ``rdp``, ``prv`` or ``pld`` accountant.

    from dpsweep.privacy import ledger
    bill = ledger.Ledger((ledger.dpsgd(noise_multiplier=1.1, sample_rate=0.01, steps=1000),))
    ledger.epsilon(bill, delta=1e-5).epsilon                      # RDP, improved conversion
    ledger.epsilon(bill, delta=1e-5, accounting=ledger.Accounting("pld")).epsilon
    ledger.to_json(bill, delta=1e-5)                              # privacy_ledger.json

Events, in dp-accounting's vocabulary (Google's ``dp_accounting.dp_event``):

- DP-SGD: ``SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), steps)`` per segment of
  constant (σ, q); Poisson sampling, add/remove-one neighbours (what Opacus's loader does);
- a pure ε-DP release (a private quantile, :mod:`dpsweep.privacy.stats`): :class:`PureDpEvent`, dpsweep's
  own, because dp-accounting has no event for a generic ε-DP mechanism under add/remove neighbours
  (its ``RandomizedResponseDpEvent`` is for replace-one, and its ``LaplaceDpEvent`` would claim the
  Laplace mechanism's tighter composition, which AboveThreshold does not have).

Accountants (:data:`ACCOUNTANTS`):

- ``rdp``: the sum of each event's RDP curve (:mod:`dpsweep.privacy.rdp`: exact subsampled Gaussian,
  randomized-response bound for pure DP) at the orders of :class:`Accounting`, then converted;
- ``pld``: privacy loss distributions (dp-accounting's ``pld``: Koskela, Jälkö & Honkela 2020;
  Doroshenko et al. 2022, "Connect the Dots"), pessimistic estimates; a pure ε-DP release is the PLD of
  (ε, 0)-DP (``from_privacy_parameters``), which is tight for a generic ε-DP mechanism;
- ``prv``: Opacus's ``PRVAccountant`` (Gopi, Lee & Wutschitz 2021) for the Gaussian steps, which is all
  it supports; pure ε-DP releases are added to its ε by basic composition (Dwork & Roth 2014,
  Thm. 3.16), which is sound and looser than ``pld``. It imports Opacus (and torch).

The ledger is data; these functions are pure. The runner logs ``epsilon`` (the chosen accountant),
``epsilon_rdp``, ``epsilon_prv`` and ``epsilon_pld``, and writes :func:`to_json` as
``privacy_ledger.json``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import attr
import numpy as np
from dp_accounting import dp_event

from dpsweep.privacy import rdp
from dpsweep.registry import Registry

UNIT = "example"  # whom ε protects by default: one example (dp.unit=user: all of one user's examples)
NEIGHBOURS = "add_or_remove_one"


@attr.s(frozen=True, slots=True, auto_attribs=True)
class PureDpEvent(dp_event.DpEvent):
    """A release by an ε-DP mechanism (δ = 0), whatever the mechanism: accounted by the bounds that
    hold for every ε-DP mechanism (see the module docstring)."""

    epsilon: float


@dataclass(frozen=True)
class Entry:
    """One line of the bill: what spent privacy (``name``), its event, the parameters it ran with and
    how it is accounted (``note``)."""

    name: str
    event: dp_event.DpEvent
    params: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class Ledger:
    """Every privacy-spending release of one run, in the order they happened."""

    entries: tuple[Entry, ...] = ()

    def __add__(self, other: Ledger) -> Ledger:
        return Ledger(self.entries + other.entries)

    @property
    def empty(self) -> bool:
        return all(_is_noop(e.event) for e in self.entries)

    def dpsgd_segments(self) -> list[tuple[float, float, int]]:
        """(σ, q, steps) of each DP-SGD entry (:func:`dpsgd`), as an Opacus accountant's history lists them."""
        keys = ("noise_multiplier", "sample_rate", "steps")
        return [tuple(e.params[k] for k in keys) for e in self.entries if e.name == DPSGD]

    def event(self) -> dp_event.DpEvent:
        """The whole run as one dp-accounting event."""
        return dp_event.ComposedDpEvent([e.event for e in self.entries])


DPSGD = "dpsgd"  # the name of DP-SGD's entries


def dpsgd(noise_multiplier: float, sample_rate: float, steps: int) -> Entry:
    """``steps`` DP-SGD steps with Poisson sampling at rate q and noise multiplier σ."""
    step = dp_event.PoissonSampledDpEvent(sample_rate, dp_event.GaussianDpEvent(noise_multiplier))
    return Entry(
        DPSGD,
        dp_event.SelfComposedDpEvent(step, int(steps)),
        {"noise_multiplier": noise_multiplier, "sample_rate": sample_rate, "steps": int(steps)},
        "Poisson-subsampled Gaussian mechanism (Abadi et al. 2016), one event per optimizer step",
    )


def from_history(history: Sequence[tuple[float, float, int]]) -> Ledger:
    """A ledger of the DP-SGD segments in an Opacus accountant's ``history`` ((σ, q, steps) each)."""
    return Ledger(tuple(dpsgd(float(s), float(q), int(n)) for s, q, n in history if int(n) > 0))


def pure_release(name: str, epsilon: float, params: Mapping[str, Any], note: str) -> Entry:
    """A release by an ε-DP mechanism."""
    return Entry(name, PureDpEvent(float(epsilon)), dict(params), note)


def amplified_by_poisson(epsilon: float, sample_rate: float) -> float:
    """ε' of an ε-DP mechanism run on a Poisson sample at rate q of the data (add/remove neighbours):
    log(1 + q(e^ε - 1)) (Li, Qardaji & Su 2012, Thm. 1; tight: Balle, Barthe & Gaboardi 2018, Thm. 8)."""
    return math.log1p(sample_rate * math.expm1(epsilon))


# ---------------------------------------------------------------------------------------------
# walking the events
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Leaf:
    """A mechanism the accountants know, with how many times it ran: a Poisson-subsampled Gaussian
    step (``sample_rate`` 1 for an unsampled Gaussian) or a pure ε-DP release."""

    kind: str  # "gaussian" | "pure"
    count: int
    noise_multiplier: float = 0.0
    sample_rate: float = 1.0
    epsilon: float = 0.0


def leaves(event: dp_event.DpEvent, count: int = 1) -> Iterator[Leaf]:
    """The mechanisms in ``event`` (composed and self-composed events unrolled); ValueError names an
    event no accountant here supports."""
    if isinstance(event, dp_event.NoOpDpEvent):
        return
    if isinstance(event, dp_event.ComposedDpEvent):
        for e in event.events:
            yield from leaves(e, count)
    elif isinstance(event, dp_event.SelfComposedDpEvent):
        yield from leaves(event.event, count * event.count)
    elif isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(event.event, dp_event.GaussianDpEvent):
        yield Leaf("gaussian", count, event.event.noise_multiplier, event.sampling_probability)
    elif isinstance(event, dp_event.GaussianDpEvent):
        yield Leaf("gaussian", count, event.noise_multiplier, 1.0)
    elif isinstance(event, PureDpEvent):
        yield Leaf("pure", count, epsilon=event.epsilon)
    else:
        raise ValueError(f"no dpsweep accountant supports {event!r}")


def _is_noop(event: dp_event.DpEvent) -> bool:
    return all(leaf.count == 0 for leaf in leaves(event))


# ---------------------------------------------------------------------------------------------
# accountants
# ---------------------------------------------------------------------------------------------
PLD_DISCRETIZATION = 1e-4  # dp-accounting's default value_discretization_interval
# A coarser interval for an ε that is only looked at on the way (calibration's search, a run's ε
# before its last epoch): 7-8x faster for DP-SGD on digits (0.17 against 1.2 s on the 2-core VM),
# within 4e-5 relative of it there, and an upper bound too (pessimistic estimate)
COARSE_PLD_DISCRETIZATION = 1e-3


@dataclass(frozen=True)
class Accounting:
    """How ε is computed: an accountant of :data:`ACCOUNTANTS` and, for ``rdp``, a conversion of
    :data:`dpsweep.privacy.rdp.CONVERSIONS` over the RDP ``orders`` (``prv`` and ``pld`` use neither);
    for ``pld``, the interval its privacy losses are discretised on (pessimistically: an upper bound
    on ε whatever the interval, coarser being looser and faster)."""

    accountant: str = "rdp"
    conversion: str = "improved"
    orders: tuple[float, ...] = rdp.DEFAULT_ORDERS
    pld_discretization: float = PLD_DISCRETIZATION


def coarse(accounting: Accounting) -> Accounting:
    """``accounting`` on PLD's coarser interval (:data:`COARSE_PLD_DISCRETIZATION`) where it is PLD on a
    finer one; else itself. Its ε is an upper bound too: under PLD the privacy losses are rounded
    pessimistically whatever the interval (Doroshenko et al., "Connect the Dots: Tighter Discrete
    Approximations of Privacy Loss Distributions", PETS 2022; dp-accounting's
    ``from_gaussian_mechanism(pessimistic_estimate=True)``), coarser being looser and faster."""
    if accounting.accountant == "pld" and accounting.pld_discretization < COARSE_PLD_DISCRETIZATION:
        return replace(accounting, pld_discretization=COARSE_PLD_DISCRETIZATION)
    return accounting


@dataclass(frozen=True)
class Spent:
    """The ε of a ledger at δ, with the accountant that computed it (``order``: RDP's optimal order)."""

    epsilon: float
    delta: float
    accountant: str
    conversion: str | None
    order: float | None


Accountant = Callable[[Ledger, float, Accounting], tuple[float, float | None]]
ACCOUNTANTS: Registry[Accountant] = Registry("accountant")


@functools.lru_cache(maxsize=4096)
def _per_step(kind: str, param: float, sample_rate: float, orders: tuple[float, ...]) -> np.ndarray:
    if kind == "gaussian":
        return rdp.subsampled_gaussian(sample_rate, param, orders)
    return rdp.pure_dp(param, orders)


def rdp_curve(ledger: Ledger, orders: Sequence[float] = rdp.DEFAULT_ORDERS) -> np.ndarray:
    """The ledger's total RDP at each order (RDP composes by addition, Mironov 2017, Prop. 1)."""
    key = tuple(float(a) for a in orders)
    total = np.zeros(len(key))
    for entry in ledger.entries:
        for leaf in leaves(entry.event):
            param = leaf.noise_multiplier if leaf.kind == "gaussian" else leaf.epsilon
            total += leaf.count * _per_step(leaf.kind, param, leaf.sample_rate, key)
    return total


@ACCOUNTANTS.register("rdp")
def _rdp(ledger: Ledger, delta: float, a: Accounting) -> tuple[float, float | None]:
    return rdp.CONVERSIONS.get(a.conversion)(a.orders, rdp_curve(ledger, a.orders), delta)


@ACCOUNTANTS.register("pld")
def _pld(ledger: Ledger, delta: float, a: Accounting) -> tuple[float, float | None]:
    total = pld_of(ledger, a.pld_discretization)
    return (0.0 if total is None else float(total.get_epsilon_for_delta(delta))), None


def pld_of(ledger: Ledger, interval: float = PLD_DISCRETIZATION) -> Any:
    """The ledger's privacy loss distribution (dp-accounting's ``PrivacyLossDistribution``, pessimistic,
    both directions of add/remove-one) on ``interval``, or None for an empty ledger. The run's ε and its
    certainty figures (:mod:`dpsweep.privacy.certainty`) read the same distribution: it is composed once."""
    parts = tuple(leaf for entry in ledger.entries for leaf in leaves(entry.event) if leaf.count > 0)
    return _composed_pld(parts, interval) if parts else None


@functools.lru_cache(maxsize=4)  # the last few ledgers' (a run's plan and its end); up to a few MB each
def _composed_pld(parts: tuple[Leaf, ...], interval: float) -> Any:
    total = None
    for leaf in parts:
        one = _one_pld(replace(leaf, count=1), interval)
        many = one.self_compose(leaf.count) if leaf.count > 1 else one
        total = many if total is None else total.compose(many)
    return total


@functools.lru_cache(maxsize=16)  # a run's step at both intervals, for a few configs; up to 3 MB each
def _one_pld(leaf: Leaf, interval: float) -> Any:
    """The PLD of one run of ``leaf``'s mechanism: a run's ε after each epoch composes the same step's
    PLD again (building it was 60% of that ε's time on the 2-core VM). Composing returns a new PLD and
    leaves this one as it is."""
    from dp_accounting.pld import common
    from dp_accounting.pld import privacy_loss_distribution as pld

    if leaf.kind == "gaussian":
        return pld.from_gaussian_mechanism(
            leaf.noise_multiplier, sampling_prob=leaf.sample_rate, value_discretization_interval=interval
        )
    params = common.DifferentialPrivacyParameters(leaf.epsilon, 0.0)
    return pld.from_privacy_parameters(params, value_discretization_interval=interval)


def scaled_noise(ledger: Ledger, factor: float) -> Ledger:
    """``ledger`` with every Gaussian mechanism's noise multiplier times ``factor`` (its other releases as
    they are): the run's mechanism at another noise level, which a privacy audit tests claims along."""
    return Ledger(tuple(replace(e, event=_scaled(e.event, factor)) for e in ledger.entries))


def _scaled(event: dp_event.DpEvent, factor: float) -> dp_event.DpEvent:
    if isinstance(event, dp_event.GaussianDpEvent):
        return dp_event.GaussianDpEvent(event.noise_multiplier * factor)
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        return dp_event.PoissonSampledDpEvent(event.sampling_probability, _scaled(event.event, factor))
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(_scaled(event.event, factor), event.count)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent([_scaled(e, factor) for e in event.events])
    return event


@ACCOUNTANTS.register("prv")
def _prv(ledger: Ledger, delta: float, a: Accounting) -> tuple[float, float | None]:
    all_leaves = [leaf for e in ledger.entries for leaf in leaves(e.event) if leaf.count > 0]
    history = [(leaf.noise_multiplier, leaf.sample_rate, leaf.count) for leaf in all_leaves if leaf.kind == "gaussian"]
    pure = sum(leaf.count * leaf.epsilon for leaf in all_leaves if leaf.kind == "pure")
    eps = 0.0
    if history:
        import warnings

        from opacus.accountants import PRVAccountant

        accountant = PRVAccountant()
        accountant.history = history
        with warnings.catch_warnings():  # log(1 - q) at q = 1 (an unsampled Gaussian): handled by np.where
            warnings.filterwarnings("ignore", "divide by zero encountered in log", RuntimeWarning)
            eps = float(accountant.get_epsilon(delta=delta))
    return eps + pure, None


# PLD and PRV discretise the privacy loss, whose range grows with ε: past this RDP ε they take minutes
# and gigabytes (digits, B = 64, 8 epochs: σ = 0.1 took 21 s under PLD and 50 s under PRV, which
# returned ∞; σ = 0.03 ran over 2 minutes under PLD, and PRV was killed for memory). Beyond it they
# are not computed and report +inf, a sound bound that no budget admits; RDP still gives a finite ε.
DISCRETISED_MAX_EPSILON = 100.0


def beyond_discretised(ledger: Ledger, delta: float, orders: tuple[float, ...] = rdp.DEFAULT_ORDERS) -> bool:
    """Whether the ledger's RDP ε exceeds :data:`DISCRETISED_MAX_EPSILON` (then PLD and PRV report +inf)."""
    return epsilon(ledger, delta, Accounting("rdp", orders=orders)).epsilon > DISCRETISED_MAX_EPSILON


def not_computed(ledger: Ledger, delta: float, accounting: Accounting, where: str) -> str | None:
    """Why ``accounting`` is refused for this ledger (PLD or PRV beyond :data:`DISCRETISED_MAX_EPSILON`),
    as what to use instead ``where`` (e.g. "for this run"); None when it is computed."""
    if accounting.accountant == "rdp" or not beyond_discretised(ledger, delta, accounting.orders):
        return None
    eps = epsilon(ledger, delta, Accounting("rdp", orders=accounting.orders)).epsilon
    return (
        f"rdp {where}: its RDP ε is {eps:.4g}, above {DISCRETISED_MAX_EPSILON:g}, where PLD and PRV discretise "
        "the privacy loss for minutes and gigabytes to report ε = inf"
    )


def epsilon(ledger: Ledger, delta: float, accounting: Accounting = Accounting()) -> Spent:
    """ε of everything in ``ledger`` at δ. Never negative and never NaN: (ε, δ)-DP implies (ε', δ)-DP
    for every ε' >= ε (Dwork & Roth 2014, Def. 2.4), so a negative bound is reported as 0, and a bound
    that could not be computed (NaN) as +inf, which no budget admits; so is PLD's or PRV's beyond
    :data:`DISCRETISED_MAX_EPSILON`. 0 for an empty ledger."""
    a = accounting
    conversion = a.conversion if a.accountant == "rdp" else None
    compute = ACCOUNTANTS.get(a.accountant, key="dp.accountant")
    if ledger.empty:
        return Spent(0.0, delta, a.accountant, conversion, None)
    if a.accountant != "rdp" and beyond_discretised(ledger, delta, a.orders):
        return Spent(math.inf, delta, a.accountant, conversion, None)
    # Every accountant is a pure function of the ledger's mechanisms (its leaves), δ and the
    # accounting: the jobs of a sweep over seeds, in one process, compute each ε once.
    key = _key(ledger, delta, a)
    found = _COMPUTED.get(key)
    if found is None:
        found = compute(ledger, delta, a)
        if len(_COMPUTED) >= COMPUTED_SIZE:
            _COMPUTED.clear()
        _COMPUTED[key] = found
    eps, order = found
    return Spent(sound_epsilon(eps), delta, a.accountant, conversion, order)


COMPUTED_SIZE = 4096  # ε values kept in this process (then forgotten all at once)
Computed = dict[tuple[tuple["Leaf", ...], float, Accounting], tuple[float, float | None]]
_COMPUTED: Computed = {}


def _key(ledger: Ledger, delta: float, a: Accounting) -> tuple[tuple[Leaf, ...], float, Accounting]:
    return tuple(leaf for e in ledger.entries for leaf in leaves(e.event) if leaf.count > 0), delta, a


def forget() -> None:
    """Drop every remembered ε value (they are recomputed when next asked for)."""
    _COMPUTED.clear()


def sound_epsilon(eps: float) -> float:
    """A computed ε as a guarantee: negative -> 0, NaN -> +inf (see :func:`epsilon`)."""
    return math.inf if math.isnan(eps) else max(0.0, eps)


def epsilons(ledger: Ledger, delta: float, orders: tuple[float, ...] = rdp.DEFAULT_ORDERS) -> dict[str, float]:
    """ε under every accountant (``rdp`` with the improved conversion), by name; beyond
    :data:`DISCRETISED_MAX_EPSILON` only ``rdp`` (PLD and PRV are not computed there)."""
    names = ["rdp"] if beyond_discretised(ledger, delta, orders) else ACCOUNTANTS.names()
    return {name: epsilon(ledger, delta, Accounting(name, orders=orders)).epsilon for name in names}


# ---------------------------------------------------------------------------------------------
# the privacy cost of tuning (Papernot & Steinke 2022)
# ---------------------------------------------------------------------------------------------
# The number of trials K: dp-accounting's RepeatAndSelectDpEvent shape of each distribution.
TUNING_SHAPES: Registry[float] = Registry("tuning distribution")
TUNING_SHAPES.register("poisson")(math.inf)
TUNING_SHAPES.register("geometric")(1.0)
TUNING_SHAPES.register("tnb")(0.5)  # truncated negative binomial with η = 0.5 (--tuning-eta sets η)


def tuning_epsilon(
    ledger: Ledger, delta: float, mean_trials: float, shape: float, orders: tuple[float, ...] = rdp.DEFAULT_ORDERS
) -> Spent:
    """ε of running the procedure in ``ledger`` K times, K random with mean ``mean_trials`` and the
    distribution of ``shape`` (∞: Poisson, 1: geometric, 0 < η < ∞: truncated negative binomial), and
    releasing only the best run: Papernot & Steinke 2022, "Hyperparameter Tuning with Renyi Differential
    Privacy", Thms. 2 and 6, as dp-accounting's ``RepeatAndSelectDpEvent`` in its ``RdpAccountant``.

    dp-accounting evaluates the single run's RDP itself, with the upper bound of its fractional-order
    series (see :mod:`dpsweep.privacy.rdp`), and a pure ε-DP release as ε²/2-zCDP (Bun & Steinke 2016,
    Prop. 1.4): both sound, so the tuning ε is an upper bound, possibly a little above the exact one."""
    from dp_accounting import rdp as dp_rdp

    inner = dp_event.ComposedDpEvent([_native(e.event) for e in ledger.entries])
    accountant = dp_rdp.RdpAccountant(list(orders))
    accountant.compose(dp_event.RepeatAndSelectDpEvent(inner, float(mean_trials), float(shape)))
    eps, order = accountant.get_epsilon_and_optimal_order(delta)
    return Spent(sound_epsilon(float(eps)), delta, "rdp", "improved", float(order))


def _native(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """``event`` with every :class:`PureDpEvent` as dp-accounting's ε²/2-zCDP event."""
    if isinstance(event, PureDpEvent):
        return dp_event.ZCDpEvent(event.epsilon**2 / 2)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent([_native(e) for e in event.events])
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(_native(event.event), event.count)
    return event


# ---------------------------------------------------------------------------------------------
# privacy_ledger.json
# ---------------------------------------------------------------------------------------------
def to_json(
    ledger: Ledger,
    delta: float,
    accounting: Accounting = Accounting(),
    spent: Mapping[str, float] | None = None,
    unit: str = UNIT,
    neighbours: str = NEIGHBOURS,
) -> dict[str, Any]:
    """The ledger as ``privacy_ledger.json``: the unit and neighbouring relation, δ, ε under each
    accountant (``spent``, :func:`epsilons`, when the caller has it), and each event with its parameters,
    its own ε (alone, under RDP and PLD: RDP over-states a pure-DP release on its own; a ledger of one
    event is its own total) and its share of the total: its fraction of the total RDP at the optimal
    order (RDP adds up, so the shares sum to 1)."""
    orders = accounting.orders
    spent = dict(spent) if spent is not None else epsilons(ledger, delta, orders)
    total = epsilon(ledger, delta, Accounting("rdp", accounting.conversion, orders))
    curves = [rdp_curve(Ledger((e,)), orders) for e in ledger.entries]
    at = orders.index(total.order) if total.order in orders else None
    whole = sum(float(c[at]) for c in curves) if at is not None else 0.0
    entries = []
    for entry, curve in zip(ledger.entries, curves, strict=True):
        if len(ledger.entries) == 1:  # the PLD of a long run takes a second: not twice
            alone = {"rdp": total.epsilon, "pld": spent.get("pld", math.inf)}
        else:
            alone = {name: epsilon(Ledger((entry,)), delta, Accounting(name, accounting.conversion, orders)).epsilon
                     for name in ("rdp", "pld")}  # fmt: skip
        entries.append({
            "name": entry.name, "event": _describe(entry.event), "params": dict(entry.params), "note": entry.note,
            "epsilon_alone": {k: v if math.isfinite(v) else None for k, v in alone.items()},  # None: not computed
            "share_of_rdp": float(curve[at]) / whole if at is not None and whole > 0 else None,
        })  # fmt: skip
    return {
        "unit": unit, "neighbours": neighbours, "delta": delta, "accountant": accounting.accountant,
        "conversion": accounting.conversion, "rdp_orders": f"{len(orders)} orders, {min(orders):g} to {max(orders):g}",
        "optimal_rdp_order": total.order, "epsilon": spent, "events": entries,
        "not_computed": {
            name: f"the RDP ε {total.epsilon:.6g} exceeds {DISCRETISED_MAX_EPSILON:g}, where {name}'s discretised "
                  "privacy loss takes minutes and gigabytes (dpsweep.privacy.ledger.DISCRETISED_MAX_EPSILON)"
            for name in ACCOUNTANTS.names() if name not in spent
        },
    }  # fmt: skip


def _describe(event: dp_event.DpEvent) -> Any:
    """A JSON form of a DpEvent: its class name and fields, nested."""
    if attr.has(type(event)):
        return {"type": type(event).__name__} | {
            f.name: _describe(getattr(event, f.name)) for f in attr.fields(type(event))
        }
    if isinstance(event, list):
        return [_describe(e) for e in event]
    return event
