"""What only the PostgreSQL store has: several replicas sharing one database.

Each test opens two or more :class:`PostgresStore` objects on one schema — each is what
one sidecar replica holds — and drives them from threads, so the concurrency is real:
concurrent schema creation, a violation found by two replicas at once, outbox claims,
the idle sweep skipping a session another replica is writing, and a violation feed that
never moves past a transaction that commits later.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import psycopg
import psycopg.conninfo
import pytest
from conftest import kept_fed, wait_for, written
from durable_sessions_collector.evaluator import Evaluator, arrival
from durable_sessions_collector.store import (
    INDEX_BUILT,
    INDEX_FAILED,
    INDEX_LEFT_TO_ANOTHER,
    Alert,
    StoreError,
    action_row,
    open_store,
)
from durable_sessions_collector.store.base import cursor_position
from durable_sessions_collector.store.postgres import (
    IS_STORED,
    OLD_ACTIONS_KEY,
    SCHEMA_VERSION,
    SESSION_RECORDS,
    SESSION_RECORDS_PAGE,
    SQL,
    PostgresStore,
    split_url,
)
from postgres_support import held_transaction
from psycopg import sql

from durable_sessions.mapping import Mapped
from durable_sessions.record import Location
from durable_sessions.violation import Severity, Violation

pytestmark = pytest.mark.postgres


def violation(rule: str, session: str = "sess", span: str = "s1") -> Violation:
    return Violation(rule, Severity.ERROR, f"{rule} broken", session, "a1", trace_id="t" * 32, span_id=span)


def action(session: str, span: str, action_id: str, kind: str = "tool_call", **fields) -> Mapped:  # type: ignore[no-untyped-def]
    record = {"session_id": session, "action_id": action_id, "kind": kind, "status": "ok", **fields}
    return Mapped(record, Location(None, None, "t" * 32, span), [])  # type: ignore[arg-type]


def test_replicas_create_the_schema_once_concurrently(postgres_url: str) -> None:
    with ThreadPoolExecutor(6) as pool:
        stores = list(pool.map(lambda _: open_store(postgres_url), range(6)))
    dsn, schema = split_url(postgres_url)
    with psycopg.connect(dsn) as db:
        tables = {
            name
            for (name,) in db.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = %s", (schema,)
            )
        }
        assert tables == {
            "meta",
            "actions",
            "sessions",
            "violations",
            "outbox",
            "forgetting",
            "session_states",
            "violation_changes",
        }
        assert db.execute(f"SELECT value FROM {schema}.meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )
        db.execute(f"UPDATE {schema}.meta SET value = '99' WHERE key = 'schema_version'")
    for store in stores:
        store.close()
    with pytest.raises(StoreError, match="schema version 99"):
        open_store(postgres_url)


def test_a_version_1_store_gets_the_newer_tables_while_a_replica_writes(postgres_url: str) -> None:
    replica = open_store(postgres_url)
    dsn, schema = split_url(postgres_url)
    with psycopg.connect(dsn) as db:  # as version 1 left it
        db.execute(f"DROP TABLE {schema}.forgetting")
        db.execute(f"DROP TABLE {schema}.session_states")
        db.execute(f"DROP TABLE {schema}.violation_changes")
        db.execute(f"UPDATE {schema}.meta SET value = '1' WHERE key = 'schema_version'")
    with replica.writer() as writer:  # a replica of version 1, inside a write transaction
        writer.add_action(action_row({"session_id": "s", "status": "ok"}, "t" * 32, "a"), 1.0)
        upgraded = open_store(postgres_url)  # not blocked by it
    assert upgraded.migrated_from == "1"
    with psycopg.connect(dsn) as db:
        assert db.execute(f"SELECT value FROM {schema}.meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )
        assert db.execute(f"SELECT to_regclass('{schema}.session_states')").fetchone() != (None,)
        assert db.execute(f"SELECT to_regclass('{schema}.violation_changes')").fetchone() != (None,)
    assert upgraded.count_actions() == 1  # type: ignore[attr-defined]
    again = open_store(postgres_url)
    assert again.migrated_from is None
    for store in (replica, upgraded, again):
        store.close()


def test_a_version_3_store_gets_the_feed_of_changes_and_its_cursors_still_resume(postgres_url: str) -> None:
    store = open_store(postgres_url)
    effect = Violation(
        "unresolved-side-effect", Severity.ERROR, "m", "sess", "a1", trace_id="t" * 32, span_id="s2"
    )
    other = Violation("re-asked", Severity.ERROR, "m", "sess", "a1", trace_id="t" * 32, span_id="s1")
    start = store.violation_cursor()
    with store.writer() as writer:
        writer.touch_session("sess", 1.0, 1)
        writer.add_violation(other, at_end=False, now=1.0)
    [first] = [item["cursor"] for item in store.violations_after(start)[0]]
    with store.writer() as writer:
        writer.add_violation(effect, at_end=True, now=1.0)
    store.close()
    dsn, schema = split_url(postgres_url)
    with psycopg.connect(dsn) as db:  # as version 3 left it
        db.execute(f"DROP TABLE {schema}.violation_changes")
        db.execute(f"UPDATE {schema}.meta SET value = '3' WHERE key = 'schema_version'")
    assert first.count(":") == 2  # a violation's cursor is version 3's pg:XID:ID
    store = open_store(postgres_url)
    assert store.migrated_from == "3"
    with store.writer() as writer:
        writer.resolve_end_violations("sess", set(), now=2.0)
    items, after = store.violations_after(first)
    assert [(i["rule"], i["status"], i["detected_at"]) for i in items] == [
        ("unresolved-side-effect", "firing", 1.0),
        ("unresolved-side-effect", "resolved", 2.0),
    ]
    assert after.count(":") == 3 and store.violations_after(after) == ([], after)
    store.close()
    with psycopg.connect(dsn) as db:
        assert db.execute(f"SELECT value FROM {schema}.meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )


def in_schema(dsn: str, schema: str | None) -> psycopg.Connection[Any]:
    """An autocommit connection to ``dsn`` whose unqualified names are ``schema``'s."""
    db = psycopg.connect(dsn, autocommit=True)
    db.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema or "public")))
    return db


