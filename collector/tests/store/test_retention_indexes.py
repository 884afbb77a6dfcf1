"""Retention finds old rows of no session through partial indexes, on both stores.

Without them a pass read every session-less row younger than the cutoff (SQLite) or the
whole actions table (PostgreSQL), once a minute, in the writer's transaction. A store of
an earlier sidecar gets them at start: SQLite in its start-up transaction, PostgreSQL
``CONCURRENTLY``, by one replica at a time, without stopping the start if it fails.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import wait_for
from durable_sessions_collector.store import INDEX_BUILT, INDEX_LEFT_TO_ANOTHER, open_store
from durable_sessions_collector.store import sqlite as sqlite_store
from durable_sessions_collector.store.postgres import split_url
from psycopg import sql

INDEXES = ("actions_sessionless_by_age", "violations_sessionless_by_age")


def sqlite_indexes(path: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}


def test_sqlite_retention_reads_rows_of_no_session_through_their_age_index(tmp_path: Path) -> None:
    open_store(f"sqlite:///{tmp_path / 's.db'}").close()
    with contextlib.closing(sqlite3.connect(tmp_path / "s.db")) as db:
        for statement, params, index in (
            (sqlite_store.PRUNE_SESSIONLESS_ACTIONS, (1.0, 10), "actions_sessionless_by_age (received_at<?)"),
            (
                sqlite_store.PRUNE_SESSIONLESS_VIOLATIONS,
                (1.0, 5, 10),
                "violations_sessionless_by_age (created_at<?)",
            ),
        ):
            plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + statement, params)]
            assert any(step.endswith(index) for step in plan), plan


def test_a_sqlite_store_without_the_indexes_gets_them_at_start_keeping_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = open_store(f"sqlite:///{path}")
    with store.writer() as writer:
        writer.add_action(sessionless_row("a"), 1.0)
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:  # the store as an earlier sidecar left it
        for index in INDEXES:
            db.execute(f"DROP INDEX {index}")
        db.commit()
    assert not sqlite_indexes(path) & set(INDEXES)
    store = open_store(f"sqlite:///{path}")
    assert store.migrated_from is None
    assert set(INDEXES) <= sqlite_indexes(path)
    with store.writer() as writer:
        assert writer.prune(2.0, 10).orphans == 1  # the old row, found through the new index
    store.close()


def sessionless_row(span: str) -> Any:
    from durable_sessions_collector.store import action_row

    return action_row({"action_id": span, "kind": "tool_call", "status": "ok"}, "t" * 32, span)


# --- PostgreSQL ----------------------------------------------------------------------------------


def pg(url: str, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    dsn, schema = split_url(url)
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema or "public")))
        cursor = db.execute(statement, params or None)  # type: ignore[arg-type]
        return cursor.fetchall() if cursor.description else []


def index_validity(url: str) -> dict[str, bool]:
    return dict(
        pg(
            url,
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relnamespace = current_schema()::regnamespace AND c.relname = ANY(%s)",
            (list(INDEXES),),
        )
    )


def drop_indexes(url: str) -> None:
    for index in INDEXES:
        pg(url, f"DROP INDEX {index}")


def earlier_sidecars_store(url: str) -> tuple[str, str | None]:
    """A store as a sidecar before the indexes left it; the DSN and schema that reach it."""
    open_store(url).close()
    drop_indexes(url)
    return split_url(url)


def building(url: str) -> tuple[Any, Reports]:
    """The store opened, and building its indexes in the background."""
    store = open_store(url)
    reports = Reports()
    store.build_indexes(reports)
    return store, reports


@pytest.mark.postgres
def test_postgres_retention_reads_rows_of_no_session_through_their_age_index(postgres_url: str) -> None:
    open_store(postgres_url).close()
    # Enough rows that a sequential scan is not the cheaper plan: 20,000 of sessions, 200 of none.
    pg(
        postgres_url,
        "INSERT INTO actions (session_id, trace_id, span_id, status, received_at, record) "
        "SELECT CASE WHEN i % 100 = 0 THEN NULL ELSE 's' || i % 50 END, md5(i::text), 'span', 'ok', i, '{}' "
        "FROM generate_series(1, 20000) i",
    )
    pg(
        postgres_url,
        "INSERT INTO violations (key, session_id, rule, severity, message, created_at) "
        "SELECT 'k' || i, CASE WHEN i % 100 = 0 THEN NULL ELSE 's' || i % 50 END, 'r', 'error', 'm', i "
        "FROM generate_series(1, 20000) i",
    )
    pg(postgres_url, "ANALYZE actions")
    pg(postgres_url, "ANALYZE violations")
    for table, column, index in (
        ("actions", "received_at", "actions_sessionless_by_age"),
        ("violations", "created_at", "violations_sessionless_by_age"),
    ):
        plan = "\n".join(
            row[0]
            for row in pg(
                postgres_url,
                f"EXPLAIN SELECT id FROM {table} WHERE session_id IS NULL AND {column} < 100 LIMIT 500",
            )
        )
        assert index in plan, plan


class Reports:
    """What ``Store.build_indexes`` reported, from its thread."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str, str | None]] = {}

    def __call__(self, index: str, outcome: str, error: str | None) -> None:
        self.seen[index] = (outcome, error)

    def wait(self) -> dict[str, tuple[str, str | None]]:
        wait_for(lambda: len(self.seen) == len(INDEXES), timeout=20)
        return self.seen


