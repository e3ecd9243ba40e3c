"""The MLflow UI in a real browser (headless Chromium): the page dpsweep points to opens on the
experiment's training runs, not on MLflow 3's GenAI overview."""

from __future__ import annotations

import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import BIN, browser_dom, chromium_path, visible_text

from dpsweep.config import TrackingConfig
from dpsweep.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, next_steps, tracked_run

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(uri: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``mlflow server`` on loopback, once its /health answers."""
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"], stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    return server
        except OSError:
            time.sleep(0.5)
        if server.poll() is not None:
            break
    server.kill()
    raise AssertionError(f"mlflow server did not come up:\n{log.read_text()[-3000:]}")


def test_the_page_dpsweep_names_opens_on_the_experiments_training_runs(tmp_path: Path) -> None:
    chromium = chromium_path()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for i in range(2):
        with tracked_run(TrackingConfig(uri, "ui", run_name=f"digits-cnn-seed{i}")) as run:
            run.log_metrics({"test_accuracy": 0.8 + i / 100, "epsilon": 2.0}, step=1)
    line = next_steps(uri, "ui")
    found = re.search(r"then open (http://127\.0\.0\.1:5000/\S+)", line)
    assert found is not None, line
    port = _free_port()
    server = _serve(uri, port, tmp_path / "server.log")
    try:
        page = found.group(1).replace(":5000/", f":{port}/")
        text = visible_text(browser_dom(chromium, page))
    finally:
        server.terminate()
        server.wait(timeout=60)
    lines = text.splitlines()
    assert lines[0] == "Runs - Experiment 1 - MLflow", text[:500]  # the runs tab, of the experiment
    assert "digits-cnn-seed0" in lines and "digits-cnn-seed1" in lines, text[:2000]
    assert "No data available for the selected time range" not in text  # not the GenAI overview
    from mlflow.tracking import MlflowClient

    experiment = MlflowClient(uri).get_experiment_by_name("ui")
    assert experiment is not None and experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