def actions_key(db: psycopg.Connection[Any]) -> tuple[bool | None, bool]:
    """Whether the version 5 key's index is valid (None: absent), and whether the
    version 1-4 constraint is still there."""
    valid = db.execute(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('actions_by_session_span')"
    ).fetchone()
    old = db.execute(
        "SELECT 1 FROM pg_constraint WHERE conrelid = 'actions'::regclass AND conname = %s",
        (OLD_ACTIONS_KEY,),
    ).fetchone()
    return (None if valid is None else bool(valid[0])), old is not None


def test_a_version_4_store_gets_the_sqlite_key_built_by_one_of_several_replicas_keeping_its_rows(
    postgres_url: str,
) -> None:
    store = open_store(postgres_url)
    rows = [
        action_row({"session_id": "sess", "status": "ok"}, "t" * 32, "s1"),
        action_row({"session_id": "sess", "status": "ok"}, "t" * 32, "s2"),
        action_row({"status": "ok"}, "f" * 32, "s1"),  # of no session
    ]
    with store.writer() as writer:
        for row in rows:
            assert writer.add_action(row, 1.0)
    store.close()
    dsn, schema = split_url(postgres_url)
    with in_schema(dsn, schema) as db:  # as version 4 left it: UNIQUE (trace_id, span_id, status)
        db.execute("DROP INDEX actions_by_session_span")
        db.execute("ALTER TABLE actions ADD UNIQUE (trace_id, span_id, status)")
        db.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
        assert actions_key(db) == (None, True)
        before = db.execute("SELECT * FROM actions ORDER BY id").fetchall()
    reports: list[tuple[str, str, str | None]] = []

    def start(_: int) -> Any:  # one replica's start: open, then build in the background
        replica = open_store(postgres_url)
        builder = replica.build_indexes(lambda *report: reports.append(report))
        return replica, builder

    with ThreadPoolExecutor(4) as pool:
        replicas = list(pool.map(start, range(4)))
    for _, builder in replicas:
        if builder is not None:
            builder.join(30)
    assert sorted(replica.migrated_from or "" for replica, _ in replicas) == ["", "", "", "4"]
    assert {index for index, _, _ in reports} == {"actions_by_session_span"}
    assert {outcome for _, outcome, _ in reports} <= {INDEX_BUILT, INDEX_LEFT_TO_ANOTHER}
    assert (INDEX_BUILT, None) in [(outcome, error) for _, outcome, error in reports]
    with in_schema(dsn, schema) as db:
        assert actions_key(db) == (True, False)
        assert db.execute("SELECT * FROM actions ORDER BY id").fetchall() == before  # rows and ids
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
            str(SCHEMA_VERSION),
        )
    replica = replicas[0][0]
    with replica.writer() as writer:
        assert [writer.add_action(row, 2.0) for row in rows] == [False, False, False]  # redelivered
        moved = action_row({"session_id": "other", "status": "ok"}, "t" * 32, "s1")
        assert writer.is_stored(rows[0]) and not writer.is_stored(moved)
        assert writer.add_action(moved, 2.0)  # the same ids and status in another session
    assert replica.count_actions() == 4  # type: ignore[attr-defined]
    for replica, _ in replicas:
        replica.close()
    again = open_store(postgres_url)
    assert again.migrated_from is None and again.build_indexes(lambda *_: None) is None  # nothing left to do
    again.close()


def test_the_old_key_is_dropped_at_a_later_start_when_its_lock_was_refused(postgres_url: str) -> None:
    open_store(postgres_url).close()
    dsn, schema = split_url(postgres_url)
    with in_schema(dsn, schema) as db:  # the new key built, the old one not yet dropped
        db.execute("ALTER TABLE actions ADD UNIQUE (trace_id, span_id, status)")
    with in_schema(dsn, schema) as holder:
        # Any transaction on the table holds the exclusive lock the drop needs back.
        holder.execute("BEGIN")
        holder.execute("SELECT count(*) FROM actions")
        refused = open_store(postgres_url + "&options=-c%20lock_timeout%3D200")
        reports: list[tuple[str, str, str | None]] = []
        builder = refused.build_indexes(lambda *report: reports.append(report))
        assert builder is not None
        builder.join(30)
        holder.execute("ROLLBACK")
        assert [(index, outcome) for index, outcome, _ in reports] == [
            ("actions_by_session_span", INDEX_FAILED)
        ]
        assert "lock" in str(reports[0][2])
        assert actions_key(holder) == (True, True)  # the old key drops a superset meanwhile
        with refused.writer() as writer:
            assert writer.add_action(action_row({"session_id": "a", "status": "ok"}, "t" * 32, "s"), 1.0)
            assert not writer.add_action(action_row({"session_id": "b", "status": "ok"}, "t" * 32, "s"), 1.0)
        refused.close()
        reports.clear()
        later = open_store(postgres_url)
        builder = later.build_indexes(lambda *report: reports.append(report))
        assert builder is not None
        builder.join(30)
        assert reports == [("actions_by_session_span", INDEX_BUILT, None)]
        assert actions_key(holder) == (True, False)
        with later.writer() as writer:
            assert writer.add_action(action_row({"session_id": "b", "status": "ok"}, "t" * 32, "s"), 1.0)
        later.close()


