"""The MLflow server ``dpsweep-ui`` runs: MLflow's own (``mlflow ui``, its CLI, its uvicorn workers), whose
page opens every experiment on model training rather than MLflow 3's GenAI overview (issue 56, item 4).

    python -m mlflow ui --app-name dpsweep --backend-store-uri sqlite:///mlflow.db --port 5000

MLflow 3.17's UI takes the workflow type of every page (the GenAI overview: Traces, Token usage, "Agent
versions"; or model training: Runs, Models, Charts) from the URL's ``workflowType`` where there is one,
else from the browser's local storage (``mlflow.workflowType_v1``, written when the user flips the
"GenAI / Model training" switch), else GenAI. Not from the experiment: its ``mlflow.experimentKind`` tag
(:data:`dpsweep.tracking.EXPERIMENT_KIND_TAG`) is read only where a feature flag of the UI (the workflow
switch) is off, and 3.17 builds it on. (Read in the built bundle, ``mlflow/server/js/build/static/js``:
the workflow-type context's provider, ``useLocalStorage({key: "mlflow.workflowType", version: 1,
initialValue: "genai"})``; the experiment kind, the tag's value only when the flag is off; the experiment
page's redirect from ``#/experiments/<id>``, to Overview or Traces for a GenAI kind, else to Runs.) So a
link without the parameter (an experiment clicked in the experiment list, the Models tab's URL, a
bookmark) opened on the GenAI overview in a browser that had not flipped the switch.

This server's page writes model training into local storage before MLflow's scripts read it (a script
at the top of ``index.html``, which every page of the UI loads: its routes are the URL's fragment), so
every way into the UI it serves opens on model training, and a link's own ``workflowType`` still wins.
The user's switch works for the page they are on; the next page load of this server opens on model
training again, as a store of dpsweep's training runs has nothing for the GenAI view.

It is MLflow's plugin for apps (the entry point ``mlflow.app`` named ``dpsweep`` in pyproject.toml), which
``mlflow ui --app-name dpsweep`` serves with MLflow's own CLI and uvicorn workers (a factory: each worker
makes it on start).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

APP_NAME = "dpsweep"
WORKFLOW_KEY = "mlflow.workflowType_v1"  # MLflow's useLocalStorage key: "<key>_v<version>"
WORKFLOW = "machine_learning"  # MLflow's WorkflowType.MACHINE_LEARNING: the "Model training" view
# before MLflow's scripts (deferred, in <head>): set while the page is parsed
SCRIPT = f"<script>try{{localStorage.setItem({WORKFLOW_KEY!r},JSON.stringify({WORKFLOW!r}))}}catch(e){{}}</script>"


def page(index_html: str) -> str:
    """MLflow's ``index.html`` with :data:`SCRIPT` first in its ``<head>``."""
    head = index_html.find("<head>")
    if head < 0:
        return SCRIPT + index_html
    at = head + len("<head>")
    return index_html[:at] + SCRIPT + index_html[at:]


def app() -> Any:
    """MLflow's ASGI app (``mlflow.server.fastapi_app``, which serves its Flask app), its ``index.html``
    served as :func:`page` makes it."""
    from flask import Response
    from mlflow.server import app as flask_app
    from mlflow.server.fastapi_app import app as asgi

    original: Callable[[], Any] = flask_app.view_functions["serve"]
    index = Path(str(flask_app.static_folder)) / "index.html"

    def serve() -> Any:
        if not index.exists():  # (MLflow's own answer: how to build its UI)
            return original()
        return Response(page(index.read_text()), mimetype="text/html", headers={"Cache-Control": "no-cache"})

    flask_app.view_functions["serve"] = serve
    return asgi
