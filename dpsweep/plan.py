"""The run plan: everything decided about a run before it starts, computed once, by one function.

    from dpsweep.plan import prepare
    plan = prepare(cfg, facts)              # cfg: dpsweep.config.Config; facts: dpsweep.data.facts.DatasetFacts
    plan.noise_multiplier, plan.steps       # σ (calibrated when dp.target_epsilon is set), optimizer steps
    plan.privacy.epsilon                    # the planned ε over every step, under dp.accountant
    plan.over_budget                        # why the planned ε exceeds sweep.max_epsilon (None: within)
    plan.physical_batch_size, plan.memory   # examples per pass, the memory prediction (with a memory model)
    plan.config_hash                        # the identity of the run (resume, skipping FINISHED configs)

The trainer (``dpsweep.run.runner``), ``dpsweep-plan``, the sweeper's preflight and ``dpsweep-memory``
all call :func:`prepare`; none of them repeats its sequence:

1. the ranges that need no data (:func:`dpsweep.config.validate`); what the run's task, mechanism and
   engine declare they run (both in :func:`dpsweep.mechanisms.engines.checked`, as every entry point
   checks a config); the ranges that need N (:func:`dpsweep.config.validate_for_dataset`: B <= N,
   δ < 1/N); the model of an engine whose steps need its layers to treat examples apart
   (:func:`dpsweep.mechanisms.fused.check_planned_model`);
2. σ: ``dp.noise_multiplier``, or calibrated so that ε <= ``dp.target_epsilon``, which the whole
   ledger spends: the clipping release of ``dp.clipping=quantile`` (``dpsweep.privacy.clipping``) included;
   or so that no membership-inference attack on the whole ledger reaches a TPR above
   ``dp.target_tpr_at_1pct`` at 1 % FPR (``dpsweep.privacy.certainty.noise_for_risk``);
3. the sampling schedule and steps (Opacus's Poisson-loader convention, ``dpsweep.privacy.schedule``) and the
   planned ε of the ledger (releases and steps), which is exactly the ε the run logs at its end;
4. the budget verdict against ``sweep.max_epsilon`` (a probe takes one step: no budget applies);
5. the physical batch: ``train.physical_batch_size``, or the largest pass a memory model predicts
   to fit the GPU memory, and the memory prediction itself when asked;
6. the config hash.

Every failure is an :class:`~dpsweep.errors.InputError` naming the key, the value and what is
allowed; nothing here trains, logs or writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dpsweep import mechanisms
from dpsweep.config import (
    Config,
    ConfigError,
    DPConfig,
    SweepConfig,
    flatten,
    identity,
    identity_hash,
    population,
    validate_for_dataset,
    validate_input_shape,
)
from dpsweep.data.facts import OFFICIAL_N_TRAIN, DatasetFacts, described, official_facts
from dpsweep.errors import InputError
from dpsweep.mechanisms import engines
from dpsweep.memory.model import MemoryModel, load_models
from dpsweep.privacy import calibrate, clipping, ledger, rdp, schedule, tuning
from dpsweep.privacy.ledger import Accounting, Ledger

if TYPE_CHECKING:  # torch: imported by the plans that use a memory model, not by every plan
    from dpsweep.memory.predict import MemoryPrediction


@dataclass(frozen=True)
class PlannedPrivacy:
    """The privacy cost a DP-SGD run will have spent after its last step (``dp.accountant``)."""

    noise_multiplier: float  # σ
    sample_rate: float | None  # q the accountant records per step (of examples or users); None: no sampling
    steps: int  # every step of train.epochs, or fewer where the task stops at the budget
    delta: float
    accountant: str
    epsilon: float
    ledger: Ledger  # every release the run will make, its DP-SGD steps included (dpsweep.privacy.ledger)
    calibrated_to: str | None = None  # what σ was calibrated to ("ε <= 3", "TPR at 1 % FPR <= 0.05"); None: given

    @property
    def calibrated(self) -> bool:
        """σ was calibrated, to dp.target_epsilon or dp.target_tpr_at_1pct."""
        return self.calibrated_to is not None

    @property
    def poisson_rate(self) -> float:
        """q of a Poisson-sampled mechanism (DP-SGD); ValueError for one that samples nothing."""
        if self.sample_rate is None:
            raise ValueError("this run's mechanism samples nothing: it has no Poisson rate")
        return self.sample_rate


@dataclass(frozen=True)
class MemoryBudget:
    """A loaded memory model file and what to plan against: ``backend`` is the memory backend the
    job measures with (``cuda``, or the CPU twin ``cpu-tensors``); ``gpu_memory`` overrides
    ``launcher.gpu_memory``; ``predict`` asks for the full prediction (stages, largest sizes), which
    ``dpsweep-plan`` and ``dpsweep-memory predict`` show and training does not need."""

    models: Mapping[str, MemoryModel]
    backend: str | None  # None: each fit's own backend
    gpu_memory: str | None = None
    predict: bool = False


@dataclass(frozen=True)
class RunPlan:
    config: Config
    facts: DatasetFacts
    steps: int  # optimizer steps the run takes (with DP: Poisson steps, one per logical batch)
    privacy: PlannedPrivacy | None  # None without DP
    over_budget: str | None  # why the planned ε exceeds sweep.max_epsilon; None within budget
    physical_batch_size: int | None  # examples per forward/backward pass; None: the whole batch
    memory: MemoryPrediction | None  # with MemoryBudget(predict=True)
    config_hash: str
    gpu_memory: str | None = None  # the GPU memory planned against, as written (e.g. 16GiB)

    @property
    def noise_multiplier(self) -> float | None:
        return self.privacy.noise_multiplier if self.privacy is not None else None

    @property
    def fits_memory(self) -> bool | None:
        """The OOM verdict (None: no memory model or no GPU memory given)."""
        return self.memory.fits if self.memory is not None else None


def prepare(cfg: Config, facts: DatasetFacts, memory: MemoryBudget | None = None) -> RunPlan:
    """The plan of one run of ``cfg`` on a training set described by ``facts`` (see the module doc)."""
    engine = engines.checked(cfg)
    validate_for_dataset(cfg, facts.n_train)
    validate_input_shape(cfg, facts.input_shape)
    if engine is not None and engine.rows_apart:
        from dpsweep.mechanisms.fused import check_planned_model  # torch: only for such an engine's plan

        check_planned_model(cfg.model, facts.input_shape, facts.num_classes)
    planned = _planned_privacy(cfg, facts.n_train)
    steps = planned.steps if planned is not None else _scheduled_steps(cfg, population(cfg, facts.n_train))
    # a memory model splits a step into passes only where the engine may (no DP: the loader's steps may)
    splits = engine is None or engine.physical_batches
    physical, prediction, figure = _memory(cfg, facts, memory, splits)
    if cfg.audit.mode == "white_box" and physical is not None:  # a canary per pass would enter a release k times
        raise ConfigError(
            "train.memory_model", cfg.train.memory_model,
            f"null with audit.mode=white_box: the plan would split each step into passes of {physical}",
        )  # fmt: skip
    return RunPlan(
        config=cfg, facts=facts, steps=steps, privacy=planned, over_budget=_budget_verdict(cfg, planned),
        physical_batch_size=physical, memory=prediction, config_hash=config_hash(cfg), gpu_memory=figure,
    )  # fmt: skip


def skip_reasons(
    hashes: Sequence[str], finished: Mapping[str, str], running: Mapping[str, str] | None = None
) -> list[str | None]:
    """Why a sweep skips each of its jobs (None: it runs), given their config hashes in launch order,
    the experiment's FINISHED runs and live RUNNING runs by config hash (``{hash: run id}``; pass no
    FINISHED runs under ``sweep.force``): running now, already FINISHED, or the same config as an
    earlier job that runs. ``dpsweep -m`` skips by it, and ``dpsweep-plan`` marks by it."""
    running = running or {}
    seen: dict[str, int] = {}
    reasons: list[str | None] = []
    for index, h in enumerate(hashes):
        if h in running:
            reasons.append(f"running now as run {running[h]} (a live job)")
        elif h in finished:
            reasons.append(f"already FINISHED as run {finished[h]} (sweep.force=true runs it again)")
        elif h in seen:
            reasons.append(f"same config as job {seen[h]}")
        else:
            seen[h] = index
            reasons.append(None)
    return reasons


def config_hash(cfg: Config) -> str:
    """The hash of what determines a run's result (:func:`dpsweep.config.identity`)."""
    return identity_hash(identity(flatten(cfg)))


