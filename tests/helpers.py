"""Helpers shared by the tests (imported as ``helpers``: pytest puts tests/ on sys.path, the folder of
tests/conftest.py, for tests/unit/<package>/, tests/integration/ and tests/system/ alike)."""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

from mlflow.entities import Run
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

# Settings that keep a training test to a few seconds on 2 CPU cores.
# tracking.log_model=false: saving the model takes seconds; tests/integration/test_train.py checks it on its own
FAST = ["train.epochs=2", "train.progress=false", "tracking.log_model=false"]

Composer = Callable[..., DictConfig]

BIN = Path(sys.executable).parent  # the console scripts of this interpreter's environment

REPO = Path(__file__).resolve().parents[1]  # the repository's root (this file is tests/helpers.py)


def runs_of(client: MlflowClient, experiment: str) -> list[Run]:
    """All runs of an experiment (none if it does not exist)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return list(client.search_runs([exp.experiment_id]))


def child_runs(cwd: Path, experiment: str = "dpsweep") -> list[Run]:
    """The runs of ``cwd/mlflow.db`` (the default tracking URI) less the sweeps' parent runs."""
    runs = runs_of(MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}"), experiment)
    return [r for r in runs if r.data.tags.get("sweep.role") != "parent"]


def run_script(
    name: str, *args: str, cwd: Path, env: Mapping[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    """A console script of this environment as its own process (stdout and stderr captured)."""
    return subprocess.run(
        [str(BIN / name), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}, check=False,
    )  # fmt: skip


# What the forkserver of the tests that run many tracking jobs at once imports, once for all the
# processes it forks: dpsweep's tracking layer, and what each job would otherwise import after the
# fork, about a second of CPU each: pytest and SQLAlchemy (the test modules import them), MLflow's
# sqlite store with Alembic, GitPython (the runs' source tags), requests. Not the test modules:
# before Python 3.12 the forkserver imports its preload list before it sets sys.path (and ignores
# the ImportError). One list for all those tests: a process starts one forkserver, at first use.
FORKSERVER_PRELOAD = [
    "dpsweep.tracking", "pytest", "requests", "sqlalchemy", "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.db.utils", "alembic.command", "alembic.runtime.migration", "git",
]  # fmt: skip


def forkserver() -> ForkServerContext:
    """The forkserver context, with :data:`FORKSERVER_PRELOAD` (if this process has not started it yet)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def in_process_then(target: Callable[..., None], *args: Any) -> None:
    """``target(*args)`` in a forked job (which imports MLflow through the forkserver's preload)."""
    target(*args)


def at_once(target: Callable[..., None], jobs: Sequence[tuple[Any, ...]], err_dir: Path) -> list[int]:
    """Run ``target(*args)`` for each of ``jobs`` in its own process (forked from the forkserver) at
    once, wait for them all, and fail with each failed job's traceback (``err_dir/<job>.err``, which
    the target writes); the processes' pids."""
    ctx = forkserver()
    procs = [ctx.Process(target=in_process_then, args=(target, *args)) for args in jobs]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    errors = {
        f"job {i} (exit {p.exitcode})": (err_dir / f"{i}.err").read_text() if (err_dir / f"{i}.err").exists() else ""
        for i, p in enumerate(procs)
        if p.exitcode != 0
    }
    assert errors == {}, "\n".join(f"{name}: {err[-2000:]}" for name, err in errors.items())
    return [p.pid for p in procs if p.pid is not None]


@contextlib.contextmanager
def _app_state(env: Mapping[str, str]) -> Iterator[None]:
    """What a Hydra app changes in its process, put back afterwards: the logging configuration
    (Hydra installs its own handlers on the root logger), Hydra's singletons, sys.argv, environment."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    named = [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    loggers = {lg: (lg.level, lg.handlers[:], lg.propagate, lg.disabled) for lg in [logging.getLogger(), *named]}
    global_hydra = GlobalHydra.instance()
    hydra_before, config_before = global_hydra.hydra, HydraConfig.instance().cfg
    global_hydra.clear()  # a test's own compose context (make_cfg) is set aside meanwhile
    # launcher=local names its driver (this process) in the environment its jobs copy: not for later tests
    argv, env_before = sys.argv[:], {k: os.environ.get(k) for k in [*env, "DPSWEEP_DRIVER"]}
    # absl's handler (absl comes with dp-accounting) closes its stream when Hydra's logging set-up
    # closes every handler, unless that stream is sys.stdout or sys.stderr at that moment. Under the
    # app's redirect_stderr it is not, and it may be pytest's capture of the session's output.
    absl = sys.modules.get("absl.logging")
    absl_handler = absl.get_absl_handler().python_handler if absl is not None else None
    absl_stream = absl_handler.stream if absl_handler is not None else None
    if absl_handler is not None:
        absl_handler.stream = sys.__stderr__
    os.environ.update(env)
    try:
        yield
    finally:
        if absl_handler is not None:
            absl_handler.stream = absl_stream
        sys.argv[:] = argv
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        global_hydra.clear()
        global_hydra.hydra = hydra_before
        HydraConfig.instance().cfg = config_before
        for lg, (level, handlers, propagate, disabled) in loggers.items():
            for handler in lg.handlers:
                if handler not in handlers:
                    handler.close()  # Hydra's console and job-log file handlers
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate, lg.disabled = propagate, disabled


def run_dpsweep(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``dpsweep *args`` (the Hydra app of ``dpsweep.cli.train``) in this process, from the current
    directory: its exit code, stdout and stderr, as a ``subprocess.run`` of the console script would
    give them. Tests that are about the driver's own process (signals, a killed driver) and one smoke
    test of the console script run it as its own process instead; the jobs of launcher=local and of
    the schedulers are processes of their own either way.

    The default ``tracking.uri=sqlite:///mlflow.db`` is given as the same file's absolute path: MLflow
    caches one store per URI for the life of the process, so a relative one would stay the store of
    the first directory it was used in."""
    from dpsweep.cli.train import main

    if not any(a.startswith("tracking.uri=") for a in args):
        args = (*args, f"tracking.uri=sqlite:///{Path.cwd() / 'mlflow.db'}")
    out, err = io.StringIO(), io.StringIO()
    code: object = 0
    with (
        _app_state({"HYDRA_FULL_ERROR": "0", **(env or {})}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        sys.argv[:] = ["dpsweep", *args]
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code
            if code is not None and not isinstance(code, int):
                print(code, file=sys.stderr)  # what the interpreter does with a message: print it, exit 1
                code = 1
    return subprocess.CompletedProcess(["dpsweep", *args], code or 0, out.getvalue(), err.getvalue())


def run_main(main: Callable[[Sequence[str]], int], *args: str) -> subprocess.CompletedProcess[str]:
    """A command's ``main(argv)`` in this process: its exit code (argparse's own usage errors
    included), stdout and stderr, as ``subprocess.run`` of its console script would give them."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


CHROMIUM_SCRIPT = REPO / "launchers" / "scripts" / "chromium_path.sh"


def chromium_path() -> str:
    """Headless Chromium (Debian's package, installed by launchers/scripts/chromium_path.sh if missing)."""
    done = subprocess.run(["bash", str(CHROMIUM_SCRIPT)], capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"no Chromium: {done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1]


def browser_dom(chromium: str, url: str, budget_ms: int = 20_000, window: str | None = None) -> str:
    """The DOM of ``url`` after a real browser ran its scripts (``budget_ms`` of virtual time, which
    waits for pending network requests too), in a window of ``window`` pixels ("2400,1200") if given:
    a table lays out only the columns its window shows."""
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         *([f"--window-size={window}"] if window else []), f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip(), f"chromium on {url}: {done.stderr[-3000:]}"
    return done.stdout


def visible_text(dom: str) -> str:
    """The text of a DOM, one line per element, without scripts and styles."""
    import re

    text = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return "\n".join(line.strip() for line in re.sub(r"<[^>]+>", "\n", text).splitlines() if line.strip())


def table_columns(dom: str) -> list[str]:
    """The column ids of an ag-grid table (MLflow's runs table: ``metrics.`test_accuracy```...) in the
    order a person sees them: its pinned columns, then the others by their position (the DOM's order is
    not the screen's: ag-grid places each column with ``left``). Only the columns laid out, which are
    those its window shows (:func:`browser_dom` with ``window``)."""
    import re

    center = dom.find('class="ag-header-viewport')
    cells = []
    for m in re.finditer(r'<div[^>]*class="ag-header-cell[ "][^>]*>', dom):
        column = re.search(r'col-id="([^"]+)"', m.group(0))
        left = re.search(r"left: (-?[0-9.]+)px", m.group(0))
        if column and left:
            cells.append((center >= 0 and m.start() > center, float(left.group(1)), column.group(1)))
    return [c for *_, c in sorted(cells)]


def chart_cards(dom: str) -> list[dict[str, Any]]:
    """The chart cards of MLflow's chart view in the DOM's order (the screen's, section by section), each
    as ``title``, the axis titles ``x`` and ``y`` (None where the chart has none), and whether it plots
    ``points`` and ``lines`` (a scatter: points alone). A collapsed section's cards are not in the DOM."""
    import re

    cards = []
    for card in dom.split('data-testid="experiment-view-compare-runs-card"')[1:]:
        title = re.search(r'<h4[^>]*title="([^"]*)"', card)
        x = re.search(r'class="xtitle"[^>]*>([^<]*)<', card)
        y = re.search(r'class="ytitle"[^>]*>([^<]*)<', card)
        cards.append({
            "title": title.group(1) if title else None, "x": x.group(1) if x else None,
            "y": y.group(1) if y else None, "points": 'class="point' in card, "lines": "js-line" in card,
        })  # fmt: skip
    return cards


def dead_run(folder: Path, tags: Mapping[str, str]) -> tuple[str, MlflowClient, str]:
    """A RUNNING run of experiment ``dead`` in a new sqlite store under ``folder``, whose process (tag
    ``run.process``) is one of this host that has ended: what reconcile finds dead. Its store's URI, a
    client of it, and the run's id."""
    from dpsweep.process.liveness import ProcessId
    from dpsweep.tracking import PROCESS_TAG
    from dpsweep.tracking.store import open_client

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = open_client(uri)
    experiment = client.create_experiment("dead")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    gone = ProcessId(ProcessId.current().host, child.pid, None)
    run = client.create_run(experiment, tags={PROCESS_TAG: gone.token, **tags})
    return uri, client, run.info.run_id


def fresh_store(folder: Path, experiment: str) -> tuple[str, list[str]]:
    """An sqlite MLflow store in ``folder`` with ``experiment`` created, its artifacts in ``folder``
    too (wherever the tests run from), and the overrides that track a run into it."""
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    MlflowClient(uri).create_experiment(experiment, artifact_location=(folder / "mlruns").as_uri())
    return uri, [f"tracking.uri={uri}", f"tracking.experiment_name={experiment}"]


def train_interrupted(cfg: DictConfig, task_run: type, epoch: int) -> None:
    """Train ``cfg`` until ``task_run.train_epoch`` (a TaskRun class) reaches ``epoch``, then raise
    KeyboardInterrupt there, as SIGTERM is turned into (dpsweep.tracking.terminate_as_interrupt): the
    run ends KILLED with the checkpoint of epoch - 1. The class is as it was afterwards."""
    import pytest

    from dpsweep.run.runner import train

    original = task_run.train_epoch

    def interrupted(self: Any, at: int, stages: Any) -> dict[str, float]:
        if at == epoch:
            raise KeyboardInterrupt
        return original(self, at, stages)  # type: ignore[no-any-return]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(task_run, "train_epoch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)


def straight_and_resumed(
    make_cfg: Composer, client: MlflowClient, experiment: str, args: Sequence[str], task_run: type, epoch: int,
    ckpt: Path,
) -> tuple[Any, Any]:  # fmt: skip
    """The TrainResults of ``args`` trained straight through (experiment ``straight``), and of the same
    config interrupted at ``epoch`` (ended KILLED, its checkpoint in ``ckpt`` kept) then resumed in
    ``experiment``: the resumed run is the killed MLflow run, continued."""
    from dpsweep.run.runner import train

    straight = train(make_cfg(*args, "tracking.experiment_name=straight"))
    cfg = make_cfg(*args, f"train.checkpoint_dir={ckpt}")
    train_interrupted(cfg, task_run, epoch)
    [killed] = runs_of(client, experiment)
    assert killed.info.status == "KILLED"
    resumed = train(cfg)
    assert resumed.run_id == killed.info.run_id
    return straight, resumed


SCRIPTS = REPO / "launchers" / "scripts"


def process_running(name: str) -> bool:
    """Whether a process of this exact name runs on this machine."""
    return subprocess.run(["pgrep", "-x", name], capture_output=True, check=False).returncode == 0


@contextlib.contextmanager
def service(
    up: str, down: Sequence[str], running: Callable[[], bool], env: Mapping[str, str] | None = None
) -> Iterator[subprocess.CompletedProcess[str]]:
    """A service the suite needs (Slurm, Grid Engine, the PostgreSQL-backed MLflow server), brought up
    by its script in launchers/scripts/ and stopped again by ``down`` (a script and its arguments)
    when the block ends, unless it was running before (then it is left as it was found). The
    scripts' output is shown whole when one fails."""
    was_running = running()
    proc = subprocess.run(["bash", str(SCRIPTS / up)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, f"{up} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    try:
        yield proc
    finally:
        if not was_running:
            script, *args = down
            command = ["bash", str(SCRIPTS / script), *args]
            stop = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
            assert stop.returncode == 0, f"{down} exited {stop.returncode}:\n{stop.stdout}\n{stop.stderr[-4000:]}"


def trained_store(
    cwd: Path, experiment: str, common: Sequence[str], runs: Mapping[Any, Sequence[str]]
) -> tuple[str, dict[Any, str]]:
    """A fresh store in ``cwd`` holding one trained run of each of ``runs`` (key -> its overrides, after
    ``common``), with one torch thread; the store's URI and each key's run id."""
    import torch
    from hydra import compose, initialize_config_module

    from dpsweep.run.runner import train

    uri, tracking = fresh_store(cwd, experiment)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with initialize_config_module("dpsweep.conf", version_base="1.3"):
            ids = {key: train(compose("config", overrides=[*common, *tracking, *o])).run_id for key, o in runs.items()}
    finally:
        torch.set_num_threads(threads)
    return uri, ids


def row_of_run(table: Any, run_id: str) -> Any:
    """The row of a report's table (a DataFrame) that counts the run ``run_id``."""
    [index] = table.index[table["run_ids"].map(lambda ids: run_id in ids)]
    return table.loc[index]


def markdown_rows(text: str) -> list[dict[str, str]]:
    """A markdown table's rows, each as header -> cell."""
    lines = [x for x in text.splitlines() if x.startswith("|")]
    cells = [[c.strip() for c in x.strip().strip("|").split("|")] for x in lines]
    return [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]


def log_run(
    client: MlflowClient,
    experiment: str,
    params: Mapping[str, str],
    metrics: Mapping[str, float] | None = None,
    tags: Mapping[str, str] | None = None,
    status: str = "FINISHED",
) -> str:
    """A run of ``experiment`` (created if need be) logged by hand in a real store, as a report reads it:
    its params, its metrics at step 2, its tags and ``status``; its id."""
    import time

    from mlflow.entities import Metric, Param

    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    run_id = client.create_run(exp_id, tags=dict(tags or {})).info.run_id
    now = int(time.time() * 1000)
    client.log_batch(
        run_id, metrics=[Metric(k, v, now, 2) for k, v in (metrics or {}).items()],
        params=[Param(k, v) for k, v in params.items()],
    )  # fmt: skip
    client.set_terminated(run_id, status)
    return run_id