def test_session_reads_and_the_redelivery_look_up_read_through_an_index(postgres_url: str) -> None:
    open_store(postgres_url).close()
    dsn, schema = split_url(postgres_url)
    with in_schema(dsn, schema) as db:
        # Enough rows that a sequential scan is not the cheaper plan: 20,000 over 1,000 sessions.
        db.execute(
            "INSERT INTO actions (session_id, trace_id, span_id, status, seq, received_at, record) "
            "SELECT 's' || i % 1000, md5(i::text), 'span', 'ok', i, i, '{}' FROM generate_series(1, 20000) i"
        )
        db.execute("ANALYZE actions")
        reads = {
            "session_actions": (SQL.session_actions, ("s7", "s7", 101)),
            "session_actions_after": (SQL.session_actions_after, ("s7", "s7", 5, 5, 101)),
            "count_kept": (SQL.count_kept, ("s7", "s7", 10**6)),
            "keep_state": (SQL.keep_state, ("s7", 1, b"state", "s7", "s7")),  # its max(id)
            "forget_session": (SQL.forget_session, ("s7", "s7")),
            "session_records": (SESSION_RECORDS, ("s7", "s7", 0, SESSION_RECORDS_PAGE)),
            "is_stored": (IS_STORED, ("s7", "0" * 32, "span", "ok")),
        }
        plans = {
            name: "\n".join(line for (line,) in db.execute("EXPLAIN " + statement, params))
            for name, (statement, params) in reads.items()
        }
    expected = dict.fromkeys(reads, "actions_by_session") | {"is_stored": "actions_by_session_span"}
    for name, index in expected.items():
        assert re.search(rf"\b(?:using|on) {index}\b", plans[name]), plans[name]


def test_libpq_parameters_of_the_url_reach_the_server_as_written(postgres_url: str) -> None:
    # A space in a URI is %20; re-encoded as "+", libpq would read "+" (not a space) and
    # the server would refuse the connection ("unrecognized configuration parameter").
    url = postgres_url + "&options=-c%20statement_timeout%3D4321"
    assert "options=-c%20statement_timeout%3D4321" in split_url(url)[0]
    store = open_store(url)
    with store.writer() as writer:
        assert writer._db.execute("SHOW statement_timeout").fetchone() == ("4321ms",)  # type: ignore[attr-defined]
    store.close()


def test_a_store_that_cannot_be_opened_keeps_no_connection(postgres_url: str) -> None:
    # An administrative command on a schema with no store, and a sidecar on a store of a
    # newer version, are refused; the connection that found out is closed, not left open
    # for as long as the error (and its traceback) is kept, by a caller that logs or
    # retries, on a server whose connections are few.
    name = f"ds-open-{time.monotonic_ns()}"
    url = postgres_url + f"&application_name={name}"
    with pytest.raises(StoreError, match="no store in") as missing:
        PostgresStore(url, existing=True)
    open_store(url).close()
    with psycopg.connect(split_url(url)[0], autocommit=True) as admin:
        admin.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(split_url(url)[1])))
        admin.execute("UPDATE meta SET value = %s WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
        with pytest.raises(StoreError, match="newer") as newer:
            PostgresStore(url)

        def sessions() -> int:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()",
                (name,),
            ).fetchone()
            return int(row[0]) if row else 0

        # A closed connection's backend leaves pg_stat_activity once it has read the
        # client's Terminate, a moment after the close: one left open stays, as long as
        # the errors (whose tracebacks would hold it) are kept, here to the end.
        wait_for(lambda: sessions() == 0, timeout=5)
    assert missing.value is not None and newer.value is not None


def tcp_options(connection: psycopg.Connection[Any]) -> tuple[int, int, int, int]:
    """The connection's socket's keepalive idle time, interval, count (s) and user timeout (ms)."""
    with socket.socket(fileno=os.dup(connection.fileno())) as sock:
        return tuple(  # type: ignore[return-value]
            sock.getsockopt(socket.IPPROTO_TCP, option)
            for option in (
                socket.TCP_KEEPIDLE,
                socket.TCP_KEEPINTVL,
                socket.TCP_KEEPCNT,
                socket.TCP_USER_TIMEOUT,
            )
        )


def assert_connection_options(
    postgres_url: str,
    options_of: Callable[[psycopg.Connection[Any]], tuple[Any, ...]],
    defaults: tuple[Any, ...],
    from_url: tuple[Any, ...],
) -> None:
    """The store's write and read connections have ``defaults`` as ``options_of`` reads
    them; with the four libpq parameters set in the URL, they win (``from_url``)."""
    if not urlsplit(postgres_url).hostname:
        pytest.skip("the test server is reached over a Unix socket: no TCP options")
    store = open_store(postgres_url)
    try:
        with store.writer() as writer:
            assert options_of(writer._db) == defaults  # type: ignore[attr-defined]
        with store.readers.lend() as reader:  # type: ignore[attr-defined]
            assert options_of(reader) == defaults
    finally:
        store.close()
    store = open_store(
        postgres_url + "&keepalives_idle=7&keepalives_interval=2&keepalives_count=5&tcp_user_timeout=9000"
    )
    try:
        with store.writer() as writer:
            assert options_of(writer._db) == from_url  # type: ignore[attr-defined]
    finally:
        store.close()


