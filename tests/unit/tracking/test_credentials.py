"""Credentials out of URIs (dpsweep.tracking.credentials) and out of printed text (dpsweep.errors.redact),
with a URI parser: passwords holding quotes, "@", ":" or an encoded "/", and secrets in the query."""

from __future__ import annotations

import pytest

from dpsweep.errors import InputError, redact
from dpsweep.tracking import credentials

AWKWARD = ["pa'ss", "p@ss@w0rd", "a:b:c", 'x"y', "per%cent"]


@pytest.mark.parametrize("password", AWKWARD)
def test_an_http_servers_password_goes_to_mlflows_variables(password: str) -> None:
    from urllib.parse import quote

    env: dict[str, str] = {}
    uri = credentials.cleaned(f"https://alice:{quote(password, safe='')}@mlflow.example:5000/x", environ=env)
    assert uri == "https://mlflow.example:5000/x"
    assert env == {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": password}


@pytest.mark.parametrize("password", ["pa'ss", "p@ss", "a:b"])
def test_an_unencoded_password_with_quotes_or_at_signs_is_taken_whole(password: str) -> None:
    """RFC 3986 ends the user information at the authority's last "@": what a user types unencoded."""
    env: dict[str, str] = {}
    assert credentials.cleaned(f"http://alice:{password}@127.0.0.1:5000", environ=env) == "http://127.0.0.1:5000"
    assert env["MLFLOW_TRACKING_PASSWORD"] == password


def test_a_postgresql_password_goes_to_pgpassword_and_the_user_stays() -> None:
    env: dict[str, str] = {}
    uri = credentials.cleaned(
        "postgresql+psycopg://mlflow:se%2Fc'r@t@db.example:5433/mlflow?sslmode=require", environ=env
    )
    assert uri == "postgresql+psycopg://mlflow@db.example:5433/mlflow?sslmode=require"
    assert env == {"PGPASSWORD": "se/c'r@t"}


@pytest.mark.parametrize(
    ("uri", "clean", "variable"),
    [
        ("http://mlflow.example/?token=abc&x=1", "http://mlflow.example/?x=1", "MLFLOW_TRACKING_TOKEN"),
        ("http://mlflow.example/?password=abc", "http://mlflow.example/", "MLFLOW_TRACKING_PASSWORD"),
        ("postgresql://u@db/m?password=abc", "postgresql://u@db/m", "PGPASSWORD"),
    ],
)
def test_secrets_in_the_query_are_taken_too(uri: str, clean: str, variable: str) -> None:
    env: dict[str, str] = {}
    assert credentials.cleaned(uri, environ=env) == clean and env == {variable: "abc"}


def test_uris_without_secrets_are_left_as_they_are() -> None:
    env: dict[str, str] = {}
    for uri in ("sqlite:///mlflow.db", "http://127.0.0.1:5000", "postgresql://u@db/m", "mlruns", "file:///tmp/m"):
        assert credentials.cleaned(uri, environ=env) == uri
    assert env == {}


def test_a_secret_no_client_setting_takes_is_refused_without_printing_it() -> None:
    with pytest.raises(InputError, match=r"sweep.storage='mysql://h/db' is invalid: a URI without a password") as err:
        credentials.cleaned("mysql://u:hunter2@h/db", "sweep.storage", environ={})
    assert "hunter2" not in str(err.value)


def test_two_stores_with_different_postgresql_passwords_are_refused() -> None:
    env: dict[str, str] = {}
    credentials.cleaned("postgresql://u:one@db/a", environ=env)
    with pytest.raises(InputError, match="one PostgreSQL password"):
        credentials.cleaned("postgresql://u:two@db/b", "sweep.storage", environ=env)


def test_the_command_line_and_the_tracking_variable_are_cleaned_in_place() -> None:
    argv = [
        "dpsweep", "-m", "tracking.uri=http://alice:pw1@h:5000", "+sweep.storage=postgresql://u:pw2@db/o",
        "--tracking-uri", "https://bob:pw3@h/", "--tracking-uri=http://h/?token=pw4", "train.epochs=1",
    ]  # fmt: skip
    env = {"MLFLOW_TRACKING_URI": "http://carol:pw5@h:5000", "HOME": "/root"}
    credentials.clean_argv(argv, env)
    assert argv == [
        "dpsweep", "-m", "tracking.uri=http://h:5000", "+sweep.storage=postgresql://u@db/o",
        "--tracking-uri", "https://h/", "--tracking-uri=http://h/", "train.epochs=1",
    ]  # fmt: skip
    assert env["MLFLOW_TRACKING_URI"] == "http://h:5000" and env["PGPASSWORD"] == "pw2"
    assert env["MLFLOW_TRACKING_TOKEN"] == "pw4"
    assert not any(f"pw{i}" in " ".join(argv) + env["MLFLOW_TRACKING_URI"] for i in range(1, 6))


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("View run x at: http://alice:pa'ss@127.0.0.1:5000/#/experiments/1", "pa'ss"),
        ("tracking.uri='postgresql://u:p@ss@host:5432/db' is invalid", "p@ss"),
        ("tracking.uri='postgresql://u:se/cret@host/db'", "se/cret"),
        ("GET http://h/api?token=abc123&run=1", "abc123"),
        ("sqlalchemy: postgresql+psycopg://u@h/db?password=abc123", "abc123"),
    ],
)
def test_printed_urls_never_show_a_secret(text: str, secret: str) -> None:
    shown = redact(text)
    assert secret not in shown and "***" in shown
    assert redact("http://127.0.0.1:5000/#/experiments/1 and sqlite:///mlflow.db") == (
        "http://127.0.0.1:5000/#/experiments/1 and sqlite:///mlflow.db"
    )


def test_the_console_scripts_look_for_uris_where_credentials_look() -> None:
    from dpsweep.cli import script

    assert script.URI_ENVIRONMENT == credentials.URI_ENVIRONMENT
