"""Webhook alerts: a real sidecar POSTs to a real local HTTP server.

Each violation is POSTed as JSON with an Idempotency-Key from session + rule + action,
retried with backoff while the receiver fails or is down, kept in the outbox across a
restart, dead-lettered after ``max_attempts``, and never sent twice once delivered.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time

import pytest
from conftest import wait_for
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sidecar_clients import Agent, grpc_exporter, recorded_agent
from webhook_server import ClosedPort, WebhookServer

SECRET = "card 4242 4242 4242 4242"
FAST = {
    "alerts__webhook__backoff_s": 0.05,
    "alerts__webhook__max_backoff_s": 0.2,
    "alerts__webhook__timeout_s": 2,
}


def expected_key(session_id: str, rule: str, action_id: str) -> str:
    """The documented contract: ds-alert- + 32 hex of SHA-256(session \\x1f rule \\x1f action)."""
    return "ds-alert-" + hashlib.sha256(f"{session_id}\x1f{rule}\x1f{action_id}".encode()).hexdigest()[:32]


def unkeyed_payment(sidecar, session_id: str = "pay-1") -> Agent:  # type: ignore[no-untyped-def]
    """One unkeyed payment (unkeyed-side-effect, an error found at ingest); the result
    text is a secret that must not reach the webhook."""
    agent = recorded_agent(sidecar.grpc_endpoint)
    agent.action(session_id, "charge", "payment", result=json.dumps({"note": SECRET}))
    return agent


def outbox(sidecar, state: str) -> float:  # type: ignore[no-untyped-def]
    return sidecar.metric("durable_sessions_alert_outbox", channel="webhook", state=state)


def deliveries(sidecar, outcome: str) -> float:  # type: ignore[no-untyped-def]
    return sidecar.metric("durable_sessions_alert_deliveries_total", channel="webhook", outcome=outcome)


def test_a_failing_receiver_gets_the_alert_after_retries_with_one_idempotency_key(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer(fail_first=2, fail_status=503) as hook:
        sidecar = start_sidecar(alerts__webhook__url=hook.url, alerts__webhook__max_attempts=5, **FAST)
        agent = unkeyed_payment(sidecar)
        wait_for(lambda: len(hook.accepted) == 1)
        assert len(hook.requests) == 3  # two 503s, then 200
        key = expected_key("pay-1", "unkeyed-side-effect", "charge")
        assert {r.headers["idempotency-key"] for r in hook.requests} == {key}
        assert {r.raw for r in hook.requests} == {hook.requests[0].raw}  # the same body each time
        request = hook.accepted[0]
        assert request.path == "/hooks/durable-sessions"
        assert request.headers["content-type"] == "application/json"
        body = request.body
        assert body["idempotency_key"] == key
        assert (body["session_id"], body["rule"], body["severity"], body["action_id"]) == (
            "pay-1",
            "unkeyed-side-effect",
            "error",
            "charge",
        )
        assert body["session_verdict"] == "unrecoverable"
        assert body["message"] and body["trace_id"] and body["span_id"]
        # no result text, nor a part of it ("4242" alone can be in a hex id or key)
        assert SECRET.encode() not in request.raw and b"4242 4242" not in request.raw

        wait_for(lambda: outbox(sidecar, "delivered") == 1)
        assert outbox(sidecar, "pending") == 0
        assert deliveries(sidecar, "retry") == 2
        # Counted, then its latency observed, once the store has the mark the outbox gauge reads.
        latency = ("durable_sessions_alert_latency_seconds_count", (("channel", "webhook"),))
        wait_for(lambda: sidecar.metrics().get(latency, 0) >= 1)
        assert deliveries(sidecar, "delivered") == 1
        assert deliveries(sidecar, "dead_letter") == 0
        metrics = sidecar.metrics()
        assert (
            metrics[("durable_sessions_alert_delivery_duration_seconds_count", (("channel", "webhook"),))]
            == 3
        )
        assert metrics[latency] == 1
        retries = [line for line in sidecar.log.lines() if line["event"] == "alert-delivery-retry"]
        assert [line["attempt"] for line in retries] == [1, 2]
        assert all(0 < line["retry_in_s"] <= 0.2 for line in retries)
        agent.shutdown()


def test_a_receiver_that_is_down_gets_the_alert_once_after_restarts(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    down = ClosedPort()  # the receiver is down
    port = down.port
    url = f"http://127.0.0.1:{port}/hook"
    store = tmp_path / "sessions.db"
    settings = {"alerts__webhook__url": url, "alerts__webhook__max_attempts": 1000, **FAST}

    first = start_sidecar(store, **settings)
    agent = unkeyed_payment(first)
    wait_for(lambda: deliveries(first, "retry") >= 2)  # connection refused, retried
    assert outbox(first, "pending") == 1
    first.stop()  # the alert is still pending: it must survive the restart
    agent.shutdown()
    spans = agent.recorder.spans

    second = start_sidecar(store, **settings)
    assert outbox(second, "pending") == 1
    with WebhookServer(down.release()) as hook:  # the receiver comes up
        wait_for(lambda: outbox(second, "delivered") == 1)
        assert [r.headers["idempotency-key"] for r in hook.requests] == [
            expected_key("pay-1", "unkeyed-side-effect", "charge")
        ]
        assert second.alerts() == []  # the log channel had already raised it in the first run
        second.stop()

        # Once more: a new process, and the same span delivered again (OTLP is at least once).
        third = start_sidecar(store, **settings)
        assert grpc_exporter(third.grpc_endpoint).export(spans) == SpanExportResult.SUCCESS
        assert third.metric("durable_sessions_spans_duplicate_total") == 1
        assert third.session("pay-1")["action_count"] == 1
        time.sleep(0.4)  # several delivery rounds
        assert len(hook.requests) == 1
        assert outbox(third, "pending") == 0 and outbox(third, "delivered") == 1
        assert third.alerts() == []


def test_a_receiver_that_never_succeeds_gets_max_attempts_then_dead_letter(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer(fail_first=None, fail_status=500) as hook:
        sidecar = start_sidecar(alerts__webhook__url=hook.url, alerts__webhook__max_attempts=3, **FAST)
        agent = unkeyed_payment(sidecar)
        wait_for(lambda: outbox(sidecar, "dead") == 1)
        assert len(hook.requests) == 3
        assert deliveries(sidecar, "retry") == 2
        assert deliveries(sidecar, "dead_letter") == 1
        assert outbox(sidecar, "pending") == 0
        [dead] = [line for line in sidecar.log.lines() if line["event"] == "alert-dead-letter"]
        assert dead["attempts"] == 3 and dead["error"] == "HTTP 500"
        assert dead["reason"] == "attempts exhausted"
        time.sleep(0.5)
        assert len(hook.requests) == 3  # a dead letter is never sent again
        assert sidecar.get("/healthz")[0] == 200
        agent.shutdown()


def test_a_receiver_that_rejects_the_alert_dead_letters_it_at_once(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer(fail_first=None, fail_status=400) as hook:
        sidecar = start_sidecar(alerts__webhook__url=hook.url, alerts__webhook__max_attempts=8, **FAST)
        agent = unkeyed_payment(sidecar)
        wait_for(lambda: outbox(sidecar, "dead") == 1)
        assert len(hook.requests) == 1
        assert deliveries(sidecar, "retry") == 0 and deliveries(sidecar, "dead_letter") == 1
        agent.shutdown()


def unkeyed_payments(sidecar, count: int) -> None:  # type: ignore[no-untyped-def]
    """``count`` alerts committed in one transaction (one Export), so that all are due at once."""
    spans = InMemorySpanExporter()
    agent = Agent(spans, "inc-1")
    for n in range(count):
        agent.action("burst", f"charge-{n}", "payment")
    agent.shutdown()
    exporter = grpc_exporter(sidecar.grpc_endpoint)
    assert exporter.export(spans.get_finished_spans()) is SpanExportResult.SUCCESS
    exporter.shutdown()


def rate_limited_receiver_pauses_the_channel(start_sidecar, store: str | None) -> None:  # type: ignore[no-untyped-def]
    # The 429's Retry-After was honoured for that one alert: the others due were POSTed at
    # once, each losing an attempt, and against a receiver allowing one POST a second a
    # burst was dead-lettered. Now nothing else is sent before the retry.
    with WebhookServer(fail_first=1, fail_status=429, retry_after="1") as hook:
        sidecar = start_sidecar(
            store,
            alerts__webhook__url=hook.url,
            alerts__webhook__max_attempts=2,
            alerts__webhook__backoff_s=0.05,
            alerts__webhook__max_backoff_s=5,
        )
        unkeyed_payments(sidecar, 4)
        wait_for(lambda: len(hook.accepted) == 4, timeout=15)
        assert len(hook.requests) == 5
        first, second = hook.requests[:2]
        assert second.at - first.at >= 0.95  # the Retry-After, for the next alert too
        # ... and no longer: on PostgreSQL the alerts claimed with the first were left
        # claimed for the 60 s lease when the channel paused. (Far below the lease, with
        # room for three POSTs on a loaded machine.)
        assert hook.accepted[-1].at - first.at < 10
    assert deliveries(sidecar, "dead_letter") == 0
    retry = next(line for line in sidecar.log.lines() if line["event"] == "alert-delivery-retry")
    assert retry["channel_paused"] is True


def test_a_rate_limited_receiver_pauses_the_channel_for_every_alert(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    rate_limited_receiver_pauses_the_channel(start_sidecar, None)


@pytest.mark.postgres
def test_a_rate_limited_receiver_pauses_the_channel_for_every_alert_postgres(
    start_sidecar, postgres_url
) -> None:  # type: ignore[no-untyped-def]
    rate_limited_receiver_pauses_the_channel(start_sidecar, postgres_url)


def test_a_failure_of_one_alert_does_not_hold_the_others(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer(fail_first=1, fail_status=500) as hook:
        # The failed alert's retry is 10-30 s away: far from the others' POSTs, also on a
        # loaded machine (with 5 s, 2.5-7.5 s away, a slow start could look like waiting).
        sidecar = start_sidecar(
            alerts__webhook__url=hook.url, alerts__webhook__backoff_s=20, alerts__webhook__max_backoff_s=20
        )
        unkeyed_payments(sidecar, 3)
        wait_for(lambda: len(hook.accepted) == 2, timeout=10)
        assert hook.accepted[-1].at - hook.requests[0].at < 8  # not after the failed one's retry


def test_an_alert_whose_mark_the_store_refused_is_marked_not_posted_again(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The receiver answered 2xx, then the store refused to mark the row delivered (a full
    # disk, a lock held past the busy timeout: here a real trigger). The alert was
    # delivered: once the store takes writes again it is marked, not POSTed a second time.
    db = tmp_path / "sessions.db"
    with WebhookServer() as hook:
        sidecar = start_sidecar(db, alerts__webhook__url=hook.url, **FAST)
        with sqlite3.connect(db) as connection:
            connection.execute(
                "CREATE TRIGGER refuse_mark BEFORE UPDATE OF state ON outbox "
                "WHEN NEW.channel = 'webhook' BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
            )
        agent = unkeyed_payment(sidecar)
        wait_for(lambda: any(line["event"] == "alert-delivery-failed" for line in sidecar.log.lines()))
        time.sleep(2.5)  # the mark is tried again each second, and refused
        assert len(hook.accepted) == 1
        with sqlite3.connect(db) as connection:
            connection.execute("DROP TRIGGER refuse_mark")
        wait_for(lambda: outbox(sidecar, "delivered") == 1)
        time.sleep(0.5)  # a second POST, were there one, would have come by now
        assert len(hook.requests) == 1
        assert deliveries(sidecar, "delivered") == 1
        # One line for the failure that repeated, and one when it is over, with the count
        # (logged once the delivery pass that marked it has returned).
        wait_for(lambda: any(line["event"] == "alert-delivery-recovered" for line in sidecar.log.lines()))
        lines = sidecar.log.lines()
        assert [line["failures"] for line in lines if line["event"] == "alert-delivery-failed"] == [1]
        [recovered] = [line for line in lines if line["event"] == "alert-delivery-recovered"]
        assert recovered["channel"] == "webhook" and recovered["failures"] >= 3
        agent.shutdown()


@pytest.mark.parametrize(
    ("url", "note"),
    [
        ("http://alerts:hunter2-secret@192.0.2.1:9/hook", "user:password as Basic auth"),
        ("http://192.0.2.1:9/hook", "alerts are sent in plaintext"),
        ("https://alerts:hunter2-secret@192.0.2.1:9/hook", None),
        ("http://alerts:hunter2-secret@LOCALHOST:9/hook", None),
        ("http://alerts:hunter2-secret@[::1]:9/hook", None),
    ],
)
def test_a_plaintext_webhook_to_another_host_is_warned_of_without_its_secrets(
    start_sidecar, url, note
) -> None:  # type: ignore[no-untyped-def]
    """As the OTLP channel warns of plaintext to another host: a webhook URL of http://
    with user:password@ sends the password as Basic auth in the clear."""
    sidecar = start_sidecar(alerts__webhook__url=url, **FAST)
    warnings = [line for line in sidecar.log.lines() if line.get("event") == "not-loopback"]
    if note is None:
        assert warnings == []
        return
    assert len(warnings) == 1
    assert warnings[0]["key"] == "alerts.webhook.url"
    assert note in warnings[0]["note"]
    assert "hunter2" not in "\n".join(json.dumps(line) for line in sidecar.log.lines())