def test_a_connection_whose_server_vanished_is_given_up_within_a_minute(postgres_url: str) -> None:
    # A server host that vanished (powered off, failed over to another host behind the same
    # address, cut off by a partition) sends no reset: a read or write waiting on it waited
    # for the operating system's defaults, 2 h of silence before the first keepalive probe,
    # and about 15 min of retransmissions for a query unacknowledged. Meanwhile the writer
    # committed nothing, and Exports were refused, long after the store was back. Every
    # connection of the store now gives up after 30 s of silence and 3 probes 10 s apart,
    # or 60 s of unacknowledged data, and is replaced.
    assert_connection_options(postgres_url, tcp_options, (30, 10, 3, 60_000), (7, 2, 5, 9000))


def server_tcp_options(connection: psycopg.Connection[Any]) -> tuple[str, ...]:
    """What the server's side of the connection's socket gives up after (as SHOW says)."""
    return tuple(
        str(connection.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()[0])  # type: ignore[index]
        for name in (
            "tcp_keepalives_idle",
            "tcp_keepalives_interval",
            "tcp_keepalives_count",
            "tcp_user_timeout",
        )
    )


def test_the_server_gives_up_a_replica_whose_host_vanished_within_a_minute(postgres_url: str) -> None:
    # The other side of the test above: a replica's host that vanished in a transaction
    # (a node powered off while the load balancer moved its sessions to the others) sent
    # the server no reset either. Its backend kept the transaction, and with it the
    # sessions' advisory locks, for the server's defaults (2 h of silence before the first
    # keepalive probe): every other replica writing one of those sessions waited in
    # pg_advisory_xact_lock meanwhile, its writer committing nothing. The server's side of
    # each connection now gives up as the sidecar's side does.
    assert_connection_options(
        postgres_url, server_tcp_options, ("30", "10", "3", "60000"), ("7", "2", "5", "9000")
    )


def sessions_locked_per_transaction(monkeypatch: pytest.MonkeyPatch, *, bound: int) -> list[int]:
    """With at most ``bound`` sessions locked by one write transaction (made small, so as
    not to fill the shared test server's lock table), the number each transaction locks,
    as the sidecar's PostgreSQL writer locks them."""
    from durable_sessions_collector import pipeline
    from durable_sessions_collector.store.postgres import PostgresWriter

    monkeypatch.setattr(pipeline, "MAX_LOCKED_SESSIONS", bound)
    locked: list[int] = []
    lock_sessions = PostgresWriter.lock_sessions

    def counted(writer: PostgresWriter, session_ids: Any) -> Any:
        locked.append(len(session_ids))
        return lock_sessions(writer, session_ids)

    monkeypatch.setattr(PostgresWriter, "lock_sessions", counted)
    return locked


def test_a_batch_of_many_sessions_is_written_in_parts_that_lock_a_bounded_number(
    start_sidecar, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # Each session a write locks is an entry of the server's lock table, which every
    # transaction on the server shares (6,400 by default): a batch of many one-span
    # sessions (a Collector's batch of 8,192 spans) locked them all in one transaction and
    # failed with "out of shared memory" (SQLSTATE 53200), again at every retry. The bound
    # is made small here so as not to fill the test server's table.
    import grpc
    from opentelemetry.proto.common.v1.common_pb2 import KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span
    from sidecar_clients import any_value, export_call, request_of

    locked = sessions_locked_per_transaction(monkeypatch, bound=4)
    sidecar = start_sidecar(postgres_url, evaluation__idle_s=60)

    def span(n: int, session: str) -> Span:
        attributes = {"session.id": session, "agent.action.id": f"a{n}", "agent.action.kind": "tool_call"}
        return Span(
            trace_id=bytes([3] * 15 + [n]),
            span_id=bytes([5] * 7 + [n]),
            name=f"action {n}",
            start_time_unix_nano=1_700_000_000_000_000_000 + n,
            end_time_unix_nano=1_700_000_000_000_000_000 + n + 1,
            attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()],
        )

    def export(*spans: Span) -> None:
        with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
            response = export_call(channel)(request_of(*spans).SerializeToString(), timeout=20)
        assert not response.HasField("partial_success")

    # One request: 10 sessions, the first with a span at its start and one at its end.
    export(*([span(0, "s0")] + [span(n, f"s{n}") for n in range(1, 10)] + [span(10, "s0")]))
    # Three requests of 3 sessions each, queued while the writer waits: one batch of 9.
    writes = sidecar.service.pipeline
    with held_transaction(sidecar.service.store, lambda writer: None):
        first = writes.submit([arrival(action("first", "f1", "a1"))], "test")
        wait_for(lambda: writes.queue.qsize() == 0)  # the writer took it, and waits
        jobs = [
            writes.submit([arrival(action(f"r{r}-{k}", f"p{r}{k}", "a1")) for k in range(3)], "test")
            for r in range(3)
        ]
        assert writes.queue.qsize() == 3
    for job in (first, *jobs):
        assert writes.wait(job).stored == len(job.items)
    assert locked and max(locked) <= 4
    stored = {s["session_id"]: s["actions"] for s in sidecar.get("/api/sessions?limit=100")[1]["sessions"]}
    assert stored == {
        "s0": 2,
        **{f"s{n}": 1 for n in range(1, 10)},
        "first": 1,
        **{f"r{r}-{k}": 1 for r in range(3) for k in range(3)},
    }
    assert [a["action_id"] for a in sidecar.session("s0")["actions"]] == ["a0", "a10"]