def built_at_a_start(url: str, expected: int) -> dict[str, tuple[str, str | None]]:
    """Open the store, have it build its indexes, wait for ``expected`` reports, close it."""
    store, reports = building(url)
    wait_for(lambda: len(reports.seen) == expected, timeout=20)
    store.close()
    return reports.seen


@pytest.mark.postgres
def test_a_postgres_store_without_the_indexes_gets_them_built_concurrently(postgres_url: str) -> None:
    dsn, schema = earlier_sidecars_store(postgres_url)
    with psycopg.connect(dsn) as replica:  # another replica, inside a write transaction
        replica.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema or "public")))
        replica.execute(INSERT_SESSIONLESS)
        store, reports = building(postgres_url)  # opens at once
        wait_for(lambda: building_concurrently(dsn), timeout=10)  # and waits for that transaction
        with store.writer() as writer:  # while this replica writes on,
            assert writer.add_action(sessionless_row("mine"), 1.0)
        replica.commit()
        replica.execute("SET statement_timeout = 2000")  # and so do the others
        replica.execute(INSERT_SESSIONLESS)
        replica.commit()
        assert reports.wait() == dict.fromkeys(INDEXES, (INDEX_BUILT, None))
    assert index_validity(postgres_url) == dict.fromkeys(INDEXES, True)
    with store.writer() as writer:
        assert writer.prune(2.0, 10).orphans == 3  # the rows written meanwhile, through the new index
    store.close()


INSERT_SESSIONLESS = (
    "INSERT INTO actions (trace_id, span_id, status, received_at, record) "
    "VALUES (md5(random()::text), 's', 'ok', 1, '{}')"
)


