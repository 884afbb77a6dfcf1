"""Retention (``retention.sessions_s``): the writer deletes old ended sessions and their rows.

Real sidecars with real OTLP/gRPC exporters, real SQLite files and the real PostgreSQL
(skipped without ``DURABLE_SESSIONS_TEST_POSTGRES_DSN`` unless
``DURABLE_SESSIONS_REQUIRE_POSTGRES=1``). Where a test needs "later", it calls the
pipeline's own pass with a later clock, as the idle-sweep tests do; where it needs the
writer's own passes, it shortens their period (``pipeline.PRUNE_EVERY_S``).
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import Sidecar, wait_for
from durable_sessions_collector import pipeline
from durable_sessions_collector.cli import main
from durable_sessions_collector.config import ConfigError, load
from durable_sessions_collector.store import Store, action_row, open_store
from durable_sessions_collector.store import sqlite as sqlite_store
from durable_sessions_collector.store.base import OUTBOX_CHANNELS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from postgres_support import held_transaction
from sidecar_clients import Agent, Recorder, grpc_exporter
from webhook_server import ClosedPort, WebhookServer

from durable_sessions.violation import Severity, Violation

HOUR = 3600.0
TABLES = ("sessions", "actions", "violations", "outbox")


# --- helpers ---------------------------------------------------------------------------------


class Holder(SpanExporter):
    """Keeps the spans, sent later in one Export request."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def query(url: str, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """Rows of ``statement`` (``%s`` placeholders) read straight from the store's database."""
    if url.startswith("sqlite:///"):
        with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as db:
            return db.execute(statement.replace("%s", "?"), tuple(params)).fetchall()
    import psycopg
    from durable_sessions_collector.store.postgres import split_url
    from psycopg import sql

    dsn, schema = split_url(url)
    with psycopg.connect(dsn) as db:
        db.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema or "public")))
        return db.execute(statement, tuple(params)).fetchall()  # type: ignore[arg-type]


def stored(url: str, session_id: str) -> dict[str, int]:
    """How many rows of each table belong to ``session_id`` (outbox rows by violation key,
    ``session|rule|action|span``)."""
    where = {
        "sessions": "session_id = %s",
        "actions": "session_id = %s",
        "violations": "session_id = %s",
        "outbox": "violation_key LIKE %s",
    }
    found = {}
    for table in TABLES:
        value = f"{session_id}|%" if table == "outbox" else session_id
        found[table] = query(url, f"SELECT count(*) FROM {table} WHERE {where[table]}", [value])[0][0]
    return found


def alert_states(url: str, session_id: str) -> list[tuple[str, str]]:
    """(channel, state) of the outbox rows of ``session_id``'s violations."""
    rows = query(url, "SELECT channel, state FROM outbox WHERE violation_key LIKE %s", [f"{session_id}|%"])
    return sorted((channel, state) for channel, state in rows)


def pruned_lines(sidecar: Sidecar) -> list[dict[str, Any]]:
    return [line for line in sidecar.log.lines() if line.get("event") == "sessions-pruned"]


def listed(sidecar: Sidecar) -> set[str]:
    status, document = sidecar.get("/api/sessions?limit=1000")
    assert status == 200, document
    return {session["session_id"] for session in document["sessions"]}


def ended(sidecar: Sidecar, *session_ids: str) -> None:
    for session_id in session_ids:
        wait_for(lambda sid=session_id: sidecar.session(sid)["state"] == "ended")


def unkeyed_payment(agent: Agent, session_id: str) -> None:
    """An unkeyed payment: an error (unkeyed-side-effect) found at ingest, alerted once."""
    agent.action(session_id, "charge", "payment")


def alerts_of(sidecar: Sidecar, session_id: str) -> list[dict[str, Any]]:
    return [line for line in sidecar.alerts() if line["session_id"] == session_id]


# --- the writer deletes old ended sessions, and only those -------------------------------------