def accounting(dp: DPConfig) -> Accounting:
    """How a run's ε is computed: ``dp.accountant`` over the orders of ``dp.rdp_orders``."""
    return Accounting(dp.accountant.value, orders=rdp.ORDER_GRIDS.get(dp.rdp_orders.value, key="dp.rdp_orders"))


def tuning_procedure(plans: Sequence[RunPlan], sweep: SweepConfig) -> tuning.Procedure:
    """The privacy cost of a private tuning (``sweep.private_tuning``) over these candidates' plans
    (:func:`dpsweep.privacy.tuning.procedure` under ``sweep.tuning_analysis``: the procedure's ε and the
    dominant candidate's alone, both under RDP); InputError for a non-private candidate, mixed δ, or a
    procedure whose ε exceeds ``sweep.max_epsilon`` (each trial alone may be within it: the released
    model's ε is the procedure's)."""
    for p in plans:
        if p.privacy is None:
            raise InputError("dp.enabled", False, "true in every job of a private tuning")
    deltas = sorted({p.privacy.delta for p in plans if p.privacy is not None})
    if len(deltas) > 1:
        raise InputError("dp.delta", deltas, "one δ for every job of a private tuning")
    bills = [p.privacy.ledger for p in plans if p.privacy is not None]
    # the orders: the dominant candidate's (papernot_steinke refuses a grid without one); mixture prices any grid
    top = tuning.dominant(bills) if sweep.tuning_analysis == tuning.DEFAULT_ANALYSIS else 0
    how = accounting(plans[top].config.dp)
    cost = tuning.procedure(
        bills, deltas[0], how, sweep.tuning_distribution, sweep.tuning_mean_trials, sweep.tuning_eta,
        sweep.tuning_analysis,
    )  # fmt: skip
    if sweep.max_epsilon is not None and cost.epsilon > sweep.max_epsilon:
        raise InputError(
            "sweep.max_epsilon", sweep.max_epsilon,
            f"at least the tuning procedure's ε={cost.epsilon:.4g} (δ={cost.delta:g}; one run alone: "
            f"ε={cost.single_run_epsilon:.4g}; both {cost.accountant}): the released model's ε is the procedure's; "
            "raise the budget, or lower sweep.tuning_mean_trials or the candidates' ε",
        )  # fmt: skip
    return cost