def building_concurrently(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as db:
        return bool(
            db.execute(
                "SELECT 1 FROM pg_stat_activity WHERE query LIKE 'CREATE INDEX CONCURRENTLY%%' "
                "AND wait_event_type = 'Lock'"
            ).fetchall()
        )


@pytest.mark.postgres
def test_a_store_with_its_indexes_builds_nothing(postgres_url: str) -> None:
    store, reports = building(postgres_url)
    store.close()  # waits for a build thread, if one had started
    assert reports.seen == {}


@pytest.mark.postgres
def test_an_index_left_invalid_by_an_interrupted_build_is_built_again(postgres_url: str) -> None:
    open_store(postgres_url).close()
    pg(
        postgres_url,
        "UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'actions_sessionless_by_age'::regclass",
    )
    assert index_validity(postgres_url)["actions_sessionless_by_age"] is False
    assert built_at_a_start(postgres_url, 1) == {"actions_sessionless_by_age": (INDEX_BUILT, None)}
    assert index_validity(postgres_url) == dict.fromkeys(INDEXES, True)


@pytest.mark.postgres
def test_closing_the_store_cancels_a_build_and_the_next_start_takes_it_up(postgres_url: str) -> None:
    dsn, schema = earlier_sidecars_store(postgres_url)
    with psycopg.connect(dsn) as replica:  # keeps the build waiting
        replica.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema or "public")))
        replica.execute(INSERT_SESSIONLESS)
        store, reports = building(postgres_url)
        wait_for(lambda: building_concurrently(dsn), timeout=10)
        began = time.monotonic()
        store.close()
        assert time.monotonic() - began < 5
        assert reports.seen == {}  # a cancel at stop is no failure to report
        replica.commit()
    assert index_validity(postgres_url) in ({}, {"actions_sessionless_by_age": False})
    assert built_at_a_start(postgres_url, len(INDEXES)) == dict.fromkeys(INDEXES, (INDEX_BUILT, None))
    assert index_validity(postgres_url) == dict.fromkeys(INDEXES, True)


@pytest.mark.postgres
def test_a_replica_finding_a_build_in_progress_leaves_it_to_that_one(postgres_url: str) -> None:
    dsn, schema = earlier_sidecars_store(postgres_url)
    with psycopg.connect(dsn, autocommit=True) as other:  # holds the lock, as a building replica does
        other.execute(
            "SELECT pg_advisory_lock(hashtextextended(%s, 0))", (f"durable-sessions index build {schema}",)
        )
        store, reports = building(postgres_url)
        assert reports.wait() == dict.fromkeys(INDEXES, (INDEX_LEFT_TO_ANOTHER, None))
        store.close()
    assert index_validity(postgres_url) == {}


@pytest.mark.postgres
def test_a_build_that_fails_is_logged_and_the_sidecar_serves(postgres_url: str, start_sidecar: Any) -> None:
    dsn, schema = earlier_sidecars_store(postgres_url)

    def problems() -> dict[str, str]:
        lines = sidecar.log.lines()
        return {line["index"]: line["error"] for line in lines if line["event"] == "store-index-not-built"}

    with psycopg.connect(dsn) as holder:
        holder.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema or "public")))
        # Conflicts with the build's own lock, not with reads or writes.
        holder.execute("LOCK TABLE actions, violations IN SHARE UPDATE EXCLUSIVE MODE")
        sidecar = start_sidecar(postgres_url + "&options=-c%20lock_timeout%3D200")
        wait_for(lambda: len(problems()) == len(INDEXES), timeout=20)
        holder.rollback()
    assert all("lock" in reason for reason in problems().values()), problems()
    assert sidecar.get("/healthz")[0] == 200
    with sidecar.service.store.writer() as writer:  # the store works without them
        writer.add_action(sessionless_row("a"), 1.0)
        assert writer.prune(2.0, 10).orphans == 1  # the same rows, only read without an index
    assert index_validity(postgres_url) == {}  # refused its lock before it made anything


@pytest.mark.postgres
def test_a_sidecar_logs_its_migration_and_the_indexes_it_built_without_the_password(
    postgres_url: str, start_sidecar: Any
) -> None:
    earlier_sidecars_store(postgres_url)
    pg(postgres_url, "DROP TABLE forgetting")  # a store of version 1
    pg(postgres_url, "UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    with_password = postgres_url.replace("://postgres@", "://postgres:s3cret-pw@")  # trust auth ignores it
    assert with_password != postgres_url
    sidecar = start_sidecar(with_password)
    wait_for(lambda: len([line for line in sidecar.log.lines() if line["event"] == "store-index"]) == 2)
    lines = sidecar.log.lines()
    built = {line["index"]: line["outcome"] for line in lines if line["event"] == "store-index"}
    assert built == dict.fromkeys(INDEXES, INDEX_BUILT)
    assert [line["from_version"] for line in lines if line["event"] == "store-migrated"] == ["1"]
    assert "s3cret-pw" not in json.dumps(lines)
