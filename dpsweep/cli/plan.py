"""``dpsweep-plan``: the jobs a ``dpsweep -m`` sweep would launch, with their ε, without training.

    dpsweep-plan experiment=demo
    dpsweep-plan train.batch_size=64,256 dp.noise_multiplier=0.8,1.1 train.epochs=10,30
    dpsweep-plan dp.noise_multiplier=0.5,1,2 sweep.max_epsilon=3     # over-budget jobs are dropped
    dpsweep-plan train.seed=0,0,1        # jobs dpsweep -m would skip (repeats, configs FINISHED) are marked
    dpsweep-plan experiment=demo --json
    dpsweep-plan train.batch_size=64,512 --memory-model memory_model.json --gpu-memory 16GiB   # peak memory
    dpsweep-plan dp.noise_multiplier=0.8,1.6 --risk   # with μ-GDP and the attack's TPR at 1 % FPR

It takes exactly the overrides ``dpsweep -m`` takes and expands them with Hydra's own basic-sweeper
logic (``hydra.sweeper.params`` from the config first, then the command line), so the rows are the
jobs, in the order Hydra launches them. ε uses the trainer's step convention
(``dpsweep.privacy.schedule.poisson_schedule``), so it equals the ε each run logs at its end.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, NoReturn

from dpsweep import mechanisms
from dpsweep.analysis import sweep_plan
from dpsweep.cli.composing import CONFIG_MODULE
from dpsweep.cli.errors import exits_on_bad_input
from dpsweep.cli.options import plain_text
from dpsweep.cli.script import run_script
from dpsweep.cli.sigma import sigma_text
from dpsweep.errors import InputError
from dpsweep.units import format_bytes

if TYPE_CHECKING:  # Hydra, torch and the planner are imported where used: --help stays fast
    from dpsweep.config import SweepConfig
    from dpsweep.plan import RunPlan
    from dpsweep.privacy.tuning import Procedure

PROG = "dpsweep-plan"


@dataclass(frozen=True)
class PlanRow:
    job: int
    overrides: str
    dataset: str
    model: str
    batch_size: int
    noise_multiplier: float | None  # σ; calibrated when dp.target_epsilon is set
    max_grad_norm: float | None
    lr: float
    epochs: int
    delta: float | None
    epsilon: float | None  # under ``accountant``; None without DP
    accountant: str | None
    steps: int
    n_train: int
    over_budget: bool  # ε > sweep.max_epsilon: dpsweep -m skips it
    skipped: str | None = None  # why dpsweep -m would not run it: FINISHED before, or a repeat of a job
    mechanism: str | None = None  # dp.mechanism (a name in dpsweep.mechanisms); None without DP
    unit: str | None = None  # whom ε protects (example, user; N counts them); None without DP
    peak_bytes: float | None = None  # predicted iteration peak (with --memory-model)
    gpu_memory: str | None = None  # the budget it is compared with
    fits_memory: bool | None = None  # None: no memory model or no budget
    world_size: int = 1  # ranks of the run (train.devices): each takes its share of every Poisson batch
    mu_gdp: float | None = None  # with --risk: μ of Gaussian DP (dpsweep.privacy.certainty.mu_gdp)
    tpr_at_1pct: float | None = None  # with --risk: a membership-inference attack's largest TPR at 1 % FPR
    gdp_delta_allowance: float | None = None  # with --risk: μ-GDP holds down to this δ (certainty.is_gdp)


def skip_reasons(plans: Sequence[RunPlan]) -> list[str | None]:
    """Why ``dpsweep -m`` would skip each job (:func:`dpsweep.analysis.sweep_plan.skip_reasons`), a store
    that cannot be read said on stderr."""
    return sweep_plan.skip_reasons(plans, note=_note)


def _note(text: str) -> None:
    print(f"{PROG}: note: {text}", file=sys.stderr)


def plan_row(job: int, overrides: list[str], plan: RunPlan, skipped: str | None = None) -> PlanRow:
    from dpsweep.config import shown_model, world_size  # loaded already: the plan's config is composed

    cfg, p = plan.config, plan.privacy
    memory = plan.memory
    return PlanRow(
        job=job, overrides=" ".join(overrides), dataset=cfg.dataset.name,
        model=shown_model(cfg.task, cfg.model.name),
        batch_size=cfg.train.batch_size, noise_multiplier=plan.noise_multiplier,
        # a quantile run's C is its own private release, unknown before it runs
        max_grad_norm=cfg.dp.max_grad_norm if p and cfg.dp.clipping != "quantile" else None,
        lr=cfg.task.learning_rate(cfg.optimizer.lr), epochs=cfg.train.epochs,
        delta=p.delta if p else None, epsilon=p.epsilon if p else None, accountant=p.accountant if p else None,
        steps=plan.steps, n_train=plan.facts.n_train, over_budget=plan.over_budget is not None, skipped=skipped,
        mechanism=cfg.dp.mechanism if p else None, unit=cfg.dp.unit.value if p else None,
        peak_bytes=memory.peak_bytes if memory else None,
        gpu_memory=plan.gpu_memory if memory else None, fits_memory=plan.fits_memory,
        world_size=world_size(cfg.train),
    )  # fmt: skip


OPTIONS = """
usage: dpsweep-plan [--json] [--risk] [--memory-model FILE [--gpu-memory SIZE] [--backend cuda|cpu-tensors]]
                    [OVERRIDES ...]