def test_the_states_kept_at_a_stop_lock_a_bounded_number_of_sessions_at_once(
    start_sidecar, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # A stop keeps the state of every long session held (up to evaluation.max_sessions,
    # 10,000) and locked them all in one transaction: past the server's lock table it
    # failed, and the next start re-fed every one of them. Bounded as a write batch is.
    locked = sessions_locked_per_transaction(monkeypatch, bound=1)
    sidecar = start_sidecar(postgres_url, evaluation__idle_s=60)
    writes = sidecar.service.pipeline
    # Kept after 2 records, then not kept again before 2 more: each of the 3 has 1 unkept.
    writes.evaluator.keep_state_after = 2
    for session in ("a", "b", "c"):
        for n in range(3):
            writes.wait(writes.submit([arrival(action(session, f"{session}{n}", f"x{n}"))], "test"))
    assert sorted(writes.evaluator.unkept()) == ["a", "b", "c"]
    locked.clear()
    sidecar.stop()
    assert locked == [1, 1, 1]
    kept = [line["sessions"] for line in sidecar.log.lines() if line.get("event") == "session-states-kept"]
    assert kept == [3]


def test_a_recount_of_verdicts_locks_a_bounded_number_of_sessions_at_once(
    start_sidecar, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    # A step of a recount looked through 2,000 sessions and locked every one with a
    # finding of the changed rules in one transaction: twice the bound a write batch
    # keeps to, enough with a few replicas at it to fill the server's lock table.
    from sidecar_clients import Agent, grpc_exporter

    sessions = [f"d{n}" for n in range(5)]
    sidecar = start_sidecar(postgres_url, evaluation__idle_s=3600, evaluation__strict=True)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for session_id in sessions:  # a failed tool call: a dead end only strict finds
        agent.action(session_id, "t1", "tool_call", error=True)
    agent.shutdown()
    sidecar.stop()
    locked = sessions_locked_per_transaction(monkeypatch, bound=2)
    sidecar = start_sidecar(postgres_url, evaluation__idle_s=3600)
    (done,) = wait_for(
        lambda: [line for line in sidecar.log.lines() if line.get("event") == "verdict-recount-done"]
    )
    assert done["sessions"] == 5
    assert sum(locked) == 5 and max(locked) <= 2
    assert sidecar.service.store.verdict_counts()["ok"] == 5


def test_split_url_cuts_out_the_schema_and_passes_the_rest_as_written() -> None:
    assert split_url("postgresql:///db?host=/run/pg&schema=s1&user=app") == (
        "postgresql:///db?host=/run/pg&user=app",
        "s1",
    )
    assert split_url("postgresql:///db") == ("postgresql:///db", None)
    assert split_url("postgresql://app@h/db?schema=s1") == ("postgresql://app@h/db", "s1")
    # "+" is itself to libpq (a base64 password), and %2F / %20 stay encoded.
    assert split_url("postgresql://app@h/ds?password=Zm9v+YmFy%2F9%3D&schema=s&application_name=a%20b") == (
        "postgresql://app@h/ds?password=Zm9v+YmFy%2F9%3D&application_name=a%20b",
        "s",
    )


def test_a_url_with_an_empty_host_part_and_a_plus_reaches_the_server_as_written(postgres_url: str) -> None:
    dsn, schema = split_url(postgres_url)
    server = psycopg.conninfo.conninfo_to_dict(dsn)
    name = f"ds+{schema}"  # what the server sees must be the URL's "+", not a space
    url = (
        f"postgresql:///{server['dbname']}?host={server.get('host', '')}&port={server.get('port', 5432)}"
        f"&user={server.get('user', '')}&application_name={name}&schema={schema}"
    )
    store = open_store(url)
    try:
        with store.writer() as writer:
            assert writer._db.execute("SHOW application_name").fetchone() == (name,)  # type: ignore[attr-defined]
            assert writer._db.execute("SELECT current_schema()").fetchone() == (schema,)  # type: ignore[attr-defined]
    finally:
        store.close()


def test_a_role_that_owns_its_schema_starts_without_create_on_the_database(postgres_url: str) -> None:
    dsn, schema = split_url(postgres_url)
    server = psycopg.conninfo.conninfo_to_dict(dsn)
    role = f"{schema}_app"  # the schema is the test's own, so is this role's name
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        try:
            admin.execute(
                sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                    sql.Identifier(schema), sql.Identifier(role)
                )
            )
            assert admin.execute(
                "SELECT has_database_privilege(%s, current_database(), 'CREATE')", (role,)
            ).fetchone() == (False,)
            url = (
                f"postgresql://{role}@{server.get('host', '')}:{server.get('port', 5432)}/{server['dbname']}"
                f"?schema={schema}"
            )
            for _ in range(2):  # creating the tables, then finding them
                store = open_store(url)
                with store.writer() as writer:
                    writer.touch_session("s", 1.0, 1)
                sessions = store.list_sessions()
                store.close()
            assert sessions[0].actions == 2
        finally:
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_a_violation_found_by_two_replicas_is_new_in_one(postgres_url: str) -> None:
    first, second = open_store(postgres_url), open_store(postgres_url)
    results: dict[str, bool] = {}

    def replica_a(writer: Any) -> None:
        results["a"] = writer.add_violation(violation("re-asked"), at_end=False, now=1.0)
        writer.enqueue_alert("log", violation("re-asked").key, {"key": "k"}, 1.0)

    with held_transaction(first, replica_a) as release:
        waited = time.monotonic()
        threading.Timer(0.3, release.set).start()
        with second.writer() as writer:  # blocks on A's uncommitted row, then finds it stored
            results["b"] = writer.add_violation(violation("re-asked"), at_end=False, now=1.0)
    assert time.monotonic() - waited >= 0.25
    assert results == {"a": True, "b": False}
    assert first.alert_counts() == {("log", "pending"): 1}
    first.close()
    second.close()


def test_outbox_rows_are_claimed_by_one_replica(postgres_url: str) -> None:
    stores = [open_store(postgres_url) for _ in range(3)]
    with stores[0].writer() as writer:
        for n in range(60):
            writer.enqueue_alert("webhook", f"k{n}", {"key": f"k{n}"}, 1.0)
    barrier = threading.Barrier(3)

    def claim(store: PostgresStore) -> list[Alert]:
        barrier.wait()
        got: list[Alert] = []
        while batch := store.pending_alerts("webhook", now=10.0, limit=7):
            got.extend(batch)
        return got

    with ThreadPoolExecutor(3) as pool:
        claimed = list(pool.map(claim, stores))
    every = [alert for alerts in claimed for alert in alerts]
    assert len(every) == len({alert.id for alert in every}) == 60  # each row claimed exactly once
    # Claimed rows wait for their lease; one left undelivered comes back after it.
    with stores[1].writer() as writer:
        writer.mark_delivered(every[:59], 11.0)
    assert stores[2].pending_alerts("webhook", now=12.0) == []
    [again] = stores[2].pending_alerts("webhook", now=10.0 + stores[2].claim_lease_s + 1)
    assert again.id == every[59].id
    for store in stores:
        store.close()


def test_a_replica_whose_claim_ran_out_neither_sends_nor_marks_the_alert(postgres_url: str) -> None:
    stale, current = open_store(postgres_url), open_store(postgres_url)
    with stale.writer() as writer:
        writer.enqueue_alert("webhook", "k", {"key": "k"}, 1.0)
    [first] = stale.pending_alerts("webhook", now=10.0)
    # The stale replica was busy with other rows past the lease; the other claimed the row.
    [second] = current.pending_alerts("webhook", now=10.0 + stale.claim_lease_s + 1)
    assert stale.hold_alert(first, now=second.claim - current.claim_lease_s, attempt_s=5.0) is None
    stale.release_alerts([first], 70.0)  # a stale replica stopping: the row is not its to give back
    held = current.hold_alert(second, now=second.claim - current.claim_lease_s, attempt_s=5.0)
    assert held is not None and held.claim is not None and held.claim > second.claim
    with current.writer() as writer:
        writer.mark_delivered([held], 80.0)
    # What the stale replica would mark after an attempt of its own changes nothing.
    with stale.writer() as writer:
        writer.mark_failed(first, "HTTP 400", None)
    assert stale.alert_counts() == {("webhook", "delivered"): 1}
    with stale.writer() as writer:
        writer.mark_failed(first, "HTTP 503", 85.0)
        writer.mark_delivered([first], 81.0)
    dsn, schema = split_url(postgres_url)
    with psycopg.connect(dsn) as db:
        row = db.execute(f"SELECT state, attempts, delivered_at, last_error FROM {schema}.outbox").fetchone()
    assert row == ("delivered", 1, 80.0, None)
    # A renewal ended by the mark: a stale hold of the delivered row finds nothing either.
    assert current.hold_alert(held, now=90.0, attempt_s=5.0) is None
    stale.close()
    current.close()


def test_times_read_back_are_the_times_written_whatever_the_servers_float_output(postgres_url: str) -> None:
    # A server (or its role, or database) whose extra_float_digits is 0 writes a float8 as
    # text in 15 digits: an epoch time read back lost its last microseconds. A claim then
    # never matched its row: hold_alert said another replica had it (a webhook alert was
    # never sent), mark_delivered marked nothing (the log channel wrote it again after each
    # lease), and every session's first_seen differed from the one held (rebuilt each batch).
    store = open_store(f"{postgres_url}&options=-c%20extra_float_digits%3D0")
    try:
        now = 1764700000.1234567  # 17 significant digits, as time.time() gives them
        with store.writer() as writer:
            writer.enqueue_alert("webhook", "k", {"key": "k"}, now)
            writer.touch_session("sess", now, 1)
        [claimed] = store.pending_alerts("webhook", now)
        assert claimed.claim == now + store.claim_lease_s
        held = store.hold_alert(claimed, now, attempt_s=5.0)
        assert held is not None
        with store.writer() as writer:
            assert writer.lock_sessions(["sess"])["sess"].first_seen == now
            writer.mark_delivered([held], now)
        assert store.alert_counts() == {("webhook", "delivered"): 1}
        assert [s.last_seen for s in store.list_sessions()] == [now]
    finally:
        store.close()


def test_idle_sweep_skips_a_session_another_replica_is_writing(postgres_url: str) -> None:
    first, second = open_store(postgres_url), open_store(postgres_url)
    with first.writer() as writer:
        writer.touch_session("busy", 1.0, 1)
        writer.touch_session("quiet", 1.0, 1)
    with held_transaction(first, lambda writer: writer.lock_sessions(["busy"])), second.writer() as writer:
        assert writer.idle_sessions(5.0, 10) == ["quiet"]
        writer.end_session("quiet", 5.0)
    with second.writer() as writer:
        assert writer.idle_sessions(5.0, 10) == ["busy"]
    first.close()
    second.close()


def test_the_feed_does_not_pass_a_transaction_that_commits_later(postgres_url: str) -> None:
    first, second = open_store(postgres_url), open_store(postgres_url)
    cursor = first.violation_cursor()
    # "slow" begins first (the older transaction id) and commits last.
    with held_transaction(
        first, lambda writer: writer.add_violation(violation("slow", "s-slow"), at_end=False, now=1.0)
    ):
        with second.writer() as writer:
            writer.add_violation(violation("fast", "s-fast"), at_end=False, now=1.0)
        items, held = second.violations_after(cursor)
        assert items == [] and held == cursor  # "fast" waits until "slow" is decided
    items, _ = second.violations_after(cursor)
    assert [item["rule"] for item in items] == ["slow", "fast"]
    first.close()
    second.close()


def test_the_feed_does_not_pass_a_change_that_commits_later(postgres_url: str) -> None:
    """A resolution written by a transaction that began first and commits last is given
    before what a later transaction resolved or found, never skipped by a cursor past them."""
    first, second = open_store(postgres_url), open_store(postgres_url)
    with first.writer() as writer:
        for session in ("a", "b"):
            writer.touch_session(session, 1.0, 1)
            writer.add_violation(violation("unresolved-side-effect", session), at_end=True, now=1.0)
    cursor = first.violation_cursor()
    # "a" is resolved with the older transaction id, and the first change id: it commits last.
    with held_transaction(first, lambda writer: writer.resolve_end_violations("a", set(), now=2.0)):
        with second.writer() as writer:
            writer.resolve_end_violations("b", set(), now=3.0)
            writer.add_violation(violation("fast", "b", "s-fast"), at_end=False, now=3.0)
        assert second.violations_after(cursor) == ([], cursor)  # both wait until "a" is decided
    items, _ = second.violations_after(cursor)
    assert [(item["session_id"], item["rule"], item["status"]) for item in items] == [
        ("a", "unresolved-side-effect", "resolved"),
        ("b", "fast", "firing"),  # a transaction's new violations, then its changes
        ("b", "unresolved-side-effect", "resolved"),
    ]
    first.close()
    second.close()


def test_the_feed_is_not_held_back_by_a_transaction_that_writes_no_violation(postgres_url: str) -> None:
    # The feed waited for every transaction of the cluster that had a transaction id: an
    # application's session left idle in a transaction stalled every WatchAlerts stream.
    store = open_store(postgres_url)
    dsn, schema = split_url(postgres_url)
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f"CREATE TABLE {schema}.other_app (n INTEGER)")
    cursor = store.violation_cursor()
    with psycopg.connect(dsn) as other:
        other.execute(f"INSERT INTO {schema}.other_app VALUES (1)")  # open, with a transaction id
        with store.writer() as writer:
            writer.add_violation(violation("during", "s-during"), at_end=False, now=1.0)
        items, cursor = store.violations_after(cursor)
        assert [item["rule"] for item in items] == ["during"]
        [start, during] = (cursor_position(c, "pg", 2)[0] for c in (store.violation_cursor(), cursor))
        assert start > during  # a new watcher starts after it too
    # One that has touched a table of the store may still write a violation: it holds the feed.
    with psycopg.connect(dsn) as other:
        other.execute(f"SELECT count(*) FROM {schema}.sessions").fetchone()
        other.execute(f"INSERT INTO {schema}.other_app VALUES (2)")
        with store.writer() as writer:
            writer.add_violation(violation("after", "s-after"), at_end=False, now=2.0)
        assert store.violations_after(cursor) == ([], cursor)
    items, _ = store.violations_after(cursor)
    assert [item["rule"] for item in items] == ["after"]
    store.close()