def _scheduled_steps(cfg: Config, n_train: int) -> int:
    """Steps of train.epochs epochs of ceil(N/B) steps (Opacus's Poisson-loader convention)."""
    return schedule.poisson_schedule(n_train, cfg.train.batch_size).steps(cfg.train.epochs)


def stops_at_budget(cfg: Config) -> bool:
    """A task that keeps σ and stops training where ε would pass dp.target_epsilon (``TaskConfig.stops_at_budget``)."""
    return bool(cfg.task.stops_at_budget())


def mechanism_of(cfg: Config) -> mechanisms.Mechanism:
    """The run's mechanism (``dp.mechanism``), from the registry; InputError for an unknown name."""
    return mechanisms.get(cfg.dp.mechanism)


def setting(cfg: Config, n_train: int, mechanism: mechanisms.Mechanism | None = None) -> mechanisms.Setting:
    """What the run's privacy depends on besides σ: N (examples or users), B, the epochs, δ, the
    accounting, the private clipping norm's release (on a Poisson sample, where the mechanism samples)
    and the mechanism's own ``dp.*`` options."""
    dp, t = cfg.dp, cfg.train
    mechanism = mechanism or mechanism_of(cfg)
    base = mechanisms.Setting(population(cfg, n_train), t.batch_size, t.epochs, dp.delta, accounting(dp))
    q = mechanism.sample_rate(base)
    extra = clipping.planned(dp, q) if q is not None else Ledger()
    options = {o.key: getattr(dp, o.key) for o in mechanism.options}
    return replace(base, extra=extra, options=options)