def test_old_ended_sessions_are_deleted_from_every_table_and_the_api(start_sidecar, store_url) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(store_url, retention__sessions_s=HOUR)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    unkeyed_payment(agent, "old-1")
    agent.action("old-1", "look", "tool_call")
    agent.action("old-2", "look", "tool_call")
    ended(sidecar, "old-1", "old-2")
    assert stored(store_url, "old-1") == {"sessions": 1, "actions": 2, "violations": 1, "outbox": 1}
    between = time.time()
    time.sleep(0.01)
    unkeyed_payment(agent, "recent")  # the newest violation (which a SQLite store always keeps)
    ended(sidecar, "recent")
    recent = sidecar.session("recent")

    pruned = sidecar.service.pipeline.prune(between + HOUR)  # an hour on: old-* are past it

    assert sorted(pruned.sessions) == ["old-1", "old-2"]
    for session_id in ("old-1", "old-2"):
        assert stored(store_url, session_id) == dict.fromkeys(TABLES, 0)
        status, document = sidecar.get(f"/api/sessions/{session_id}")
        assert status == 404, document
    assert listed(sidecar) == {"recent"}
    assert sidecar.session("recent") == recent
    assert stored(store_url, "recent") == {"sessions": 1, "actions": 1, "violations": 1, "outbox": 1}
    assert sidecar.metric("durable_sessions_sessions_pruned_total") == 2
    assert sidecar.metric("durable_sessions_sessions", verdict="unrecoverable") == 1
    [line] = pruned_lines(sidecar)
    assert (line["level"], line["sessions"], line["orphan_rows"]) == ("info", 2, 0)
    assert sidecar.service.pipeline.prune(between + HOUR).sessions == []  # nothing left to delete
    agent.shutdown()


def test_open_sessions_are_kept_however_old(start_sidecar, store_url) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(store_url, retention__sessions_s=1, evaluation__idle_s=HOUR)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    unkeyed_payment(agent, "long-1")
    agent.action("long-2", "look", "tool_call")
    before = {session_id: sidecar.session(session_id) for session_id in ("long-1", "long-2")}

    assert sidecar.service.pipeline.prune(time.time() + 10 * HOUR).sessions == []

    assert {session_id: sidecar.session(session_id) for session_id in before} == before
    assert all(document["state"] == "active" for document in before.values())
    assert stored(store_url, "long-1") == {"sessions": 1, "actions": 1, "violations": 1, "outbox": 1}
    assert sidecar.metric("durable_sessions_sessions_pruned_total") == 0
    agent.shutdown()


def test_the_writer_prunes_on_its_own_once_past_the_retention(start_sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pipeline, "PRUNE_EVERY_S", 0.2)
    sidecar = start_sidecar(retention__sessions_s=0.5)
    # Both spans in one Export: sent one by one, a loaded machine could take longer than
    # idle_s + the retention between them, and the first alone be ended and pruned.
    holder = Holder()
    agent = Agent(holder, "inc-1")
    agent.action("gone", "look", "tool_call")
    agent.action("gone", "read", "tool_call")
    last = time.time()  # the session is last seen after this
    assert grpc_exporter(sidecar.grpc_endpoint).export(holder.spans) == SpanExportResult.SUCCESS
    wait_for(lambda: sidecar.metric("durable_sessions_sessions_pruned_total") == 1)
    assert time.time() - last >= 0.5  # not before it was older than the retention
    status, _ = sidecar.get("/api/sessions/gone")
    assert status == 404
    [line] = wait_for(lambda: pruned_lines(sidecar))  # logged after the count
    assert line["sessions"] == 1
    agent.shutdown()


def test_no_retention_prunes_nothing(start_sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pipeline, "PRUNE_EVERY_S", 0.05)
    sidecar = start_sidecar()  # retention.sessions_s defaults to 0
    assert sidecar.service.config.retention_sessions_s == 0
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    unkeyed_payment(agent, "kept-1")
    agent.action("kept-2", "look", "tool_call")
    ended(sidecar, "kept-1", "kept-2")
    time.sleep(1.0)  # twenty periods, every session ended and older than any cutoff
    assert listed(sidecar) == {"kept-1", "kept-2"}
    assert sidecar.metric("durable_sessions_sessions_pruned_total") == 0
    assert pruned_lines(sidecar) == []
    agent.shutdown()


