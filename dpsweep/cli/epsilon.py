"""``dpsweep-epsilon``: the privacy cost of a mechanism's configuration, before training.

In the style of the field's ``compute_dp_sgd_privacy`` script::

    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15                 # ε after 15 epochs
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15 --json          # one JSON object
    dpsweep-epsilon -s 60000 -b 150 -e 15 --target-epsilon 2     # σ for ε <= 2
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 --target-epsilon 2    # most epochs with ε <= 2
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15 --plot plots/   # ε against each knob, as PNG
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15 --clipping quantile --clip-epsilon 1   # with a private C
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15 --tuning-trials 10 --tuning-distribution poisson
    dpsweep-epsilon --mechanism NAME -s 50 -b 5 -e 30 --target-epsilon 8   # any registered mechanism

``--mechanism`` takes any mechanism of the registry (``dpsweep.mechanisms``; DP-SGD by default), with
its own options (each mechanism's docstring gives its command). Its ledger is the one a run of the
same N, B, σ, epochs, δ and clipping records, so the ε printed here is exactly the ε ``dpsweep`` logs
at the end of such a run; calibration is the mechanism's (one bisection over σ -> ledger).
``--clipping quantile`` adds the clipping-norm release (``dpsweep.privacy.clipping``; calibration then
spends the target with it), for a mechanism that samples. ``--tuning-trials M`` also prints the ε of
tuning: the best of K runs, K random with mean M (Papernot & Steinke 2022, dp-accounting's
RepeatAndSelectDpEvent). Bad input exits with 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from dpsweep import mechanisms
from dpsweep.cli.errors import exits_on_bad_input
from dpsweep.cli.options import plain_text
from dpsweep.cli.script import run_script
from dpsweep.cli.sigma import SIGMA_DIGITS
from dpsweep.errors import InputError
from dpsweep.mechanisms import query
from dpsweep.privacy import certainty, clipping, ledger, ranges, rdp, schedule


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpsweep-epsilon", description=plain_text(__doc__.split("\n")[0]))
    p.add_argument("-s", "--dataset-size", type=int, required=True, metavar="N", help="training-set size N")
    p.add_argument("-b", "--batch-size", type=int, required=True, metavar="B", help="logical batch size B")
    p.add_argument("-n", "--noise-multiplier", type=float, metavar="SIGMA", help="noise multiplier σ")
    p.add_argument("-e", "--epochs", type=int, help="number of epochs (or give --steps)")
    p.add_argument("--steps", type=int, help="number of optimizer steps (or give -e)")
    p.add_argument("-d", "--delta", type=float, default=1e-5, help="δ, in (0, 1) and below 1/N (default 1e-5)")
    p.add_argument("--accountant", choices=ledger.ACCOUNTANTS.names(), default="pld",
                   help="pld (dp-accounting's, the tightest: default), prv (Gopi et al. 2021, Opacus's) or rdp "
                   "(Mironov 2017, to reproduce papers)")  # fmt: skip
    p.add_argument("--conversion", choices=rdp.CONVERSIONS.names(), default="improved",
                   help="RDP to (ε, δ): improved (Balle et al. 2020, Opacus) or classic (Mironov 2017)")  # fmt: skip
    p.add_argument("--alphas", nargs="+", metavar="ALPHA",
                   help="RDP orders: 'default' (to 1024), 'opacus' (Opacus's and TF Privacy's, to 63, "
                   "to reproduce published figures) or a list of orders")  # fmt: skip
    p.add_argument("--target-epsilon", type=float, metavar="EPS",
                   help="calibrate σ (given -e/--steps) or the epochs (given -n) so that ε <= EPS")  # fmt: skip
    p.add_argument("--clipping", choices=["fixed", "quantile", "adaptive"], default="fixed",
                   help="how C is chosen: quantile adds its release (priced with --clip-epsilon); adaptive "
                   "costs what fixed does (its count noise is inside σ)")  # fmt: skip
    p.add_argument("--clip-epsilon", type=float, default=clipping.DEFAULT_EPSILON, metavar="EPS",
                   help="ε of the quantile release, before Poisson amplification (as dp.clip_epsilon)")  # fmt: skip
    p.add_argument("--tuning-trials", type=float, metavar="M", help="the mean number K of tuning trials")
    p.add_argument("--tuning-distribution", choices=ledger.TUNING_SHAPES.names(), default="poisson",
                   help="the distribution of K (Papernot & Steinke 2022)")  # fmt: skip
    p.add_argument("--tuning-eta", type=float, default=0.5, metavar="ETA",
                   help="shape η > 0 of the truncated negative binomial (default 0.5)")  # fmt: skip
    p.add_argument("--mechanism", choices=mechanisms.MECHANISMS.names(), default="dpsgd",
                   help=plain_text("; ".join(f"{n}: {mechanisms.get(n).label}, {mechanisms.get(n).note}"
                                             for n in mechanisms.MECHANISMS.names())))  # fmt: skip
    for name, option in _options():
        if option.kind is bool:
            p.add_argument(option.flag, action="store_true", help=plain_text(f"{name}: {option.help}"))
        else:
            p.add_argument(option.flag, type=option.kind, help=plain_text(f"{name}: {option.help}"))
    p.add_argument("--convention", choices=list(schedule.CONVENTIONS), default=schedule.TRAINED,
                   help="how q and the steps are counted: opacus (q = 1/ceil(N/B), ceil(N/B) steps an epoch: "
                   "what dpsweep trains) or tf_privacy (q = B/N, ceil(epochs·N/B) steps: TF Privacy's "
                   "compute_dp_sgd_privacy, to reproduce its published figures)")  # fmt: skip
    p.add_argument("--allow-large-delta", action="store_true", help="permit δ >= 1/N (voids the guarantee)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write plots of ε against each knob to DIR")
    p.add_argument("--plot-format", choices=PLOT_FORMATS, default="png",
                   help="png (300 dpi), or pdf or svg: vector, with the fonts embedded as TrueType")  # fmt: skip
    return p


def _check(a: argparse.Namespace) -> None:
    """Reject bad input with the flag, the value and the allowed range (InputError: exit code 2).
    The ranges are those of the config keys (``dpsweep.privacy.ranges``)."""
    ranges.check("dataset_size", "-s/--dataset-size", a.dataset_size)
    ranges.check_batch_size("-b/--batch-size", a.batch_size, a.dataset_size)
    if a.noise_multiplier is not None:
        ranges.check("noise_multiplier", "-n/--noise-multiplier", a.noise_multiplier)
    ranges.check_delta("-d/--delta", a.delta, a.dataset_size, a.allow_large_delta, "--allow-large-delta")
    if a.epochs is not None:
        ranges.check("epochs", "-e/--epochs", a.epochs)
    if a.steps is not None:
        ranges.check("steps", "--steps", a.steps)
    if a.alphas is not None:
        a.alphas = _orders(a.alphas)
    if a.clipping == "quantile" and not (a.clip_epsilon > 0 and math.isfinite(a.clip_epsilon)):
        raise InputError("--clip-epsilon", a.clip_epsilon, "a positive ε (finite) for the quantile release")
    if a.tuning_trials is not None and not (a.tuning_trials > 1 and math.isfinite(a.tuning_trials)):
        raise InputError("--tuning-trials", a.tuning_trials, "a finite mean number of trials above 1")
    if a.tuning_distribution == "tnb" and not (a.tuning_eta > 0 and math.isfinite(a.tuning_eta)):
        raise InputError("--tuning-eta", a.tuning_eta, "a shape η > 0 (η = 1: geometric; poisson is η -> ∞)")
    if a.target_epsilon is not None:
        ranges.check("target_epsilon", "--target-epsilon", a.target_epsilon)
        if a.conversion != "improved":
            raise InputError(
                "--target-epsilon", a.target_epsilon, "used with the improved conversion, as the trainer "
                "calibrates: drop --conversion classic, or calibrate without it",
            )  # fmt: skip
    given = (a.epochs is not None) + (a.steps is not None)
    length = ("-e/--epochs", a.epochs) if a.epochs is not None else ("--steps", a.steps)
    if given == 2:
        raise InputError("-e/--epochs", a.epochs, "-e/--epochs or --steps, not both")
    if a.target_epsilon is not None and a.noise_multiplier is not None:
        if given:
            raise InputError(
                length[0], length[1], "left out with --target-epsilon and -n: the epochs are what is calibrated"
            )
    elif a.target_epsilon is None and a.noise_multiplier is None:
        raise InputError("-n/--noise-multiplier", None, "a noise multiplier σ (or --target-epsilon to calibrate it)")
    elif given == 0:
        raise InputError("-e/--epochs or --steps", None, "the training length: -e/--epochs or --steps")
    if a.plot is not None:
        _check_plot_dir(a.plot)


def _check_plot_dir(folder: Path) -> None:
    """--plot: a directory that exists, or can be made, and can be written (checked before any work;
    what the file system refuses only when the plots are written is refused then, by :func:`_plots`)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:  # the nearest part of it that exists
        existing = existing.parent
    if not existing.is_dir():
        raise InputError("--plot", str(folder), f"a directory for the plots ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError("--plot", str(folder), f"a directory dpsweep-epsilon can write ({existing} is not writable)")


def _orders(given: list[str]) -> tuple[float, ...]:
    """--alphas: a grid's name (one word) or a list of orders, each > 1."""
    if len(given) == 1 and given[0] in rdp.ORDER_GRIDS.names():
        return rdp.ORDER_GRIDS.get(given[0])
    try:
        orders = [float(x) for x in given]
    except ValueError as err:
        raise InputError(
            "--alphas", " ".join(given), f"one of {', '.join(rdp.ORDER_GRIDS.names())}, or numbers"
        ) from err
    ranges.check("rdp_orders", "--alphas", orders)
    if max(orders) > RDP_ORDER_MAX:
        raise InputError(
            "--alphas", " ".join(given), f"RDP orders of at most {RDP_ORDER_MAX:g} (the default grid reaches "
            f"{max(rdp.DEFAULT_ORDERS):g}; an integer order α sums α + 1 terms, held in memory at once)",
        )  # fmt: skip
    return tuple(orders)


RDP_ORDER_MAX = 10_000.0  # --alphas: the largest order (1e308 asked numpy for an array of 1e308 terms)


def _accounting(a: argparse.Namespace) -> ledger.Accounting:
    return ledger.Accounting(a.accountant, a.conversion, a.alphas or rdp.DEFAULT_ORDERS)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse, check and compute; returns the JSON object (also printed). Bad input raises InputError."""
    a = _parser().parse_args(argv)
    _check(a)
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    out = price(a, mechanisms.get(a.mechanism, key="--mechanism"))
    print(json.dumps(out) if a.json else statement(out))
    return out


def _options() -> list[tuple[str, mechanisms.Option]]:
    """Every mechanism's own options, with the mechanism that declares it."""
    return [(n, o) for n in mechanisms.MECHANISMS.names() for o in mechanisms.get(n).options]


def _dest(option: mechanisms.Option) -> str:
    return option.flag.lstrip("-").replace("-", "_")


# config keys named by the privacy code -> this command's flags
PLOT_FORMATS = ("png", "pdf", "svg")  # --plot-format (dpsweep.analysis.privacy_plots writes them)
FLAGS = {
    "dp.accountant": "--accountant", "train.epochs": "-e/--epochs", "train.steps": "--steps",
    "dp.target_epsilon": "--target-epsilon", "dp.clipping": "--clipping", "dp.mechanism": "--mechanism",
}  # fmt: skip


def _setting(a: argparse.Namespace, mechanism: mechanisms.Mechanism) -> mechanisms.Setting:
    """The command line as the mechanism's setting (without the clipping norm's release, which
    :func:`dpsweep.mechanisms.query.price` adds); refuses another mechanism's options."""
    for name, option in _options():
        value = getattr(a, _dest(option))
        if value not in (None, False) and option not in mechanism.options:
            raise InputError(option.flag, value, f"used with --mechanism {name} only")
    options = {o.key: getattr(a, _dest(o)) for o in mechanism.options}
    if a.convention not in mechanism.conventions:
        allowed = " or ".join(mechanism.conventions)
        raise InputError("--convention", a.convention, f"{allowed} with --mechanism {a.mechanism}")
    base = mechanisms.Setting(a.dataset_size, a.batch_size, a.epochs, a.delta, _accounting(a), a.steps,
                              options=options, convention=a.convention)  # fmt: skip
    if a.clipping != "fixed" and not mechanism.sampled:
        raise InputError("--clipping", a.clipping, f"fixed with --mechanism {a.mechanism} (it samples nothing)")
    if a.plot is not None and a.convention != schedule.TRAINED:
        raise InputError("--plot", str(a.plot), "left out with --convention tf_privacy (the plots use dpsweep's)")
    if a.plot is not None and not mechanism.sampled:
        raise InputError("--plot", str(a.plot), f"left out with --mechanism {a.mechanism}: the plots vary q")
    return base


def price(a: argparse.Namespace, mechanism: mechanisms.Mechanism) -> dict[str, Any]:
    """ε of ``mechanism`` (and the releases and tuning asked for), or σ or the epochs calibrated
    (:func:`dpsweep.mechanisms.query.price`), and the plots asked for."""
    try:
        out = query.price(mechanism, _query(a, _setting(a, mechanism)), described_digits=SIGMA_DIGITS)
        if a.plot is not None:
            out["plots"] = _plots(a, out["noise_multiplier"], out["steps"])
        return out
    except InputError as err:  # the privacy code names config keys: name this command's flags
        flags = FLAGS | {f"dp.{o.key}": o.flag for _, o in _options()}
        if err.key in flags:
            raise InputError(flags[err.key], err.value, err.allowed) from err
        raise


def _query(a: argparse.Namespace, setting: mechanisms.Setting) -> query.Query:
    """The command line as the question :func:`dpsweep.mechanisms.query.price` answers."""
    tuning = None
    if a.tuning_trials is not None:
        tuning = query.Tuning(a.tuning_trials, a.tuning_distribution, a.tuning_eta)
    clip_epsilon = a.clip_epsilon if a.clipping == "quantile" else None
    return query.Query(a.mechanism, setting, a.noise_multiplier, a.target_epsilon, clip_epsilon, tuning)


def certainty_text(o: dict[str, Any]) -> str:
    """The lines of :func:`dpsweep.mechanisms.query.certain`'s figures: the interval (the PLD's, whatever
    the accountant; its relative width where it exceeds 1 %), μ and the attack risk."""
    lower, upper = o["epsilon_lower"], o["epsilon_upper"]
    whose = "" if o["accountant"] == "pld" else " (the interval is the PLD's: its upper end is the PLD accountant's ε)"
    if not math.isfinite(upper):
        return "\nThe PLD accountant does not compute this ε (beyond its reach): no interval, μ or attack risk."
    text = f"\nThe true ε at δ = {o['delta']:g} lies in [{lower:.6g}, {upper:.6g}]{whose}"
    width = certainty.Interval(lower, upper).relative_width
    text += f"; its width is {100 * width:.3g} % of ε." if width > WIDTH_SHOWN else "."
    return text + (
        f"\nIt is μ-GDP with μ = {o['mu_gdp']:.4g} (up to δ = {o['gdp_delta_allowance']:.2g}); a membership-inference "
        f"attacker's TPR is at most {o['tpr_at_1pct']:.4g} at 1 % FPR and {o['tpr_at_10pct']:.4g} at 10 % FPR, "
        f"its advantage (TPR - FPR) at most {o['mia_advantage']:.4g}."
    )


WIDTH_SHOWN = 0.01  # the interval's relative width is printed where it exceeds 1 %


def _plots(a: argparse.Namespace, sigma: float, steps: int) -> list[str]:
    from dpsweep.analysis.privacy_plots import plot_all

    try:
        paths = plot_all(a.plot, n=a.dataset_size, batch_size=a.batch_size, noise_multiplier=sigma, steps=steps,
                         delta=a.delta, fmt=a.plot_format)  # fmt: skip
    except OSError as err:  # what only writing finds: a full disk, a file system that refuses (/proc)
        raise InputError("--plot", str(a.plot), f"a directory the plots can be written to ({err})") from err
    return [str(f) for f in paths]


def statement(o: dict[str, Any]) -> str:
    """The readable form of the result."""
    how = f"{o['accountant'].upper()} accountant" + (f", {o['conversion']} conversion" if o["conversion"] else "")
    text = (
        f"{o['description']}, satisfies differential privacy with ε = {o['epsilon']:.6g} and "
        f"δ = {o['delta']:g} ({how}; neighbours: {o['neighbours'].replace('_', ' ')})."
    )
    if o["alpha"] is not None:
        text += f"\nThe optimal RDP order is α = {o['alpha']:g}."
    if o.get("clipping"):
        text += f"\nIt includes the {o['clip_epsilon']:g}-DP quantile release of the clipping norm (amplified by q)."
    if o.get("calibrated"):
        text += f"\n{o['calibrated']} was calibrated for ε <= {o['target_epsilon']:g}."
        if o["calibrated"] == "noise_multiplier":
            text += (
                f" σ is shown rounded up to {SIGMA_DIGITS} significant digits (a run at the σ shown spends at most "
                "that ε); --json gives it whole."
            )
    if "epsilon_lower" in o:
        text += certainty_text(o)
    if "epsilon_tuning" in o:
        text += (
            f"\nTuning: releasing the best of K runs, K ~ {o['tuning_distribution']} with mean {o['tuning_trials']:g}, "
            f"costs ε = {o['epsilon_tuning']:.6g} at δ = {o['delta']:g} (RDP, Papernot & Steinke 2022), "
            f"against ε = {o['epsilon']:.6g} for one run."
        )
    for f in o.get("plots", []):
        text += f"\nwrote {f}"
    return text


@exits_on_bad_input("dpsweep-epsilon")
def main(argv: Sequence[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv)
    return 0


def console() -> NoReturn:
    """The console script: its secrets handed over, ``main``, then its exit (``dpsweep.cli.script``)."""
    run_script(main, "dpsweep-epsilon")


if __name__ == "__main__":
    console()
