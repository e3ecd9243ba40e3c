"""The lines a run prints: the first, as soon as its config is composed, and its result.

print(start_line(cfg, output_dir))      # dpsweep: training digits/cnn B=64 epochs=8 seed=0, ...
print(summary_line(config, result))     # dpsweep: run 1a2b3c4d digits/cnn ... test_accuracy=0.8778 ε=...

Both say how the run trains where it is not the default: on several ranks (``train.devices`` ×
``train.nodes``), by which method of its task (``task.method``, e.g. task=recommender's als or dpam),
and with which step (:func:`dpsweep.config.step_kind`: ``dp.grad_sample_mode``, or the fused step of
``dp.engine=fused``). The result line of
an audit run (``audit.mode``) adds the audit's lower bounds beside the accountant's ε, and says where
they show the run less private than its ledger (:mod:`dpsweep.audit`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from dpsweep import units
from dpsweep.cli.sigma import sigma_text
from dpsweep.config import Config, DPConfig, GradSampleMode, TaskConfig, shown_model, step_kind

WIDE = 0.01  # an ε interval wider than this, relative to its upper end, has its width printed (issue 58)

if TYPE_CHECKING:  # torch and MLflow are imported where a run needs them: --help stays fast
    from dpsweep.run.runner import TrainResult


def start_line(cfg: DictConfig, output_dir: str) -> str:
    """``dpsweep: training digits/cnn B=64 epochs=8 seed=0, DP-SGD per example (σ=1, C=1); output in outputs/…``:
    what a single run prints as soon as its config is composed (issue 33, item 11)."""
    task = OmegaConf.to_object(cfg.task)
    assert isinstance(task, TaskConfig)
    what = shown_model(task, cfg.model.name)
    dp, batches = cfg.dp, task.reads_batches()
    if not dp.enabled:
        privacy = "non-private"
    else:
        sigma = (
            f"σ for ε<={dp.target_epsilon:g}" if dp.target_epsilon is not None
            else f"σ for TPR@1%<={dp.target_tpr_at_1pct:g}" if dp.target_tpr_at_1pct is not None
            else f"σ={dp.noise_multiplier:g}"
        )  # fmt: skip
        privacy = f"{dp.mechanism} per {dp.unit}{_step_text(dp)} ({sigma}" + (
            f", C={dp.max_grad_norm:g})" if batches else ")"
        )
    batch = f" B={cfg.train.batch_size}" if batches else ""
    return (
        f"dpsweep: training {cfg.dataset.name}/{what}{batch} epochs={cfg.train.epochs} "
        f"seed={cfg.train.seed}{_how_text(task, cfg.train)}, {privacy}; output in {output_dir}"
    )


def _how_text(task: TaskConfig, train: Any) -> str:
    """`` method=dpam on 4 ranks (2 nodes × 2 devices)``: the task's method (a task with ``task.method``)
    and the ranks of a run across devices; empty for a run of one process of a task without methods."""
    method = getattr(task, "method", None)
    text = f" method={method}" if method is not None else ""
    devices, nodes = int(train.devices), int(train.nodes)
    if devices * nodes > 1:
        text += f" on {devices * nodes} ranks" + (f" ({nodes} nodes × {devices} devices)" if nodes > 1 else "")
    return text


def _step_text(dp: Any) -> str:
    """``, fused step``: how a private run's step is taken, where it is not Opacus's default hooks
    (:func:`dpsweep.config.step_kind`; ``dp`` a typed DPConfig or its DictConfig, the old spellings read)."""
    typed = dp if isinstance(dp, DPConfig) else OmegaConf.to_object(dp)
    assert isinstance(typed, DPConfig)
    kind = step_kind(typed)
    return "" if kind == GradSampleMode.hooks.value else f", {kind} step"


def summary_line(cfg: Config, r: TrainResult) -> str:
    """``dpsweep: run 1a2b3c4d digits/cnn B=64 epochs=8 seed=0  test_accuracy=0.8556  ε=6.483 ∈ [6.470, 6.483]
    (pld, δ=1e-05, dpsgd per example; …)``: the accountant's ε and the sound interval around the PLD ε
    (:func:`_interval_text`; under another accountant, beside the PLD's figure among the others)."""
    if cfg.train.probe:
        from dpsweep.memory import stages
        from dpsweep.memory.tables import logged

        m = r.epochs[-1]  # logged in MiB: read back in bytes

        def shown(name: str) -> str:
            value = logged(m, name)
            return "—" if value is None else units.format_bytes(value)

        figures = "  ".join(f"{s}={shown(f'{s}_bytes')}" for s in stages.STAGES)
        peak = shown("iteration_peak_bytes")
        return (
            f"dpsweep: probe {r.run_id[:8]} {cfg.dataset.name}/{cfg.model.name} B={cfg.train.batch_size} "
            f"dp={cfg.dp.enabled}  {figures}  peak={peak} ({r.memory_backend})"
        )
    if r.epsilon is not None:
        pld = cfg.dp.accountant.value == "pld"  # else the interval stands beside the PLD figure, whose it is
        interval = _interval_text(r)
        others = ", ".join(f"{name} {eps:.3f}" + ("" if pld or name != "pld" else interval)
                           for name, eps in r.epsilons.items())  # fmt: skip
        clip = r.ledger.entries[0].params.get("max_grad_norm_chosen") if cfg.dp.clipping == "quantile" else None
        clip_text = f"C={cfg.dp.max_grad_norm:g}" if clip is None else f"C={clip:.3g} (private quantile)"
        sigma = "σ=—" if r.noise_multiplier is None else f"σ={sigma_text(r.noise_multiplier)}"
        privacy_text = (
            f"ε={r.epsilon:.3f}{interval if pld else ''} ({cfg.dp.accountant.value}, δ={cfg.dp.delta:g}, "
            f"{cfg.dp.mechanism} per "
            f"{cfg.dp.unit.value}{_step_text(cfg.dp)}; {others})  "
            f"{sigma}" + (f" {clip_text}" if cfg.task.reads_batches() else "")
        ) + _audit_text(cfg, r)
    else:
        privacy_text = "non-private (no ε)"
    what = shown_model(cfg.task, cfg.model.name)
    batch = f" B={cfg.train.batch_size}" if cfg.task.reads_batches() else ""
    diverged = f"  DIVERGED: {r.diverged} (tagged run.diverged; reports leave it out)" if r.diverged else ""
    return (
        f"dpsweep: run {r.run_id[:8]} {cfg.dataset.name}/{what}{batch} epochs={cfg.train.epochs} "
        f"seed={cfg.train.seed}{_how_text(cfg.task, cfg.train)}  {r.objective}={r.score:.4f}  {privacy_text}{diverged}"
    )


def _interval_text(r: TrainResult) -> str:
    """`` ∈ [6.470, 6.483]``, with `` width 2.1 %`` where the interval is wider than 1 % of its upper end:
    the sound interval around the run's PLD ε (its upper end; metric ``epsilon_lower`` the lower end,
    :func:`dpsweep.privacy.certainty.epsilon_interval`), the lower end rounded down so that the interval
    shown holds the true ε. Empty where the run has no lower end (the PLD not computed)."""
    upper = r.epsilons.get("pld")
    if r.epsilon_lower is None or upper is None:
        return ""
    lower = math.floor(r.epsilon_lower * 1000) / 1000
    relative = (upper - r.epsilon_lower) / upper if upper > 0 else 0.0
    return f" ∈ [{lower:.3f}, {upper:.3f}]" + (f" width {relative * 100:.1f} %" if relative > WIDE else "")


def _audit_text(cfg: Config, r: TrainResult) -> str:
    """``  white_box audit: ε ≥ 1.953, f-DP ε ≥ 3.021 (95%)``: an audit run's lower bounds on ε beside the
    accountant's upper bound (metrics ``audit.epsilon_lower``: Steinke, Nasr & Jagielski 2023, Thm. 5.2;
    ``audit.epsilon_lower_fdp``: Mahloujifar, Melis & Chaudhuri 2025), and, where Steinke et al.'s bound
    exceeds the run's ε or the f-DP test rejects the run's own ledger (``audit.claim_rejected``), that
    the run is less private than its ledger says (the flag of docs/src/guides/audit.md)."""
    last = r.epochs[-1] if r.epochs else {}
    lower = last.get("audit.epsilon_lower")
    if lower is None or r.epsilon is None:
        return ""
    fdp = last.get("audit.epsilon_lower_fdp")
    text = f"  {cfg.audit.mode} audit: ε ≥ {lower:.3f}" + (f", f-DP ε ≥ {fdp:.3f}" if fdp is not None else "")
    text += f" ({cfg.audit.confidence:.0%})"
    why = []
    if lower > r.epsilon:
        why.append(f"its bound {lower:.3f} exceeds ε={r.epsilon:.3f}")
    if last.get("audit.claim_rejected") == 1:
        why.append("the f-DP test rejects its own ledger (audit.claim_rejected=1)")
    if why:
        text += f"  FLAGGED: less private than its ledger says: {'; '.join(why)}"
    return text