# --- alerts ------------------------------------------------------------------------------------


def test_a_pending_alert_of_a_pruned_session_is_kept_and_still_delivered(start_sidecar, store_url) -> None:  # type: ignore[no-untyped-def]
    down = ClosedPort()  # nobody listens yet: the webhook alerts stay pending
    port = down.port
    sidecar = start_sidecar(
        store_url,
        retention__sessions_s=HOUR,
        alerts__webhook__url=f"http://127.0.0.1:{port}/hook",
        alerts__webhook__max_attempts=1000,
        alerts__webhook__backoff_s=0.05,
        alerts__webhook__max_backoff_s=0.2,
    )
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    unkeyed_payment(agent, "pay-1")
    ended(sidecar, "pay-1")
    wait_for(lambda: alert_states(store_url, "pay-1") == [("log", "delivered"), ("webhook", "pending")])
    between = time.time()
    time.sleep(0.01)
    unkeyed_payment(agent, "later")  # the newest violation (which a SQLite store always keeps)
    pipe = sidecar.service.pipeline

    assert pipe.prune(between + HOUR).sessions == ["pay-1"]

    assert sidecar.get("/api/sessions/pay-1")[0] == 404
    assert stored(store_url, "pay-1") == {"sessions": 0, "actions": 0, "violations": 0, "outbox": 1}
    assert alert_states(store_url, "pay-1") == [("webhook", "pending")]  # the delivered log row is gone
    with WebhookServer(down.release()) as hook:  # the receiver comes up: the kept alert is delivered
        wait_for(lambda: "pay-1" in {received.body["session_id"] for received in hook.accepted})
        wait_for(lambda: alert_states(store_url, "pay-1") == [("webhook", "delivered")])
    # Delivered now, its violation gone: a pass deletes it once its next_attempt_at (on a
    # shared store, the end of the delivering replica's one-minute claim) is past the cutoff.
    assert pipe.prune(time.time() + HOUR + 120).orphans >= 1
    assert alert_states(store_url, "pay-1") == []
    agent.shutdown()


def test_a_pruned_session_that_gets_spans_again_is_stored_and_judged_afresh(start_sidecar, store_url) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(store_url, retention__sessions_s=HOUR)
    recorder = Recorder(sidecar.grpc_endpoint)
    agent = Agent(recorder, "inc-1")
    unkeyed_payment(agent, "again")
    agent.action("again", "look", "tool_call")
    payment = recorder.spans[0]
    ended(sidecar, "again")
    wait_for(lambda: len(alerts_of(sidecar, "again")) == 1)  # the log thread writes it after the commit
    assert grpc_exporter(sidecar.grpc_endpoint).export([payment]) == SpanExportResult.SUCCESS
    assert sidecar.metric("durable_sessions_spans_duplicate_total") == 1  # while stored: a duplicate
    between = time.time()
    time.sleep(0.01)
    unkeyed_payment(agent, "other")  # the newest violation (which a SQLite store always keeps)

    assert sidecar.service.pipeline.prune(between + HOUR).sessions == ["again"]
    assert grpc_exporter(sidecar.grpc_endpoint).export([payment]) == SpanExportResult.SUCCESS

    document = sidecar.session("again")
    assert (document["state"], document["action_count"], document["verdict"]) == (
        "active",
        1,
        "unrecoverable",
    )
    assert [action["action_id"] for action in document["actions"]] == ["charge"]
    [violation] = document["violations"]
    wait_for(lambda: len(alerts_of(sidecar, "again")) == 2)  # alerted again
    assert {alert["key"] for alert in alerts_of(sidecar, "again")} == {violation["key"]}
    assert sidecar.metric("durable_sessions_spans_duplicate_total") == 1
    agent.shutdown()


# --- bounded passes ----------------------------------------------------------------------------


