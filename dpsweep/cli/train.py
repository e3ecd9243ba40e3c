"""``dpsweep``: one run of one config, or a sweep with ``-m`` (Hydra's command line).

    dpsweep                                          # one run on the defaults (digits, cnn, DP-SGD)
    dpsweep dp.noise_multiplier=1.3 train.epochs=5   # one run with overrides
    dpsweep -m experiment=demo                       # the README's demo sweep (4 configs, 3 train)

A thin entry point: the run is :func:`dpsweep.run.runner.train` (across ``train.devices`` devices,
:func:`dpsweep.run.across_devices.launch` starts its ranks); this module sets the checkpoint
directory to the Hydra job's own, prints the result line, and turns bad input into exit code 2 (in
a sweep it raises instead, so that the sweeper records the job as failed and goes on). A config over
``sweep.max_epsilon`` is skipped, not failed.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.types import RunMode
from omegaconf import DictConfig

from dpsweep.cli.composing import composition_problem
from dpsweep.cli.early import MULTIRUN_FLAGS, Checked, check_plans, composed_and_checked, scheduler_refusal, submits
from dpsweep.cli.errors import bad_input_types, report_bad_input
from dpsweep.cli.lines import start_line, summary_line
from dpsweep.cli.overrides import override_value
from dpsweep.cli.script import run_script
from dpsweep.config import given_overrides, to_config
from dpsweep.errors import InputError
from dpsweep.launchers.overrides import string_override
from dpsweep.process import a_rank
from dpsweep.process.liveness import die_with_driver


def register_hydra_plugins() -> None:
    """Register dpsweep's sweeper and launchers with Hydra, for the dpsweep command.

    Hydra's plugin scan finds them in a wheel install but not through an editable install's import
    hook; registering twice is harmless.
    """
    from hydra_plugins.dpsweep_launchers import PLUGINS

    for plugin in PLUGINS:
        Plugins.instance().register(plugin)


def _job_overrides() -> str:
    """The job's overrides as the user gave them (without the ones dpsweep's sweepers add)."""
    return " ".join(given_overrides(HydraConfig.get().overrides.task)) or "(defaults)"


register_hydra_plugins()


def unwritable_output(argv: Sequence[str], cwd: Path | None = None) -> InputError | None:
    """Hydra creates the job's output directory (``hydra.run.dir``, or ``hydra.sweep.dir`` with -m;
    by default under the working directory) before dpsweep runs: where it cannot, say so as bad input
    instead of Hydra's traceback. The nearest existing ancestor must take a new file."""
    key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir"
    given = override_value(argv, key)
    base = cwd or Path.cwd()
    target = base / given if given else base
    existing = next(p for p in (target, *target.parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            return None
    except OSError as err:
        where = f"{key}={given}" if given else f"the working directory {base}"
        return InputError(
            key,
            given or str(base),
            f"a directory dpsweep can create and write ({where}: {err.strerror}); Hydra keeps each job's "
            f"config and log there: run from a writable directory or set {key}=/a/writable/dir",
        )


def _raised_by_the_run(err: BaseException) -> bool:
    """Whether ``err`` passed through the Hydra task (:func:`app`), i.e. came after composition."""
    task = app.__wrapped__.__code__  # hydra.main keeps the task function (functools.wraps)
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is task:
            return True
        tb = tb.tb_next
    return False


@contextmanager
def composition_errors_raised() -> Iterator[None]:
    """Hydra raises what it would print and exit 1 with (``HYDRA_FULL_ERROR=1``), for the block."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


def main() -> None:
    """Console entry point ``dpsweep``: the Hydra app, where its output directory can be written and
    its overrides compose and pass the checks that need no training (else exit 2).

    The run's config, or every job of a sweep (-m), is composed and checked first, before any line,
    torch, MLflow or file (``dpsweep.cli.early``): bad input is one line and exit code 2, with nothing
    left behind. Then the first line (a run's start line; a sweep's jobs and axes), then each job's
    plan checked; then the app, whose composition errors are reported as bad input too, while errors
    of the run itself keep their traceback and exit 1.
    Hydra's own flags (--help, --cfg, ...) are left to Hydra."""
    argv = sys.argv[1:]
    problem = unwritable_output(argv)
    if problem is not None:
        raise SystemExit(report_bad_input("dpsweep", problem))
    if {a for a in argv if a.startswith("-")} - set(MULTIRUN_FLAGS):  # Hydra's own flags: its output
        app()
        return
    STARTED.line_said = False
    checked = None if a_rank() else _checked_or_refused(argv)  # a rank: its command checked it already
    if checked is not None and checked.first_line is not None:
        print(checked.first_line, flush=True)
        if checked.run_dir is not None:  # the app's output directory, the one the line names
            sys.argv.append(string_override("hydra.run.dir", checked.run_dir))
            STARTED.line_said = True
    if checked is not None:
        _refuse_bad_input(check_plans, checked)
    with composition_errors_raised():
        try:
            app()
        except Exception as err:
            problem = None if _raised_by_the_run(err) else composition_problem(err, argv)
            if problem is None:
                raise
            raise SystemExit(report_bad_input("dpsweep", problem)) from None


@dataclass
class _Started:
    """Whether :func:`main` printed the run's start line already (the app then does not)."""

    line_said: bool = False


STARTED = _Started()


def _checked_or_refused(argv: Sequence[str]) -> Checked | None:
    return _refuse_bad_input(composed_and_checked, argv)


def _refuse_bad_input(check: Callable[[Any], Any], arg: Any) -> Any:
    """``check(arg)``; bad input: one line on stderr and exit code 2."""
    try:
        return check(arg)
    except InputError as err:
        raise SystemExit(report_bad_input("dpsweep", err)) from None


@dataclass(frozen=True)
class JobSummary:
    """What a sweep's job returns to the driver (pickled back by submitit launchers): its result line,
    which the driver prints as the job completes, and the figures behind it."""

    line: str
    score: float  # the task's objective (test_accuracy, tstr_accuracy)
    epsilon: float | None


@hydra.main(version_base="1.3", config_path="pkg://dpsweep.conf", config_name="config")
def app(cfg: DictConfig) -> JobSummary | None:
    """The Hydra task: train one config; returns its summary (None: skipped)."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN and submits(cfg.launcher.name):  # before the store or any run
        raise SystemExit(report_bad_input("dpsweep", scheduler_refusal(cfg.launcher.name)))
    rank = a_rank()  # one of the processes of a run across devices (train.devices)
    if hydra_cfg.mode != RunMode.MULTIRUN and not rank and not STARTED.line_said:  # a first line now: torch, the
        print(start_line(cfg, hydra_cfg.runtime.output_dir), flush=True)  # data and the store take seconds more
    from dpsweep.run.runner import OverBudget, train
    from dpsweep.tracking import Claimed, next_steps

    die_with_driver()  # a launcher=local job: ends (run KILLED) when the sweep's driver is gone
    if cfg.train.checkpoint_dir is None:  # the job's own directory: stable when a cluster requeues it
        cfg.train.checkpoint_dir = str(_own_directory(cfg, hydra_cfg) / "checkpoint")
    if cfg.train.devices > 1 and not rank:
        return _launch_ranks(cfg, hydra_cfg)
    from dpsweep.distributed import current

    leader = rank and current().leader  # rank 0 speaks for a run across devices
    quiet = rank and (not leader or cfg.sweep.id is not None)  # in a sweep, the job that launched the ranks
    try:
        result = train(cfg)
    except (OverBudget, Claimed) as why:  # not an error: the sweep goes on without this config
        if not quiet:
            _say_skipped(why)
        if leader:
            _leave_summary(hydra_cfg, {"skipped": str(why)})
        return None
    except bad_input_types() as err:
        if hydra_cfg.mode == RunMode.MULTIRUN or rank:
            raise  # the sweeper records this job as failed and goes on (a rank: torchrun ends the others)
        raise SystemExit(report_bad_input("dpsweep", err)) from err
    config = to_config(cfg)
    summary = JobSummary(summary_line(config, result), result.score, result.epsilon)
    if leader:
        _leave_summary(hydra_cfg, dataclasses.asdict(summary))
    if quiet:
        return summary
    print(summary.line, flush=True)
    if hydra_cfg.mode != RunMode.MULTIRUN and cfg.sweep.id is None:  # a sweep ends with its own line
        print(next_steps(config.tracking.uri, config.tracking.experiment_name), flush=True)
    return summary


def _say_skipped(why: object) -> None:
    print(f"dpsweep: skip {_job_overrides()}: {why}", flush=True)


def _leave_summary(hydra_cfg: Any, summary: dict[str, Any]) -> None:
    from dpsweep.run.across_devices import leave_summary

    leave_summary(Path(hydra_cfg.runtime.output_dir), summary)


def _launch_ranks(cfg: DictConfig, hydra_cfg: Any) -> JobSummary | None:
    """A run across ``train.devices`` devices (:func:`dpsweep.run.across_devices.launch`: checked, then
    its ranks under torchrun, its runs ended after a failed rank): bad input exits 2 before any rank
    starts, a config over budget is skipped. A single run exits with torchrun's code; a sweep's job
    returns rank 0's summary (None: skipped) or raises, as a job of one process."""
    from dpsweep.run.across_devices import launch
    from dpsweep.run.runner import OverBudget

    sweep = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        ended = launch(cfg, hydra_cfg.overrides.task, Path(hydra_cfg.runtime.output_dir))
    except OverBudget as why:
        _say_skipped(why)
        return None
    except bad_input_types() as err:
        if sweep:
            raise
        raise SystemExit(report_bad_input("dpsweep", err)) from err
    if ended.code != 0:
        cause = ended.root_cause or f"torchrun exited with {ended.code}"
        print(f"dpsweep: a rank of this run failed first: {cause}; torchrun's report: {ended.report}",
              file=sys.stderr, flush=True)  # fmt: skip
        for run_id in ended.failed:
            print(f"dpsweep: run {run_id[:8]} ended FAILED: a rank failed; run the same command again to resume "
                  "it from its last checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        for run_id, reason in ended.killed:
            print(f"dpsweep: run {run_id[:8]} ended KILLED: {reason}", file=sys.stderr, flush=True)
    if not sweep:
        raise SystemExit(ended.code)
    if ended.code != 0:
        raise RuntimeError(f"a rank of this run failed: torchrun exited with {ended.code} (its output is above)")
    summary = ended.summary()
    if "skipped" in summary:
        _say_skipped(summary["skipped"])
        return None
    done = JobSummary(**summary)
    print(done.line, flush=True)
    return done


def _own_directory(cfg: DictConfig, hydra_cfg: Any) -> Path:
    """The job's output directory; for a trial of a private tuning, a directory of the sweep named by a
    random token, not by its number among the trials, which would tell a lower bound on K wherever the
    path is logged (issue 33, item 1), nor by a hash of its overrides, whose secret ``train.seed`` a search
    of its 2**31 values would find (issue 54, item 3). The sweep's driver gives each trial its directory
    (``train.checkpoint_dir``, :func:`dpsweep.launchers.sweeper.private_trials`), the same when a cluster
    requeues the job; a trial without one (its driver an older dpsweep's) gets a fresh token here, which
    a requeue does not find again: it starts afresh."""
    if cfg.sweep.private_tuning and hydra_cfg.mode == RunMode.MULTIRUN:
        return Path(hydra_cfg.sweep.dir) / f"trial-{secrets.token_hex(8)}"
    return Path(hydra_cfg.runtime.output_dir)


def console() -> NoReturn:
    """The console script: its secrets handed over, ``main``, then its exit (``dpsweep.cli.script``)."""
    run_script(main, "dpsweep")


if __name__ == "__main__":
    console()
