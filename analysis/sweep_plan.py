"""A sweep's jobs planned before it runs (``dpsweep-plan``'s and ``dpsweep-memory predict``'s work): each
job's run plan, why ``dpsweep -m`` would skip it, and what its ε means for an attacker.

    budget = memory_budget(MemoryCheck("memory_model.json", "16GiB"))   # None without a memory model
    plans, notes = plan_jobs(configs, budget)          # dpsweep.plan.prepare, dataset facts read once
    skip_reasons(plans, note=print)                    # FINISHED before, or a repeat of a job
    risk_figures(plans)                                # μ-GDP and TPR@1%, once per distinct ledger

The configs are those of the sweep's jobs, composed as the sweeper composes them (the command that
takes the overrides composes them). Nothing heavy is imported at the top: torch, MLflow and the planner
are imported where used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from dpsweep.config import Config
    from dpsweep.plan import MemoryBudget, RunPlan


@dataclass(frozen=True)
class MemoryCheck:
    """A memory model to plan with: predict each job's peak memory from the fit file ``model_file``."""

    model_file: str
    gpu_memory: str | None = None  # default: each job's launcher.gpu_memory
    backend: str | None = None  # default: cuda where a GPU is visible, else the backend the file was fitted on


def default_backend() -> str | None:
    """The memory backend to plan with when none is given: ``cuda`` where a GPU is visible; else
    None, which takes the backend each fit in the file was made on (e.g. CUDA probes from a cluster,
    planned on a CPU-only login node, or the CPU twin's probes on a laptop)."""
    import torch  # only where a memory model is given

    return "cuda" if torch.cuda.is_available() else None


def memory_budget(memory: MemoryCheck | None) -> MemoryBudget | None:
    """The budget every job is planned against (the file read once, not per job); None without a model."""
    if memory is None:
        return None
    from dpsweep.memory.model import load_models
    from dpsweep.plan import MemoryBudget

    backend = memory.backend or default_backend()
    return MemoryBudget(load_models(memory.model_file), backend, memory.gpu_memory, predict=True)


def plan_jobs(configs: Sequence[Config], budget: MemoryBudget | None = None) -> tuple[list[RunPlan], list[str]]:
    """Each config's run plan (``dpsweep.plan.prepare``, each dataset's facts read once), and the notes
    of the datasets whose files are missing (planned with their official size), each once."""
    from dpsweep.plan import FactsCache, prepare

    facts = FactsCache()
    plans = [prepare(cfg, facts(cfg), budget) for cfg in configs]
    return plans, list(dict.fromkeys(facts.notes))


def store_readable(uri: str) -> bool:
    """Whether ``uri`` can be asked for runs without creating it (a local SQLite file that is not
    there holds no runs, and opening it would create it)."""
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).is_file()
    return True


def skip_reasons(plans: Sequence[RunPlan], note: Callable[[str], None]) -> list[str | None]:
    """Why ``dpsweep -m`` would skip each job (``dpsweep.plan.skip_reasons``, as its sweeper decides):
    its config already FINISHED in its experiment (unless ``sweep.force``), or the same config as an
    earlier job. None: it runs. (Jobs running now in live processes are skipped too; that is known
    only when the sweep starts.) A store that cannot be read is told to ``note``, and its FINISHED
    configs are not marked."""
    from dpsweep import plan

    done: dict[str, str] = {}
    stores = {(p.config.tracking.uri, p.config.tracking.experiment_name) for p in plans if not p.config.sweep.force}
    for uri, experiment in sorted(stores):
        if not store_readable(uri):
            continue
        from dpsweep.tracking.sweeps import runs_by_hash  # MLflow: only where there is a store to ask

        try:
            done |= runs_by_hash(uri, experiment, "FINISHED")
        except Exception as err:  # an unreachable server: the plan stands, without this column
            note(f"could not read {uri} ({type(err).__name__}); FINISHED configs are not marked")
    return plan.skip_reasons([p.config_hash for p in plans], done)


class Risk(NamedTuple):
    """What a job's ε means for an attacker (:mod:`dpsweep.privacy.certainty`)."""

    mu_gdp: float  # the job is μ-GDP (Dong, Roth & Su 2022), certified from its pessimistic PLD ...
    tpr_at_1pct: float  # a membership-inference attack's largest TPR at 1 % FPR (Kairouz, Oh & Viswanath 2015)
    gdp_delta_allowance: float  # ... down to this δ (certainty.is_gdp)


def risk_figures(plans: Sequence[RunPlan]) -> list[Risk | None]:
    """Each DP job's :class:`Risk`, from the pessimistic PLD's profile, computed once per distinct ledger
    (a grid that repeats a setting, over seeds or learning rates, prices it once); None without DP."""
    from dpsweep.privacy import certainty

    cache: dict[str, Risk] = {}
    out: list[Risk | None] = []
    for p in plans:
        if p.privacy is None:
            out.append(None)
            continue
        key = repr(p.privacy.ledger)
        if key not in cache:
            found = certainty.profile(p.privacy.ledger)
            cache[key] = Risk(
                certainty.mu_gdp(p.privacy.ledger, found=found),
                certainty.tpr_bound(found, 0.01),
                certainty.delta_allowance(found),
            )
        out.append(cache[key])
    return out
