"""Credentials out of URIs: a store's password (or token) is taken out of every URI dpsweep is given, at
start-up, and handed to the client that needs it through that client's own setting, so that no config,
param, tag, artifact, Hydra file, job script, printed line or traceback holds it.

    dpsweep tracking.uri=https://alice:s3cret@mlflow.example/ ...   # what a user types
    # what every part of dpsweep sees: tracking.uri=https://mlflow.example/, and in the environment
    # MLFLOW_TRACKING_USERNAME=alice, MLFLOW_TRACKING_PASSWORD=s3cret

URIs are parsed with :func:`urllib.parse.urlsplit` (RFC 3986: the user information is what precedes the
*last* ``@`` of the authority, so a password may hold ``@``, ``:`` or quotes), never with a regex.
Where each credential goes (the clients' documented settings):

- an MLflow tracking server (``http``, ``https``): ``MLFLOW_TRACKING_USERNAME`` and
  ``MLFLOW_TRACKING_PASSWORD`` (HTTP basic authentication), or a ``token=`` of the query as
  ``MLFLOW_TRACKING_TOKEN`` (bearer); MLflow's "Authentication" docs, ``mlflow.environment_variables``;
- PostgreSQL (MLflow's SQLAlchemy store, Optuna's RDB storage): ``PGPASSWORD``, which libpq and so
  psycopg read when the URI has none (PostgreSQL docs, "Environment Variables"); the user name stays.

The environment reaches every process of a run: a local launcher's jobs, torchrun's ranks, and
Slurm and Grid Engine jobs (``sbatch`` exports the environment by default; dpsweep's ``qsub`` passes
``-V``). A password in a URI of any other scheme is refused: no client setting is known to take it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, MutableSequence
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from dpsweep.config import Config
from dpsweep.errors import InputError, redact

SECRET_QUERY_KEYS = frozenset({"password", "passwd", "pwd", "token", "access_token", "api_key", "apikey", "secret"})
HTTP_SCHEMES = frozenset({"http", "https"})
URI_OPTIONS = ("--tracking-uri",)  # the commands' options that take a store's URI
URI_ENVIRONMENT = ("MLFLOW_TRACKING_URI",)  # variables that may hold one (the --tracking-uri default)


@dataclass
class Taken:
    """What :func:`take` took out of a URI: the clean URI and the variables that now carry the secret."""

    uri: str
    environment: dict[str, str] = field(default_factory=dict)

    @property
    def had_secret(self) -> bool:
        return bool(self.environment)


def _is_postgres(scheme: str) -> bool:
    return scheme.split("+")[0] in ("postgresql", "postgres")


def take(uri: str, key: str = "tracking.uri") -> Taken:
    """``uri`` without its password and secret query parameters, and the client variables that carry them
    (module docstring); InputError naming ``key`` for a secret that no client setting takes."""
    if "://" not in uri:
        return Taken(uri)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if "@" not in parts.netloc and "@" in parts.path and ":" in parts.netloc:
        raise InputError(key, redact(uri), "a URI whose password percent-encodes '/' as %2F (RFC 3986, 3.2.1)")
    query = parse_qsl(parts.query, keep_blank_values=True)
    secrets = {k.lower(): v for k, v in query if k.lower() in SECRET_QUERY_KEYS}
    password = unquote(parts.password) if parts.password is not None else None
    if password is None and not secrets:
        return Taken(uri)
    env: dict[str, str] = {}
    host = parts.netloc.rpartition("@")[2]
    user = unquote(parts.username) if parts.username else None
    if scheme in HTTP_SCHEMES:
        netloc = host  # basic authentication comes from the variables, user and password together
        if user is not None:
            env["MLFLOW_TRACKING_USERNAME"] = user
        if password is not None:
            env["MLFLOW_TRACKING_PASSWORD"] = password
        for name in ("token", "access_token"):
            if name in secrets:
                env["MLFLOW_TRACKING_TOKEN"] = secrets.pop(name)
        if "password" in secrets and password is None:
            env["MLFLOW_TRACKING_PASSWORD"] = secrets.pop("password")
    elif _is_postgres(scheme):
        netloc = f"{parts.netloc.rpartition('@')[0].partition(':')[0]}@{host}" if user is not None else host
        in_query = secrets.pop("password", None)
        given = password if password is not None else in_query
        if given is not None:
            env["PGPASSWORD"] = given
    else:
        netloc = parts.netloc
    if (password is not None and "MLFLOW_TRACKING_PASSWORD" not in env and "PGPASSWORD" not in env) or secrets:
        safe = urlunsplit((parts.scheme, host, parts.path, "", ""))
        raise InputError(
            key, safe, "a URI without a password or token for this scheme: pass the secret in its client's own "
            "environment variable (an http(s) MLflow server: MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN; "
            "PostgreSQL: PGPASSWORD)",
        )  # fmt: skip
    kept = [(k, v) for k, v in query if k.lower() not in SECRET_QUERY_KEYS]
    return Taken(urlunsplit((parts.scheme, netloc, parts.path, urlencode(kept), parts.fragment)), env)


def hand_over(taken: Taken, environ: MutableMapping[str, str] | None = None) -> str:
    """Put the secrets :func:`take` found where their clients read them; returns the clean URI. Two URIs
    with different PostgreSQL passwords cannot share ``PGPASSWORD``: InputError."""
    env = os.environ if environ is None else environ
    for name, value in taken.environment.items():
        if name == "PGPASSWORD" and env.get(name) not in (None, value):
            raise InputError("PGPASSWORD", "***", "one PostgreSQL password for the stores of a run (libpq reads one)")
        env[name] = value
    return taken.uri


def cleaned(uri: str, key: str = "tracking.uri", environ: MutableMapping[str, str] | None = None) -> str:
    """``uri`` without its secrets, which are handed over to their clients (:func:`take`, :func:`hand_over`)."""
    return hand_over(take(uri, key), environ)


def clean_stores(config: Config) -> None:
    """A run's ``tracking.uri`` and ``sweep.storage`` without their secrets, in place (:func:`cleaned`): for a
    run started from Python, or a URI written in a config file, which no command line held."""
    config.tracking.uri = cleaned(config.tracking.uri, "tracking.uri")
    if config.sweep.storage is not None:
        config.sweep.storage = cleaned(config.sweep.storage, "sweep.storage")


def clean_argv(argv: MutableSequence[str], environ: MutableMapping[str, str] | None = None) -> None:
    """A command line without secrets, in place: every ``key=URI`` override (``tracking.uri=``,
    ``sweep.storage=``, ...) and every ``--tracking-uri`` value, and the variables of
    :data:`URI_ENVIRONMENT`; their secrets handed over (:func:`hand_over`). Run first, before Hydra or
    argparse read the command line, so that neither writes a secret anywhere."""
    env = os.environ if environ is None else environ
    for name in URI_ENVIRONMENT:
        if "://" in env.get(name, ""):
            env[name] = cleaned(env[name], name, env)
    for i, arg in enumerate(argv):
        if i == 0 or "://" not in arg:
            continue
        if i > 0 and argv[i - 1] in URI_OPTIONS:
            argv[i] = cleaned(arg, argv[i - 1], env)
            continue
        key, sep, value = arg.partition("=")
        if sep and "://" in value and "://" not in key:
            argv[i] = f"{key}={cleaned(value, key.lstrip('+~'), env)}"
