"""The store's password in what the sidecar and its commands print (collector/README.md,
Security: "Secrets never logged").

- libpq quotes in its errors the part of the URL it cannot read, the password or the
  whole URL; ``serve`` and ``alerts`` print such a store error on standard error, where
  neither may show;
- a short store password (``test``, ``info``) is hidden where the URL is printed, and is
  not given to the log's redactor, which would blank it out of every line.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import LineBuffer, loopback_config
from durable_sessions_collector.cli import main
from durable_sessions_collector.config import Config, load, redact_store_url, store_secrets
from durable_sessions_collector.service import Service

SERVE = ("serve", "--grpc-endpoint", "127.0.0.1:0", "--http-endpoint", "127.0.0.1:0")


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DURABLE_SESSIONS_STORE", "DURABLE_SESSIONS_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GRPC_VERBOSITY", "NONE")  # serve sets it in the process otherwise


@pytest.mark.parametrize("command", [SERVE, ("alerts", "dead"), ("alerts", "redeliver")])
@pytest.mark.parametrize(
    ("url", "password"),
    [
        # libpq: invalid percent-encoded token: "<the password>"
        ("postgresql://ds:Sup3rSecret%Pw@127.0.0.1:1/db", "Sup3rSecret%Pw"),
        # libpq: unexpected character "x" at position 42 in URI (...): "<the whole URL>"
        ("postgresql://ds:Sup3rSecretPw@[::1]x:1/db", "Sup3rSecretPw"),
        # short, and the message still never shows it
        ("postgresql://ds:p%w@127.0.0.1:1/db", "p%w"),
    ],
)
def test_a_store_error_never_shows_the_password(
    command: tuple[str, ...], url: str, password: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("psycopg")
    code = main([*command, "--store", url])
    err = capsys.readouterr().err
    assert code == 2 and "cannot open store" in err, err
    assert password not in err
    assert redact_store_url(url) in err  # which store is still said


@pytest.mark.parametrize("password", ["a", "test"])
def test_a_short_password_is_hidden_without_garbling_the_error(
    password: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A password shorter than the log's minimum is hidden where it stands as a value
    (quoted, or between ':' and '@'), not wherever its letters occur: a password 'a' made
    'dur***ble-sessions-collector: store: c***nnot open store'."""
    pytest.importorskip("psycopg")
    url = f"postgresql://app:{password}@[::1]x:1/analytics"  # libpq quotes the whole URL
    assert main([*SERVE, "--store", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("durable-sessions-collector: store: cannot open store "), err
    assert redact_store_url(url) in err and "/analytics" in err
    assert f":{password}@" not in err and f'"{url}"' not in err


def test_store_secrets_cover_every_form_libpq_may_quote() -> None:
    """As written, percent-decoded, and encoded again (the store hands the query's values
    to libpq encoded), and the URL itself; nothing for a URL without a password."""
    url = "postgresql://ds:p%40ss@h/db?password=a/b+c&schema=s"

    def quoted(secret: str) -> list[str]:  # a short one: where it stands as a value
        return [f'"{secret}"', f"'{secret}'", f":{secret}@"]

    assert store_secrets(url) == [
        url,
        *(form for secret in ("p%40ss", "p@ss", "a/b+c", "a/b c") for form in quoted(secret)),
        "a%2Fb%20c",
    ]
    assert store_secrets("postgresql://ds@h/db?schema=s") == []
    assert store_secrets("sqlite:///x.db") == []


def with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=f"{parts.username}:{password}@{parts.netloc.rpartition('@')[2]}").geturl()


@pytest.mark.postgres
def test_a_short_store_password_leaves_the_log_lines_intact(postgres_url: str) -> None:
    """With the store password ``info`` registered with the log's redactor, every line's
    ``"level":"info"`` became ``"***"`` (and a ``test`` one blanked the database name and
    alert lines' session ids). A short password is hidden where the URL is logged, and
    nowhere else touched."""
    store = with_password(postgres_url, "info")  # trust authentication: any password is taken
    config, lines = _served_once(store)
    assert "info" not in config.secrets() and store in config.secrets()
    started = next(line for line in lines if line["event"] == "started")
    assert started["level"] == "info"
    assert started["store"] == redact_store_url(store) and ":***@" in started["store"]


@pytest.mark.parametrize("command", [SERVE, ("alerts", "dead")])
@pytest.mark.parametrize("control", ["\n", "\r", "\t"])
def test_a_line_break_in_the_store_url_is_refused_and_never_shown(
    command: tuple[str, ...], control: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """libpq reads a raw line break into the password (Python's urlsplit drops it, so the
    redactor was given another password) and quotes it raw in its error, which the
    sidecar cuts at its first line: 'invalid percent-encoded token: "Sup3r' showed the
    password up to the break. The URL is refused before libpq reads it."""
    url = f"postgresql://ds:Sup3r{control}Secret%Pw@127.0.0.1:1/db"
    assert main([*command, "--store", url]) == 2
    err = capsys.readouterr().err
    assert "Sup3r" not in err and "Secret%Pw" not in err, err
    assert "store: " in err and "percent-encode" in err and "%0A" in err, err


def test_a_store_url_with_surrounding_whitespace_is_read_without_it() -> None:
    """A Kubernetes Secret, or a YAML block scalar, ends its value with a newline: libpq
    read it into the last part (database "db\\n" does not exist)."""
    url = "postgresql://ds:Sup3rSecretPw@127.0.0.1:1/db?schema=s"
    config = load(None, env={"DURABLE_SESSIONS_STORE": f" {url}\n"})
    assert config.store == url
    assert url in config.secrets() and f"{url}\n" not in config.secrets()


@pytest.mark.parametrize("command", [SERVE, ("alerts", "dead")])
@pytest.mark.parametrize("mark", ["#", "?"])
def test_a_hash_or_question_mark_in_the_password_is_never_shown(
    command: tuple[str, ...], mark: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """libpq reads the user info up to the '@' (a '#' or '?' before it is part of the
    password); the redactor cut the URL at the '#' or '?', as Python's URL parser does,
    found no '@' before it and showed the URL whole: 'expected
    postgresql://USER@HOST:PORT/DB, got 'postgresql://ds:Sup3r#Secret@127.0.0.1:1/db''."""
    url = f"postgresql://ds:Sup3r{mark}Secret@127.0.0.1:1/db"
    assert main([*command, "--store", url]) == 2
    err = capsys.readouterr().err
    assert "Secret" not in err, err
    assert "postgresql://ds:***@127.0.0.1:1/db" in err and "%23" in err, err


@pytest.mark.parametrize("command", [SERVE, ("alerts", "dead")])
def test_an_at_sign_in_the_password_is_refused_and_never_shown(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """libpq ends the user info at the first '@', the redactor at the last (to hide more):
    of 'ds:Sup3r@Secret99@127.0.0.1', libpq took 'Secret99@127.0.0.1' for the host and
    psycopg said "failed to resolve host 'Secret99@127.0.0.1'", the password's tail, which
    no secret the redactor held covered. Two '@' before the path are never a valid URL (a
    host holds none): the URL is refused before libpq reads it."""
    pytest.importorskip("psycopg")
    url = "postgresql://ds:Sup3r@Secret99@127.0.0.1:1/db"
    assert main([*command, "--store", url]) == 2
    err = capsys.readouterr().err
    assert "Secret99" not in err and "Sup3r" not in err, err
    assert "store: " in err and "percent-encode an @" in err and "%40" in err, err
    assert "postgresql://ds:***@127.0.0.1:1/db" in err, err


@pytest.mark.postgres
def test_a_password_with_a_hash_is_hidden_in_the_log(postgres_url: str) -> None:
    """A password that urlsplit reads as a port ('1234' of '1234#…') passes the
    configuration and libpq connects with it whole; the ``started`` line showed it, and
    the redactor, given no password, could not hide it."""
    password = "1234#Sup3rSecret"
    store = with_password(postgres_url, password)  # trust authentication: any password is taken
    config, lines = _served_once(store)
    assert password in config.secrets()
    assert "Sup3rSecret" not in repr(lines)
    started = next(line for line in lines if line["event"] == "started")
    assert started["store"] == redact_store_url(store) and ":***@" in started["store"]


def _served_once(store: str) -> tuple[Config, list[dict[str, Any]]]:
    """The configuration of a sidecar on ``store`` (free loopback ports), and the log lines
    it wrote as it started and stopped."""
    config = loopback_config(store)
    log = LineBuffer()
    Service(config, log_stream=log).start().stop()
    return config, log.lines()
