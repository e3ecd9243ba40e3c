"""Every way into the MLflow UI that ``dpsweep-ui`` serves opens on model training, not MLflow 3's GenAI
overview, and the trained model's page shows its ε and objective (issue 56, items 3 and 4); ``dpsweep-ui``
says where it will serve at once, then when the server is ready (item 5). In headless Chromium at
1440x900, against a real server on a real sqlite store."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BIN, browser_dom, chromium_path, visible_text

from dpsweep.config import TrackingConfig
from dpsweep.tracking import tracked_run

pytestmark = pytest.mark.slow
WINDOW = "1440,900"
# what MLflow 3.17's GenAI view shows of an experiment (its overview's charts, its sidebar and Models tab)
GENAI = ("Agent versions", "Token Usage", "Training runs", "No data available for the selected time range")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
            return True
    except OSError:
        return False


def _serve(uri: str, port: int, out: Path, err: Path) -> tuple[subprocess.Popen[str], float, bool, str]:
    """``dpsweep-ui`` on ``uri``: the seconds until it printed its first line, whether the server answered
    then, and the page its ready line names (``dpsweep-ui: the runs: <url>``, the line
    tests/system/test_mlflow_ui.py reads). SIGINT has its default action in it, as in a terminal."""
    started = time.monotonic()
    ui = subprocess.Popen(
        [str(BIN / "dpsweep-ui"), "--tracking-uri", uri, "--port", str(port), "--no-browser"],
        stdout=out.open("w"), stderr=err.open("w"), text=True, env=os.environ | {"PYTHONFAULTHANDLER": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    first_s, answered = None, False
    while time.monotonic() - started < 240:
        text = out.read_text()
        if first_s is None and text.strip():
            first_s, answered = time.monotonic() - started, _answers(port)
        found = re.search(r"^dpsweep-ui: the runs: (\S+)$", text, re.MULTILINE)
        if found and first_s is not None:
            return ui, first_s, answered, found.group(1)
        if ui.poll() is not None:
            raise AssertionError(f"dpsweep-ui ended with {ui.returncode} before it served:\n{err.read_text()[-3000:]}")
        time.sleep(0.1)
    ui.kill()
    raise AssertionError(f"dpsweep-ui did not serve in 240 s:\n{err.read_text()[-3000:]}")


def _page(chromium: str, url: str) -> list[str]:
    return visible_text(browser_dom(chromium, url, window=WINDOW)).splitlines()


def test_every_way_in_opens_on_model_training_and_the_models_page_shows_its_epsilon(tmp_path: Path) -> None:
    chromium = chromium_path()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # log_model=False: the tracking process warms no model imports (their torch would race this model's)
    with tracked_run(TrackingConfig(uri, "ways", run_name="σ1-B64-digits-cnn", log_model=False)) as run:
        run.log_params({"task.name": "classifier", "dataset.name": "digits", "model.name": "cnn", "dp.enabled": True,
                        "dp.mechanism": "dpsgd"})  # fmt: skip
        run.log_dataset_splits({"name": "digits"}, {"train": 1437, "test": 360})
        run.log_metrics({"test_accuracy": 0.8125, "epsilon": 1.8343}, step=1)
        run.log_model(torch.nn.Linear(4, 2), np.zeros((1, 4), dtype=np.float32))
        run.log_metrics({"epsilon_rdp": 2.3175}, step=1)  # after the model, as a run's final ε may be
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("ways")
    assert experiment is not None
    [model] = client.search_logged_models([experiment.experiment_id])
    port = _free_port()
    out = tmp_path / "ui.out"
    ui, first_s, answered, _ = _serve(uri, port, out, tmp_path / "ui.err")
    server = f"http://127.0.0.1:{port}"
    try:
        listing = browser_dom(chromium, f"{server}/#/experiments", window=WINDOW)
        links = dict(re.findall(r'<a [^>]*title="([^"]+)"[^>]*experiment-list-item-link[^>]*href="([^"]+)"', listing))
        clicked = _page(chromium, f"{server}/{links['ways']}")  # the experiment clicked in MLflow's list
        models_tab = _page(chromium, f"{server}/#/experiments/{experiment.experiment_id}/models")
        model_page = _page(chromium, f"{server}/#/experiments/{experiment.experiment_id}/models/{model.model_id}")
    finally:
        ui.send_signal(signal.SIGINT)
        ui.wait(timeout=60)
    lines = out.read_text().splitlines()
    # item 5: a first line at once, before MLflow's server answers; then the page, once it does
    assert lines[0] == f"dpsweep-ui: starting MLflow's server for {uri} at {server} (the page follows once it answers)"
    assert first_s < 20 and not answered, (first_s, lines)
    assert re.search(r"^dpsweep-ui: the server is ready \(\d+ s\); Ctrl-C stops it$", out.read_text(), re.M), lines
    # item 4: the experiment list's link and the Models tab's URL open on model training
    assert clicked[0] == f"Runs - Experiment {experiment.experiment_id} - MLflow", clicked[:40]
    assert "σ1-B64-digits-cnn" in clicked and not set(GENAI) & set(clicked), clicked[:80]
    assert models_tab[0] == f"Logged Models - Experiment {experiment.experiment_id} - MLflow", models_tab[:40]
    assert model.name in models_tab and not set(GENAI) & set(models_tab), models_tab[:80]
    # item 3: the model's page, named by what it is, shows its objective and every ε, with their datasets
    assert model.name == "digits-cnn-dpsgd-eps1_84" and model.name in model_page, model_page[:80]
    assert "Metrics (3)" in model_page, model_page[:120]
    metrics = model_page[model_page.index("Metrics (3)") :]
    for key, value, dataset in [("test_accuracy", "0.8125", "digits-test"), ("epsilon", "1.8343", "digits-train"),
                                ("epsilon_rdp", "2.3175", "digits-train")]:  # fmt: skip
        at = metrics.index(key)
        assert metrics[at + 1].startswith(dataset + " (") and value in metrics[at + 1 : at + 4], metrics[:30]