def _planned_privacy(cfg: Config, n_train: int) -> PlannedPrivacy | None:
    dp = cfg.dp
    if not dp.enabled:
        return None
    mechanism = mechanism_of(cfg)
    mechanism.check_config(cfg)
    s = setting(cfg, n_train, mechanism)
    mechanism.check(s)
    q = mechanism.sample_rate(s)
    sigma, steps = dp.noise_multiplier, mechanism.steps(s)
    if dp.target_epsilon is not None and stops_at_budget(cfg):
        steps = _steps_within_budget(mechanism, s, dp.target_epsilon, sigma, steps)
    elif dp.target_epsilon is not None:
        sigma = _calibrated(mechanism, s, dp)
    elif dp.target_tpr_at_1pct is not None:
        sigma = _calibrated_to_risk(mechanism, s, dp.target_tpr_at_1pct)
    clipping.check_adaptive(dp, sigma, cfg.train.batch_size)
    bill = mechanism.ledger(replace(s, steps=steps), sigma)
    return _computable(dp, PlannedPrivacy(
        sigma, q, steps, dp.delta, dp.accountant.value, ledger.epsilon(bill, dp.delta, s.accounting).epsilon, bill,
        calibrated_to(cfg),
    ))  # fmt: skip


def calibrated_to(cfg: Config) -> str | None:
    """What the run's σ is calibrated to (the run's lines and tags say it): ``ε <= target`` or
    ``TPR at 1 % FPR <= target``; None where σ is ``dp.noise_multiplier`` (a task that stops at the budget
    keeps it)."""
    dp = cfg.dp
    if dp.target_epsilon is not None and not stops_at_budget(cfg):
        return f"ε <= {dp.target_epsilon:g}"
    if dp.target_tpr_at_1pct is not None:
        return f"TPR at 1 % FPR <= {dp.target_tpr_at_1pct:g}"
    return None


def _calibrated_to_risk(mechanism: mechanisms.Mechanism, s: mechanisms.Setting, target_tpr: float) -> float:
    """σ calibrated to ``dp.target_tpr_at_1pct``: the smallest σ whose whole ledger (the other releases
    included) lets no membership-inference attack reach a TPR above the target at 1 % FPR
    (:func:`dpsweep.privacy.certainty.noise_for_risk`; Kulynych et al. 2024, "Attack-Aware Noise
    Calibration for Differential Privacy", NeurIPS), by the bisection of ``dp.target_epsilon``."""
    from dpsweep.privacy import certainty  # scipy's signal module: only for a run calibrated to risk

    try:
        return certainty.noise_for_risk(lambda sigma: mechanism.ledger(s, sigma), target_tpr)
    except ValueError as err:  # the target is out of reach
        if isinstance(err, InputError):
            raise
        raise ConfigError("dp.target_tpr_at_1pct", target_tpr, f"a risk reachable with σ <= 1e6 ({err})") from err


def _steps_within_budget(
    mechanism: mechanisms.Mechanism, s: mechanisms.Setting, target: float, sigma: float, most: int
) -> int:
    """The most steps whose ε stays within ``target`` at this σ (where the task stops at the budget)."""

    def eps(k: int) -> float:
        return ledger.epsilon(mechanism.ledger(replace(s, steps=k), sigma), s.delta, s.accounting).epsilon

    steps = calibrate.largest_count(eps, target, most)
    if steps == 0:
        q = mechanism.sample_rate(s)
        at = f"σ={sigma:g}" + (f", q={q:.4g}" if q is not None else "")
        raise ConfigError(
            "dp.target_epsilon", target,
            f"at least one critic step's ε (ε={eps(1):.4g} at {at}) with task.stop_at_budget=true: "
            "raise it or dp.noise_multiplier",
        )  # fmt: skip
    return steps


def _calibrated(mechanism: mechanisms.Mechanism, s: mechanisms.Setting, dp: DPConfig) -> float:
    """σ calibrated to ``dp.target_epsilon`` (the mechanism's bisection), after what the other releases spend."""
    target = float(dp.target_epsilon or 0)
    before = ledger.epsilon(s.extra, s.delta, s.accounting).epsilon
    if before >= target:
        q = mechanism.sample_rate(s) or 1.0
        raise ConfigError(
            "dp.target_epsilon", target,
            f"more than the clipping release alone spends (ε={before:.4g} for dp.clip_epsilon={dp.clip_epsilon:g} "
            f"on a Poisson sample at q={q:.4g}): raise it or lower dp.clip_epsilon",
        )  # fmt: skip
    try:
        return mechanism.calibrate(s, target)
    except ValueError as err:  # the budget is out of reach
        if isinstance(err, InputError):
            raise
        raise ConfigError("dp.target_epsilon", target, f"a budget reachable with σ <= 1e6 ({err})") from err


