"""dpsweep's Hydra sweeper: Hydra's grid expansion, plus what a sweep of DP-SGD jobs needs.

    dpsweep -m launcher=slurm dp.noise_multiplier=0.8,1.2 train.seed=0,1

Before anything is launched it
- composes and validates every job's config (a bad value fails the sweep before any job runs),
- checks the launcher: satisfiable resources, ``sbatch``/``qsub`` on PATH, a reachable tracking URI,
- creates the MLflow experiment once, so that parallel jobs do not race to create it.

While jobs run, a failed job (raised, killed, out of memory) is recorded and the sweep goes on. At
the end it marks any run its jobs left RUNNING (a job killed outright) as KILLED, prints one summary
line with the finished, skipped and failed counts and the failed runs' ids, and exits with status 1
if any job failed. Every job gets the override ``sweep.id='<id>'`` (quoted: see
``dpsweep.launchers.overrides``); its MLflow run carries that tag. The jobs are expanded by
``dpsweep.launchers.expand``; the parent run, failure policy, progress lines, orphaned runs and
summary come from ``dpsweep.launchers.session``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from dpsweep.config import Config, given_overrides
from dpsweep.config.launcher import spec
from dpsweep.errors import InputError
from dpsweep.launchers.base import DpsweepLauncher
from dpsweep.launchers.composed import ComposedJobs
from dpsweep.launchers.expand import expand
from dpsweep.launchers.nodes import OptunaSearchConf
from dpsweep.launchers.overrides import new_sweep_id, string_override
from dpsweep.launchers.preflight import check_rank_shapes, check_search, preflight, refuse
from dpsweep.launchers.session import SweepOutcome, SweepSession, close_dead_runs

if TYPE_CHECKING:
    from dpsweep.privacy.tuning import Procedure  # imported where a private tuning is drawn (dp-accounting)

log = logging.getLogger(__name__)


class DpsweepSweeper(Sweeper):
    """Grid expansion as Hydra's basic sweeper (``hydra.sweeper.params`` first, then the command line).

    It subclasses Hydra's stable ``Sweeper`` interface rather than ``BasicSweeper``: Hydra's plugin
    scan re-executes ``basic_sweeper.py``, which would leave a subclass with a stale base class.
    """

    def __init__(
        self, max_batch_size: int | None = None, params: dict[str, str] | None = None, optuna: Any = None
    ) -> None:
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.optuna: OptunaSearchConf | None = None
        if optuna is not None:
            node = OmegaConf.merge(OmegaConf.structured(OptunaSearchConf), optuna)
            self.optuna = OmegaConf.to_object(node)
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.launcher: Launcher | None = None
        self.composer: ComposedJobs | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        # Fix the sweep directory now: jobs started again later (a requeue is a new process) must
        # find the same output and checkpoint directories, not a new ${now:} timestamp.
        with open_dict(config):
            config.hydra.sweep.dir = str(Path(str(config.hydra.sweep.dir)).absolute())
        self.config, self.hydra_context = config, hydra_context
        # an inline launcher (in this process) runs each job on the config composed here
        try:
            inline = spec(str(OmegaConf.select(config, "launcher.name"))).inline
        except InputError as err:  # an unknown launcher.name, before Hydra instantiates anything
            refuse(str(err))
        self.composer = ComposedJobs(hydra_context.config_loader, keep=inline)
        launcher_context = HydraContext(self.composer, hydra_context.callbacks) if inline else hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=launcher_context, task_function=task_function, config=config
        )

    def _jobs(self, arguments: list[str], sweep_id: str) -> list[list[str]]:
        """The grid's jobs (``hydra.sweeper.params`` first, then the command line), each with its sweep id."""
        assert self.hydra_context is not None
        jobs = expand(arguments, self.params, self.hydra_context.config_loader)
        return [[*job, string_override("sweep.id", sweep_id)] for job in jobs]

    def compose_job(self, job: list[str]) -> DictConfig:
        """The job's own config (without the ``hydra`` node, whose job fields exist only at run time)."""
        assert self.composer is not None and self.config is not None
        return self.composer.compose(self.config, job)

    def typed_job(self, job: list[str]) -> Config:
        """The job's typed config, for the checks before launch (``ComposedJobs.typed``: no OmegaConf copy a
        job where the launcher composes each job itself)."""
        assert self.composer is not None and self.config is not None
        return self.composer.typed(self.config, job)

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None
        private_tuning = bool(OmegaConf.select(self.config, "sweep.private_tuning", default=False))
        try:  # checked by the dpsweep command before its first line too (dpsweep.cli.early)
            check_search(self.optuna is not None, bool(self.params), private_tuning)
        except InputError as err:
            refuse(str(err))
        if self.optuna is not None:
            from dpsweep.launchers.optuna_sweeper import OptunaSearch

            return OptunaSearch(self.optuna, self).run(arguments)
        return self._grid(arguments)

    def _grid(self, arguments: list[str]) -> list[Sequence[JobReturn]]:
        """The grid sweep (or the private tuning drawn from it): jobs composed and checked, launched
        under one parent run, summarised."""
        sweep_id = new_sweep_id()
        jobs = self._jobs(arguments, sweep_id)
        configs = [self.typed_job(job) for job in jobs]
        preflight(configs, jobs)
        first = configs[0]
        tuned: PrivateTuning | None = None
        if first.sweep.private_tuning:
            assert self.config is not None
            tuned = private_trials(jobs, configs, Path(str(self.config.hydra.sweep.dir)))
            jobs, configs = tuned.jobs, [self.typed_job(job) for job in tuned.jobs]
        todo, skipped = select_jobs(jobs, configs)
        for line in skipped:
            print(f"dpsweep: skip {line}", flush=True)
        todo = self._pack(first, configs, todo)
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")

        session, outcome = SweepSession(first, sweep_id), SweepOutcome(sweep_id, skipped=len(skipped))
        if tuned is not None and not tuned.jobs:
            print(f"dpsweep: sweep {sweep_id}: private tuning drew K = 0 trials: nothing runs, nothing is released")
            return []
        if not todo:  # a no-op re-run: no parent run, which would stand empty in the MLflow UI
            print(outcome.line() + " (nothing to run: no parent run recorded)", flush=True)
            return []
        params = {
            "sweep.overrides": " ".join(arguments), "sweep.launcher": first.launcher.name,
            "sweep.n_configs": len(jobs), "sweep.n_skipped": len(skipped), "sweep.dir": str(sweep_dir),
        }  # fmt: skip
        try:
            with session.parent_run(f"sweep-{sweep_id}", {}, params) as parent:
                todo = [[*job, string_override("sweep.parent_run_id", parent.run_id)] for job in todo]
                count = f"{len(todo)} job" + "s" * (len(todo) != 1)
                print(f"dpsweep: {count} to run (sweep {sweep_id}, launcher={first.launcher.name})", flush=True)
                returns = self._launch(todo, outcome, session)
                session.finish(outcome)
                if tuned is not None:
                    tuned.record(session)
                parent.log_metrics({"sweep.finished": outcome.finished, "sweep.failed": outcome.failed,
                                    "sweep.skipped": outcome.skipped})  # fmt: skip
                if outcome.aborted:
                    raise SweepAborted(outcome.aborted)
        except SweepAborted:
            pass  # the parent run ended FAILED with the reason; report and exit below
        session.end(session.summary(outcome), failed=bool(outcome.failed or outcome.aborted))
        return returns

    def _pack(self, first: Config, configs: Sequence[Config], todo: list[list[str]]) -> list[list[str]]:
        """K, the trials per device (``launcher.trials_per_device``; ``auto`` resolved from the memory
        model and given to every job as a number), and T, the trials per job in turn
        (``launcher.trials_per_job``), told to the launcher; one line when either is above 1."""
        from dpsweep.config import trials_per_device
        from dpsweep.config.launcher import trials_per_job
        from dpsweep.launchers import packing
        from dpsweep.launchers.preflight import job_backend

        k = trials_per_device(first.launcher)
        if k is None and todo:
            k = packing.resolve(configs, len(todo), job_backend(first))
            todo = [[*job, f"launcher.trials_per_device={k}"] for job in todo]
            print(f"dpsweep: launcher.trials_per_device=auto: {k} trials fit {first.launcher.gpu_memory} together "
                  f"({first.train.memory_model})", flush=True)  # fmt: skip
        k = k or 1
        try:  # one job shape a sweep whose jobs' tasks are its ranks (the launcher's spec.rank_tasks)
            check_rank_shapes(configs)
        except InputError as err:
            refuse(str(err))
        t = trials_per_job(first.launcher)
        if isinstance(self.launcher, DpsweepLauncher):  # not a Hydra launcher a user chose (hydra/launcher=...)
            self.launcher.trials_per_device = k
            self.launcher.trials_per_job = t
            self.launcher.take_ranks(first.train)
        if max(k, t) > 1 and todo:
            n_jobs = -(-len(todo) // max(k, t))
            jobs = f"{n_jobs} job{'s' * (n_jobs > 1)}"
            how = (
                "one after another in each job's process (one start-up a job)"
                if t > 1
                else "one device each (time-slicing it, or through CUDA MPS where its daemon runs)"
            )
            print(f"dpsweep: {len(todo)} trials in {jobs} of up to {max(k, t)} trials, {how}", flush=True)
        return todo

    def _launch(self, jobs: list[list[str]], outcome: SweepOutcome, session: SweepSession) -> list[Sequence[JobReturn]]:
        """Launch in batches; stop once the share of failed jobs exceeds sweep.max_failure_rate."""
        assert self.launcher is not None
        # inline jobs run one at a time anyway: batches of one let the failure policy act early
        k = 1  # trials per job: K at once on a device, or T in turn
        if isinstance(self.launcher, DpsweepLauncher):
            k = self.launcher.trials_per_device * self.launcher.trials_per_job
        size = self.max_batch_size * k if self.max_batch_size else (1 if session.inline else max(1, len(jobs)))
        returns: list[Sequence[JobReturn]] = []
        progress = session.progress(self.launcher, len(jobs))
        for start in range(0, len(jobs), size):
            batch = self.launcher.launch(jobs[start : start + size], initial_job_idx=start)
            for ret in batch:  # those the launcher did not report as they completed
                progress.job_done(ret)
            returns.append(batch)
            outcome.count(batch)
            left = len(jobs) - start - size
            why = session.failure_rate(outcome.failed, outcome.finished + outcome.failed, "jobs") if left > 0 else None
            if why is not None:
                outcome.aborted = f"stopping: {why}; {left} jobs not launched"
                print(f"dpsweep: {outcome.aborted}", flush=True)
                break
        return returns


class SweepAborted(Exception):
    """The failure policy stopped the sweep."""


@dataclass
class PrivateTuning:
    """``sweep.private_tuning``: the trials drawn from the grid (``dpsweep.privacy.tuning``) and their cost."""

    jobs: list[list[str]]
    cost: Procedure  # both ε (the procedure's, the dominant candidate's alone), their accountant and analysis
    dominant: str  # the dominant candidate's overrides

    def record(self, session: SweepSession) -> None:
        """Log the procedure's ε on the parent run, and tag the trials: only the best is released
        (``dpsweep.tracking.sweeps.release_best``). The parent run, which holds K, is withheld from
        dpsweep-ui's view (tag ``tuning.withheld``), as the trials not released are."""
        from dpsweep.tracking import release_best
        from dpsweep.tracking.sweeps import ANALYSIS_TAG, WITHHELD_TAG, void_of

        parent, first = session.parent, session.first
        assert parent is not None
        s = first.sweep
        cost = self.cost
        parent.log_metrics({"epsilon_tuning": cost.epsilon, "epsilon_single_run": cost.single_run_epsilon})
        parent.log_params({
            "sweep.tuning_distribution": s.tuning_distribution, "sweep.tuning_mean_trials": s.tuning_mean_trials,
            "sweep.tuning_eta": s.tuning_eta,
        })  # fmt: skip
        objective = first.task.objective
        procedure = {
            "epsilon": cost.epsilon, "delta": cost.delta, "accountant": cost.accountant,
            "epsilon_single_run_of_dominant": cost.single_run_epsilon, "dominant_candidate": self.dominant,
            "distribution": s.tuning_distribution, "mean_trials": s.tuning_mean_trials, "eta": s.tuning_eta,
            "selection": f"the best trial by {objective}", "analysis": cost.analysis, "reference": cost.reference,
        }  # fmt: skip
        uri, experiment = first.tracking.uri, first.tracking.experiment_name
        best, finished = release_best(uri, experiment, session.sweep_id, objective, procedure)
        parent.set_tags({
            "tuning.best_run_id": best if best is not None else "none",
            "tuning.k": len(self.jobs),  # part of the secret randomness: not for publication
            "tuning.dominant_candidate": self.dominant, "dp.delta": cost.delta,
            "tuning.release": f"the best trial only (by {objective}); publishing K or other trials voids its ε",
            "tuning.accountant": cost.accountant, ANALYSIS_TAG: cost.analysis,
            WITHHELD_TAG: "true",
        })  # fmt: skip
        best_text = f"run {best[:8]}" if best is not None else "no finished trial"
        void = void_of(uri, parent.run_id)
        if void is not None:
            print(f"dpsweep: private tuning: not for release: {void}", file=sys.stderr, flush=True)
        print(
            f"dpsweep: private tuning: {finished} trials finished; release only the best ({best_text}): "
            f"ε={cost.epsilon:.4g} for the whole procedure (δ={cost.delta:g}; one run alone: "
            f"ε={cost.single_run_epsilon:.4g}; both {cost.accountant}, the {cost.analysis} analysis)",
            flush=True,
        )


def private_trials(jobs: Sequence[list[str]], typed: Sequence[Config], sweep_dir: Path) -> PrivateTuning:
    """K trials drawn from the grid's configs, with secret seeds, and the procedure's ε (``dpsweep.privacy.tuning``).

    Each trial's checkpoint directory (``train.checkpoint_dir``, logged as a tag) is named by a token of
    its own from the operating system's entropy, given to the job as an override: a requeued job, whose
    overrides are the same, finds its checkpoint again, and the name tells neither the trial's seed
    (a hash of the overrides would: 31 bits are searched in minutes) nor its number among the trials
    (a lower bound on K). ``train.checkpoint_dir`` is not part of a config's identity: the trial's config
    hash is that of its config. A grid's own ``train.checkpoint_dir`` is the folder of its trials' own."""
    import secrets

    from dpsweep.plan import FactsCache, prepare, tuning_procedure
    from dpsweep.privacy import tuning

    s = typed[0].sweep
    facts = FactsCache()
    try:
        cost = tuning_procedure([prepare(cfg, facts(cfg)) for cfg in typed], s)
    except InputError as err:
        refuse(str(err))
    rng = tuning.secret_generator()
    k = tuning.draw_k(s.tuning_distribution, s.tuning_mean_trials, s.tuning_eta, rng)
    trials = []
    for _ in range(k):  # no trial index and no output of the generator that drew K reaches a trial
        pick = int(rng.integers(len(jobs)))
        job = [o for o in jobs[pick] if not o.startswith(("train.seed=", "train.checkpoint_dir="))]
        token, given = f"trial-{secrets.token_hex(8)}", typed[pick].train.checkpoint_dir
        directory = Path(given) / token if given else sweep_dir / token / "checkpoint"
        seed = f"train.seed={tuning.secret_seed()}"
        trials.append([*job, seed, string_override("train.checkpoint_dir", str(directory))])
    common = set.intersection(*(set(job) for job in jobs))  # the overrides every candidate shares
    axes = " ".join(o for o in given_overrides(jobs[cost.dominant]) if o not in common) or "(every candidate)"
    return PrivateTuning(trials, cost, axes)


def select_jobs(jobs: Sequence[list[str]], typed: Sequence[Config]) -> tuple[list[list[str]], list[str]]:
    """Jobs to launch, and one line per job skipped: its config already FINISHED in the experiment
    (matched by the hash of its identity, see dpsweep.config.identity), running now in a live job, or
    a repeat of an earlier job. Runs left RUNNING by dead processes are ended KILLED first
    (``dpsweep.tracking.dead_runs``), so that their configs run again."""
    from dpsweep.plan import config_hash, skip_reasons
    from dpsweep.tracking import runs_by_hash

    done: dict[str, str] = {}
    running: dict[str, str] = {}
    for uri, name in sorted({(c.tracking.uri, c.tracking.experiment_name) for c in typed}):
        close_dead_runs(uri, name)
        running |= runs_by_hash(uri, name, "RUNNING")
        if not typed[0].sweep.force:
            done |= runs_by_hash(uri, name, "FINISHED")
    todo: list[list[str]] = []
    skipped: list[str] = []
    reasons = skip_reasons([config_hash(cfg) for cfg in typed], done, running)
    for job, why in zip(jobs, reasons, strict=True):
        if why is None:
            todo.append(job)
        else:
            skipped.append(f"{' '.join(given_overrides(job))}: {why}")
    return todo, skipped
