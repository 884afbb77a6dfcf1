"""Replicas sharing a PostgreSQL store judge idleness, and alerts fall due, by one clock:
the server's."""

from __future__ import annotations

import time

import pytest
from conftest import wait_for
from durable_sessions_collector.store.postgres import ServerClock
from sidecar_clients import Agent, grpc_exporter
from webhook_server import WebhookServer

pytestmark = pytest.mark.postgres


def test_a_replica_whose_clock_is_behind_does_not_get_live_sessions_ended(
    start_sidecar, postgres_url
) -> None:  # type: ignore[no-untyped-def]
    judge = start_sidecar(postgres_url, evaluation__idle_s=30)
    behind = start_sidecar(postgres_url, evaluation__idle_s=3600)
    behind.service.pipeline.clock = lambda: time.time() - 45  # its host's clock: 45 s late
    agent = Agent(grpc_exporter(behind.grpc_endpoint), "inc-1")
    agent.action("live", "e1", "email", status="started")  # a still-running side effect
    agent.shutdown()
    pipeline = judge.service.pipeline
    assert pipeline.sweep(pipeline.now()) == 0  # active 45 s ago by the late clock: not idle
    session = judge.session("live")
    assert session["state"] == "active" and session["verdict"] == "ok"
    assert abs(session["last_seen"] - time.time()) < 5  # the server's time, not the late host's


def test_an_alert_written_by_a_replica_whose_clock_is_ahead_is_due_for_the_others(
    start_sidecar, postgres_url
) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer() as hook:
        ahead = start_sidecar(postgres_url, alerts__webhook__url=hook.url)
        ahead.service.webhook.stop()  # it writes the alert; another replica delivers it
        ahead.service.pipeline.clock = lambda: time.time() + 3600  # its host's clock: an hour early
        deliverer = start_sidecar(postgres_url, alerts__webhook__url=hook.url, alerts__webhook__timeout_s=1)
        agent = Agent(grpc_exporter(ahead.grpc_endpoint), "inc-1")
        agent.action("pay", "charge", "payment")  # no idempotency key: a violation at once
        agent.shutdown()
        [alert] = wait_for(lambda: hook.accepted)
        assert alert.body["session_id"] == "pay"
        assert abs(alert.body["detected_at"] - time.time()) < 5  # the server's time
        # A host an hour late neither waits an hour for alerts due nor takes a claim early.
        deliverer.service.webhook.clock = lambda: time.time() - 3600
        assert abs(deliverer.service.webhook.now() - time.time()) < 5


def test_the_server_clock_is_read_again_only_after_its_interval() -> None:
    readings = iter([1000.0, 5000.0])
    clock = ServerClock(lambda: next(readings), read_every_s=3600)
    first = clock.now()
    assert 1000.0 <= first < 1001.0
    assert first <= clock.now() < 1001.0  # carried by the monotonic clock, not read again
    clock.read_every_s = 0
    assert clock.now() >= 5000.0
