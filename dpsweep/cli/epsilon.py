"""``dpsweep-epsilon``: the privacy cost of a DP-SGD configuration, before training.

In the style of the field's ``compute_dp_sgd_privacy`` script::

    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15                 # ε after 15 epochs
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15 --json          # one JSON object
    dpsweep-epsilon -s 60000 -b 150 -e 15 --target-epsilon 2     # σ for ε <= 2
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 --target-epsilon 2    # most epochs with ε <= 2
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15 --plot plots/   # ε against each knob, as PNG
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15 --clipping quantile --clip-epsilon 1   # with a private C
    dpsweep-epsilon -s 60000 -b 150 -n 1.3 -e 15 --tuning-trials 10 --tuning-distribution poisson
    dpsweep-epsilon --mechanism dpftrl -s 60000 -b 250 -e 100 -n 46.3 --restart-every 20 --tree-completion
    dpsweep-epsilon --mechanism dpftrl -s 50 -b 5 -e 30 --target-epsilon 8   # user level: N = users

Steps follow Opacus's Poisson loader (see ``dpsweep.privacy.schedule``), so the ε printed here is exactly the
ε ``dpsweep`` logs at the end of a run with the same N, B, σ, epochs, δ and clipping. ``--clipping
quantile`` adds the clipping-norm release (``dpsweep.privacy.clipping``; calibration then spends the target
with it). ``--tuning-trials M`` also prints the ε of tuning: the best of K runs, K random with mean M
(Papernot & Steinke 2022, dp-accounting's RepeatAndSelectDpEvent). ``--mechanism dpftrl`` prices
DP-FTRL instead (Kairouz et al. 2021; ``dpsweep.privacy.tree``): ceil(N/B) batches per epoch in a
fixed order, tree aggregation restarted every ``--restart-every`` epochs, one Gaussian mechanism of
the tree's sensitivity, no sampling and so no amplification. Bad input exits with 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from dpsweep.cli.errors import exits_on_bad_input
from dpsweep.errors import InputError
from dpsweep.privacy import clipping, ledger, ranges, rdp
from dpsweep.privacy import schedule as privacy
from dpsweep.process.shutdown import run_then_exit
from dpsweep.registry import Registry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dpsweep-epsilon",
        description="Privacy cost (ε, δ) of DP-SGD with Poisson sampling (add/remove one example), "
        "from dpsweep's privacy ledger.",
    )
    p.add_argument("-s", "--dataset-size", type=int, required=True, metavar="N", help="training-set size N")
    p.add_argument("-b", "--batch-size", type=int, required=True, metavar="B", help="logical batch size B")
    p.add_argument("-n", "--noise-multiplier", type=float, metavar="SIGMA", help="noise multiplier σ")
    p.add_argument("-e", "--epochs", type=int, help="number of epochs (or give --steps)")
    p.add_argument("--steps", type=int, help="number of optimizer steps (or give -e)")
    p.add_argument("-d", "--delta", type=float, default=1e-5, help="δ, in (0, 1) and below 1/N (default 1e-5)")
    p.add_argument("--accountant", choices=ledger.ACCOUNTANTS.names(), default="rdp",
                   help="rdp (Mironov 2017), prv (Gopi et al. 2021, Opacus's) or pld (dp-accounting's)")  # fmt: skip
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
    p.add_argument("--mechanism", choices=MECHANISMS.names(), default="dpsgd",
                   help="dpsgd (Poisson DP-SGD, default) or dpftrl (tree aggregation: no sampling)")  # fmt: skip
    p.add_argument("--restart-every", type=int, metavar="EPOCHS",
                   help="dpftrl: restart the tree every this many epochs (default: never)")  # fmt: skip
    p.add_argument("--tree-completion", action="store_true",
                   help="dpftrl: complete each tree with virtual steps before a restart")  # fmt: skip
    p.add_argument("--allow-large-delta", action="store_true", help="permit δ >= 1/N (voids the guarantee)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write PNG plots of ε against each knob to DIR")
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
    if a.clipping == "quantile" and not a.clip_epsilon > 0:
        raise InputError("--clip-epsilon", a.clip_epsilon, "a positive ε for the quantile release")
    if a.tuning_trials is not None and not a.tuning_trials > 1:
        raise InputError("--tuning-trials", a.tuning_trials, "a mean number of trials above 1")
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
    return tuple(orders)


def _accounting(a: argparse.Namespace) -> ledger.Accounting:
    return ledger.Accounting(a.accountant, a.conversion, a.alphas or rdp.DEFAULT_ORDERS)


def _extra(a: argparse.Namespace) -> ledger.Ledger:
    """The releases besides the steps: the quantile clipping norm, on a Poisson sample at the run's q."""
    if a.clipping != "quantile":
        return ledger.Ledger()
    return ledger.Ledger((clipping.release(a.clip_epsilon, _schedule(a).sample_rate, "histogram"),))


