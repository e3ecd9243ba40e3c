"""The MLflow UI in a real browser (headless Chromium): ``dpsweep-ui`` serves a store and the page it
opens (the one a run's last line names) shows the experiment's training runs, not MLflow 3's GenAI
overview, in dpsweep's view of them (issue 33, item 6): at 1440 px, the objective, ε and the swept key
without scrolling, and a chart view that opens on ε against the objective (issue 56, items 1 and 2)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from helpers import BIN, browser_dom, chart_cards, chromium_path, run_script, table_columns, visible_text
from memory_metrics import memory_metric

from dpsweep.config import TrackingConfig
from dpsweep.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, next_steps, tracked_run
from dpsweep.tracking.store import open_client

pytestmark = pytest.mark.slow
# some of the params a private run logs (dpsweep.run.records.run_params), which a non-private run lacks
DP_KEYS = ("accountant", "clipping", "delta", "max_grad_norm", "mechanism", "noise_multiplier", "secure_mode",
           "unit", "grad_sample_mode", "clip_quantile")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(uri: str, port: int, log: Path) -> tuple[subprocess.Popen[str], str]:
    """``dpsweep-ui`` on ``uri``, once it prints the page it opened (its server answers by then).

    It starts with SIGINT's default action, as a terminal's foreground command does: a test run started
    in the background (``.ci/run &``: a shell without job control ignores SIGINT in what it starts, and
    an ignored signal stays ignored across exec) would pass it on ignored, and Ctrl-C would not stop it
    (a development VM's CI run saw dpsweep-ui not end in 60 s). Its output goes to files: the server's
    access log is on its stdout, and a pipe nobody reads any more would fill up and block the server.
    With PYTHONFAULTHANDLER set, a SIGABRT (:func:`_ended`) writes every thread's stack to ``log``."""
    out = log.with_suffix(".out")
    ui = subprocess.Popen(
        [str(BIN / "dpsweep-ui"), "--tracking-uri", uri, "--port", str(port), "--no-browser"],
        stdout=out.open("w"), stderr=log.open("w"), text=True, env=os.environ | {"PYTHONFAULTHANDLER": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = re.search(r"^dpsweep-ui: the runs: (\S+)$", out.read_text(), re.MULTILINE)
        if found:
            return ui, found.group(1)
        if ui.poll() is not None:
            raise AssertionError(f"dpsweep-ui ended with {ui.returncode} before it served:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    ui.kill()
    raise AssertionError(f"dpsweep-ui did not serve in 180 s:\n{log.read_text()[-3000:]}")


def _ended(ui: subprocess.Popen[str], log: Path, timeout_s: float = 60) -> int:
    """``ui``'s exit code; where it has not ended in ``timeout_s``, its threads' stacks (SIGABRT, with
    PYTHONFAULTHANDLER set by :func:`_serve`) in the failure."""
    try:
        return ui.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        ui.send_signal(signal.SIGABRT)
        ui.wait(timeout=30)
        stacks = log.read_text()[-6000:]
        raise AssertionError(f"dpsweep-ui did not end in {timeout_s:g} s; its stacks:\n{stacks}") from None


def test_the_page_dpsweep_names_opens_on_the_experiments_training_runs(tmp_path: Path) -> None:
    chromium = chromium_path()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with tracked_run(TrackingConfig(uri, "ui", run_name="sweep-parent")) as parent:
        parent.log_metrics({"sweep.finished": 2, "sweep.failed": 0, "sweep.skipped": 0})  # as a sweep's run
    # what a private run logs: the dp.* params (that a non-private run lacks), ε under every accountant
    private = {f"dp.{k}": "1" for k in DP_KEYS}
    for i in range(2):  # a sweep's two jobs over train.seed
        with tracked_run(TrackingConfig(uri, "ui", run_name=f"digits-cnn-seed{i}")) as run:
            run.log_params({"task.name": "classifier", "model.name": "cnn", "train.seed": i, **private})
            run.set_tags({"mlflow.parentRunId": parent.run_id})
            for epoch in (1, 2):
                run.log_metrics({"test_accuracy": 0.7 + i / 100 + epoch / 20, "epsilon": 1.7 * epoch}, step=epoch)
            run.log_metrics({"epsilon_rdp": 3.6, "epsilon_pld": 3.4, "epsilon_prv": 3.39}, step=2)
            # memory in MiB under system/ (dpsweep.memory.tables.metric): 2e8 bytes, not a whole number of MiB
            run.log_metrics({memory_metric("model_load"): 1.5, memory_metric("backward"): 2e8 / 2**20}, step=0)
    with tracked_run(TrackingConfig(uri, "ui", run_name="digits-cnn-nodp")) as run:  # a non-private baseline
        run.log_params({"task.name": "classifier", "model.name": "cnn", "train.seed": 0, "dp.enabled": False})
        run.log_metrics({"test_accuracy": 0.9, memory_metric("model_load"): 1.5}, step=1)
    baseline = run.run_id
    line = next_steps(uri, "ui")
    found = re.search(
        r"dpsweep-ui --experiment ui --tracking-uri \S+, which opens (http://127\.0\.0\.1:5000/\S+)", line
    )
    assert found is not None, line
    port = _free_port()
    ui, page = _serve(uri, port, tmp_path / "ui.log")  # the latest run's experiment: the one next_steps names
    try:
        assert page == found.group(1).replace(":5000/", f":{port}/")
        dom = browser_dom(chromium, page, window="1440,900")  # a laptop's: only the columns it shows laid out
        # the chart view (the page's "Chart" button); its charts load in seconds of virtual time, not 20
        charts = browser_dom(chromium, page + "&compareRunsMode=CHART", budget_ms=60_000, window="1440,900")
        # a run's metrics tabs: memory is among its System metrics, not its Model metrics (issue 56, 2)
        experiment_page = re.sub(r"(#/experiments/\d+).*", r"\1", page)
        run_page = f"{experiment_page}/runs/{baseline}"
        model_tab, system_tab = (
            visible_text(browser_dom(chromium, f"{run_page}/{tab}", budget_ms=30_000, window="1440,900"))
            for tab in ("model-metrics", "system-metrics")
        )
    finally:
        ui.send_signal(signal.SIGINT)  # Ctrl-C: the server stops with it
        assert _ended(ui, tmp_path / "ui.log") == 0, (tmp_path / "ui.log").read_text()[-3000:]
    with pytest.raises(ConnectionRefusedError):  # no server left behind
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    # SIGTERM (kill) stops it and the whole server too: MLflow's web server and job consumers are
    # processes of their own, which outlived a plain terminate of `mlflow ui`
    ui, _ = _serve(uri, port, tmp_path / "ui2.log")
    server = psutil.Process(ui.pid).children()[0]
    family = [server, *server.children(recursive=True)]
    assert len(family) > 1, [p.cmdline() for p in family]
    ui.terminate()
    assert _ended(ui, tmp_path / "ui2.log") == 128 + signal.SIGTERM
    assert not [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    text = visible_text(dom)
    lines = text.splitlines()
    assert lines[0] == "Runs - Experiment 1 - MLflow", text[:500]  # the runs tab, of the experiment
    assert "No data available for the selected time range" not in text  # not the GenAI overview
    # dpsweep's view (views.save_view): the jobs as rows of their own, best first, not nested under
    # the sweep's run; the objective, ε and the swept key as columns, not what is the same or system/memory/…
    assert "You're viewing a shared view." in " ".join(lines) and "Sort: test_accuracy" in lines, text[:2000]
    named = ["digits-cnn-nodp", "digits-cnn-seed1", "digits-cnn-seed0", "sweep-parent"]
    assert [lines.index(n) for n in named] == sorted(lines.index(n) for n in named), text[:2000]
    # at 1440 px, without scrolling: the objective, then ε, then the swept key; not every accountant's ε,
    # the sweep's counters, the dp.* params the baseline lacks, what is the same, or system/memory/… (issue 56, 1)
    columns = [c for c in table_columns(dom) if c.startswith(("metrics.", "params."))]
    assert columns == ["metrics.`test_accuracy`", "metrics.`epsilon`", "params.`train.seed`"], table_columns(dom)
    assert {"test_accuracy", "epsilon", "train.seed"} <= set(lines), text[:3000]
    assert "model.name" not in lines and not [n for n in lines if "memory" in n], text[:3000]
    # the chart view opens on a scatter of ε against the objective, then the objective per epoch; the
    # memory section comes last, collapsed: none of its charts drawn (issue 56, item 2)
    cards = chart_cards(charts)
    assert cards[0] == {"title": "epsilon vs. test_accuracy", "x": "epsilon", "y": "test_accuracy",
                        "points": True, "lines": False}, cards  # fmt: skip
    assert (cards[1]["title"], cards[1]["x"], cards[1]["lines"]) == ("test_accuracy", "Step", True), cards
    assert not [c for c in cards if "_mib" in str(c["title"]) or "memory" in str(c["title"])], cards
    shown = visible_text(charts).splitlines()
    assert shown.index("Model metrics") < shown.index("system/memory"), shown
    # the run's Model metrics tab: one section, of its one model metric (the objective); its memory is a
    # section of its System metrics tab
    assert _sections(model_tab) == [("Model metrics", 1)], model_tab[-3000:]
    assert ("system/memory", 1) in _sections(system_tab), system_tab[-3000:]
    from mlflow.tracking import MlflowClient

    experiment = MlflowClient(uri).get_experiment_by_name("ui")
    assert experiment is not None and experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def _sections(text: str) -> list[tuple[str, int]]:
    """The chart sections of a run's metrics tab (its visible text): each name with its number of charts."""
    lines = text.splitlines()
    return [(lines[i - 1], int(n.group(1))) for i, line in enumerate(lines) if (n := re.fullmatch(r"\((\d+)\)", line))]


def test_dpsweep_ui_refuses_bad_input_before_serving(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with tracked_run(TrackingConfig(uri, "ui", run_name="one")) as run:
        run.log_metrics({"test_accuracy": 0.5}, step=1)
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    open_client(empty)  # a store without a run: no page to open by default
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        cases = [
            (["--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"], "--tracking-uri='sqlite:///"),
            (["--tracking-uri", uri, "--experiment", "nope"], "--experiment='nope' is invalid: an experiment of"),
            (["--tracking-uri", uri, "--port", str(taken)], f"--port={taken} is invalid: a port nothing listens on"),
            (["--tracking-uri", "s3://bucket/x"], "--tracking-uri='s3://bucket/x' is invalid"),
            (
                ["--tracking-uri", empty],
                "--experiment=None is invalid: the name of an experiment: the store holds no run",
            ),
        ]
        for args, message in cases:
            done = run_script("dpsweep-ui", *args, "--no-browser", cwd=tmp_path, timeout=120)
            assert done.returncode == 2 and message in done.stderr, (args, done.stdout, done.stderr)
            assert "Traceback" not in done.stderr and "the runs:" not in done.stdout