def test_pruning_is_bounded_per_pass_and_exports_are_still_acknowledged(
    start_sidecar, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """1,100 sessions old enough when a sidecar starts: its first pass deletes 500, and as
    each full pass is followed by another after the next write batch (not after the
    period, an hour here), two more delete the rest, while Exports are acknowledged."""
    count = pipeline.PRUNE_BATCH * 2 + 100
    store = tmp_path / "sessions.db"
    first = start_sidecar(store)
    holder = Holder()
    agent = Agent(holder, "inc-1")
    for n in range(count):
        agent.action(f"w{n}", "look", "tool_call")
    assert grpc_exporter(first.grpc_endpoint).export(holder.spans) == SpanExportResult.SUCCESS
    wait_for(lambda: first.metric("durable_sessions_sessions_ended_total") == count, timeout=30)
    first.stop()

    monkeypatch.setattr(pipeline, "PRUNE_EVERY_S", HOUR)
    time.sleep(0.6)  # every session is older than the retention when the second one starts
    # idle_s: the session written meanwhile stays open, so it is never deleted.
    second = start_sidecar(
        store, retention__sessions_s=0.5, evaluation__idle_s=HOUR, pipeline__ack_timeout_s=5
    )
    results: list[SpanExportResult] = []
    stop = threading.Event()

    def export_meanwhile() -> None:
        exporter = grpc_exporter(second.grpc_endpoint)
        held = Holder()
        live = Agent(held, "inc-2")
        while not stop.is_set():
            live.action("live", f"a{len(results)}", "tool_call")
            results.append(exporter.export(held.spans[-1:]))

    thread = threading.Thread(target=export_meanwhile)
    thread.start()
    try:
        wait_for(lambda: second.metric("durable_sessions_sessions_pruned_total") == count, timeout=30)
        # Each pass is logged after it is counted: the last pass's line may still be on its way.
        wait_for(lambda: sum(line["sessions"] for line in pruned_lines(second)) >= count)
    finally:
        stop.set()
        thread.join()
    passes = [line["sessions"] for line in pruned_lines(second)]
    assert passes == [pipeline.PRUNE_BATCH, pipeline.PRUNE_BATCH, 100], passes
    assert listed(second) == {"live"}
    assert results and all(result == SpanExportResult.SUCCESS for result in results)
    assert second.session("live")["action_count"] == len(results)


# --- failures --------------------------------------------------------------------------------------


def test_a_failed_pass_is_logged_and_retried_and_the_writer_keeps_writing(
    start_sidecar, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pipeline, "PRUNE_EVERY_S", 0.1)
    store = tmp_path / "sessions.db"
    open_store(f"sqlite:///{store}").close()
    with contextlib.closing(sqlite3.connect(store)) as db:  # the store refuses to delete a session
        db.execute(
            "CREATE TRIGGER refuse BEFORE DELETE ON sessions BEGIN SELECT RAISE(ABORT, 'kept by a test'); END"
        )
        db.commit()
    sidecar = start_sidecar(store, retention__sessions_s=0.2)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("stuck", "look", "tool_call")
    ended(sidecar, "stuck")
    wait_for(lambda: len([line for line in sidecar.log.lines() if line["event"] == "prune-failed"]) >= 2)
    failed = next(line for line in sidecar.log.lines() if line["event"] == "prune-failed")
    assert "kept by a test" in failed["error"] and failed["level"] == "error"
    agent.action("busy", "look", "tool_call")  # still written and acknowledged
    assert sidecar.session("busy")["action_count"] == 1
    assert sidecar.get("/healthz")[0] == 200
    with contextlib.closing(sqlite3.connect(store)) as db:
        db.execute("DROP TRIGGER refuse")
        db.commit()
    wait_for(lambda: listed(sidecar) == set())  # retried at the next passes: both go
    # Counted after the commit that the API shows.
    wait_for(lambda: sidecar.metric("durable_sessions_sessions_pruned_total") >= 2)
    assert sidecar.metric("durable_sessions_sessions_pruned_total") == 2
    agent.shutdown()


# --- the stores' prune -------------------------------------------------------------------------


def violation(session_id: str | None, span: str) -> Violation:
    return Violation(
        "re-asked", Severity.ERROR, "re-asked", session_id, "a1", trace_id="t" * 32, span_id=span
    )


def sessionless_action(span: str) -> Any:
    return action_row({"action_id": "a9", "kind": "tool_call", "status": "ok"}, "f" * 32, span)


@pytest.fixture
def store(store_url: str) -> Any:
    opened = open_store(store_url)
    yield opened
    opened.close()


def test_rows_of_no_session_older_than_the_cutoff_are_deleted_a_batch_at_a_time(store: Store) -> None:
    old, new = violation(None, "old"), violation(None, "new")
    with store.writer() as writer:
        for n in range(3):
            writer.add_action(sessionless_action(f"old{n}"), 1.0)
        writer.add_action(sessionless_action("new"), 200.0)
        writer.add_violation(old, at_end=False, now=1.0)
        for channel in ("log", "webhook", "otlp"):
            writer.enqueue_alert(channel, "gone-" + channel, {}, 1.0)  # their violation is gone
        writer.enqueue_alert("log", old.key, {}, 1.0)
        writer.enqueue_alert("log", "gone-late", {}, 200.0)
        writer.add_violation(new, at_end=False, now=200.0)
    # (A PostgreSQL store claims what it returns for a minute: still due before the cutoff.)
    due = {alert.violation_key: alert for ch in ("log", "webhook") for alert in store.pending_alerts(ch, 1.0)}
    with store.writer() as writer:
        writer.mark_delivered([due["gone-log"], due[old.key]], 1.0)
        writer.mark_failed(due["gone-webhook"], "400", None)
    [late] = store.pending_alerts("log", 200.0)
    with store.writer() as writer:
        writer.mark_delivered([late], 200.0)

    with store.writer() as writer:
        first = writer.prune(100.0, 2)
    # Two of the three old actions (the limit); the old violation; two of the three
    # delivered or dead alerts of violations gone (the old one's went in this pass).
    assert (first.sessions, first.orphans, first.full) == ([], 2 + 1 + 2, True)
    with store.writer() as writer:
        second = writer.prune(100.0, 2)
    assert (second.sessions, second.orphans, second.full) == ([], 1 + 0 + 1, False)
    assert query_counts(store) == {"actions": 1, "violations": 1, "outbox": 2}
    with store.writer() as writer:
        assert writer.prune(100.0, 2).orphans == 0
    # Kept: the pending alert (still to be delivered) and the one delivered after the cutoff.
    assert [alert.violation_key for alert in store.pending_alerts("otlp", 300.0)] == ["gone-otlp"]
    assert store.alert_counts() == {("log", "delivered"): 1, ("otlp", "pending"): 1}


def test_a_violation_of_an_empty_session_id_is_one_of_no_session(store: Store) -> None:
    # A span with session.id "" is stored with no session, but its missing-field violation
    # was stored with session "": no session row, and never a row of no session to prune.
    with store.writer() as writer:
        writer.add_action(sessionless_action("blank"), 1.0)
        writer.add_violation(violation("", "blank"), at_end=False, now=1.0)
        writer.add_violation(violation(None, "keep"), at_end=False, now=200.0)  # the newest is kept
    with store.writer() as writer:
        assert writer.prune(100.0, 10).orphans == 2
    assert query_counts(store) == {"actions": 0, "violations": 1, "outbox": 0}


def ended_session(writer: Any, session_id: str, actions: int, now: float) -> None:
    for n in range(actions):
        row = action_row(
            {"session_id": session_id, "action_id": f"a{n}", "kind": "tool_call", "status": "ok"},
            "e" * 32,
            f"{session_id}-{n}",
        )
        assert writer.add_action(row, now)
    writer.touch_session(session_id, now, actions)
    writer.end_session(session_id, now)


def test_a_pass_deletes_sessions_up_to_an_action_budget_and_a_huge_one_over_several(store: Store) -> None:
    # One pass is one transaction that Exports wait for: it deletes at most max_actions
    # actions, oldest sessions first. A session holding more is deleted at once but for
    # its actions, which the next passes delete a budget at a time.
    with store.writer() as writer:
        for n, (session_id, actions) in enumerate([("huge", 80), ("s1", 30), ("s2", 15), ("s3", 10)]):
            ended_session(writer, session_id, actions, 1.0 + n)
    passes = []
    full = True
    while full:
        before = query_counts(store)["actions"]
        with store.writer() as writer:
            pruned = writer.prune(100.0, 10, max_actions=50)
        deleted = before - query_counts(store)["actions"]
        assert deleted <= 50
        passes.append((pruned.sessions, deleted, pruned.full))
        full = pruned.full
    assert passes == [
        (["huge"], 0, True),  # gone from the API; its 80 actions left to the next passes
        ([], 50, True),
        (["s1"], 30, True),  # the rest of huge; s1 alone is over the 20 left: its turn next
        (["s2"], 45, True),  # s1's 30 and s2's 15; s3 would pass the budget
        (["s3"], 10, False),
    ]
    assert query_counts(store)["actions"] == 0
    assert store.list_sessions() == []


def test_spans_of_a_session_being_forgotten_start_it_afresh(store: Store) -> None:
    with store.writer() as writer:
        ended_session(writer, "huge", 30, 1.0)
        assert writer.prune(100.0, 10, max_actions=10).sessions == ["huge"]
        assert writer.prune(100.0, 10, max_actions=10).orphans == 10  # 20 of its actions left
    with store.writer() as writer:  # the session's id comes back, with new spans
        assert writer.add_action(
            action_row(
                {"session_id": "huge", "action_id": "new", "kind": "tool_call", "status": "ok"}, "f" * 32, "n"
            ),
            200.0,
        )
        writer.touch_session("huge", 200.0, 1)
        assert [where.span_id for _, where in writer.session_records("huge")] == ["n"]
    detail = store.get_session("huge")
    assert detail is not None and [action["span_id"] for action in detail.actions] == ["n"]
    while True:
        with store.writer() as writer:
            if not writer.prune(100.0, 10, max_actions=10).full:
                break
    assert query_counts(store)["actions"] == 1  # the old ones gone, the new one kept
    with store.writer() as writer:
        assert [where.span_id for _, where in writer.session_records("huge")] == ["n"]


def test_a_session_started_afresh_while_its_newest_old_action_is_forgotten_keeps_its_spans(
    store: Store,
) -> None:
    # SQLite gives the largest id in the table plus one to a new row. A pass deleted the
    # forgotten session's actions in index order (by trace id), so its newest, holding the
    # table's largest id, could go first: the next action of the session started afresh
    # was given an id the forgetting still covered. It was shown nowhere, never re-fed,
    # and the next pass deleted it, acknowledged as it was. Now the action of the largest
    # id goes last, with the forgetting row.
    with store.writer() as writer:
        for n in range(1, 11):  # the newest action has the smallest trace id
            row = {"session_id": "job", "action_id": f"a{n}", "kind": "tool_call", "status": "ok"}
            assert writer.add_action(action_row(row, f"{100 - n:032x}", f"{n:016x}"), 1.0)
        writer.touch_session("job", 1.0, 10)
        writer.end_session("job", 1.0)
    with store.writer() as writer:
        assert writer.prune(100.0, 10, max_actions=3).sessions == ["job"]
    with store.writer() as writer:
        assert writer.prune(100.0, 10, max_actions=3).orphans == 3
    with store.writer() as writer:  # the session's id comes back (a job run again, say)
        row = {"session_id": "job", "action_id": "new", "kind": "tool_call", "status": "ok"}
        assert writer.add_action(action_row(row, "f" * 32, "n" * 16), 200.0)
        writer.touch_session("job", 200.0, 1)
    detail = store.get_session("job")
    assert detail is not None and [action["span_id"] for action in detail.actions] == ["n" * 16]
    while True:
        with store.writer() as writer:
            if not writer.prune(100.0, 10, max_actions=3).full:
                break
    assert query_counts(store)["actions"] == 1
    with store.writer() as writer:
        assert [where.span_id for _, where in writer.session_records("job")] == ["n" * 16]


def query_counts(store: Store) -> dict[str, int]:
    url = f"sqlite:///{store.path}" if hasattr(store, "path") else store.url  # type: ignore[attr-defined]
    return {
        table: query(url, f"SELECT count(*) FROM {table}")[0][0]
        for table in ("actions", "violations", "outbox")
    }


def test_sqlite_keeps_the_newest_violation_so_a_watch_cursor_never_goes_back(tmp_path: Path) -> None:
    """SQLite gives a deleted largest id to the next row: deleting the newest violation
    would let the next one take its id, behind a WatchAlerts cursor already there."""
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    with store.writer() as writer:
        for session_id in ("a", "b"):
            writer.touch_session(session_id, 1.0, 1)
            writer.add_violation(violation(session_id, "s1"), at_end=False, now=1.0)
            writer.end_session(session_id, 2.0)
    cursor = store.violation_cursor()
    with store.writer() as writer:
        assert writer.prune(10.0, 10).sessions == ["a"]  # b holds the newest violation
    assert store.violation_cursor() == cursor
    with store.writer() as writer:
        writer.touch_session("c", 11.0, 1)
        writer.add_violation(violation("c", "s1"), at_end=False, now=11.0)
    found, _ = store.violations_after(cursor)
    assert [item["session_id"] for item in found] == ["c"]
    with store.writer() as writer:
        assert writer.prune(10.0, 10).sessions == ["b"]  # no longer the newest
    store.close()


def test_sqlite_prune_statements_read_through_indexes(tmp_path: Path) -> None:
    """EXPLAIN QUERY PLAN: no statement of a pass scans a table (or a whole index)."""
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    store.close()
    statements = [
        (sqlite_store.NEWEST_VIOLATION, ()),
        (sqlite_store.SQL.prunable_sessions, (1.0, 10)),
        (sqlite_store.PRUNE_SESSION_ALERTS, ("log", "s")),
        *((statement, ("s",)) for statement in sqlite_store.PRUNE_SESSION_ROWS),
        (sqlite_store.FORGET_ACTIONS, ("s", 5, 10)),
        (sqlite_store.FORGET_LAST_ACTION, (5, "s")),
        (sqlite_store.PRUNE_SESSIONLESS_ACTIONS, (1.0, 10)),
        (sqlite_store.PRUNE_SESSIONLESS_VIOLATIONS, (1.0, 5, 10)),
        (sqlite_store.PRUNE_ORPHAN_ALERTS, ("log", 1.0, 10)),
        (OUTBOX_CHANNELS, ()),
    ]
    with contextlib.closing(sqlite3.connect(tmp_path / "s.db")) as db:
        for statement, params in statements:
            plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + statement, params)]
            assert any(step.startswith("SEARCH") for step in plan), (statement, plan)
            assert not [
                step for step in plan if re.match(r"SCAN (actions|sessions|violations|outbox|o|v)\b", step)
            ], (
                statement,
                plan,
            )


