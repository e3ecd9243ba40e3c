"""A run across ``train.devices`` devices, as the ``dpsweep`` command starts it: checked here as a run
would be (bad input raises before any rank starts), then its ranks under torchrun
(:mod:`dpsweep.distributed.launch`), each the same command line in the job's directory, where rank 0
leaves its summary (:func:`leave_summary`) for the job that launched it.

    ended = launch(cfg, hydra_cfg.overrides.task, Path(hydra_cfg.runtime.output_dir))
    ended.code, ended.root_cause      # torchrun's exit code; its first failure: "rank 1 (exit code -9, SIGKILL)"
    ended.failed, ended.killed        # the runs ended after a failed rank: set FAILED, found dead
    ended.summary()                   # rank 0's: its result, or why it was skipped

torchrun exits non-zero when any rank failed (it ends the others); the experiment's dead runs are then
ended (:func:`dpsweep.tracking.reconcile`), so none is left RUNNING even where rank 0 itself was killed
outright, and a run that torchrun's SIGTERM ended KILLED because another rank failed is set FAILED
(:func:`dpsweep.tracking.failed_by_a_rank`). Either keeps the config's checkpoint: the same command
resumes the run from it. What is printed, and the command's exit code, are the command's
(:mod:`dpsweep.cli.train`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from dpsweep.distributed.launch import run_ranks, torchrun_command
from dpsweep.process import RANKS_ENV
from dpsweep.run.runner import check_launch
from dpsweep.tracking import failed_by_a_rank, reconcile

RANK0_SUMMARY = ".dpsweep-ranks.json"  # in the job's directory: rank 0's summary, for the job that launched it


def leave_summary(output_dir: Path, summary: Mapping[str, Any]) -> None:
    """Rank 0's summary of the run (its result line and figures, or ``{"skipped": why}``), in the job's
    directory ``output_dir``, for the job that launched the ranks (:meth:`RanksEnded.summary`)."""
    (output_dir / RANK0_SUMMARY).write_text(json.dumps(summary))


@dataclass(frozen=True)
class RanksEnded:
    """How a run's ranks ended: torchrun's exit code, the first failure it observed (None: none known),
    the file of its report, the job's directory; after a failed rank, the runs set FAILED (a rank
    failed) and those ended KILLED (found dead), each with its reason."""

    code: int
    root_cause: str | None
    report: Path
    output_dir: Path
    failed: tuple[str, ...] = ()
    killed: tuple[tuple[str, str], ...] = ()

    def summary(self) -> dict[str, Any]:
        """Rank 0's summary (:func:`leave_summary`), once the ranks ended with code 0."""
        summary: dict[str, Any] = json.loads((self.output_dir / RANK0_SUMMARY).read_text())
        return summary


def rank_overrides(given: Sequence[str], checkpoint_dir: str) -> list[str]:
    """The job's overrides for every rank, with the job's own ``train.checkpoint_dir`` (the one given
    replaced: the ranks resume from, and rank 0 writes, the job's checkpoint)."""
    kept = [o for o in given if not o.startswith("train.checkpoint_dir=")]
    return [*kept, f"train.checkpoint_dir={checkpoint_dir}"]


def launch(cfg: DictConfig, given: Sequence[str], output_dir: Path) -> RanksEnded:
    """Check the run, then run its ``cfg.train.devices`` ranks under torchrun with the job's overrides
    ``given``, in its directory ``output_dir``; after a failed rank, end its runs (module docstring).
    Raises what :func:`dpsweep.run.runner.check_launch` raises (bad input, ``OverBudget``) before any
    rank starts."""
    config_hash = check_launch(cfg)
    (output_dir / RANK0_SUMMARY).unlink(missing_ok=True)  # a summary of an earlier launch is not this one's
    command = torchrun_command(cfg.train.devices, rank_overrides(given, cfg.train.checkpoint_dir), str(output_dir))
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # torchrun's default, said quietly
    since_ms = int(time.time() * 1000)
    ranks = run_ranks(command, os.environ | threads | {RANKS_ENV: "1"}, output_dir)
    ended = RanksEnded(ranks.code, ranks.root_cause, ranks.report, output_dir)
    if ranks.code == 0:  # a Ctrl-C or SIGTERM of this command itself never gets here either
        return ended
    failed, killed = end_runs(cfg.tracking.uri, cfg.tracking.experiment_name, config_hash, since_ms, ranks.code)
    return RanksEnded(ranks.code, ranks.root_cause, ranks.report, output_dir, failed, killed)


def end_runs(
    uri: str, experiment: str, config_hash: str, since_ms: int, code: int
) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """After torchrun exited with ``code`` (a rank failed), the experiment's runs ended, none left
    RUNNING: the runs of ``config_hash`` that ended since ``since_ms`` (this launch) KILLED by torchrun's
    SIGTERM, or FAILED on the dead rank's closed connection, are set FAILED (a failure of a rank); then
    the dead RUNNING runs (rank 0 killed outright: SIGKILL, the OOM killer) are ended KILLED. The
    checkpoint of ``config_hash`` is kept for the same command to resume. Returns the ids set FAILED,
    and those ended KILLED with their reason."""
    failed = tuple(failed_by_a_rank(uri, experiment, config_hash, since_ms, code))
    killed = tuple((run_id, reason) for run_id, reason, _ in reconcile(uri, experiment, spare=config_hash))
    return failed, killed
