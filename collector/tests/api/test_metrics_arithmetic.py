"""The span counters add up: every span of every request is counted once, as received and
as stored, a duplicate, not an action, or rejected for one reason (found by a helper's
audit, each case failing before its fix):

    spans_received = actions_stored + spans_duplicate + spans_not_action + Σ spans_rejected{reason}

Real sidecars on SQLite files, real OTLP/HTTP requests; the store is made to fail or to
wait with real SQLite triggers and locks.
"""

from __future__ import annotations

import hashlib
import http.client
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from conftest import Sidecar, wait_for
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sidecar_clients import request_of

REASONS = ("invalid", "unstorable", "overload", "unavailable")


def _span(session: str, name: str, *, action: bool = True, trace_id: bytes | None = None) -> Span:
    attributes = [KeyValue(key="session.id", value=AnyValue(string_value=session))]
    if action:
        attributes += [
            KeyValue(key="agent.action.id", value=AnyValue(string_value=name)),
            KeyValue(key="agent.action.kind", value=AnyValue(string_value="tool_call")),
        ]
    return Span(
        trace_id=trace_id if trace_id is not None else hashlib.sha256(session.encode()).digest()[:16],
        span_id=hashlib.sha256(f"{session}/{name}".encode()).digest()[:8],
        name=name,
        start_time_unix_nano=1_700_000_000_000_000_000,
        attributes=attributes,
    )


def mixed_request(session: str) -> bytes:
    """Two actions, a span that is no action, and one with a trace id of 8 bytes (invalid)."""
    spans = [
        _span(session, "a1"),
        _span(session, "a2"),
        _span(session, "plain", action=False),
        _span(session, "bad-id", trace_id=b"\x01" * 8),
    ]
    return request_of(*spans).SerializeToString()


def post(sidecar: Sidecar, body: bytes, headers: dict[str, str] | None = None) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=60)
    try:
        connection.request(
            "POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf", **(headers or {})}
        )
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def balance(sidecar: Sidecar) -> tuple[float, float, dict[str, float]]:
    """(received, what it came to, the rejected by reason) over the HTTP transport."""
    metric = sidecar.metric
    rejected = {
        reason: metric("durable_sessions_spans_rejected_total", transport="http", reason=reason)
        for reason in REASONS
    }
    received = metric("durable_sessions_spans_received_total", transport="http")
    accounted = (
        metric("durable_sessions_actions_stored_total")
        + metric("durable_sessions_spans_duplicate_total")
        + metric("durable_sessions_spans_not_action_total")
        + sum(rejected.values())
    )
    return received, accounted, rejected


def test_an_overloaded_request_counts_its_actions_as_overload_and_the_rest_as_what_they_are(
    start_sidecar: Any, tmp_path: Path
) -> None:
    # The whole request was counted as overload, its not-action span a second time: 27
    # spans accounted for 24 received.
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store, pipeline__queue_size=1, pipeline__max_batch=1)
    lock = sqlite3.connect(store, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # the writer waits for it: the queue fills
    pipeline = sidecar.service.pipeline
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, sidecar, mixed_request("first"))
        wait_for(lambda: sidecar.metric("durable_sessions_spans_received_total", transport="http") == 4)
        wait_for(lambda: pipeline.queue.qsize() == 0)  # the writer took it
        second = pool.submit(post, sidecar, mixed_request("second"))
        wait_for(lambda: pipeline.queue.qsize() == 1)
        assert post(sidecar, mixed_request("third")) == 503
        lock.execute("COMMIT")
        lock.close()
        assert (first.result(), second.result()) == (200, 200)
    received, accounted, rejected = balance(sidecar)
    assert received == accounted == 12
    assert rejected == {"invalid": 3, "unstorable": 0, "overload": 2, "unavailable": 0}


def test_a_request_the_store_cannot_take_counts_its_actions_as_unavailable(
    start_sidecar: Any, tmp_path: Path
) -> None:
    # Answered 503 for a store failure, its actions and its invalid span were counted in
    # nothing but spans_received.
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    with sqlite3.connect(store) as db:  # a store whose schema it cannot use: a StoreError
        db.execute("CREATE TRIGGER broken BEFORE INSERT ON actions BEGIN SELECT 1 FROM no_such_table; END")
    db.close()
    assert post(sidecar, mixed_request("broken")) == 503
    received, accounted, rejected = balance(sidecar)
    assert received == accounted == 4
    assert rejected == {"invalid": 1, "unstorable": 0, "overload": 0, "unavailable": 2}


def test_a_failed_idle_sweep_is_a_failed_store_transaction(start_sidecar: Any, tmp_path: Path) -> None:
    # Only Export write batches were counted: a sweep failing every second went unseen.
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store, evaluation__idle_s=0.3)
    assert post(sidecar, mixed_request("idle")) == 200
    with sqlite3.connect(store) as db:
        db.execute("CREATE TRIGGER broken BEFORE UPDATE ON sessions BEGIN SELECT 1 FROM no_such_table; END")
    db.close()
    wait_for(lambda: any(line.get("event") == "idle-sweep-failed" for line in sidecar.log.lines()))
    assert sidecar.metric("durable_sessions_store_commit_failures_total") >= 1


def test_a_redelivered_span_of_an_ended_session_neither_rebuilds_nor_holds_it(
    start_sidecar: Any, tmp_path: Path
) -> None:
    # Each duplicate of an ended session replayed its stored records and held it in memory,
    # for good: nothing new was stored, so no sweep ended it again.
    sidecar = start_sidecar(tmp_path / "sessions.db", evaluation__idle_s=0.3)
    bodies = [mixed_request(f"ended-{n}") for n in range(3)]
    for body in bodies:
        assert post(sidecar, body) == 200
    wait_for(lambda: sidecar.metric("durable_sessions_sessions_ended_total") == 3)
    assert sidecar.metric("durable_sessions_sessions_in_memory") == 0
    for body in bodies:
        assert post(sidecar, body) == 200
    assert sidecar.metric("durable_sessions_spans_duplicate_total") == 6
    assert sidecar.metric("durable_sessions_sessions_rebuilt_total") == 0
    assert sidecar.metric("durable_sessions_sessions_in_memory") == 0


def test_a_transfer_coding_the_port_does_not_take_is_counted_unsupported(sidecar: Sidecar) -> None:
    # Answered 501, it was counted as invalid.
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    connection.putrequest("POST", "/v1/traces")
    connection.putheader("Content-Type", "application/x-protobuf")
    connection.putheader("Transfer-Encoding", "gzip, chunked")
    connection.endheaders()
    connection.send(b"0\r\n\r\n")
    assert connection.getresponse().status == 501
    connection.close()
    assert (
        sidecar.metric("durable_sessions_export_requests_total", transport="http", outcome="unsupported") == 1
    )
    assert sidecar.metric("durable_sessions_export_requests_total", transport="http", outcome="invalid") == 0