def test_two_evaluators_judge_one_session_as_one(postgres_url: str) -> None:
    """Spans of one session alternate between replicas; each rebuilds what the other added."""
    stores = [open_store(postgres_url), open_store(postgres_url)]
    evaluators = [Evaluator(), Evaluator()]
    steps = [
        action("trip", "p1", "c1", "tool_call"),
        action("trip", "p2", "pay1", "payment", idempotency_key="K"),
        action("trip", "p3", "pay2", "payment", idempotency_key="K"),
    ]
    found: list[str] = []
    for n, mapped in enumerate(steps):
        store, evaluator = stores[n % 2], evaluators[n % 2]
        with store.writer() as writer:
            stored = writer.lock_sessions(["trip"])
            evaluator.forget_stale(stored)
            added, violations = evaluator.ingest(writer, arrival(mapped), float(n))
            assert added
            writer.touch_session("trip", float(n), 1)
            found += [v.rule for v in violations if writer.add_violation(v, at_end=False, now=float(n))]
    # Replica 0 held the session since step 1; the shared key of step 3 is only found if
    # it notices step 2 (written by replica 1) and rebuilds the session from the store.
    assert found == ["shared-key"]
    assert (evaluators[0].rebuilt, evaluators[1].rebuilt) == (1, 1)
    for store in stores:
        store.close()


