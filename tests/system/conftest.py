"""Fixtures of the system tests: the PostgreSQL-backed MLflow tracking server, as on a cluster.

The fixture brings the server up with ``launchers/scripts/mlflow_server_up.sh`` (root on Debian: it
installs and runs PostgreSQL) and leaves it running, so a second session reuses it in about a second;
``launchers/scripts/mlflow_server_down.sh`` stops it.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy
from helpers import service


@pytest.fixture(scope="module")
def server_uri() -> Iterator[str]:
    """URI of the PostgreSQL-backed tracking server, started by the launcher script if not up, and
    stopped (server and PostgreSQL) after this module unless it was up before."""
    assert os.geteuid() == 0 and shutil.which("apt-get"), "needs root on Debian: the script installs PostgreSQL"
    env = {**os.environ, "DPSWEEP_VENV": sys.prefix}  # the server runs the mlflow of this interpreter
    with service("mlflow_server_up.sh", ("mlflow_server_down.sh",), _server_running, env) as proc:
        yield proc.stdout.strip().splitlines()[-1]


def _server_running() -> bool:
    """Whether the server that mlflow_server_up.sh records in its pid file runs."""
    pid_file = Path(os.environ.get("DPSWEEP_MLFLOW_HOME", "/var/lib/dpsweep-mlflow")) / "mlflow.pid"
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


@pytest.fixture(scope="module")
def backend_engine(server_uri: str) -> Iterator[sqlalchemy.Engine]:
    """The server's PostgreSQL database, with the defaults of mlflow_server_up.sh."""
    env = os.environ.get
    url = sqlalchemy.URL.create(
        "postgresql",  # the driver is the one mlflow_server_up.sh made sure of
        username=env("DPSWEEP_PG_USER", "mlflow"),
        password=env("DPSWEEP_PG_PASSWORD", "mlflow"),
        host="127.0.0.1",
        port=int(env("DPSWEEP_PG_PORT", "5433")),
        database=env("DPSWEEP_PG_DB", "mlflow"),
    )
    engine = sqlalchemy.create_engine(url)
    yield engine
    engine.dispose()
