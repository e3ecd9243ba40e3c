"""What a run shows of itself besides its metrics: an epoch's line (console or progress bar, and Hydra's
job log), and the released model as the run's ``model`` artifact."""

from __future__ import annotations

import logging
from typing import Any

from dpsweep import tasks, units
from dpsweep.config import Config
from dpsweep.tracking import Tracker

EPOCH_FIGURES = {
    "train_loss": "train_loss={:.4f}", "test_accuracy": "test_accuracy={:.4f}", "critic_loss": "critic_loss={:.3f}",
    "generator_loss": "generator_loss={:.3f}", "tstr_accuracy": "tstr_accuracy={:.4f}", "epsilon": "ε={:.3f}",
}  # fmt: skip
log = logging.getLogger("dpsweep")


def report_epoch(label: str, metrics: dict[str, float], seconds: float, bar: Any) -> None:
    """An epoch's figures: a line on the console when no progress bar is shown (piped output, CI,
    nohup; Hydra's logging also writes it to the job's ``<name>.log``), else the bar's postfix and
    the line in the log file only."""
    figures = "  ".join(form.format(metrics[k]) for k, form in EPOCH_FIGURES.items() if k in metrics)
    line = f"{label}  {figures}  ({seconds:.1f} s)"
    if bar.disable:
        log.info(line)
        return
    bar.set_postfix_str(figures)
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, line, (), None)
    for handler in logging.getLogger().handlers:  # Hydra's job log file, not the console under the bar
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def log_model(cfg: Config, task_run: tasks.TaskRun, run: Tracker) -> None:
    """The released model as the run's ``model`` artifact, or a tag saying why it was not logged."""
    module, example = task_run.released_model()
    size_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    limit_bytes = cfg.tracking.log_model_max_mib * 2**20
    if size_bytes > limit_bytes:
        why = (
            f"skipped: {units.format_bytes(size_bytes)} > tracking.log_model_max_mib={cfg.tracking.log_model_max_mib:g}"
        )
        run.set_tags({"model.logged": why})
        return
    run.log_model(module, example)
    run.set_tags({"model.logged": "true", "model.logged_bytes": size_bytes})
