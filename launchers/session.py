"""One sweep's scaffolding, shared by the grid sweep, its private tuning and the Optuna study.

    session = SweepSession(first, sweep_id)        # first: the first job's typed config
    with session.parent_run(f"sweep-{sweep_id}", {}, params) as parent:
        progress = session.progress(launcher, len(jobs))   # "dpsweep: [n/N] ..." as each job ends
        why = session.failure_rate(failed, ended, "jobs")  # not None: stop launching
        session.finish(outcome)                            # orphaned runs KILLED, failed runs named
    session.end(session.summary(outcome), failed=outcome.failed > 0)  # the last lines; exit 1 if failed

The parent run is an MLflow run tagged ``sweep.id`` and ``sweep.role=parent``; SIGTERM ends it
KILLED, and inline jobs (one after another in this process) carry the memory census's baseline
(``dpsweep.memory.stages``) across it. The grid sweep (``dpsweep.launchers.sweeper``) uses all of
it, and its private tuning logs to the same parent run; an Optuna study
(``dpsweep.launchers.optuna_sweeper``) uses the parent run, the failure policy, ``close_orphans``
and ``end``, with its own summary (the best trials) and no progress lines.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher

from dpsweep.config import given_overrides
from dpsweep.config.launcher import spec
from dpsweep.errors import redact, redacted
from dpsweep.launchers.base import DpsweepLauncher

if TYPE_CHECKING:
    from dpsweep.config import Config
    from dpsweep.tracking import Tracker

log = logging.getLogger(__name__)


@dataclass
class SweepOutcome:
    """A grid sweep's counts and the runs to look at: its summary line."""

    sweep_id: str
    finished: int = 0
    skipped: int = 0
    failed: int = 0
    failed_runs: list[str] | None = None
    killed_runs: list[str] | None = None
    aborted: str | None = None  # why the failure policy stopped the sweep

    def line(self) -> str:
        text = f"dpsweep: sweep {self.sweep_id}: {self.finished} finished, {self.skipped} skipped, {self.failed} failed"
        if self.failed_runs:
            text += f"; failed runs: {', '.join(self.failed_runs)}"
        if self.killed_runs:
            text += f"; killed runs: {', '.join(self.killed_runs)}"
        return text

    def count(self, results: Sequence[JobReturn]) -> None:
        """Add a batch's job results: a job returning None was skipped (over sweep.max_epsilon)."""
        for r in results:
            if r.status == JobStatus.COMPLETED:
                if r.return_value is None:
                    self.skipped += 1
                else:
                    self.finished += 1
                continue
            self.failed += 1
            try:
                r.return_value  # noqa: B018  (a failed job's return_value re-raises what it raised)
            except BaseException as err:
                print(f"dpsweep: job {' '.join(given_overrides(r.overrides or []))} failed: {err!r}", file=sys.stderr,
                      flush=True)  # fmt: skip


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


@dataclass
class Progress:
    """One line per job as it ends, whatever the launcher: ``[n/N]``, its result line, the time since
    the sweep started and an ETA from the pace so far (jobs ended per second, so parallel launchers'
    estimates count their parallelism). ``echoed``: the job printed its own line in this process
    (launcher=inline), so only the count and times are added."""

    total: int
    echoed: bool
    started_s: float = field(default_factory=time.monotonic)
    ended: int = 0
    seen: set[int] = field(default_factory=set)

    def job_done(self, ret: JobReturn) -> None:
        if id(ret) in self.seen:
            return
        self.seen.add(id(ret))
        self.ended += 1
        elapsed = time.monotonic() - self.started_s
        left = self.total - self.ended
        eta = f", ETA {_duration(elapsed / self.ended * left)}" if left else ""
        shown = " ".join(given_overrides(ret.overrides or []))
        if ret.status != JobStatus.COMPLETED:
            what = f"{shown}: failed"
        elif ret.return_value is None:
            what = f"{shown}: skipped"
        else:
            line = str(getattr(ret.return_value, "line", ret.return_value)).removeprefix("dpsweep: ")
            what = "done" if self.echoed else line
        print(f"dpsweep: [{self.ended}/{self.total}] {what} ({_duration(elapsed)} elapsed{eta})", flush=True)


