"""Resolved alerts: an end-of-session violation that later spans settle is reported as
resolved on every channel, once, and one that holds again afterwards fires again.

Real sidecars (SQLite, and PostgreSQL when configured) with the log channel, a real
webhook receiver and a real OTLP logs receiver. The scenario is the README's: an email
started and never completed is ``unresolved-side-effect`` when the session goes idle;
its completion (status ``error``: nothing was sent) arrives after that end, so the next
end resolves it. A later keyed start of the same action makes it hold again.

The process killed by SIGKILL with the resolution committed and not yet delivered is in
``test_a_resolution_committed_before_a_sigkill_is_delivered_once_after_it``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from conftest import Sidecar, wait_for
from durable_sessions_collector.alerts import idempotency_key, outbox_key
from durable_sessions_collector.store import open_store
from opentelemetry.proto.logs.v1 import logs_pb2
from otlp_log_server import OtlpLogServer
from sidecar_clients import Agent, grpc_exporter
from webhook_server import WebhookServer, free_port

SESSION, ACTION = "late", "mail-1"
LEASE = 60.0
"""Past a PostgreSQL store's claim of a row (its lease): due again for the next claim."""
FAST = {
    "alerts__webhook__backoff_s": 0.05,
    "alerts__webhook__max_backoff_s": 0.2,
    "alerts__otlp__backoff_s": 0.05,
    "alerts__otlp__max_backoff_s": 0.2,
}


def started(sidecar: Sidecar, **fields: Any) -> None:
    """The email is started (and not completed, nor keyed): unresolved-side-effect at the end."""
    send(sidecar, status="started", **fields)


def failed(sidecar: Sidecar, **fields: Any) -> None:
    """The email's completion: it failed, nothing was sent, so nothing is unresolved."""
    send(sidecar, status="error", error=True, **fields)


def send(endpoint: Sidecar | str, **fields: Any) -> None:
    address = endpoint if isinstance(endpoint, str) else endpoint.grpc_endpoint
    agent = Agent(grpc_exporter(address), "run-1")
    agent.action(SESSION, ACTION, "email", **fields)
    agent.shutdown()


def ended(sidecar: Sidecar) -> dict[str, Any]:
    """The session once it is ended, with its violations."""

    def detail() -> dict[str, Any] | None:
        found = sidecar.session(SESSION)
        return found if found["state"] == "ended" else None

    return wait_for(detail)  # type: ignore[no-any-return]


def log_alerts(*sidecars: Sidecar) -> list[dict[str, Any]]:
    return [
        line
        for sidecar in sidecars
        for line in sidecar.log.lines()
        if line.get("event") in ("violation", "violation-resolved")
    ]


def otlp_records(server: OtlpLogServer) -> list[logs_pb2.LogRecord]:
    return [
        record
        for export in server.accepted
        for resource_logs in export.request.resource_logs
        for scope_logs in resource_logs.scope_logs
        for record in scope_logs.log_records
    ]


def attributes(record: logs_pb2.LogRecord) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in record.attributes}


def pending(sidecar: Sidecar) -> float:
    return sum(
        sidecar.metric("durable_sessions_alert_outbox", channel=channel, state="pending")
        for channel in ("log", "webhook", "otlp")
    )


def settle(*sidecars: Sidecar) -> None:
    """Let several sweeps and delivery rounds pass: whatever would be sent twice is, by now."""
    time.sleep(1.0)
    for sidecar in sidecars:
        wait_for(lambda s=sidecar: pending(s) == 0)