@pytest.mark.postgres
def test_postgres_replicas_prune_only_sessions_whose_lock_they_take(postgres_url: str) -> None:
    first, second = open_store(postgres_url), open_store(postgres_url)
    with first.writer() as writer:
        for session_id in ("busy", "quiet"):
            writer.touch_session(session_id, 1.0, 1)
            writer.add_action(action_row({"session_id": session_id, "action_id": "a", "kind": "tool_call",
                                          "status": "ok"}, "t" * 32, session_id), 1.0)  # fmt: skip
            writer.end_session(session_id, 2.0)

    def replica_appending(writer: Any) -> None:
        writer.lock_sessions(["busy"])  # as a write batch holding spans of "busy" does
        writer.touch_session("busy", 50.0, 1)

    with held_transaction(first, replica_appending):
        began = time.monotonic()
        with second.writer() as writer:
            assert writer.prune(10.0, 10).sessions == ["quiet"]  # skips "busy", without waiting for it
        assert time.monotonic() - began < 2
    # "busy" is open again and recent under the committed write: never deleted.
    with second.writer() as writer:
        assert writer.prune(10.0, 10).sessions == []
    assert [s.session_id for s in second.list_sessions()] == ["busy"]
    assert second.count_actions() == 1  # type: ignore[attr-defined]
    first.close()
    second.close()