def test_a_session_pruned_and_started_afresh_is_rebuilt_by_a_replica_holding_it(postgres_url: str) -> None:
    """Replica B holds S (one action); A ends and prunes S, and a span starts S afresh on
    A: one action again, as B held. B must still drop what it held (the deleted action)."""
    a, b = open_store(postgres_url), open_store(postgres_url)
    on_a, on_b = Evaluator(), Evaluator()

    def write(store: PostgresStore, evaluator: Evaluator, mapped: Mapped, now: float) -> list[str]:
        with store.writer() as writer:
            evaluator.forget_stale(writer.lock_sessions(["S"]))
            added, violations = evaluator.ingest(writer, arrival(mapped), now)
            assert added
            writer.touch_session("S", now, 1)
            return [v.rule for v in violations if writer.add_violation(v, at_end=False, now=now)]

    assert write(b, on_b, action("S", "p1", "pay1", "payment", idempotency_key="K-1"), 1.0) == []
    with a.writer() as writer:
        writer.end_session("S", 2.0)
    with a.writer() as writer:
        assert writer.prune(100.0, 10).sessions == ["S"]
    assert write(a, on_a, action("S", "x1", "c1"), 200.0) == []
    # Without telling the rows apart, B judged this against the deleted pay1: shared-key.
    assert write(b, on_b, action("S", "p2", "pay2", "payment", idempotency_key="K-1"), 201.0) == []
    assert on_b.rebuilt == 1
    for store in (a, b):
        store.close()


