"""Close the runs whose process died: RUNNING in MLflow, gone in fact (a killed sweep driver, a job
killed with SIGKILL or by the OOM killer, a node that went down).

    dpsweep-runs reconcile --experiment demo        # by hand (dpsweep.cli.runs)
    reconcile(uri, "demo")                          # what dpsweep -m and dpsweep-report do first

A run is dead when its process (tag ``run.process``, host:pid:start) is not running on this host, or,
for a run of another host, when its heartbeat (tag ``run.heartbeat``) is older than
:data:`dpsweep.tracking.STALE_AFTER_S`. A dead run is ended KILLED with ``failure.kind=dead`` and the reason in
``error``, and its checkpoint (``train.checkpoint_dir``), which holds the RNG state that generated
its noise and batches, is deleted. Runs of older versions, which carry neither tag, are left alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpsweep.tracking import why_dead
from dpsweep.tracking.store import open_client, retry_busy, set_tags


@dataclass(frozen=True)
class DeadRun:
    run_id: str
    reason: str
    checkpoint_removed: str | None = None  # the checkpoint file deleted with it


def reconcile(
    uri: str,
    experiment: str | None = None,
    dry_run: bool = False,
    config_hash: str | None = None,
    keep: str = "",
    spare: str = "",
) -> list[DeadRun]:
    """End KILLED every dead RUNNING run of ``experiment`` (every experiment when None), of ``config_hash``
    only where given, but the run ``keep`` (a run about to resume it); the checkpoint of a run of config
    ``spare`` is kept (the command that launched its ranks is run again to resume it). Returns them."""
    client = open_client(uri)
    if experiment is None:
        ids = [e.experiment_id for e in client.search_experiments()]
    else:
        found = client.get_experiment_by_name(experiment)
        ids = [found.experiment_id] if found is not None else []
    if not ids:
        return []
    query = "attributes.status = 'RUNNING'"
    if config_hash is not None:
        query += f" and tags.`config.hash` = '{config_hash}'"
    running = client.search_runs(ids, filter_string=query, max_results=50000)
    now_s = time.time()
    dead = []
    for run in running:
        reason = why_dead(run.data.tags, now_s)
        if reason is None or run.info.run_id == keep:
            continue
        removed = None
        if not dry_run:
            set_tags(uri, run.info.run_id, {"error": f"found dead: {reason}", "failure.kind": "dead"})
            retry_busy(lambda run=run: client.set_terminated(run.info.run_id, "KILLED"))  # type: ignore[misc]
            removed = None if spare and run.data.tags.get("config.hash") == spare else _remove_checkpoint(run)
        dead.append(DeadRun(run.info.run_id, reason, removed))
    return dead


def _remove_checkpoint(run: Any) -> str | None:
    """Delete the dead run's checkpoint (only if it is that run's: another may have resumed since)."""
    from dpsweep.run import checkpoint  # torch: only when a dead run has a checkpoint directory

    # a setting, so a tag (dpsweep.run.records.setting_tags); runs of older versions logged it as a param
    directory = run.data.tags.get("train.checkpoint_dir") or run.data.params.get("train.checkpoint_dir")
    if not directory or directory == "None":
        return None
    state = checkpoint.peek_any(Path(directory))
    if state is None or state.run_id != run.info.run_id:
        return None
    checkpoint.remove(Path(directory))
    return str(Path(directory) / checkpoint.FILENAME)


def close_dead_of_config(uri: str, experiment: str, config_hash: str, keep: str = "") -> list[str]:
    """A run of a config closes that config's dead runs first, as ``dpsweep -m`` closes its experiment's
    (:func:`reconcile`): a run killed by SIGKILL or the OOM killer stays RUNNING in MLflow until then.
    The run ``keep`` is the one this run resumes from its checkpoint: left to it. Returns their ids."""
    return [dead.run_id for dead in reconcile(uri, experiment, config_hash=config_hash, keep=keep)]


# How rank 0 ends its run when another rank fails: KILLED by torchrun's SIGTERM, or FAILED on the dead rank's
# closed connection; either without its failure.kind where the SIGTERM came before that tag was written
RANK_ENDS = {("KILLED", "interrupted"), ("KILLED", None), ("FAILED", "exception"), ("FAILED", None)}


def failed_by_a_rank(uri: str, experiment: str, config_hash: str, since_ms: int, exit_code: int) -> list[str]:
    """A run across devices whose rank failed: torchrun then ends the other ranks with SIGTERM, so rank 0
    ends its run KILLED (interrupted) although nobody interrupted it, or FAILED on an exception where the
    dead rank's closed connection reached it first. The runs of ``config_hash`` that either ended since
    ``since_ms`` (this launch) are set FAILED, ``failure.kind=rank``; their checkpoint is kept (the run
    resumes). Returns their ids."""
    client = open_client(uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    query = f"tags.`config.hash` = '{config_hash}'"  # MLflow compares a status with one value, not a list
    ended = [
        r for r in client.search_runs([found.experiment_id], filter_string=query)
        if (r.info.status, r.data.tags.get("failure.kind")) in RANK_ENDS and (r.info.end_time or 0) >= since_ms
    ]  # fmt: skip
    for run in ended:
        why = f"a rank of this run failed (torchrun exited with {exit_code}; its output says which rank)"
        set_tags(uri, run.info.run_id, {"error": why, "failure.kind": "rank"})
        retry_busy(lambda run=run: client.set_terminated(run.info.run_id, "FAILED"))  # type: ignore[misc]
    return [r.info.run_id for r in ended]