def resolution_with_a_restart_between(start_sidecar, store: str | Path) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer() as hook, OtlpLogServer() as logs:
        channels = {"alerts__webhook__url": hook.url, "alerts__otlp__endpoint": logs.endpoint, **FAST}
        first = start_sidecar(store, **channels)
        started(first)
        [violation] = ended(first)["violations"]
        key = violation["key"]
        wait_for(lambda: len(hook.accepted) == 1 and len(otlp_records(logs)) == 1)
        first.stop()

        second = start_sidecar(store, **channels)
        failed(second)
        detail = ended(second)
        assert detail["verdict"] == "ok"
        assert [(v["key"], v["resolved"]) for v in detail["violations"]] == [(key, True)]
        wait_for(lambda: len(hook.accepted) == 2 and len(otlp_records(logs)) == 2)
        settle(second)
        # A third start: nothing left to send, nothing sent again.
        second.stop()
        third = start_sidecar(store, **channels)
        settle(third)

        # The log: the firing line from the first process, the resolution from the second.
        [firing_line] = log_alerts(first)
        [resolved_line] = log_alerts(second)
        assert log_alerts(third) == []
        assert (firing_line["status"], firing_line["session_verdict"]) == ("firing", "unrecoverable")
        assert (resolved_line["event"], resolved_line["level"]) == ("violation-resolved", "info")
        assert (resolved_line["status"], resolved_line["session_verdict"]) == ("resolved", "ok")
        assert resolved_line["detected_at"] > firing_line["detected_at"]
        same = ("key", "rule", "severity", "session_id", "action_id", "trace_id", "span_id", "message")
        assert {name: resolved_line[name] for name in same} == {name: firing_line[name] for name in same}
        assert resolved_line["key"] == key

        # The webhook: once each, the resolution under a key of its own.
        assert len(hook.requests) == 2
        firing, resolved = (received.body for received in hook.accepted)
        assert (firing["status"], resolved["status"]) == ("firing", "resolved")
        assert (firing["session_verdict"], resolved["session_verdict"]) == ("unrecoverable", "ok")
        assert firing["violation_key"] == resolved["violation_key"] == key
        keys = [received.headers["idempotency-key"] for received in hook.accepted]
        assert keys == [firing["idempotency_key"], resolved["idempotency_key"]]
        assert re.fullmatch(re.escape(keys[0]) + r":resolved:\d+", keys[1])
        assert keys[0] == idempotency_key(
            {"session_id": SESSION, "rule": violation["rule"], "action_id": ACTION}
        )

        # The OTLP log records: the resolution at INFO, with the same attributes.
        assert len(logs.requests) == 2
        error, info = otlp_records(logs)
        assert (error.severity_text, info.severity_text) == ("ERROR", "INFO")
        assert info.severity_number == logs_pb2.SEVERITY_NUMBER_INFO
        assert info.body.string_value == "resolved: " + error.body.string_value
        assert (info.trace_id, info.span_id) == (error.trace_id, error.span_id)
        firing_attrs, resolved_attrs = attributes(error), attributes(info)
        assert firing_attrs.pop("durable_sessions.alert.status") == "firing"
        assert resolved_attrs.pop("durable_sessions.alert.status") == "resolved"
        assert firing_attrs.pop("durable_sessions.verdict") == "unrecoverable"
        assert resolved_attrs.pop("durable_sessions.verdict") == "ok"
        assert firing_attrs.pop("durable_sessions.alert.idempotency_key") == keys[0]
        assert resolved_attrs.pop("durable_sessions.alert.idempotency_key") == keys[1]
        assert firing_attrs == resolved_attrs


def test_a_late_completion_after_a_restart_is_reported_resolved_once_on_every_channel(
    start_sidecar, store_url: str
) -> None:  # type: ignore[no-untyped-def]
    resolution_with_a_restart_between(start_sidecar, store_url)


def firing_resolved_firing(start_sidecar, store: str | Path) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer() as hook:
        channels = {"alerts__webhook__url": hook.url, **FAST}
        first = start_sidecar(store, **channels)
        started(first)
        [violation] = ended(first)["violations"]
        key = violation["key"]
        failed(first)
        assert [(v["key"], v["resolved"]) for v in ended(first)["violations"]] == [(key, True)]
        wait_for(lambda: len(hook.accepted) == 2)
        # Restarted between the resolution and the new start: the store alone knows the
        # violation was resolved, and that it holding again is a change.
        first.stop()
        sidecar = start_sidecar(store, **channels)
        started(sidecar, idempotency_key="mail-1-key")  # the action is run again, keyed
        detail = ended(sidecar)
        assert detail["verdict"] == "unrecoverable"
        assert (key, False) in [(v["key"], v["resolved"]) for v in detail["violations"]]
        settle(sidecar)

    ours = [received for received in hook.requests if received.body["violation_key"] == key]
    assert [r.body["status"] for r in ours] == ["firing", "resolved", "firing"]
    assert [r.body["session_verdict"] for r in ours] == ["unrecoverable", "ok", "unrecoverable"]
    keys = [r.headers["idempotency-key"] for r in ours]
    assert len(set(keys)) == 3
    assert re.fullmatch(re.escape(keys[0]) + r":resolved:\d+", keys[1])
    assert re.fullmatch(re.escape(keys[0]) + r":firing:\d+", keys[2])
    # The new start itself breaks another rule (the action id is used again): its own alert.
    others = Counter(r.body["rule"] for r in hook.requests if r.body["violation_key"] != key)
    assert others == Counter({"duplicate-action-id": 1})
    logged = [
        [(line["event"], line["status"]) for line in log_alerts(s) if line["key"] == key]
        for s in (first, sidecar)
    ]
    assert logged == [
        [("violation", "firing"), ("violation-resolved", "resolved")],
        [("violation", "firing")],
    ]


def test_a_violation_that_fires_resolves_and_fires_again_is_delivered_three_times_once_each(
    start_sidecar, store_url: str
) -> None:  # type: ignore[no-untyped-def]
    firing_resolved_firing(start_sidecar, store_url)


def test_a_resolution_waits_for_its_violations_alert_being_retried(start_sidecar, store_url: str) -> None:  # type: ignore[no-untyped-def]
    """The firing alert fails once (a 500 for its body: the channel goes on) and waits out
    its backoff; the resolution committed meanwhile is sent after it, not before."""
    with WebhookServer(fail_first=1, fail_status=500) as hook:
        sidecar = start_sidecar(store_url, alerts__webhook__url=hook.url, alerts__webhook__backoff_s=3)
        started(sidecar)
        ended(sidecar)
        wait_for(lambda: len(hook.requests) == 1)  # refused: retried in 1.5 s at the soonest
        failed(sidecar)
        assert [v["resolved"] for v in ended(sidecar)["violations"]] == [True]
        wait_for(lambda: len(hook.accepted) == 2, timeout=15)
    assert [r.body["status"] for r in hook.requests] == ["firing", "firing", "resolved"]


