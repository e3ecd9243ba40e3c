"""``dpsweep-plan``: the jobs a ``dpsweep -m`` sweep would launch, with their ε, without training.

    dpsweep-plan experiment=demo
    dpsweep-plan train.batch_size=64,256 dp.noise_multiplier=0.8,1.1 train.epochs=10,30
    dpsweep-plan dp.noise_multiplier=0.5,1,2 sweep.max_epsilon=3     # over-budget jobs are dropped
    dpsweep-plan experiment=demo --json
    dpsweep-plan train.batch_size=64,512 --memory-model memory_model.json --gpu-memory 16GiB   # peak memory

It takes exactly the overrides ``dpsweep -m`` takes and expands them with Hydra's own basic-sweeper
logic (``hydra.sweeper.params`` from the config first, then the command line), so the rows are the
jobs, in the order Hydra launches them. ε uses the trainer's step convention
(``dpsweep.privacy.poisson_schedule``), so it equals the ε each run logs at its end.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hydra import compose, initialize_config_module
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf

from dpsweep import data as datasets
from dpsweep import privacy
from dpsweep.config import Config, ConfigError, to_config, validate, validate_for_dataset

CONFIG_MODULE = "dpsweep.conf"


def expand_sweep(overrides: Sequence[str]) -> list[list[str]]:
    """The override lists of the jobs ``dpsweep -m <overrides>`` launches, in launch order."""
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(list(overrides))
    fixed = [o.input_line for o in parsed if not o.is_sweep_override() and o.input_line is not None]
    hydra_cfg = compose("config", overrides=fixed, return_hydra_config=True).hydra
    node = hydra_cfg.sweeper.get("params")
    params = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    assert isinstance(params, dict)
    lines = [f"{k!s}={v!s}" for k, v in params.items()] + list(overrides)
    [jobs] = BasicSweeper.split_arguments(parser.parse_overrides(lines), max_batch_size=None)
    return jobs


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
    peak_bytes: float | None = None  # predicted iteration peak (with --memory-model)
    gpu_memory: str | None = None  # the budget it is compared with
    fits_memory: bool | None = None  # None: no memory model or no budget


class OverBudget(Exception):
    """A config whose planned ε exceeds ``sweep.max_epsilon``; ``dpsweep -m`` skips it."""


def planned_epsilon(cfg: Config, n_train: int, noise_multiplier: float) -> privacy.EpsilonResult:
    return privacy.epsilon(
        n=n_train, batch_size=cfg.train.batch_size, noise_multiplier=noise_multiplier, delta=cfg.dp.delta,
        epochs=cfg.train.epochs, accountant=cfg.dp.accountant.value,
    )  # fmt: skip


def resolve_noise(cfg: Config, n_train: int) -> float | None:
    """σ to train with: the configured one, or calibrated to ``dp.target_epsilon`` (ε never above it)."""
    dp = cfg.dp
    if not dp.enabled:
        return None
    if dp.target_epsilon is None:
        return dp.noise_multiplier
    try:
        return privacy.calibrate_noise(
            target_epsilon=dp.target_epsilon, n=n_train, batch_size=cfg.train.batch_size, delta=dp.delta,
            epochs=cfg.train.epochs, accountant=dp.accountant.value,
        )  # fmt: skip
    except ValueError as err:  # "The privacy budget is too low."
        raise ConfigError("dp.target_epsilon", dp.target_epsilon, f"a budget reachable with σ <= 1e6 ({err})") from err


def check_budget(cfg: Config, n_train: int, noise_multiplier: float | None) -> None:
    """Raise :class:`OverBudget` when the planned ε exceeds ``sweep.max_epsilon``."""
    limit = cfg.sweep.max_epsilon
    if noise_multiplier is None or limit is None:
        return
    eps = planned_epsilon(cfg, n_train, noise_multiplier).epsilon
    if eps > limit:
        raise OverBudget(f"ε={eps:.4g} ({cfg.dp.accountant.value}, δ={cfg.dp.delta:g}) > sweep.max_epsilon={limit:g}")


def plan_job(job: int, overrides: list[str], cfg: Config, n_train: int) -> PlanRow:
    validate(cfg)
    validate_for_dataset(cfg, n_train)
    steps = privacy.poisson_schedule(n_train, cfg.train.batch_size).steps(cfg.train.epochs)
    sigma = resolve_noise(cfg, n_train)
    eps = planned_epsilon(cfg, n_train, sigma) if sigma is not None else None
    limit = cfg.sweep.max_epsilon
    return PlanRow(
        job=job, overrides=" ".join(overrides), dataset=cfg.dataset.name, model=cfg.model.name,
        batch_size=cfg.train.batch_size, noise_multiplier=sigma,
        max_grad_norm=cfg.dp.max_grad_norm if cfg.dp.enabled else None, lr=cfg.optimizer.lr,
        epochs=cfg.train.epochs, delta=cfg.dp.delta if cfg.dp.enabled else None,
        epsilon=eps.epsilon if eps else None, accountant=cfg.dp.accountant.value if cfg.dp.enabled else None,
        steps=steps, n_train=n_train, over_budget=bool(eps and limit is not None and eps.epsilon > limit),
    )  # fmt: skip


def dataset_facts(cfg: Config) -> datasets.DatasetFacts:
    """N, input shape and classes from the dataset's files or, when they are not downloaded yet,
    from its official description."""
    try:
        splits = datasets.build(cfg.dataset)
        return datasets.DatasetFacts(splits.n_train, splits.input_shape, splits.num_classes)
    except datasets.DatasetNotFoundError:
        if cfg.dataset.name not in datasets.OFFICIAL_N_TRAIN:
            raise
        facts = datasets.official_facts(cfg.dataset)
        print(
            f"dpsweep-plan: note: {cfg.dataset.name} files not found; using its official training-set size "
            f"N={facts.n_train}",
            file=sys.stderr,
        )
        return facts


class TrainingSetSizes:
    """N (and the other :class:`~dpsweep.data.DatasetFacts`) per dataset config, each dataset read
    once (a sweep's jobs mostly share one)."""

    def __init__(self) -> None:
        self._facts: dict[str, datasets.DatasetFacts] = {}

    def facts(self, cfg: Config) -> datasets.DatasetFacts:
        key = json.dumps(OmegaConf.to_container(OmegaConf.structured(cfg.dataset)), sort_keys=True)
        if key not in self._facts:
            self._facts[key] = dataset_facts(cfg)
        return self._facts[key]

    def __call__(self, cfg: Config) -> int:
        return self.facts(cfg).n_train


@dataclass(frozen=True)
class MemoryCheck:
    """``--memory-model FILE [--gpu-memory SIZE] [--backend B]``: predict each job's peak memory."""

    model_file: str
    gpu_memory: str | None = None  # default: each job's launcher.gpu_memory
    backend: str = "cuda"

    def apply(self, row: PlanRow, cfg: Config, sizes: TrainingSetSizes, models: dict[str, Any]) -> PlanRow:
        from dpsweep.analysis import memory_predict  # pandas, scipy: only when asked
        from dpsweep.memory import model_key as memory_key

        figure, budget = memory_predict.gpu_budget(cfg, self.gpu_memory)
        fitted = memory_predict.model_for(models, memory_key(cfg), self.backend)
        facts = sizes.facts(cfg)
        cfg = memory_predict.with_chosen_physical_batch(fitted, cfg, facts, budget)  # as the job will choose
        p = memory_predict.predict_config(fitted, cfg, facts, None)
        # the device-resident training split (train.device_resident) stays beside the peak
        fits = None if budget is None else p.peak_bytes + p.resident_bytes <= budget
        return dataclasses.replace(row, peak_bytes=p.peak_bytes, gpu_memory=figure, fits_memory=fits)


def job_configs(overrides: Sequence[str], sizes: TrainingSetSizes) -> list[tuple[list[str], Config]]:
    """Each job of ``dpsweep -m <overrides>`` with its typed config, checked as the sweeper checks it
    (:func:`validate`, :func:`validate_for_dataset`); needs Hydra initialised on dpsweep.conf."""
    jobs = []
    for job in expand_sweep(overrides):
        cfg = to_config(compose("config", overrides=job))
        validate(cfg)
        validate_for_dataset(cfg, sizes(cfg))
        jobs.append((job, cfg))
    return jobs


def plan(overrides: Sequence[str], memory: MemoryCheck | None = None) -> list[PlanRow]:
    """One row per job of ``dpsweep -m <overrides>``; needs Hydra initialised on dpsweep.conf."""
    rows = []
    n_train = TrainingSetSizes()
    models: dict[str, Any] = {}
    if memory is not None:
        from dpsweep.analysis import memory_model

        models = memory_model.load_models(memory.model_file)  # once, not per job
    for job, job_overrides in enumerate(expand_sweep(overrides)):
        cfg = to_config(compose("config", overrides=job_overrides))
        row = plan_job(job, job_overrides, cfg, n_train(cfg))
        rows.append(memory.apply(row, cfg, n_train, models) if memory is not None else row)
    return rows


def format_table(rows: Sequence[PlanRow]) -> str:
    from dpsweep.memory import format_bytes

    cols = ("job", "dataset", "model", "B", "σ", "C", "lr", "epochs", "δ", "ε")
    memory = any(r.peak_bytes is not None for r in rows)
    header = "{:>3}  {:<10} {:<12} {:>5} {:>7} {:>6} {:>8} {:>6} {:>8} {:>9}".format(*cols)
    lines = [header + ("  {:>10}".format("peak") if memory else "")]
    for r in rows:
        dash = "—"
        sigma = f"{r.noise_multiplier:.4g}" if r.noise_multiplier is not None else dash
        clip = f"{r.max_grad_norm:g}" if r.max_grad_norm is not None else dash
        delta = f"{r.delta:.0e}" if r.delta is not None else dash
        eps = f"{r.epsilon:.4g}" if r.epsilon is not None else "non-DP"
        line = (
            f"{r.job:>3}  {r.dataset:<10} {r.model:<12} {r.batch_size:>5} {sigma:>7} {clip:>6} {r.lr:>8.3g} "
            f"{r.epochs:>6} {delta:>8} {eps:>9}"
        )
        if memory:
            line += f"  {format_bytes(r.peak_bytes) if r.peak_bytes is not None else dash:>10}"
        if r.fits_memory is False:
            line += f"  will not fit {r.gpu_memory}"
        lines.append(line + ("  over budget: skipped" if r.over_budget else ""))
    accountants = sorted({r.accountant for r in rows if r.accountant})
    if accountants:
        lines.append(f"ε: {', '.join(accountants)} accountant(s) over each job's steps (Opacus Poisson convention)")
    if memory:
        lines.append(
            "peak: predicted iteration peak (envelope fit; with DP for the run's largest Poisson batch); "
            "dpsweep-memory predict says what would fit"
        )
    return "\n".join(lines)


def _take_option(args: list[str], flag: str) -> str | None:
    """Remove ``--flag VALUE`` or ``--flag=VALUE`` from ``args`` and return VALUE."""
    for i, a in enumerate(args):
        if a == flag:
            if i + 1 == len(args):
                raise ConfigError(flag, None, "a value after the flag")
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if a.startswith(flag + "="):
            del args[i]
            return a.split("=", 1)[1]
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """``dpsweep-plan [--json] [--memory-model FILE [--gpu-memory SIZE] [--backend cuda|cpu-tensors]] OVERRIDES``"""
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    if "-h" in args or "--help" in args:
        print(__doc__)
        return
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    try:
        model_file = _take_option(args, "--memory-model")
        gpu_memory = _take_option(args, "--gpu-memory")
        backend = _take_option(args, "--backend")
        if backend not in (None, "cuda", "cpu-tensors"):
            raise ConfigError("--backend", backend, "cuda or cpu-tensors (the memory backend of the probes)")
        if model_file is None and (gpu_memory is not None or backend is not None):
            flag, value = ("--gpu-memory", gpu_memory) if gpu_memory is not None else ("--backend", backend)
            raise ConfigError(flag, value, "used with --memory-model FILE (dpsweep-memory fit)")
        backend = backend or "cuda"
        memory = MemoryCheck(model_file, gpu_memory, backend) if model_file is not None else None
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            rows = plan(args, memory)
    except (ConfigError, KeyError, FileNotFoundError, HydraException, ValueError) as err:
        print(f"dpsweep-plan: error: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print(format_table(rows))
        dropped = [r for r in rows if r.over_budget]
        if dropped:
            print(f"{len(dropped)} of {len(rows)} jobs exceed sweep.max_epsilon and would be skipped")
        oom = [r for r in rows if r.fits_memory is False]
        if oom:
            print(f"{len(oom)} of {len(rows)} jobs are predicted not to fit the GPU memory")


if __name__ == "__main__":
    main()