def _computable(dp: DPConfig, planned: PlannedPrivacy) -> PlannedPrivacy:
    """The plan, unless dp.accountant is pld or prv beyond ``ledger.DISCRETISED_MAX_EPSILON``: there
    they would take minutes and gigabytes at the end of the run to report ε = inf; refused before it."""
    why = ledger.not_computed(planned.ledger, dp.delta, accounting(dp), "for this run")
    if why is not None:
        raise ConfigError("dp.accountant", dp.accountant.value, why)
    return planned


def _budget_verdict(cfg: Config, planned: PlannedPrivacy | None) -> str | None:
    limit = cfg.sweep.max_epsilon
    if planned is None or limit is None or cfg.train.probe:  # a probe takes one step and reports no ε
        return None
    if not planned.epsilon <= limit:  # an ε that is not a finite number is never within a budget
        return f"ε={planned.epsilon:.4g} ({planned.accountant}, δ={planned.delta:g}) > sweep.max_epsilon={limit:g}"
    return None


def _memory(
    cfg: Config, facts: DatasetFacts, memory: MemoryBudget | None, splits: bool
) -> tuple[int | None, MemoryPrediction | None, str | None]:
    """The physical batch, the memory prediction when asked, and the GPU memory figure planned against; a
    memory model chooses a physical batch only where the run's steps may be split (``splits``:
    ``Engine.physical_batches``)."""
    t = cfg.train
    if memory is None or t.probe:
        return t.physical_batch_size, None, None
    from dpsweep.memory.predict import chosen_physical_batch, gpu_budget, model_for, predict_config
    from dpsweep.memory.stages import model_key  # torch

    figure, budget = gpu_budget(cfg, memory.gpu_memory)
    fitted = model_for(memory.models, model_key(cfg), memory.backend)
    physical = t.physical_batch_size
    if physical is None and splits and t.memory_model is not None and budget is not None:
        physical = chosen_physical_batch(fitted, cfg, facts, budget)
        if physical is None:
            raise ConfigError(
                "launcher.gpu_memory" if memory.gpu_memory is None else "--gpu-memory", figure,
                f"room for at least one example: {t.memory_model} predicts more for a pass of 1 example",
            )  # fmt: skip
    prediction = predict_config(fitted, cfg, facts, budget) if memory.predict else None
    return physical, prediction, figure


# ---------------------------------------------------------------------------------------------
# dataset facts, before the run: N, the input shape and the classes
# ---------------------------------------------------------------------------------------------
def dataset_facts(cfg: Config) -> tuple[DatasetFacts, str | None]:
    """N, input shape and classes from the dataset's description (digits, no files needed), its files
    or, when they are not downloaded yet, its official description; the second value is a note saying
    so (None when the facts are exact)."""
    known = described(cfg.dataset)
    if known is not None:
        return known, None
    from dpsweep.data import loaders  # torch and torchvision: only to read a dataset's files

    try:
        splits = loaders.build(cfg.dataset)
        return DatasetFacts(splits.n_train, splits.input_shape, splits.num_classes), None
    except loaders.DatasetNotFoundError:
        if cfg.dataset.name not in OFFICIAL_N_TRAIN:
            raise
        facts = official_facts(cfg.dataset)
        return facts, f"{cfg.dataset.name} files not found; using its official training-set size N={facts.n_train}"


class FactsCache:
    """:func:`dataset_facts` per dataset config, each dataset read once (a sweep's jobs mostly share
    one); the notes of the datasets read from their official description are kept in ``notes``."""

    def __init__(self) -> None:
        self._facts: dict[str, DatasetFacts] = {}
        self.notes: list[str] = []

    def __call__(self, cfg: Config) -> DatasetFacts:
        key = repr(cfg.dataset)  # a dataclass: every field (2 ms a job less than OmegaConf's JSON of it)
        if key not in self._facts:
            self._facts[key], note = dataset_facts(cfg)
            if note is not None:
                self.notes.append(note)
        return self._facts[key]


class MemoryFiles:
    """Memory model files, each read once (a sweep's jobs mostly name one)."""

    def __init__(self) -> None:
        self._models: dict[str, Mapping[str, MemoryModel]] = {}

    def budget(self, cfg: Config, backend: str) -> MemoryBudget | None:
        """The budget ``train.memory_model`` names (None when it is not set), the file read once."""
        path = cfg.train.memory_model
        if path is None:
            return None
        key = str(Path(path).absolute())
        if key not in self._models:
            self._models[key] = load_models(path)
        return MemoryBudget(self._models[key], backend)