# --- configuration -----------------------------------------------------------------------------


def test_retention_is_read_from_the_file_the_environment_and_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text("retention: {sessions_s: 604800}\n")
    assert load(path, env={}).retention_sessions_s == 604800.0
    assert load(path, env={"DURABLE_SESSIONS_RETENTION_S": "86400"}).retention_sessions_s == 86400.0
    flagged = load(
        path, env={"DURABLE_SESSIONS_RETENTION_S": "86400"}, overrides={"retention_sessions_s": "0"}
    )
    assert (flagged.retention_sessions_s, flagged.sources["retention.sessions_s"]) == (0.0, "--retention-s")
    assert load(None, env={}).retention_sessions_s == 0.0


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf", "a week", ""])
def test_an_unusable_retention_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as from_env:
        load(None, env={"DURABLE_SESSIONS_RETENTION_S": value})
    assert str(from_env.value).startswith("retention.sessions_s: expected a number of 0 or more")
    assert "(from DURABLE_SESSIONS_RETENTION_S)" in str(from_env.value)
    with pytest.raises(ConfigError, match=r"^retention\.sessions_s: .*\(from --retention-s\)"):
        load(None, env={}, overrides={"retention_sessions_s": value})


@pytest.mark.parametrize("text", ["-5", ".nan", ".inf", "soon", "true", "[1]"])
def test_an_unusable_retention_in_the_file_is_refused_naming_the_key(tmp_path: Path, text: str) -> None:
    path = tmp_path / "collector.yaml"
    path.write_text(f"retention: {{sessions_s: {text}}}\n")
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(path))}:1:13: retention\.sessions_s: expected a number of 0 or more",
    ):
        load(path, env={})


