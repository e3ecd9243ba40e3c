"""``dpsweep-ui``: MLflow's UI on a local store, opened on an experiment's training runs.

    dpsweep-ui                                  # ./mlflow.db, the experiment of the latest run
    dpsweep-ui --experiment grid --port 5001    # another experiment, another port
    dpsweep-ui --tracking-uri http://mlflow:5000 --no-browser   # a server's page: printed, nothing served

It says at once where it will serve (before MLflow, which takes seconds to import, a minute on a loaded
machine), serves the store with MLflow's server on 127.0.0.1 (loopback only), waits until it answers,
then prints the experiment's page, says the server is ready, and opens the page in the default browser
where there is one. The page asks for MLflow 3's model-training view (``workflowType=machine_learning``),
where the runs table is, instead of its GenAI overview (see ``dpsweep.tracking.ui_url``), in the view of
the runs that dpsweep-ui saves on the experiment first: the objective and ε as columns, with the swept
params, runs sorted by the objective (``dpsweep.tracking.views.save_view``). Every other way into the
UI it serves (an experiment clicked in MLflow's list, the Models tab's URL) opens on model training too
(``dpsweep.tracking.ui_server``). Ctrl-C stops the server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import webbrowser
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlparse

from dpsweep.cli.errors import exits_on_bad_input
from dpsweep.cli.options import add_tracking_uri, plain_text
from dpsweep.cli.script import run_script
from dpsweep.errors import InputError
from dpsweep.tracking.ui_server import APP_NAME

HOST = "127.0.0.1"
START_S = 120.0  # how long `mlflow ui` may take to answer /health (it imports MLflow's server first)
STILL_S = 15.0  # while it has not answered, a line this often


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpsweep-ui", description=plain_text(__doc__.split("\n")[0]))
    add_tracking_uri(p)
    p.add_argument("--experiment", metavar="NAME", help="the experiment to open (default: that of the latest run)")
    p.add_argument("--port", type=int, default=5000, help="the port to serve on, on 127.0.0.1 (default 5000)")
    p.add_argument("--no-browser", action="store_true", help="print the page, do not open a browser")
    return p


@exits_on_bad_input("dpsweep-ui")
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    uri = args.tracking_uri
    scheme = urlparse(uri).scheme
    if scheme not in ("sqlite", "file", "", "http", "https"):
        raise InputError(
            "--tracking-uri", uri, "a local store (sqlite:///mlflow.db, a folder) or an MLflow server's URL"
        )
    from dpsweep.tracking import sqlite_path, ui_url

    local = scheme not in ("http", "https")
    where = sqlite_path(uri) or Path(urlparse(uri).path)
    if local and not where.exists():
        raise InputError("--tracking-uri", uri, f"a store that exists ({where.absolute()} does not): run dpsweep first")
    if not 0 < args.port < 65536:
        raise InputError("--port", args.port, "a TCP port, 1 to 65535")
    if local and not _free(args.port):
        raise InputError("--port", args.port, f"a port nothing listens on at {HOST} (another mlflow ui?)")
    started = time.monotonic()
    print(_first_line(uri, local, args.port), flush=True)
    from dpsweep.tracking.store import open_client  # MLflow: after the arguments parse
    from dpsweep.tracking.views import latest_experiment, save_view  # MLflow: after the arguments parse

    client = open_client(uri)
    if args.experiment is not None:
        found = client.get_experiment_by_name(args.experiment)
        if found is None:
            names = ", ".join(e.name for e in client.search_experiments()) or "none"
            raise InputError("--experiment", args.experiment, f"an experiment of {uri} (it holds: {names})")
        experiment_id = found.experiment_id
    else:
        experiment_id = latest_experiment(client)
    view = save_view(client, experiment_id)
    if not local:  # a server: its UI is already served
        return _show(ui_url(uri, experiment_id, view), args.no_browser)
    # Its output is the user's (the server's log, on this terminal). Its own session: MLflow starts its
    # web server and job consumers as processes of their own, and the whole group is stopped with it,
    # on Ctrl-C, on SIGTERM (kill) and on SIGHUP (the terminal closed) alike.
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, _exit_on)
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--app-name", APP_NAME, "--backend-store-uri", uri, "--host", HOST,
         "--port", str(args.port)],
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(server, args.port, started)
        _show(ui_url(f"http://{HOST}:{args.port}", experiment_id, view), args.no_browser)
        print(f"dpsweep-ui: the server is ready ({time.monotonic() - started:.0f} s); Ctrl-C stops it", flush=True)
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(server)


def _exit_on(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left of it after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        try:
            server.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError):  # the web server it started, if it outlived it
            os.killpg(server.pid, signal.SIGKILL)
        return


def _show(url: str, no_browser: bool) -> int:
    print(f"dpsweep-ui: the runs: {url}", flush=True)
    if not no_browser:
        webbrowser.open(url)  # False (nothing opened) where there is no browser: the line above says where
    return 0


def _free(port: int) -> bool:
    """Whether nothing listens on ``port``. With SO_REUSEADDR, as the server binds: connections of an
    earlier server that still linger in TIME_WAIT (a UI just stopped and started again) do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _first_line(uri: str, local: bool, port: int) -> str:
    """What dpsweep-ui says before it imports MLflow: where it will serve, or which server it reads."""
    from dpsweep.errors import redact

    if not local:
        return redact(f"dpsweep-ui: reading {uri} (MLflow takes a few seconds to load)")  # never a password
    return f"dpsweep-ui: starting MLflow's server for {uri} at http://{HOST}:{port} (the page follows once it answers)"


def _wait_for(server: subprocess.Popen[bytes], port: int, started: float) -> None:
    """Until the server answers /health; a line every :data:`STILL_S` while it has not."""
    said = time.monotonic()
    deadline = said + START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mlflow ui ended with exit code {server.returncode} before it answered")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.25)
        if time.monotonic() - said >= STILL_S:
            said = time.monotonic()
            print(f"dpsweep-ui: MLflow's server is still starting ({said - started:.0f} s)", flush=True)
    raise RuntimeError(f"mlflow ui did not answer on port {port} within {START_S:g} s")


def console() -> NoReturn:
    """The console script: its secrets handed over, ``main``, then its exit (``dpsweep.cli.script``)."""
    run_script(main, "dpsweep-ui")


if __name__ == "__main__":
    console()
