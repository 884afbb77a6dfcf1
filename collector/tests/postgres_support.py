"""A real PostgreSQL for the tests: one fresh schema per test, dropped afterwards.

The server is named by ``DURABLE_SESSIONS_TEST_POSTGRES_DSN`` (e.g.
``postgresql://postgres@127.0.0.1:5432/test``). Unset, the PostgreSQL tests are skipped
— unless ``DURABLE_SESSIONS_REQUIRE_POSTGRES=1`` (as CI sets it), which makes a missing
or unreachable server a failure. A DSN that is set but unreachable always fails: it was
set so that the tests run.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest
from durable_sessions_collector.environment import REQUIRE_POSTGRES, TEST_POSTGRES_DSN

# Declared in the sidecar, which knows them (a sidecar the tests start inherits them).
DSN_ENV = TEST_POSTGRES_DSN
REQUIRE_ENV = REQUIRE_POSTGRES
HOW = (
    f"set {DSN_ENV}=postgresql://postgres@127.0.0.1:5432/test to run them "
    f"(and {REQUIRE_ENV}=1 to make a missing server fail instead of skip)"
)


def postgres_dsn() -> str:
    """The test server's DSN, after checking it answers; skips or fails the test if not."""
    dsn = os.environ.get(DSN_ENV, "").strip()
    required = os.environ.get(REQUIRE_ENV, "").strip() == "1"
    if not dsn:
        if required:
            pytest.fail(f"{REQUIRE_ENV}=1 but {DSN_ENV} is not set; {HOW}", pytrace=False)
        pytest.skip(f"PostgreSQL tests skipped: {HOW}")
    try:
        import psycopg
    except ImportError as error:
        pytest.fail(f"{DSN_ENV} is set but psycopg is not installed: {error}", pytrace=False)
    try:
        with psycopg.connect(dsn, connect_timeout=5) as connection:
            connection.execute("SELECT 1")
    except psycopg.Error as error:
        pytest.fail(f"{DSN_ENV} is set but PostgreSQL cannot be reached: {error}", pytrace=False)
    return dsn


def with_schema(dsn: str, schema: str) -> str:
    parts = urlsplit(dsn)
    query = [*parse_qsl(parts.query, keep_blank_values=True), ("schema", schema)]
    return urlunsplit(parts._replace(query=urlencode(query)))


def drop_schema(dsn: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as connection:
        connection.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A ``postgresql://…?schema=…`` store URL with a schema of this test's own."""
    dsn = postgres_dsn()
    schema = f"ds_test_{os.getpid()}_{uuid.uuid4().hex[:10]}"
    try:
        yield with_schema(dsn, schema)
    finally:
        drop_schema(dsn, schema)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store URL, once of each kind: a SQLite file in ``tmp_path``, then a PostgreSQL
    schema of the test's own (:func:`postgres_url`)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sessions.db'}"
    return str(request.getfixturevalue("postgres_url"))


@contextmanager
def held_transaction(store: Any, write: Callable[[Any], Any]) -> Iterator[threading.Event]:
    """``write`` done in a writer transaction of ``store`` in a thread of its own, as
    another replica's, and the transaction held open (uncommitted) until the event given
    is set, or 10 s; on leaving, it is set and the transaction commits."""
    written, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.writer() as writer:
            write(writer)
            written.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert written.wait(10)
        yield release
    finally:
        release.set()
        thread.join()