@dataclass
class SweepSession:
    """A sweep's parent run, failure policy, progress, orphaned runs and summary. ``first``: the
    first job's typed config (its tracking store, launcher and ``sweep`` policy)."""

    first: Config
    sweep_id: str
    parent: Tracker | None = None  # inside parent_run

    @property
    def inline(self) -> bool:
        """Jobs run one after another in this process (the launcher's spec)."""
        return spec(self.first.launcher).inline

    @contextlib.contextmanager
    def parent_run(self, name: str, tags: Mapping[str, str], params: Mapping[str, Any]) -> Iterator[Tracker]:
        """The sweep's parent MLflow run ``name``, with ``tags`` besides the sweep's own and ``params``;
        it ends FINISHED, FAILED (an exception) or KILLED (SIGTERM, Ctrl-C)."""
        from dpsweep.config import TrackingConfig
        from dpsweep.memory.stages import carried_baseline
        from dpsweep.tracking import terminate_as_interrupt, tracked_run

        tracking = TrackingConfig(self.first.tracking.uri, self.first.tracking.experiment_name, name)
        own = {"sweep.id": self.sweep_id, "sweep.role": "parent", **tags, "sweep.launcher": self.first.launcher.name}
        carried = carried_baseline() if self.inline else contextlib.nullcontext()
        with terminate_as_interrupt(), tracked_run(tracking, redacted(own)) as parent, carried:
            parent.log_params(redacted(dict(params)))  # a URL's password is never logged
            self.parent = parent
            yield parent

    def failure_rate(self, failed: int, ended: int, noun: str) -> str | None:
        """Why to stop, e.g. ``4 of 4 jobs failed (100% > sweep.max_failure_rate=50%)``: once
        sweep.min_jobs_for_failure_rate have ended and more than sweep.max_failure_rate of them
        failed. None: go on."""
        rate, floor = self.first.sweep.max_failure_rate, self.first.sweep.min_jobs_for_failure_rate
        if ended < max(floor, 1) or failed / ended <= rate:
            return None
        return f"{failed} of {ended} {noun} failed ({failed / ended:.0%} > sweep.max_failure_rate={rate:.0%})"

    def progress(self, launcher: Launcher, total: int) -> Progress:
        """Progress lines of ``total`` jobs; dpsweep's submitit launchers report each job as it completes."""
        progress = Progress(total, echoed=self.inline)
        if isinstance(launcher, DpsweepLauncher):  # those that see each job end; the sweeper tells the others
            launcher.on_job_done = progress.job_done
        return progress

    def close_dead_runs(self) -> None:
        """End KILLED the experiment's runs whose process is gone (an earlier, killed driver's), each
        with a line: before anything is launched."""
        close_dead_runs(self.first.tracking.uri, self.first.tracking.experiment_name)

    def close_orphans(self) -> list[str]:
        """End KILLED the sweep's runs still RUNNING (their jobs were killed outright: SIGKILL, the
        OOM killer, scancel); their ids."""
        from dpsweep.tracking import close_orphaned_runs

        return close_orphaned_runs(self.first.tracking.uri, self.first.tracking.experiment_name, self.sweep_id)

    def finish(self, outcome: SweepOutcome) -> None:
        """Close runs left RUNNING by killed jobs; name the failed runs; log the results table."""
        from dpsweep.tracking import log_results_table, runs_of_sweep

        assert self.parent is not None
        uri, experiment = self.first.tracking.uri, self.first.tracking.experiment_name
        outcome.killed_runs = self.close_orphans()
        runs = runs_of_sweep(uri, experiment, self.sweep_id)
        outcome.failed_runs = sorted(run_id for run_id, status in runs.items() if status in ("FAILED", "KILLED"))
        log_results_table(uri, experiment, self.sweep_id, self.parent.run_id)

    def summary(self, outcome: SweepOutcome) -> Iterator[str]:
        """A grid sweep's last lines: its summary line, then (if a job finished or was skipped) the
        commands to report and browse its runs."""
        from dpsweep.tracking import DEFAULT_URI, next_steps

        yield outcome.line()
        t = self.first.tracking
        if self.first.train.probe and outcome.finished:  # memory probes: no accuracy or ε to report
            uri = "" if t.uri == DEFAULT_URI else f" --tracking-uri {t.uri}"
            yield redact(f"dpsweep: next: dpsweep-memory fit --experiment {t.experiment_name}{uri}")
        elif outcome.finished or outcome.skipped:
            yield next_steps(t.uri, t.experiment_name, self.sweep_id)

    @staticmethod
    def end(lines: Iterable[str], failed: bool) -> None:
        """Print the sweep's last lines, each as it comes; exit with status 1 if the sweep failed."""
        for line in lines:
            print(line, flush=True)
        if failed:
            raise SystemExit(1)


def close_dead_runs(uri: str, experiment: str) -> None:
    """End KILLED the runs of ``experiment`` whose process is gone, each with a line."""
    from dpsweep.tracking import reconcile

    for run_id, reason, _ in reconcile(uri, experiment):
        print(f"dpsweep: ended run {run_id} KILLED: {reason}", flush=True)
