"""``dpsweep-memory``: probe the memory of configs, fit per-stage memory models, predict OOM before launch.

    dpsweep-memory probe train.batch_size=16,64,256 model.hidden_units=32,128   # one process per config
    dpsweep-memory probe experiment=flowers_vgg16 launcher=slurm launcher.gpus_per_job=1 \\
        train.batch_size=8,32,128 model.hidden_units=128,512,2048 dataset.downscale=1,2,4
    dpsweep-memory fit --experiment dpsweep-probes           # every model probed (probes have their own experiment)
    dpsweep-memory fit --csv probes.csv --model cnn --out memory_model.json
    dpsweep-memory predict train.batch_size=512 --gpu-memory 16GiB --memory-model memory_model.json

``probe`` runs only the first training iteration of each config (``train.probe=true``), each in a fresh
process through a launcher (``launcher=local`` unless one is given; never in-process, where the
allocator's cache would carry over from one config to the next), and in parallel where the device
allows: one job per GPU, or one per CPU core on the CPU twin. Each probe is an MLflow run tagged
``probe=true`` holding the four stage levels and deltas, the iteration peak and the reserved peak
(``system/memory/*_mib`` metrics in MiB, read from the CUDA caching allocator, or from the ``cpu-tensors``
census on CPU, tagged ``memory.backend``; the probe table holds them in bytes, and older probes' metrics
in bytes, ``memory/*_bytes`` and ``memory.*_bytes``, are read too). Every config is measured afresh,
even one probed before (that probe may be of another device), and this invocation's probes are written
as CSV. Probes take one step and
are not results: ``sweep.max_epsilon`` does not apply to them.

``fit`` fits each stage's allocated bytes as a linear function of config features, by least squares
and as an upper envelope (a linear program), prints the formulas and k-fold held-out errors, writes a
residual plot and saves the models as JSON for ``predict``, ``dpsweep-plan --memory-model`` and
``train.memory_model``. See :mod:`dpsweep.analysis.memory_model`; the probe sweep and the probe table
are :mod:`dpsweep.memory.probes`.

Bad input exits with code 2 before any work starts, naming the flag or key, the value and what is
allowed (``--gpu-memory=16: a memory figure with units, e.g. 16GiB ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from dpsweep.analysis.sweep_plan import MemoryCheck
from dpsweep.cli.composing import CONFIG_MODULE
from dpsweep.cli.errors import exits_on_bad_input
from dpsweep.cli.options import add_tracking_uri, plain_text
from dpsweep.cli.overrides import override_value
from dpsweep.cli.plan import job_plans
from dpsweep.cli.script import run_script
from dpsweep.config import Config
from dpsweep.config.launcher import LAUNCHERS, launchers_where, spec
from dpsweep.errors import InputError
from dpsweep.memory import probes
from dpsweep.memory.model import PEAK_TARGET, MemoryModel
from dpsweep.units import format_bytes

if TYPE_CHECKING:  # pandas, torch, Hydra and MLflow are imported where used: --help stays fast
    import pandas as pd


# What every probe sweep sets: probe mode; a fresh measurement even of a config probed before (maybe
# on another device); no ε budget (a probe takes one step and reports no ε).
FORCED_VALUES = ("train.probe=true", "sweep.force=true", "sweep.max_epsilon=null")
# Probes are measurements, not results: their own experiment unless tracking.experiment_name is given,
# so that the reports and the UI of the training runs do not list them
PROBE_EXPERIMENT = "dpsweep-probes"
FORCED = tuple(v.partition("=")[0] for v in FORCED_VALUES)


# ---------------------------------------------------------------------------------------------
# probe
# ---------------------------------------------------------------------------------------------
def probe_launcher() -> str:
    """The launcher a probe sweep takes unless the user names another: the first whose spec starts a fresh
    process per config on this machine (a probe measures this machine's device)."""
    return launchers_where(lambda s: s.processes and not s.remote)[0]


def probe_overrides(overrides: Sequence[str]) -> list[str]:
    """The ``dpsweep -m`` overrides of a probe sweep: probe mode, a fresh process per config, and
    as many at once as the device allows, unless the user said otherwise."""
    launcher = override_value(overrides, "launcher") or probe_launcher()
    if launcher not in LAUNCHERS or not spec(launcher).processes:
        fresh = launchers_where(lambda s: s.processes)
        raise InputError("launcher", launcher, f"one of {', '.join(fresh)}: each probe needs a fresh process")
    for key in FORCED:
        value = override_value(overrides, key)
        if value is not None:
            raise InputError(key, value, f"leave it out: dpsweep-memory probe sets {', '.join(FORCED_VALUES)}")
    extra = [f"launcher={launcher}"]
    if override_value(overrides, "tracking.experiment_name") is None:
        extra.append(f"tracking.experiment_name={PROBE_EXPERIMENT}")
    import torch

    gpus, remote = torch.cuda.device_count(), spec(launcher).remote  # remote: this machine's GPUs are not its
    if not remote and override_value(overrides, "launcher.max_parallel") is None:
        extra.append(f"launcher.max_parallel={gpus or os.cpu_count() or 1}")  # one per GPU, or per core
    if (gpus or remote) and override_value(overrides, "launcher.gpus_per_job") is None:
        extra.append("launcher.gpus_per_job=1")  # probes are of GPU memory wherever GPUs are
    # last, so that no experiment preset changes them
    return [*extra, *[o for o in overrides if not o.startswith("launcher=")], *FORCED_VALUES]


def plan_probes(overrides: Sequence[str]) -> tuple[list[Config], list[str]]:
    """The configs of a probe sweep, each checked as ``dpsweep -m`` would, and their config hashes."""
    plans = [plan for _, plan in job_plans(overrides)]
    return [p.config for p in plans], [p.config_hash for p in plans]


def run_probes(overrides: Sequence[str], csv: Path) -> pd.DataFrame:
    """Probe every config of ``overrides`` (a ``dpsweep -m`` sweep) and write the table to ``csv``."""
    args = probe_overrides(overrides)
    from hydra import initialize_config_module

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        configs, hashes = plan_probes(args)
    first = configs[0]
    print(f"dpsweep-memory: probing {len(configs)} configs, a fresh process each", flush=True)
    swept = probes.run_probe_sweep(args, first.tracking.uri, first.tracking.experiment_name, hashes, csv, _note)
    table, missing = swept.table, swept.missing
    print(
        f"dpsweep-memory: {len(table)} probes written to {csv}"
        + (f"; {missing} configs have no FINISHED probe (see the sweep's output above)" if missing else ""),
        flush=True,
    )
    if swept.returncode != 0 or missing:
        raise SystemExit(1)
    print(f"dpsweep-memory: next: dpsweep-memory fit --csv {csv} --out memory_model.json, then plan with "
          "dpsweep-plan --memory-model memory_model.json ...", flush=True)  # fmt: skip
    return table


def _note(text: str) -> None:
    """A probe run left out of a probe table, said on stderr."""
    print(f"dpsweep-memory: note: {text}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# fit
# ---------------------------------------------------------------------------------------------
def run_fit(args: argparse.Namespace) -> dict[str, Any]:
    from dpsweep.analysis.memory_model import fit_all, pipeline  # scipy and matplotlib: only here

    features = _names(args.features) or None
    targets = None
    if args.targets:  # the iteration peak is what plans use: always fitted
        targets = list(dict.fromkeys([*_names(args.targets), PEAK_TARGET]))
    table, source = pipeline.load_probes(args.csv, args.experiment, args.tracking_uri, _note)
    chosen = pipeline.select_probes(table, args.model, args.device)
    models = fit_all(chosen, args.model, features, targets=targets, folds=args.folds)
    out, plot = pipeline.save_fit(models, source, args.out, args.plot)
    _print_fit(models)
    print(f"\nmodels written to {out}; residual plot {plot}")
    return {"models": models, "out": out, "plot": plot}


def _names(listed: str | None) -> list[str]:
    """The names of a comma-separated option (``--features``, ``--targets``), blanks left out."""
    return [name.strip() for name in (listed or "").split(",") if name.strip()]


def _print_fit(models: dict[str, MemoryModel]) -> None:
    """Each model's formulas, then the k-fold held-out error of every fit."""
    from dpsweep.analysis import memory_model

    for name, m in models.items():
        devices = ", ".join(m.provenance.get("device_name", [])) or "?"
        print(f"\n{name}: {m.n_probes} probes, backend {m.backend} ({devices})")
        for target, tf in m.targets.items():
            for fit_name in ("envelope", "least_squares"):
                print(f"  {fit_name:<13} {memory_model.formula(m, target, fit_name)}")
            if tf.dropped:
                print(f"  {'':<13} not identifiable from these probes: {', '.join(tf.dropped)}")
    table = memory_model.cv_table(models)
    shown = table[["model", "target", "fit", "n_probes", *memory_model.CV_METRICS]].copy()
    for column in memory_model.CV_METRICS:
        shown[column] = (100 * shown[column]).map("{:.2f}%".format)
    used = ", ".join(f"{m}: {k}" for m, k in table.groupby("model", sort=False)["folds"].max().items())
    print(f"\nk-fold held-out error (folds: {used}; relative to the observed bytes):")
    print(shown.to_string(index=False))


# ---------------------------------------------------------------------------------------------
# predict
# ---------------------------------------------------------------------------------------------
def run_predict(args: argparse.Namespace) -> list[dict[str, Any]]:
    from hydra import initialize_config_module

    memory = MemoryCheck(str(args.memory_model), args.gpu_memory, args.backend)
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        plans = job_plans(args.overrides, memory)
    rows: list[dict[str, Any]] = []
    for job, plan in plans:
        if plan.memory is None or plan.gpu_memory is None:
            raise InputError("--gpu-memory", None, "the GPU memory with units, e.g. 16GiB (or launcher.gpu_memory)")
        rows.append({"overrides": " ".join(job) or "(defaults)", "prediction": plan.memory,
                     "budget": plan.gpu_memory, "n_train": plan.facts.n_train})  # fmt: skip
    if args.json:  # only the JSON on stdout, for jq and scripts
        print(json.dumps([_as_json(r) for r in rows], indent=1))
        return rows
    for r in rows:
        _print_prediction(r["overrides"], r["prediction"], r["budget"], r["n_train"])
    return rows


def _print_prediction(overrides: str, p: Any, budget: str, n_train: int) -> None:
    verdict = "fits" if p.fits else "OUT OF MEMORY"
    resident = f" + {format_bytes(p.resident_bytes)} of device-resident data" if p.resident_bytes else ""
    kept = f", less {p.headroom:.0%} kept for the allocator's fragmentation" if p.headroom else ""
    print(f"{overrides}: {verdict}: predicted peak {format_bytes(p.peak_bytes)}{resident} for {budget}{kept} "
          "(envelope fit)")  # fmt: skip
    why = {
        "poisson": f"the largest Poisson batch of B={p.batch_size} in the run (exceeded with probability < 1e-6)",
        "physical": "train.physical_batch_size caps each pass",
        "batch": "B, the logical batch",
    }[p.pass_reason]
    print(f"  planned for a pass of {p.row['batch_size']} examples: {why}")
    for stage, value in p.stages.items():
        print(f"  {stage:<22} {format_bytes(value):>10}   (least squares: {format_bytes(p.typical[stage])})")
    b = p.largest_batch_size
    shown = "none" if b is None else f"{b} (all of the training set)" if b >= n_train else str(b)
    print(f"  largest train.batch_size that fits: {shown}")
    if p.largest_physical_batch_size is not None and not p.fits:
        print(
            f"  or keep B and set train.physical_batch_size={p.largest_physical_batch_size} (Opacus BatchMemoryManager)"
        )
    if p.largest_hidden_units is not None:
        h = p.largest_hidden_units
        from dpsweep.memory.predict import MAX_HIDDEN_UNITS

        shown = f"≥ {MAX_HIDDEN_UNITS} (the end of the range searched)" if h >= MAX_HIDDEN_UNITS else str(h)
        print(f"  largest model.hidden_units that fits at B={p.batch_size}: {shown}")
    for note in p.notes:
        print(f"  note: {note}")


def _as_json(r: dict[str, Any]) -> dict[str, Any]:
    p = r["prediction"]
    return {
        "overrides": r["overrides"], "gpu_memory": r["budget"], "usable_bytes": p.usable_bytes, "headroom": p.headroom,
        "fits": p.fits, "peak_bytes": p.peak_bytes,
        "resident_bytes": p.resident_bytes, "pass_batch_size": p.row["batch_size"], "stages_bytes": p.stages,
        "least_squares_bytes": p.typical, "largest_batch_size": p.largest_batch_size,
        "largest_hidden_units": p.largest_hidden_units, "largest_physical_batch_size": p.largest_physical_batch_size,
        "notes": list(p.notes),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpsweep-memory", description=plain_text(__doc__.split("\n")[0]))
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("probe", help="measure the first iteration of each config of a sweep")
    pr.add_argument("--csv", type=Path, default=Path("probes.csv"), help="probe table to write (default probes.csv)")
    pr.add_argument("overrides", nargs="*", help="Hydra overrides, as for dpsweep -m")

    fi = sub.add_parser("fit", help="fit per-stage memory models to probes")
    fi.add_argument("--experiment", metavar="NAME", help="MLflow experiment holding the probes (tag probe=true)")
    fi.add_argument("--csv", type=Path, metavar="FILE", help="a probe table instead of the experiment")
    fi.add_argument("--model", metavar="M", help="fit only this model (default: each model probed)")
    fi.add_argument("--device", metavar="NAME", help="only the probes of this device (tag device.name)")
    fi.add_argument("--features", metavar="F1,F2,...",
                    help="one feature list for every stage (default: per stage; see the module doc)")  # fmt: skip
    fi.add_argument("--targets", metavar="T1,T2,...",
                    help="what to fit (default: all of model_load, batch_load, backward, optimizer_step, "
                         "iteration_peak, reserved_peak; iteration_peak is always fitted)")  # fmt: skip
    fi.add_argument("--folds", type=int, default=5, help="k of the k-fold held-out error (default 5)")
    fi.add_argument(
        "--out", type=Path, default=Path("memory_model.json"), help="model file (default memory_model.json)"
    )
    fi.add_argument("--plot", type=Path, help="residual plot PNG (default <out>_residuals.png)")
    add_tracking_uri(fi)

    pe = sub.add_parser("predict", help="predicted memory, OOM verdict and the largest batch that fits")
    pe.add_argument(
        "--gpu-memory", metavar="SIZE", help="GPU memory with units, e.g. 16GiB (default launcher.gpu_memory)"
    )
    pe.add_argument("--memory-model", type=Path, default=Path("memory_model.json"),
                    help="model file from dpsweep-memory fit (default memory_model.json)")  # fmt: skip
    pe.add_argument("--backend", choices=("cuda", "cpu-tensors"),
                    help="memory backend of the probes to use (default: cuda where a GPU is visible, "
                         "else the backend the file was fitted on)")  # fmt: skip
    pe.add_argument("--json", action="store_true", help="also print the predictions as JSON")
    pe.add_argument("overrides", nargs="*", help="Hydra overrides of the config(s) to predict")
    return p


COMMANDS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "probe": lambda args: run_probes(args.overrides, args.csv),
    "fit": run_fit,
    "predict": run_predict,
}


@exits_on_bad_input("dpsweep-memory")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    COMMANDS[args.command](args)
    return 0


def console() -> NoReturn:
    """The console script: its secrets handed over, ``main``, then its exit (``dpsweep.cli.script``)."""
    run_script(main, "dpsweep-memory")


if __name__ == "__main__":
    console()