def _result(a: argparse.Namespace, sigma: float, epochs: int | None, steps: int | None) -> privacy.EpsilonResult:
    return privacy.epsilon(
        _schedule(a), noise_multiplier=sigma, delta=a.delta, epochs=epochs, steps=steps, accounting=_accounting(a),
        extra=_extra(a),
    )  # fmt: skip


def _tuning_shape(a: argparse.Namespace) -> float:
    return a.tuning_eta if a.tuning_distribution == "tnb" else ledger.TUNING_SHAPES.get(a.tuning_distribution)


def _schedule(a: argparse.Namespace) -> privacy.PoissonSchedule:
    return privacy.poisson_schedule(a.dataset_size, a.batch_size)


def run(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse, check and compute; returns the JSON object (also printed). Bad input raises InputError."""
    a = _parser().parse_args(argv)
    _check(a)
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    out = MECHANISMS.get(a.mechanism, key="--mechanism")(a)
    print(json.dumps(out) if a.json else statement(out))
    return out


def _dpsgd(a: argparse.Namespace) -> dict[str, Any]:
    """ε of DP-SGD with Poisson sampling (and the releases and tuning asked for)."""
    if a.restart_every is not None or a.tree_completion:
        flag, value = (
            ("--restart-every", a.restart_every) if a.restart_every is not None else ("--tree-completion", True)
        )
        raise InputError(flag, value, "used with --mechanism dpftrl only (DP-SGD has no tree)")
    epochs, steps, sigma = a.epochs, a.steps, a.noise_multiplier
    calibrated: str | None = None
    if a.target_epsilon is not None and sigma is None:
        try:
            sigma = privacy.calibrate_noise(
                _schedule(a), target_epsilon=a.target_epsilon, delta=a.delta, epochs=epochs, steps=steps,
                accounting=_accounting(a), extra=_extra(a),
            )  # fmt: skip
        except ValueError as err:
            raise InputError(
                "--target-epsilon", a.target_epsilon, "an ε that can be reached with σ <= 1e6 at this B, N and length"
            ) from err
        calibrated = "noise_multiplier"
    elif a.target_epsilon is not None:
        epochs = privacy.calibrate_epochs(
            _schedule(a), target_epsilon=a.target_epsilon, noise_multiplier=sigma, delta=a.delta,
            accounting=_accounting(a), extra=_extra(a),
        )  # fmt: skip
        if epochs == 0:
            raise InputError("--target-epsilon", a.target_epsilon, f"an ε above that of one epoch at σ={sigma}")
        calibrated = "epochs"
    r = _result(a, sigma, epochs, steps)
    bill = privacy.run_ledger(_schedule(a), r.noise_multiplier, r.steps, _extra(a))
    why = ledger.not_computed(bill, a.delta, _accounting(a), "here")
    if why is not None:
        raise InputError("--accountant", a.accountant, why)
    out: dict[str, Any] = {
        "epsilon": r.epsilon, "delta": r.delta, "alpha": r.alpha, "steps": r.steps,
        "sample_rate": r.sample_rate, "noise_multiplier": r.noise_multiplier, "accountant": r.accountant,
        "conversion": r.conversion,
    }  # fmt: skip
    if calibrated:
        out |= {"target_epsilon": a.target_epsilon, "calibrated": calibrated}
    if a.clipping == "quantile":
        out |= {"clipping": "quantile", "clip_epsilon": a.clip_epsilon}
    if a.tuning_trials is not None:
        tuned = ledger.tuning_epsilon(bill, a.delta, a.tuning_trials, _tuning_shape(a), _accounting(a).orders)
        out |= {
            "epsilon_tuning": tuned.epsilon, "tuning_trials": a.tuning_trials,
            "tuning_distribution": a.tuning_distribution, "tuning_alpha": tuned.order,
        }  # fmt: skip
        if a.tuning_distribution == "tnb":
            out["tuning_eta"] = a.tuning_eta
    if epochs is not None:
        out["epochs"] = epochs
    if a.plot is not None:
        from dpsweep.analysis.privacy_plots import plot_all

        paths = plot_all(
            a.plot, n=a.dataset_size, batch_size=a.batch_size, noise_multiplier=r.noise_multiplier, steps=r.steps,
            delta=a.delta,
        )  # fmt: skip
        out["plots"] = [str(f) for f in paths]
    return out


def _dpftrl(a: argparse.Namespace) -> dict[str, Any]:
    """ε of DP-FTRL: ceil(N/B) batches per epoch, tree aggregation (``dpsweep.privacy.tree``)."""
    from dpsweep.privacy import tree as ftrl_accounting

    for flag, value, given in (
        ("--steps", a.steps, a.steps is not None), ("--clipping", a.clipping, a.clipping != "fixed"),
        ("--tuning-trials", a.tuning_trials, a.tuning_trials is not None), ("--plot", a.plot, a.plot is not None),
        ("--accountant", a.accountant, a.accountant == "prv"), ("--alphas", a.alphas, a.alphas is not None),
    ):  # fmt: skip
        if given:
            raise InputError(flag, value, "left out with --mechanism dpftrl (rdp or pld; whole epochs: -e)")
    if a.epochs is None:
        raise InputError("-e/--epochs", None, "the number of epochs with --mechanism dpftrl (calibrate σ with -e)")
    steps_per_epoch = math.ceil(a.dataset_size / a.batch_size)  # each example in one batch per epoch
    shape = (steps_per_epoch, a.epochs, a.restart_every, a.tree_completion)
    try:  # also checks the restart period against the run
        sensitivity_squared = ftrl_accounting.ftrl_sensitivity_squared(*shape)
    except InputError as err:
        flag = {"dp.ftrl_restart_every": "--restart-every", "train.epochs": "-e/--epochs"}.get(err.key, err.key)
        raise InputError(flag, err.value, err.allowed) from err
    sigma = a.noise_multiplier
    if a.target_epsilon is not None:
        sigma = ftrl_accounting.calibrate_ftrl_noise(
            a.target_epsilon, *shape[:2], a.delta, *shape[2:], accountant=a.accountant
        )
    bill = ledger.Ledger((ftrl_accounting.ftrl_entry(sigma, *shape),))  # what a run's ledger holds
    eps = ledger.epsilon(bill, a.delta, _accounting(a)).epsilon
    out: dict[str, Any] = {
        "mechanism": "dpftrl", "epsilon": eps, "delta": a.delta, "alpha": None, "steps": steps_per_epoch * a.epochs,
        "epochs": a.epochs, "steps_per_epoch": steps_per_epoch, "sample_rate": None, "noise_multiplier": sigma,
        "restart_every": a.restart_every, "tree_completion": a.tree_completion,
        "sensitivity_squared": sensitivity_squared, "accountant": a.accountant,
        "conversion": a.conversion if a.accountant == "rdp" else None, "neighbours": "replace_one_with_zero",
    }  # fmt: skip
    if a.target_epsilon is not None:
        out |= {"target_epsilon": a.target_epsilon, "calibrated": "noise_multiplier"}
    return out


MECHANISMS: Registry[Any] = Registry("mechanism")
MECHANISMS.register("dpsgd")(_dpsgd)
MECHANISMS.register("dpftrl")(_dpftrl)


def statement(o: dict[str, Any]) -> str:
    """The readable form of the result."""
    how = f"{o['accountant'].upper()} accountant" + (f", {o['conversion']} conversion" if o["conversion"] else "")
    if o.get("mechanism") == "dpftrl":
        restarts = f", the tree restarted every {o['restart_every']} epochs" if o["restart_every"] else ""
        completion = " with tree completion" if o["tree_completion"] and o["restart_every"] else ""
        text = (
            f"DP-FTRL with noise multiplier σ = {o['noise_multiplier']:.6g} over {o['steps']} steps "
            f"({o['epochs']} epochs of {o['steps_per_epoch']} batches in a fixed order{restarts}{completion}; "
            f"no sampling, no amplification; tree sensitivity Δ² = {o['sensitivity_squared']}) satisfies "
            f"differential privacy with ε = {o['epsilon']:.6g} and δ = {o['delta']:g} ({how}; one example "
            "replaced by a zero record, Kairouz et al. 2021)."
        )
        if o.get("calibrated"):
            text += f"\n{o['calibrated']} was calibrated for ε <= {o['target_epsilon']:g}."
        return text
    text = (
        f"DP-SGD with sample rate q = {o['sample_rate']:.6g} and noise multiplier σ = {o['noise_multiplier']:.6g}, "
        f"iterated over {o['steps']} steps{_epochs(o)}, satisfies differential privacy with "
        f"ε = {o['epsilon']:.6g} and δ = {o['delta']:g} ({how})."
    )
    if o["alpha"] is not None:
        text += f"\nThe optimal RDP order is α = {o['alpha']:g}."
    if o.get("clipping"):
        text += f"\nIt includes the {o['clip_epsilon']:g}-DP quantile release of the clipping norm (amplified by q)."
    if o.get("calibrated"):
        text += f"\n{o['calibrated']} was calibrated for ε <= {o['target_epsilon']:g}."
    if "epsilon_tuning" in o:
        text += (
            f"\nTuning: releasing the best of K runs, K ~ {o['tuning_distribution']} with mean {o['tuning_trials']:g}, "
            f"costs ε = {o['epsilon_tuning']:.6g} at δ = {o['delta']:g} (RDP, Papernot & Steinke 2022), "
            f"against ε = {o['epsilon']:.6g} for one run."
        )
    for f in o.get("plots", []):
        text += f"\nwrote {f}"
    return text


def _epochs(o: dict[str, Any]) -> str:
    return f" ({o['epochs']} epochs)" if "epochs" in o else ""


@exits_on_bad_input("dpsweep-epsilon")
def main(argv: Sequence[str] | None = None) -> int:
    run(sys.argv[1:] if argv is None else argv)
    return 0


def console() -> NoReturn:
    """The console script: ``main``, then the process ends without the interpreter's teardown
    (``dpsweep.process.shutdown``)."""
    run_then_exit(main)


if __name__ == "__main__":
    console()