def test_the_outbox_gives_a_violations_alerts_in_order(store_url: str) -> None:
    store = open_store(store_url)
    try:
        fired, other = {"key": "s|r|a|1", "status": "firing"}, {"key": "s|r|a|2", "status": "firing"}
        resolved = {**fired, "status": "resolved", "transition": "resolved:2000000"}
        again = {**fired, "transition": "firing:3000000"}
        with store.writer() as writer:
            for payload in (fired, other, resolved, again):
                writer.enqueue_alert("webhook", outbox_key(payload), payload, 1.0)

        def due(now: float) -> list[str]:
            return [alert.violation_key for alert in store.pending_alerts("webhook", now)]

        [first, second] = store.pending_alerts("webhook", 2.0)
        assert [first.violation_key, second.violation_key] == ["s|r|a|1", "s|r|a|2"]
        with store.writer() as writer:  # the firing alert failed: retried at 100
            writer.mark_failed(first, "HTTP 500", 100.0)
            writer.mark_delivered([second], 2.0)
        assert due(99.0) == []  # its resolution waits for it
        assert due(100.0 + LEASE) == ["s|r|a|1"]
        [first] = store.pending_alerts("webhook", 200.0 + LEASE)
        with store.writer() as writer:
            writer.mark_delivered([first], 201.0)
        [resolution] = store.pending_alerts("webhook", 300.0 + LEASE)
        assert resolution.violation_key == "s|r|a|1:resolved:2000000"
        with store.writer() as writer:  # a dead letter holds nothing back
            writer.mark_failed(resolution, "HTTP 400", None)
        assert due(400.0 + LEASE) == ["s|r|a|1:firing:3000000"]
    finally:
        store.close()


# --- SIGKILL --------------------------------------------------------------------------------


class SidecarProcess:
    """``durable-sessions-collector serve`` in a process of its own, to be SIGKILLed."""

    def __init__(self, db: Path, log: Path, webhook_url: str) -> None:
        self.log = log
        self.grpc_endpoint = f"127.0.0.1:{free_port()}"
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "durable_sessions_collector", "serve",
                "--store", f"sqlite:///{db}",
                "--grpc-endpoint", self.grpc_endpoint,
                "--http-endpoint", f"127.0.0.1:{free_port()}",
                "--idle-s", "0.3",
                "--webhook-url", webhook_url,
                "--webhook-backoff-s", "0.05",
                "--webhook-max-backoff-s", "0.2",
                "--webhook-max-attempts", "1000",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        wait_for(lambda: self.events("started") or self.process.poll() is not None, 20)
        assert self.process.poll() is None, log.read_text()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def events(self, event: str) -> list[dict[str, Any]]:
        return [line for line in self.lines() if line.get("event") == event]

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


def test_a_resolution_committed_before_a_sigkill_is_delivered_once_after_it(tmp_path: Path) -> None:
    db = tmp_path / "sessions.db"
    with WebhookServer() as hook:
        first = SidecarProcess(db, tmp_path / "first.log", hook.url)
        try:
            send(first.grpc_endpoint, status="started")
            wait_for(lambda: len(hook.accepted) == 1)
            hook.fail_first = None  # the receiver goes down (503 to every POST) ...
            send(first.grpc_endpoint, status="error", error=True)
            # ... so the resolution, committed and written to the log, waits in the outbox.
            wait_for(lambda: first.events("violation-resolved"))
            wait_for(lambda: len(hook.requests) >= 3)  # retried: still pending when killed
        finally:
            first.kill()
        hook.fail_first = 0  # the receiver is back
        second = SidecarProcess(db, tmp_path / "second.log", hook.url)
        try:
            wait_for(lambda: len(hook.accepted) == 2)
            time.sleep(1.0)  # sweeps and delivery rounds: a repeat would be sent by now
        finally:
            second.kill()
        third = SidecarProcess(db, tmp_path / "third.log", hook.url)  # killed again, restarted
        time.sleep(1.0)
        third.kill()

    firing, resolved = (received.body for received in hook.accepted)
    assert (firing["status"], resolved["status"]) == ("firing", "resolved")
    assert resolved["session_verdict"] == "ok"
    assert resolved["idempotency_key"].startswith(firing["idempotency_key"] + ":resolved:")
    assert len(hook.accepted) == 2  # once each, across the kills
    alert_events = ("violation", "violation-resolved")
    assert [line["event"] for line in first.lines() if line.get("event") in alert_events] == list(
        alert_events
    )
    for later in (second, third):
        assert [line for line in later.lines() if line.get("event") in alert_events] == []