def test_serve_stops_at_start_up_on_a_negative_retention() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "durable_sessions_collector", "serve", "--retention-s", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "retention.sessions_s: expected a number of 0 or more, got '-1' (from --retention-s)" in result.stderr
    )


def test_the_config_reference_lists_retention(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config-reference"]) in (0, None)
    row = next(line for line in capsys.readouterr().out.splitlines() if "`retention.sessions_s`" in line)
    assert row.startswith(
        "| `retention.sessions_s` | `DURABLE_SESSIONS_RETENTION_S` | `--retention-s` | `0.0` |"
    )
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert row in readme


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), budget=st.integers(1, 30))
def test_passes_keep_to_the_budget_and_delete_every_session_once(sizes: list[int], budget: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        store = open_store(f"sqlite:///{work}/s.db")
        with store.writer() as writer:
            for n, size in enumerate(sizes):
                ended_session(writer, f"s{n}", size, 1.0 + n)
        deleted: list[str] = []
        for _ in range(sum(sizes) + len(sizes) + 2):  # more passes than can be needed
            before = store.count_actions()  # type: ignore[attr-defined]
            with store.writer() as writer:
                pruned = writer.prune(100.0, 3, max_actions=budget)
            assert before - store.count_actions() <= budget  # type: ignore[attr-defined]
            deleted += pruned.sessions
            if not pruned.full:
                break
        assert sorted(deleted) == sorted(f"s{n}" for n in range(len(sizes)))  # each once, oldest first
        assert deleted == sorted(deleted, key=lambda session_id: int(session_id[1:]))
        assert store.count_actions() == 0  # type: ignore[attr-defined]
        assert query(f"sqlite:///{work}/s.db", "SELECT count(*) FROM forgetting") == [(0,)]
        store.close()
