"""The lines a run prints: the first, as soon as its config is composed, and its result.

print(start_line(cfg, output_dir))      # dpsweep: training digits/cnn B=64 epochs=8 seed=0, ...
print(summary_line(config, result))     # dpsweep: run 1a2b3c4d digits/cnn ... test_accuracy=0.8778 ε=...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from dpsweep import units
from dpsweep.config import Config, TaskConfig, shown_model

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
        sigma = f"σ for ε<={dp.target_epsilon:g}" if dp.target_epsilon is not None else f"σ={dp.noise_multiplier:g}"
        privacy = f"{dp.mechanism} per {dp.unit} ({sigma}" + (f", C={dp.max_grad_norm:g})" if batches else ")")
    batch = f" B={cfg.train.batch_size}" if batches else ""
    return (
        f"dpsweep: training {cfg.dataset.name}/{what}{batch} epochs={cfg.train.epochs} "
        f"seed={cfg.train.seed}, {privacy}; output in {output_dir}"
    )


def summary_line(cfg: Config, r: TrainResult) -> str:
    """``dpsweep: run 1a2b3c4d digits/cnn B=64 epochs=8 seed=0  test_accuracy=0.8778  ε=7.414 (rdp, δ=1e-05,
    dpsgd per example; …)``"""
    if cfg.train.probe:
        from dpsweep.memory import stages as memory
        from dpsweep.memory.tables import metric

        m = r.epochs[-1]
        stages = "  ".join(f"{s}={units.format_bytes(m[metric(f'{s}_bytes')])}" for s in memory.STAGES)
        peak = units.format_bytes(m[metric("iteration_peak_bytes")])
        return (
            f"dpsweep: probe {r.run_id[:8]} {cfg.dataset.name}/{cfg.model.name} B={cfg.train.batch_size} "
            f"dp={cfg.dp.enabled}  {stages}  peak={peak} ({r.memory_backend})"
        )
    if r.epsilon is not None:
        others = ", ".join(f"{name} {eps:.3f}" for name, eps in r.epsilons.items())
        clip = r.ledger.entries[0].params.get("max_grad_norm_chosen") if cfg.dp.clipping == "quantile" else None
        clip_text = f"C={cfg.dp.max_grad_norm:g}" if clip is None else f"C={clip:.3g} (private quantile)"
        privacy_text = (
            f"ε={r.epsilon:.3f} ({cfg.dp.accountant.value}, δ={cfg.dp.delta:g}, {cfg.dp.mechanism} per "
            f"{cfg.dp.unit.value}; {others})  "
            f"σ={r.noise_multiplier:.3g}" + (f" {clip_text}" if cfg.task.reads_batches() else "")
        )
    else:
        privacy_text = "non-private (no ε)"
    what = shown_model(cfg.task, cfg.model.name)
    batch = f" B={cfg.train.batch_size}" if cfg.task.reads_batches() else ""
    diverged = f"  DIVERGED: {r.diverged} (tagged run.diverged; reports leave it out)" if r.diverged else ""
    return (
        f"dpsweep: run {r.run_id[:8]} {cfg.dataset.name}/{what}{batch} "
        f"epochs={cfg.train.epochs} seed={cfg.train.seed}  {r.objective}={r.score:.4f}  {privacy_text}{diverged}"
    )
