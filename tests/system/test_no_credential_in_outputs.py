"""No credential in any output (issue 55, item 1), against the real PostgreSQL-backed MLflow server.

A PostgreSQL role with an awkward password (a quote, an "@", a ":") logs a run straight into the
server's database: the run only finishes if the password reached psycopg (as ``PGPASSWORD``), and it
is then looked for in every byte the commands printed or wrote (Hydra's ``.hydra/*.yaml``, job logs,
artifacts) and in every param, tag and artifact of the runs. The same for an HTTP server's password,
given to a sweep and to ``dpsweep-runs``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
from helpers import BIN
from mlflow.tracking import MlflowClient

PASSWORD = "s3cr'et@p:ss"  # what a naive regex half-prints or misses
ROLE = "dpsweep_credentials"


def _psql(sql: str, **variables: str) -> None:
    """SQL as PostgreSQL's superuser, psql variables quoting the values (as mlflow_server_up.sh does)."""
    port = os.environ.get("DPSWEEP_PG_PORT", "5433")
    args = [
        "runuser",
        "-u",
        "postgres",
        "--",
        "psql",
        "-X",
        "-q",
        "-v",
        "ON_ERROR_STOP=1",
        "-p",
        port,
        "-d",
        "postgres",
    ]
    for name, value in variables.items():
        args += ["-v", f"{name}={value}"]
    proc = subprocess.run(args, input=sql, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _run(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _leaks(text: str) -> bool:
    return any(secret in text for secret in (PASSWORD, quote(PASSWORD, safe=""), "s3cr"))


@pytest.mark.cluster
def test_no_password_reaches_any_output_file_param_or_tag(server_uri: str, tmp_path: Path) -> None:
    db_user = os.environ.get("DPSWEEP_PG_USER", "mlflow")
    _psql(
        "DROP ROLE IF EXISTS :\"role\";\nCREATE ROLE :\"role\" LOGIN PASSWORD :'pw' IN ROLE :\"owner\";\n",
        role=ROLE, pw=PASSWORD, owner=db_user,
    )  # fmt: skip
    port = os.environ.get("DPSWEEP_PG_PORT", "5433")
    database = os.environ.get("DPSWEEP_PG_DB", "mlflow")
    experiment = f"credentials-{os.getpid()}"
    pg_uri = f"postgresql://{ROLE}:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/{database}"
    http_uri = server_uri.replace("http://", f"http://alice:{PASSWORD}@")  # unencoded, as a user types it
    common = [f"tracking.experiment_name={experiment}", "train.epochs=1", "train.progress=false"]
    printed = _run([str(BIN / "dpsweep"), f"tracking.uri={pg_uri}", *common], tmp_path)
    printed += _run([str(BIN / "dpsweep"), "-m", f"tracking.uri={http_uri}", "dp.noise_multiplier=0.8,1.6", *common],
                    tmp_path)  # fmt: skip
    printed += _run([str(BIN / "dpsweep-runs"), "reconcile", "--tracking-uri", http_uri], tmp_path)
    assert not _leaks(printed), printed
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.parent.name == ".hydra" for p in written)  # Hydra wrote its files: without the password
    for path in written:
        assert not _leaks(path.read_bytes().decode(errors="replace")), path
    client = MlflowClient(server_uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}  # 1 run, a sweep's parent and 2 jobs
    for run in runs:
        assert not _leaks(repr(run.data.params) + repr(run.data.tags)), run.info.run_id
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        if "config.yaml" in artifacts:
            assert not _leaks(
                Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text()
            )
