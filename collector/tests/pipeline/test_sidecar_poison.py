"""A span that cannot be stored must not fail, forever, the requests batched with it.

The store cannot be made to fail on one span from the outside, so a real SQLite trigger
on the sidecar's own store file aborts the insert of any action with ``action_id``
'poison'. It stands for whatever in a record a store may refuse (the OverflowError of
a start time past 2^63 was one). The trigger raises a constraint error, not an error
of the store's state, so the sidecar treats it as coming from the records.
"""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Sidecar, wait_for
from durable_sessions_collector.jsonlog import JsonLog, RepeatedFailure
from durable_sessions_collector.store import stored
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sidecar_clients import export_call, request_of


def span_id(session: str, action_id: str) -> bytes:
    return hashlib.sha256(f"{session}/{action_id}".encode()).digest()[:8]


def request(session: str, *action_ids: str) -> bytes:
    spans = [
        Span(
            trace_id=hashlib.sha256(session.encode()).digest()[:16],
            span_id=span_id(session, action_id),
            name=action_id,
            start_time_unix_nano=1_700_000_000_000_000_000 + n,
            attributes=[
                KeyValue(key="session.id", value=AnyValue(string_value=session)),
                KeyValue(key="agent.action.id", value=AnyValue(string_value=action_id)),
                KeyValue(key="agent.action.kind", value=AnyValue(string_value="tool_call")),
            ],
        )
        for n, action_id in enumerate(action_ids)
    ]
    return request_of(*spans).SerializeToString()


def assert_retryable(export: Callable[..., Any], body: bytes, detail: str = "") -> None:
    """``body`` is answered UNAVAILABLE (to be sent again), ``detail`` in the error's details."""
    try:
        answer = export(body, timeout=30)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
        assert detail in error.details()
    else:
        raise AssertionError(f"answered OK: {answer.partial_success}")


def assert_failed_whole(sidecar: Sidecar, body: bytes, detail: str) -> None:
    """``body`` is answered retryable as a whole (:func:`assert_retryable`) and the store's
    failure logged once, the request not written again span by span."""
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        assert_retryable(export_call(channel), body, detail)
    events = [line.get("event") for line in sidecar.log.lines()]
    assert events.count("store-write-failed") == 1 and "request-write-failed" not in events


def poison(store: Path) -> None:
    with sqlite3.connect(store) as db:
        db.execute(
            "CREATE TRIGGER poison BEFORE INSERT ON actions WHEN NEW.action_id = 'poison' "
            "BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
        )
    db.close()


