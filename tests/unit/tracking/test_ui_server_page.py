"""The page of the server ``dpsweep-ui`` runs sets MLflow's workflow to model training before MLflow's own
scripts read it (issue 56, item 4; the browser test is tests/system/test_mlflow_ui_ways_in.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlflow.server

from dpsweep.tracking.ui_server import SCRIPT, WORKFLOW_KEY, page


def test_the_page_sets_model_training_before_mlflows_scripts_load() -> None:
    index = (Path(str(mlflow.server.app.static_folder)) / "index.html").read_text()  # MLflow's, as installed
    served = page(index)
    scripts = re.findall(r"<script\b[^>]*>", served)
    assert scripts[0] == "<script>" and 'src="static-files/static/js/main.' in scripts[1], scripts
    assert served.index(SCRIPT) < served.index("static-files/static/js/main.")
    assert served.replace(SCRIPT, "", 1) == index  # MLflow's page otherwise as it was
    # the key and value MLflow's UI reads (useLocalStorage: JSON under "<key>_v<version>")
    value = re.search(r"setItem\('([^']+)',JSON.stringify\('([^']+)'\)\)", SCRIPT)
    assert value is not None and (value.group(1), json.dumps(value.group(2))) == (WORKFLOW_KEY, '"machine_learning"')
