"""Tracking against a real MLflow tracking server backed by PostgreSQL, as on a cluster.

The module fixture brings the server up with ``launchers/scripts/mlflow_server_up.sh`` (root on
Debian: it installs and runs PostgreSQL) and leaves it running, so a second session reuses it in
about a second; ``launchers/scripts/mlflow_server_down.sh`` stops it.

The 32 jobs are separate OS processes forked from a multiprocessing forkserver that has imported
``dpsweep.tracking`` once: each job then has its own interpreter state, MLflow client and
connections, but the 32 imports of torch (~6 s of CPU and ~0.5 GB each) are not paid 32 times.

Released together, the jobs still reach the server one after the other on a small machine: the first
creates the experiment before most others have asked for it. To make the race of
``experiment_id()`` certain, the test holds a lock on PostgreSQL's ``experiments`` table that lets
reads through but blocks inserts, until every job has found no experiment and waits to create it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.synchronize import Barrier
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
import sqlalchemy
from helpers import BIN, forkserver, in_process_then, service
from mlflow.entities import Run, ViewType
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.tracking._tracking_service.utils import _use_tracking_uri

from dpsweep.config import TrackingConfig
from dpsweep.errors import InputError
from dpsweep.tracking import tracked_run

JOBS = 32
STEPS = 5
DEAD_URI = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused at once


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


def _expected_params(index: int) -> dict[str, str]:
    return {"job.index": str(index), "train.lr": str(0.01 * (index + 1)), "model.name": f"net-{index}"}


def _expected_metrics(index: int) -> dict[str, list[tuple[int, float]]]:
    # Sums of powers of 2 are exact in binary: the values that come back can be compared with ==.
    return {
        "train_loss": [(step, index + 1 / 2**step) for step in range(STEPS)],
        "test_accuracy": [(step, index + step / 8) for step in range(STEPS)],
    }


def _expected_artifact(index: int) -> str:
    return f"job {index}\nsome: config\n"


def _job(uri: str, experiment: str, index: int, barrier: Barrier, out_dir: str) -> None:
    """One training job: waits for all the others, then logs through the real ``tracked_run``."""
    result: dict[str, str] = {}
    try:
        MlflowClient(uri).search_experiments(max_results=1)  # warm up (lazy imports), so that after
        barrier.wait(timeout=120)  # the barrier all 32 race to create the experiment at the same moment
        cfg = TrackingConfig(uri=uri, experiment_name=experiment)
        with tracked_run(cfg, tags={"job.index": index}) as run:
            run.log_params(_expected_params(index))
            for step in range(STEPS):
                run.log_metrics({name: hist[step][1] for name, hist in _expected_metrics(index).items()}, step=step)
            run.log_text(_expected_artifact(index), "notes/job.txt")
        result["run_id"] = run.run_id
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out_dir, f"{index}.json").write_text(json.dumps(result))


def _check_run(client: MlflowClient, run: Run, dst: Path) -> None:
    """The run is FINISHED with the params, full metric histories and artifact its job logged."""
    index, run_id = int(run.data.tags["job.index"]), run.info.run_id
    assert run.info.status == "FINISHED", (index, run.info.status, run.data.tags.get("error"))
    assert run.data.params == _expected_params(index)
    for name, history in _expected_metrics(index).items():
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert logged == history, (index, name)
    assert [a.path for a in client.list_artifacts(run_id, "notes")] == ["notes/job.txt"]
    (dst / str(index)).mkdir(parents=True)
    # The download goes through the server's artifact proxy, whose workers can drop a request while
    # the machine is loaded (one did in a full make test): the artifact was listed just above, so
    # a transient failure is retried, and only three in a row fail the test, with every error shown.
    errors: list[str] = []
    for attempt in range(3):
        try:
            local = client.download_artifacts(run_id, "notes/job.txt", str(dst / str(index)))
            break
        except MlflowException as err:
            errors.append(f"attempt {attempt + 1}: {err}")
            time.sleep(1.0)
    else:
        raise AssertionError(f"job {index}: the artifact could not be downloaded:\n" + "\n".join(errors))
    assert Path(local).read_text() == _expected_artifact(index)


def _inserts_waiting(conn: sqlalchemy.Connection) -> int:
    query = "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'experiments'::regclass"
    return int(conn.execute(sqlalchemy.text(query)).scalar_one())


@pytest.mark.cluster
def test_32_concurrent_jobs_each_log_a_complete_run(
    server_uri: str, backend_engine: sqlalchemy.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # 32 downloads, 32 bars otherwise
    experiment = f"test-concurrent-{uuid.uuid4().hex[:12]}"  # the server outlives test sessions
    start = time.monotonic()
    ctx = forkserver()  # what the jobs import, imported once (helpers.FORKSERVER_PRELOAD)
    barrier = ctx.Barrier(JOBS + 1)
    procs = [
        ctx.Process(
            target=in_process_then, args=(_job, server_uri, experiment, i, barrier, str(tmp_path)), name=f"job-{i}"
        )
        for i in range(JOBS)
    ]
    try:
        for p in procs:
            p.start()
        with backend_engine.connect() as lock, backend_engine.connect() as probe:
            # Reads pass, inserts wait: every job sees no experiment, then all 32 try to create it.
            lock.execute(sqlalchemy.text("LOCK TABLE experiments IN SHARE ROW EXCLUSIVE MODE"))
            barrier.wait(timeout=180)  # every job is started and waiting: release them together
            released = time.monotonic()
            ready_in = released - start
            while (contenders := _inserts_waiting(probe)) < JOBS and time.monotonic() - released < 20:
                time.sleep(0.05)
            lock.commit()
        for p in procs:
            p.join(timeout=120)
        logged_in = time.monotonic() - released
        assert [p.exitcode for p in procs] == [0] * JOBS
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    results = {i: json.loads((tmp_path / f"{i}.json").read_text()) for i in range(JOBS)}
    errors = {i: r["error"] for i, r in results.items() if "error" in r}
    assert not errors, "\n".join(f"job {i}:\n{e}" for i, e in errors.items())
    # Each blocked insert is one job's create_experiment: the race really happened. Fewer means requests
    # queued in the server for a database connection (SQLAlchemy's default pool is 5+10 per worker).
    assert contenders == JOBS, f"only {contenders} jobs reached the database together"

    client = MlflowClient(server_uri)
    [exp] = client.search_experiments(view_type=ViewType.ALL, filter_string=f"name = '{experiment}'")
    runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL, max_results=1000)
    assert len(runs) == JOBS
    assert {r.info.run_id for r in runs} == {r["run_id"] for r in results.values()}
    with ThreadPoolExecutor(max_workers=8) as pool:  # ~0.5 s of requests per run
        list(pool.map(lambda run: _check_run(client, run, tmp_path / "artifacts"), runs))
    assert sorted(int(r.data.tags["job.index"]) for r in runs) == list(range(JOBS))
    print(
        f"\n{JOBS} jobs ready in {ready_in:.1f} s, raced and logged in {logged_in:.1f} s, "
        f"checked in {time.monotonic() - start - ready_in - logged_in:.1f} s"
    )


def _tracking_uri_error(uri: str, timeout_s: float = 3.0) -> str | None:
    """Why an http(s) tracking URI cannot be used, or None: one request, no retries, bounded time.

    Any HTTP answer proves the server is reachable (what it thinks of the request is for MLflow to
    report); only a refused or timed-out connection is an error. Other schemes (sqlite, file) are local.
    """
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s)
    except requests.RequestException as err:
        return f"tracking.uri={uri} is unreachable: {type(err).__name__}: {err}"
    return None


def test_an_unreachable_tracking_server_is_refused_in_seconds() -> None:
    """MLflow's client retries a refused connection with exponential backoff (its defaults: 7 retries,
    factor 2: about 4 minutes), then raises. dpsweep asks the server's /health first and refuses the URI
    within seconds, naming tracking.uri (issue 39, item 13), before any run is created."""
    start = time.monotonic()
    with (
        _use_tracking_uri(DEAD_URI),
        pytest.raises(InputError, match=r"tracking.uri=.* is invalid: a reachable MLflow server"),
        tracked_run(TrackingConfig(uri=DEAD_URI, experiment_name="never-created")),
    ):
        pass
    assert time.monotonic() - start < 15


@pytest.mark.cluster
def test_a_single_probe_detects_an_unreachable_uri_at_once(server_uri: str) -> None:
    start = time.monotonic()
    error = _tracking_uri_error(DEAD_URI)
    assert error is not None and "ConnectionError" in error
    assert time.monotonic() - start < 1
    assert _tracking_uri_error(server_uri) is None
    assert _tracking_uri_error("sqlite:///mlflow.db") is None


@pytest.mark.cluster
def test_the_servers_page_opens_every_way_in_on_model_training(server_uri: str) -> None:
    """The cluster's server runs MLflow's app as dpsweep's (``--app-name dpsweep``): its page sets the
    model-training view before MLflow's scripts, so an experiment clicked in its list does not open on the
    GenAI overview (issue 56, item 4; the browser test of the same page: test_mlflow_ui_ways_in.py)."""
    from dpsweep.tracking.ui_server import SCRIPT

    page = requests.get(f"{server_uri.rstrip('/')}/", timeout=30)
    assert page.status_code == 200 and SCRIPT in page.text, page.text[:500]


@pytest.mark.cluster
def test_optuna_study_on_postgresql_storage(server_uri: str) -> None:
    """Studies on clusters keep their trials in an RDB: the same PostgreSQL serves as Optuna storage."""
    import optuna

    from dpsweep.run.pruning import open_storage

    env = os.environ.get
    url = (
        f"postgresql://{env('DPSWEEP_PG_USER', 'mlflow')}:{env('DPSWEEP_PG_PASSWORD', 'mlflow')}"
        f"@127.0.0.1:{env('DPSWEEP_PG_PORT', '5433')}/{env('DPSWEEP_PG_OPTUNA_DB', 'optuna')}"
    )
    name = f"pg-{os.getpid()}-{time.time_ns()}"
    study = optuna.create_study(study_name=name, storage=open_storage(url))
    study.optimize(lambda t: (t.suggest_float("x", -1, 1)) ** 2, n_trials=3)
    resumed = optuna.load_study(study_name=name, storage=open_storage(url))
    assert len(resumed.trials) == 3 and resumed.best_value == study.best_value


# No credential in any output (issue 55, item 1), against this server: a PostgreSQL role with an awkward
# password logs a run straight into the server's database (it finishes only if the password reached psycopg
# as PGPASSWORD), then the password is looked for in every byte the commands printed or wrote and in every
# param, tag and artifact of the runs; the same for an HTTP server's password given to a sweep and dpsweep-runs.
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