options:
  -h, --help            show this help and exit
  --json                print the jobs as JSON only (for jq and scripts)
  --risk                add columns μ (the run is μ-GDP) and TPR@1% (a membership-inference attack's largest
                        true-positive rate at 1 % false positives), from each distinct ledger's PLD
  --memory-model FILE   a dpsweep-memory fit file: predict each job's peak memory and OOM verdict
  --gpu-memory SIZE     the GPU memory to plan against, with units (e.g. 16GiB); default: each job's
                        launcher.gpu_memory
  --backend B           cuda or cpu-tensors: the memory backend of the probes to plan with; default:
                        cuda where a GPU is visible, else the backend the file was fitted on
  -m, --multirun        accepted and ignored: the jobs planned are always those of dpsweep -m
  OVERRIDES             Hydra overrides, exactly as for dpsweep -m
"""


def job_plans(
    overrides: Sequence[str], memory: sweep_plan.MemoryCheck | None = None
) -> list[tuple[list[str], RunPlan]]:
    """Each job of ``dpsweep -m <overrides>`` with its run plan (:func:`dpsweep.analysis.sweep_plan.plan_jobs`),
    in launch order, composed as the sweeper composes them (Hydra's errors as bad input); needs Hydra
    initialised on dpsweep.conf. The notes of datasets whose files are missing (planned with their
    official size) go to stderr."""
    from hydra.core.global_hydra import GlobalHydra

    from dpsweep.cli.composing import composition_refused, sweep_jobs
    from dpsweep.launchers.composed import ComposedJobs

    budget = sweep_plan.memory_budget(memory)  # the file read before any job is composed
    with composition_refused(overrides):
        jobs, master = sweep_jobs(overrides)
        composer = ComposedJobs(GlobalHydra.instance().config_loader(), keep=False)  # as the sweeper composes
        typed = [composer.typed(master, job) for job in jobs]
    plans, notes = sweep_plan.plan_jobs(typed, budget)
    for note in notes:
        _note(note)
    return list(zip(jobs, plans, strict=True))


def plan(overrides: Sequence[str], memory: sweep_plan.MemoryCheck | None = None) -> list[PlanRow]:
    """One row per job of ``dpsweep -m <overrides>``; needs Hydra initialised on dpsweep.conf."""
    return rows_of(job_plans(overrides, memory))


def rows_of(jobs: Sequence[tuple[list[str], RunPlan]]) -> list[PlanRow]:
    """The table's rows of planned jobs, each marked with why ``dpsweep -m`` would skip it."""
    reasons = skip_reasons([p for _, p in jobs])
    return [plan_row(i, job, p, why) for i, ((job, p), why) in enumerate(zip(jobs, reasons, strict=True))]


def with_risk(rows: Sequence[PlanRow], jobs: Sequence[tuple[list[str], RunPlan]]) -> list[PlanRow]:
    """``--risk``: each DP row with its μ of Gaussian DP and a membership-inference attacker's largest TPR at
    1 % FPR (:func:`dpsweep.analysis.sweep_plan.risk_figures`)."""
    figures = sweep_plan.risk_figures([p for _, p in jobs])
    return [
        row
        if f is None
        else replace(row, mu_gdp=f.mu_gdp, tpr_at_1pct=f.tpr_at_1pct, gdp_delta_allowance=f.gdp_delta_allowance)
        for row, f in zip(rows, figures, strict=True)
    ]


# the keys the table's own columns show (a swept one needs no column of its own; dp: σ and ε say off)
SHOWN_KEYS = frozenset({"dataset", "model", "train.batch_size", "dp.noise_multiplier", "dp.max_grad_norm",
                        "optimizer.lr", "train.epochs", "dp.mechanism", "dp.unit", "dp"})  # fmt: skip


def swept_keys(rows: Sequence[PlanRow]) -> tuple[list[str], list[dict[str, str]]]:
    """The override keys whose values differ between jobs (``~key`` and ``+key`` as ``key``), besides
    the columns the table has, and each row's overrides by key."""
    given = [
        {o.split("=", 1)[0].lstrip("+~"): o.split("=", 1)[1] if "=" in o else "—" for o in r.overrides.split()}
        for r in rows
    ]
    keys = sorted({k for g in given for k in g} - SHOWN_KEYS)
    return [k for k in keys if len({g.get(k) for g in given}) > 1], given


def format_table(rows: Sequence[PlanRow]) -> str:
    cols = ("job", "dataset", "model", "B", "σ", "C", "lr", "epochs", "δ", "ε")
    memory = any(r.peak_bytes is not None for r in rows)
    risk = any(r.mu_gdp is not None for r in rows)
    swept, given = swept_keys(rows)
    widths = [max(len(k), *(len(g.get(k, "—")) for g in given)) for k in swept]
    # mechanism and unit columns where some job's differ from the defaults (example-level DP-SGD)
    kinds = any((r.mechanism, r.unit) not in ((None, None), (mechanisms.dpsgd.DPSGD.name, "example")) for r in rows)
    header = "{:>3}  {:<10} {:<12} {:>5} {:>7} {:>6} {:>8} {:>6} {:>8} {:>9}".format(*cols)
    header += "  {:>6} {:>7}".format("μ", "TPR@1%") if risk else ""
    header += "  {:<9} {:<8}".format("mechanism", "ε per") if kinds else ""
    header += "".join(f"  {k:<{w}}" for k, w in zip(swept, widths, strict=True))
    lines = [(header + ("  {:>10}".format("peak") if memory else "")).rstrip()]
    for r, values in zip(rows, given, strict=True):
        dash = "—"
        sigma = sigma_text(r.noise_multiplier) if r.noise_multiplier is not None else dash
        clip = f"{r.max_grad_norm:g}" if r.max_grad_norm is not None else dash
        delta = f"{r.delta:.0e}" if r.delta is not None else dash
        eps = f"{r.epsilon:.4g}" if r.epsilon is not None else "non-DP"
        line = (
            f"{r.job:>3}  {r.dataset:<10} {r.model:<12} {r.batch_size:>5} {sigma:>7} {clip:>6} {r.lr:>8.3g} "
            f"{r.epochs:>6} {delta:>8} {eps:>9}"
        )
        if risk:
            line += f"  {_figure(r.mu_gdp):>6} {_figure(r.tpr_at_1pct):>7}"
        if kinds:
            line += f"  {r.mechanism or dash:<9} {r.unit or dash:<8}"
        line += "".join(f"  {values.get(k, dash):<{w}}" for k, w in zip(swept, widths, strict=True))
        if memory:
            line += f"  {format_bytes(r.peak_bytes) if r.peak_bytes is not None else dash:>10}"
        if r.fits_memory is False:
            line += f"  will not fit {r.gpu_memory}"
        if r.skipped is not None:
            line += f"  skipped: {r.skipped}"
        lines.append((line + ("  over budget: skipped" if r.over_budget else "")).rstrip())
    accountants = sorted({r.accountant for r in rows if r.accountant})
    if accountants:
        used = sorted({r.mechanism for r in rows if r.mechanism})
        how = "; ".join(f"{m}: {mechanisms.get(m).note}" for m in used)
        lines.append(f"ε: {', '.join(accountants)} accountant(s) over each job's steps ({how})")
    if risk:
        allowed = max(r.gdp_delta_allowance or 0.0 for r in rows)
        lines.append(
            f"μ: each job is μ-GDP (certified from its pessimistic PLD, down to δ = {allowed:.2g}); TPR@1%: the "
            "largest true-positive rate of a membership-inference attack at 1 % false positives"
        )
    if memory:
        lines.append(
            "peak: predicted iteration peak (envelope fit; with DP for the run's largest Poisson batch); "
            "dpsweep-memory predict says what would fit"
        )
    return "\n".join(lines)


def _figure(value: float | None) -> str:
    return f"{value:.3g}" if value is not None else "—"


def _packing_line(jobs: Sequence[tuple[list[str], RunPlan]], rows: Sequence[PlanRow]) -> str | None:
    """K trials per device (``launcher.trials_per_device``; ``auto`` resolved as the sweeper resolves it)
    and the device jobs the sweep's jobs to run take; None for one trial per device."""
    from dpsweep.config import trials_per_device

    first = jobs[0][1].config if jobs else None
    if first is None:
        return None
    k = trials_per_device(first.launcher)
    n = sum(r.skipped is None and not r.over_budget for r in rows)
    how = ""
    if k is None:
        from dpsweep.launchers import packing
        from dpsweep.launchers.preflight import job_backend

        k = packing.resolve([p.config for _, p in jobs], max(n, 1), job_backend(first))
        how = f" (auto: the most whose predicted peaks fit {first.launcher.gpu_memory} together)"
    if k == 1:
        return None
    return f"trials per device: {k}{how}; {n} jobs to run take {-(-n // k)} device jobs"


def _serial_line(jobs: Sequence[tuple[list[str], RunPlan]], rows: Sequence[PlanRow]) -> str | None:
    """T trials one after another in each job's process (``launcher.trials_per_job``); None for one."""
    t = jobs[0][1].config.launcher.trials_per_job if jobs else 1
    if t == 1:
        return None
    n = sum(r.skipped is None and not r.over_budget for r in rows)
    return f"trials per job: {t}, one after another in each job's process; {n} jobs to run take {-(-n // t)} jobs"


def _take_option(args: list[str], flag: str) -> str | None:
    """Remove ``--flag VALUE`` or ``--flag=VALUE`` from ``args`` and return VALUE."""
    for i, a in enumerate(args):
        if a == flag:
            if i + 1 == len(args):
                raise InputError(flag, None, "a value after the flag")
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if a.startswith(flag + "="):
            del args[i]
            return a.split("=", 1)[1]
    return None


@exits_on_bad_input(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    """``dpsweep-plan [--json] [--risk] [--memory-model FILE [--gpu-memory SIZE] [--backend B]] OVERRIDES``"""
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    risk = "--risk" in args
    args = [a for a in args if a not in ("--json", "--risk", "-m", "--multirun")]  # -m: what dpsweep-plan plans
    if "-h" in args or "--help" in args:
        print(plain_text(__doc__ + OPTIONS))
        return 0
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    model_file = _take_option(args, "--memory-model")
    gpu_memory = _take_option(args, "--gpu-memory")
    backend = _take_option(args, "--backend")
    if backend not in (None, "cuda", "cpu-tensors"):
        raise InputError("--backend", backend, "cuda or cpu-tensors (the memory backend of the probes)")
    if model_file is None and (gpu_memory is not None or backend is not None):
        flag, value = ("--gpu-memory", gpu_memory) if gpu_memory is not None else ("--backend", backend)
        raise InputError(flag, value, "used with --memory-model FILE (dpsweep-memory fit)")
    memory = sweep_plan.MemoryCheck(model_file, gpu_memory, backend) if model_file is not None else None
    from hydra import initialize_config_module

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        jobs = job_plans(args, memory)
        rows = with_risk(rows_of(jobs), jobs) if risk else rows_of(jobs)
        tuned = None
        if jobs and jobs[0][1].config.sweep.private_tuning:
            from dpsweep.plan import tuning_procedure

            sweep_cfg = jobs[0][1].config.sweep
            tuned = (sweep_cfg, tuning_procedure([p for _, p in jobs], sweep_cfg))
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    print(format_table(rows))
    repeats = [r for r in rows if r.skipped is not None]
    if repeats:
        print(f"{len(repeats)} of {len(rows)} jobs would be skipped by dpsweep -m: already FINISHED, or repeated")
    dropped = [r for r in rows if r.over_budget]
    if dropped:
        print(f"{len(dropped)} of {len(rows)} jobs exceed sweep.max_epsilon and would be skipped")
    oom = [r for r in rows if r.fits_memory is False]
    if oom:
        print(f"{len(oom)} of {len(rows)} jobs are predicted not to fit the GPU memory")
    packed = _packing_line(jobs, rows)
    if packed:
        print(packed)
    serial = _serial_line(jobs, rows)
    if serial:
        print(serial)
    ranked = sorted({r.world_size for r in rows if r.world_size > 1})
    if ranked:
        print(
            f"ranks: {', '.join(map(str, ranked))} a run (train.devices x train.nodes), each taking "
            "its share of every Poisson batch; σ, q, steps and ε are one process's (rank 0 draws the noise)"
        )
    if tuned is not None:
        print(tuning_line(*tuned, rows))
    return 0


def tuning_line(s: SweepConfig, cost: Procedure, rows: Sequence[PlanRow]) -> str:
    """The cost of a private tuning over ``rows``: the procedure's ε beside the dominant job's alone, both
    under the procedure's accountant (RDP: dp-accounting analyses its RepeatAndSelectDpEvent by RDP alone),
    which the line names, with the job's ε under its own accountant where the table shows another, and the
    analysis that priced the procedure (``sweep.tuning_analysis``) with its reference."""
    dominant = rows[cost.dominant]
    own = ""
    if dominant.accountant != cost.accountant and dominant.epsilon is not None:
        own = f"; the table's {dominant.epsilon:.4g} for it is {dominant.accountant}'s"
    return (
        f"private tuning: K ~ {s.tuning_distribution} with mean {s.tuning_mean_trials:g} trials drawn from these "
        f"{len(rows)} jobs, the best released: ε = {cost.epsilon:.4g} (δ = {cost.delta:g}) for the whole procedure, "
        f"against ε = {cost.single_run_epsilon:.4g} for job {cost.dominant} alone, both under the {cost.accountant} "
        f"accountant (the tuning bounds are RDP ones{own}); analysis: sweep.tuning_analysis={cost.analysis}, "
        f"{cost.reference}"
    )


def console() -> NoReturn:
    """The console script: its secrets handed over, ``main``, then its exit (``dpsweep.cli.script``)."""
    run_script(main, "dpsweep-plan")


if __name__ == "__main__":
    console()