def test_only_the_unstorable_span_is_rejected_and_its_batch_is_stored(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    poison(store)
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    export = export_call(channel)
    # Hold the store's write lock so that the three requests queue up behind a first one
    # and are written as one batch once it is released.
    lock = sqlite3.connect(store, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    pipeline = sidecar.service.pipeline
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(export, request("first", "f1"), timeout=60)
        wait_for(lambda: sidecar.metric("durable_sessions_spans_received_total", transport="grpc") == 1)
        wait_for(lambda: pipeline.queue.qsize() == 0)  # the writer took it and waits on the lock
        bodies = [request("mixed", "m1", "poison", "m2"), request("clean-a", "a1"), request("clean-b", "b1")]
        answers = [pool.submit(export, body, timeout=60) for body in bodies]
        wait_for(lambda: pipeline.queue.qsize() == 3)
        lock.execute("COMMIT")
        lock.close()
        assert not first.result().HasField("partial_success")
        mixed, clean_a, clean_b = (answer.result() for answer in answers)
    channel.close()

    assert not clean_a.HasField("partial_success") and not clean_b.HasField("partial_success")
    assert mixed.partial_success.rejected_spans == 1
    message = mixed.partial_success.error_message
    assert "rejected 1 of 3 span(s)" in message and "cannot be stored" in message
    assert "IntegrityError: poisoned row" in message and span_id("mixed", "poison").hex() in message
    assert [a["action_id"] for a in sidecar.session("mixed")["actions"]] == ["m1", "m2"]
    assert sidecar.session("clean-a")["action_count"] == 1
    assert sidecar.session("clean-b")["action_count"] == 1
    assert sidecar.metric("durable_sessions_spans_rejected_total", transport="grpc", reason="unstorable") == 1
    assert sidecar.metric("durable_sessions_actions_stored_total") == 5
    assert sidecar.get("/healthz")[0] == 200


def test_a_request_of_only_unstorable_spans_is_retryable(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Nothing of it could be stored: that looks like the store, not the spans, so the
    # client is told to retry rather than have the spans dropped.
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    poison(store)
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        assert_retryable(export_call(channel), request("all-bad", "poison"), "poisoned row")
    assert sidecar.get("/healthz")[0] == 200


def break_inserts(store: Path) -> None:
    """Make every insert of an action into the SQLite ``store`` fail with the store's own
    error (a trigger reading a table that does not exist), as a broken schema would."""
    with sqlite3.connect(store) as db:
        db.execute("CREATE TRIGGER broken BEFORE INSERT ON actions BEGIN SELECT 1 FROM no_such_table; END")
    db.close()


def test_a_broken_store_fails_the_batch_without_splitting_it(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # An error of the store's own state (here a schema it cannot use: a trigger on a
    # table that is gone) is a StoreError: the request is answered retryable as a whole,
    # not retried span by span (which would fail once per span), and nothing is kept.
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    break_inserts(store)
    assert_failed_whole(sidecar, request("broken", "b1", "b2", "b3"), "no such table")
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM actions").fetchone() == (0,)
    db.close()


def test_a_store_failing_every_write_is_logged_once_with_a_count_then_its_recovery(
    start_sidecar, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    # Clients retry a failed Export every second or so: one line a minute says the store
    # fails, not one per failed batch, and a line says when it is over and how many failed.
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    break_inserts(store)
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        export = export_call(channel)
        for n in range(4):
            with pytest.raises(grpc.RpcError):
                export(request(f"retried-{n}", "a1"), timeout=30)
        with sqlite3.connect(store) as db:
            db.execute("DROP TRIGGER broken")
        db.close()
        export(request("after", "a1"), timeout=30)
    lines = sidecar.log.lines()
    failed = [line for line in lines if line.get("event") == "store-write-failed"]
    assert [line["failures"] for line in failed] == [1]
    assert "no such table" in failed[0]["error"]
    assert [line["failures"] for line in lines if line.get("event") == "store-write-recovered"] == [4]
    assert sidecar.metric("durable_sessions_store_commit_failures_total") == 4


def test_a_repeated_failure_is_logged_again_after_its_interval_with_the_count() -> None:
    stream, now = io.StringIO(), [0.0]
    failures = RepeatedFailure(
        JsonLog(stream), "store-write-failed", "store-write-recovered", clock=lambda: now[0]
    )
    for now[0] in (0.0, 1.0, 59.0, 60.0, 61.0):
        failures.failed(error="disk full")
    failures.ok()
    failures.ok()  # nothing failed since: no line
    failures.failed(error="locked")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["event"], line.get("failures")) for line in lines] == [
        ("store-write-failed", 1),
        ("store-write-failed", 4),
        ("store-write-recovered", 5),
        ("store-write-failed", 1),
    ]


# --- the same on PostgreSQL: its errors are told apart by SQLSTATE class ------------------


def _pg(postgres_url: str, statement: str) -> None:
    import psycopg

    dsn, _, schema = postgres_url.partition("?schema=")
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f'SET search_path TO "{schema}"')
        db.execute(statement)


def test_postgres_only_the_span_it_refuses_is_rejected(start_sidecar, postgres_url) -> None:  # type: ignore[no-untyped-def]
    # A constraint violation (SQLSTATE class 23) is about the values: only that span is rejected.
    sidecar = start_sidecar(postgres_url)
    _pg(
        postgres_url,
        "ALTER TABLE actions ADD CONSTRAINT no_poison CHECK (action_id IS DISTINCT FROM 'poison')",
    )
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        export = export_call(channel)
        answer = export(request("pg-mixed", "m1", "poison", "m2"), timeout=30)
    assert answer.partial_success.rejected_spans == 1
    assert span_id("pg-mixed", "poison").hex() in answer.partial_success.error_message
    assert "no_poison" in answer.partial_success.error_message
    assert sidecar.session("pg-mixed")["action_count"] == 2


def test_postgres_a_span_the_store_fails_while_a_request_is_split_is_retried_not_rejected(  # type: ignore[no-untyped-def]
    start_sidecar, postgres_url
) -> None:
    # A request is written span by span after one of its spans was refused. A span the
    # store itself then failed (here a trigger raising disk_full, SQLSTATE 53100, for one
    # span: a failover or a full disk at that moment) was listed with the refused one,
    # and the client, told it was rejected, never sent it again: acknowledged and lost.
    # Now the request is answered retryable; the retry stores it, and the spans committed
    # the first time are dropped as duplicates.
    sidecar = start_sidecar(postgres_url)
    _pg(
        postgres_url,
        "ALTER TABLE actions ADD CONSTRAINT no_poison CHECK (action_id IS DISTINCT FROM 'poison')",
    )
    _pg(
        postgres_url,
        "CREATE FUNCTION full_disk() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.action_id = 'unlucky' THEN RAISE EXCEPTION 'could not extend file' USING ERRCODE = '53100'; "
        "END IF; RETURN NEW; END $$",
    )
    _pg(
        postgres_url,
        "CREATE TRIGGER full_disk BEFORE INSERT ON actions FOR EACH ROW EXECUTE FUNCTION full_disk()",
    )
    body = request("pg-split", "m1", "poison", "unlucky")
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        export = export_call(channel)
        assert_retryable(export, body)
        _pg(postgres_url, "DROP TRIGGER full_disk ON actions")  # the disk has room again
        retried = export(body, timeout=30)
    assert retried.partial_success.rejected_spans == 1  # the span the store refuses, alone
    assert span_id("pg-split", "poison").hex() in retried.partial_success.error_message
    assert [a["action_id"] for a in sidecar.session("pg-split")["actions"]] == ["m1", "unlucky"]
    # Every span counted once per request: m1 stored the first time, a duplicate the next.
    metric = sidecar.metric
    assert metric("durable_sessions_spans_received_total", transport="grpc") == 6
    assert metric("durable_sessions_actions_stored_total") == 2
    assert metric("durable_sessions_spans_duplicate_total") == 1
    assert metric("durable_sessions_spans_rejected_total", transport="grpc", reason="unavailable") == 2
    assert metric("durable_sessions_spans_rejected_total", transport="grpc", reason="unstorable") == 1


def test_postgres_a_value_past_its_index_limit_is_rejected_not_retried(  # type: ignore[no-untyped-def]
    start_sidecar, postgres_url, monkeypatch
) -> None:
    # PostgreSQL refuses an index entry over 2,704 bytes (SQLSTATE 54000, which psycopg
    # raises as an OperationalError). It was answered UNAVAILABLE, every time: a Collector
    # retried the span forever, failing the requests batched with it each time. A stored
    # identifier is now at most 256 characters (a longer one is stored as its digest), far
    # below the limit; the store still answers such a refusal so, should a wider column
    # ever reach it: here identifiers are let through whole.
    monkeypatch.setattr(stored, "MAX_TEXT", 100_000)
    sidecar = start_sidecar(postgres_url)
    # (incompressible: PostgreSQL compresses an index entry before it measures it)
    long_session = "".join(hashlib.sha256(bytes([n])).hexdigest() for n in range(64))
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        export = export_call(channel)
        alone = export(request(long_session, "a1"), timeout=30)
        mixed = export(request("pg-fine", "f1") + request(long_session, "a2"), timeout=30)
    assert alone.partial_success.rejected_spans == 1
    message = alone.partial_success.error_message
    assert "PostgreSQL refuses the record" in message and "index row size" in message
    assert span_id(long_session, "a1").hex() in message
    assert mixed.partial_success.rejected_spans == 1
    assert span_id(long_session, "a2").hex() in mixed.partial_success.error_message
    assert sidecar.session("pg-fine")["action_count"] == 1
    assert sidecar.metric("durable_sessions_spans_rejected_total", transport="grpc", reason="unstorable") == 2
    assert sidecar.metric("durable_sessions_actions_stored_total") == 1
    assert "store-write-failed" not in [line.get("event") for line in sidecar.log.lines()]
    assert sidecar.get("/healthz")[0] == 200


def test_postgres_a_dropped_table_fails_the_batch_without_splitting_it(start_sidecar, postgres_url) -> None:  # type: ignore[no-untyped-def]
    # UndefinedTable is a ProgrammingError (SQLSTATE 42P01), not an OperationalError, but it
    # is the store's state all the same: retryable as a whole, not span by span.
    sidecar = start_sidecar(postgres_url)
    _pg(postgres_url, "DROP TABLE violations")
    assert_failed_whole(sidecar, request("pg-broken", "b1", "b2", "b3"), "violations")


def test_an_id_holding_nul_is_refused_alike_by_both_stores(start_sidecar, store_url) -> None:  # type: ignore[no-untyped-def]
    # PostgreSQL text cannot hold NUL; writing U+FFFD in its place made "a\x00b" and
    # "a\ufffdb" one session, answered as "a\ufffdb". Both stores refuse such a span.
    sidecar = start_sidecar(store_url)
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        export = export_call(channel)
        kept = export(request("a\ufffdb", "p1", "p2"), timeout=30)
        with_nul = export(request("a\x00b", "p1", "p2", "p3"), timeout=30)
        nul_action = export(request("plain", "ok1", "x\x00y"), timeout=30)
    assert not kept.HasField("partial_success")
    assert with_nul.partial_success.rejected_spans == 3
    assert "session_id 'a\\x00b' holds NUL" in with_nul.partial_success.error_message
    assert nul_action.partial_success.rejected_spans == 1
    assert "action_id 'x\\x00y' holds NUL" in nul_action.partial_success.error_message
    assert sidecar.get("/api/sessions/a%00b")[0] == 404
    session = sidecar.session("a\ufffdb")
    assert session["session_id"] == "a\ufffdb" and session["action_count"] == 2
    assert [a["action_id"] for a in sidecar.session("plain")["actions"]] == ["ok1"]
    status, listed = sidecar.get("/api/sessions")
    assert status == 200 and sorted(s["session_id"] for s in listed["sessions"]) == ["a\ufffdb", "plain"]
