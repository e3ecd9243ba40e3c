"""Is a store's server there? Asked once, fast, before MLflow is handed its URI.

    from dpsweep.tracking.probes import probe
    probe("postgresql://alice@db.example/mlflow")   # ConfigError naming tracking.uri, within seconds

MLflow's clients wait minutes for a server that refuses or never answers, then print a traceback:
its REST client retries an HTTP server (issue 39, item 13), and its SQLAlchemy store retries
creating its engine while a database server refuses, each attempt waiting up to the driver's own
connect timeout (psycopg's 130 s) on one that never answers (issue 55, item 5). :func:`probe`
refuses such a store within :data:`SERVER_PROBE_S` or :data:`DATABASE_PROBE_S` instead, and
remembers the refusal for :data:`REFUSAL_MEMORY_S`, so that a process that opens the store again
(a sweep's jobs, each opening it) does not wait again. Errors name
the server as host and port, never its user or password.
"""

from __future__ import annotations

import threading
import time
from urllib.parse import urlparse

from dpsweep.config import ConfigError

SERVER_PROBE_S = 10.0  # how long a tracking server may take to answer before the run is refused
DATABASE_PROBE_S = 5.0  # how long a database server may take to accept a connection and its login
REFUSAL_MEMORY_S = 60.0  # how long a process takes a refused store's refusal as still standing
DATABASE_SCHEMES = frozenset({"postgresql", "mysql", "mssql"})  # MLflow's SQLAlchemy stores, but sqlite
LOCAL = "start it, or use a local store (sqlite:///mlflow.db)"

_REFUSED: dict[str, tuple[float, ConfigError]] = {}  # URI -> when it was refused, and why


def probe(uri: str) -> None:
    """ConfigError naming ``tracking.uri`` unless the server of ``uri`` (an MLflow server, or a database
    server) answers; nothing to ask for other stores (sqlite, a file store)."""
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme in ("http", "https"):
        ask = _probe_server
    elif scheme in DATABASE_SCHEMES:
        ask = _probe_database
    else:
        return
    refused = _REFUSED.get(uri)
    if refused is not None and time.monotonic() - refused[0] < REFUSAL_MEMORY_S:
        raise ConfigError(refused[1].key, refused[1].value, refused[1].allowed)
    try:
        ask(uri)
    except ConfigError as err:
        _REFUSED[uri] = (time.monotonic(), err)
        raise
    _REFUSED.pop(uri, None)


def server_of(uri: str) -> str:
    """``host:port`` of ``uri`` (no user or password)."""
    parts = urlparse(uri)
    try:
        port = parts.port
    except ValueError as err:  # not a number, or out of range
        raise ConfigError("tracking.uri", uri, f"a server URI with a port from 0 to 65535 ({err})") from err
    return f"{parts.hostname}" + (f":{port}" if port else "")


def _probe_server(uri: str) -> None:
    """ConfigError naming ``tracking.uri`` unless the MLflow server answers its ``/health`` within
    :data:`SERVER_PROBE_S` (any HTTP status is an answer)."""
    import urllib.error
    import urllib.request

    parts, server = urlparse(uri), server_of(uri)
    health = parts._replace(netloc=server, path=parts.path.rstrip("/") + "/health").geturl()
    try:
        with urllib.request.urlopen(health, timeout=SERVER_PROBE_S):
            return
    except urllib.error.HTTPError:  # it answered (an auth proxy, an older server): MLflow's client says the rest
        return
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ConfigError(
            "tracking.uri", uri, f"a reachable MLflow server: no answer from {server} within "
            f"{SERVER_PROBE_S:g} s ({reason}); {LOCAL}",
        ) from err  # fmt: skip


def _probe_database(uri: str) -> None:
    """ConfigError naming ``tracking.uri`` unless the database server takes a connection and its login
    (a password from the environment: ``dpsweep.tracking.credentials``) within :data:`DATABASE_PROBE_S`.

    SQLAlchemy connects, with the driver MLflow's store will use, in a daemon thread that is left
    behind where the server never answers: a connect timeout is each driver's own setting (libpq's
    ``connect_timeout``, pyodbc's ``timeout``, none for some), and a TCP connect alone would pass a
    server that accepts and then never answers."""
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    server = server_of(uri)
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            engine = sqlalchemy.create_engine(uri, poolclass=NullPool)
            try:
                engine.connect().close()
            finally:
                engine.dispose()
            outcome.append(None)
        except Exception as err:  # the driver's own (OperationalError, a missing module, a malformed URL)
            outcome.append(err)

    thread = threading.Thread(target=connect, name="dpsweep-database-probe", daemon=True)
    thread.start()
    thread.join(DATABASE_PROBE_S)
    allowed = "a reachable database server: {}; " + LOCAL
    if not outcome:
        raise ConfigError("tracking.uri", uri, allowed.format(f"no answer from {server} within {DATABASE_PROBE_S:g} s"))
    err = outcome[0]
    if err is None:
        return
    if isinstance(err, ImportError | sqlalchemy.exc.ArgumentError):  # (NoSuchModuleError: an unknown dialect)
        raise ConfigError("tracking.uri", uri, f"a database URI of an installed driver ({err})") from err
    text = str(getattr(err, "orig", None) or err).strip()  # the driver's own message (SQLAlchemy's .orig)
    why = f"{server} did not take the connection: {text.splitlines()[0] if text else type(err).__name__}"
    raise ConfigError("tracking.uri", uri, allowed.format(why)) from err