def test_an_evicted_session_s_state_does_not_replace_a_newer_one_another_replica_kept(
    postgres_url: str,
) -> None:
    # A replica evicting a session from its memory kept its state without the session's
    # lock, the session being no span's of the batch: a replica holding an older state
    # than another had kept replaced that one, and the store held none that fits.
    a, b = open_store(postgres_url), open_store(postgres_url)
    on_a, on_b = Evaluator(max_sessions=1, keep_state_after=1), Evaluator(keep_state_after=1)
    written(a, on_a, *(action("S", f"p{n}", f"c{n}") for n in range(5)))
    assert kept_fed(a, "S") == 4  # kept at 1, 2, 3 and 4 records; the fifth is unkept
    written(b, on_b, action("S", "p5", "c5"))  # rebuilt from it, and kept at 6
    assert kept_fed(a, "S") == 6
    written(a, on_a, action("T", "q0", "d0"))  # evicts S, whose state it holds after 5
    assert kept_fed(a, "S") == 6
    for store in (a, b):
        store.close()


def test_an_evicted_session_s_state_is_not_kept_for_the_session_started_afresh(postgres_url: str) -> None:
    # A holds S; B ends and deletes it, and spans start it afresh, as many as A holds.
    # A's eviction then kept the state of the deleted S, which fit the new one's records:
    # a replica rebuilding S restored it, and judged the new S against the old one.
    a, b = open_store(postgres_url), open_store(postgres_url)
    on_a = Evaluator(max_sessions=1, keep_state_after=1)
    old = [action("S", "p1", "pay1", "payment", idempotency_key="K-1")]
    written(a, on_a, *old, *(action("S", f"p{n}", f"c{n}") for n in range(2, 6)))  # 5, kept at 4
    with b.writer() as writer:
        writer.end_session("S", 2.0)
    with b.writer() as writer:
        assert writer.prune(100.0, 10).sessions == ["S"]
    assert written(b, Evaluator(), *(action("S", f"x{n}", f"d{n}") for n in range(5)), now=200.0) == []
    written(a, on_a, action("T", "q0", "e0"), now=201.0)  # evicts S, whose state it holds after 5
    assert kept_fed(a, "S") is None
    fresh = written(b, Evaluator(), action("S", "x5", "pay2", "payment", idempotency_key="K-1"), now=202.0)
    assert fresh == []  # the deleted S's pay1 used K-1, not this S
    for store in (a, b):
        store.close()


def test_text_with_nul_and_a_bad_server_are_handled(postgres_url: str) -> None:
    store = open_store(postgres_url)
    with store.writer() as writer:  # NUL outside the id columns: in the record (JSON) and a message
        row = action_row(
            {"session_id": "se\ufffdss", "idempotency_key": "k\x00", "status": "ok"}, "t" * 32, "s1"
        )  # type: ignore[typeddict-item]
        assert writer.add_action(row, 1.0)
        writer.touch_session("se\ufffdss", 1.0, 1)
        nul = Violation("r", Severity.ERROR, "bad \x00", "se\ufffdss", "a1", trace_id="t" * 32, span_id="s1")
        assert writer.add_violation(nul, at_end=False, now=1.0)
    detail = store.get_session("se\ufffdss")
    assert detail is not None and detail.actions[0]["idempotency_key"] == "k\x00"  # the record keeps it
    assert detail.violations[0]["message"] == "bad \ufffd"  # free text: shown, not an id
    assert store.get_session("se\x00ss") is None  # no id holds NUL: not the session of U+FFFD
    store.close()
    with pytest.raises(StoreError) as caught:
        open_store("postgresql://postgres:hunter2@127.0.0.1:1/test?connect_timeout=2")
    assert "cannot open store" in str(caught.value) and "hunter2" not in str(caught.value)
