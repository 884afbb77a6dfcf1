"""Replicas sharing a PostgreSQL store judge idleness, and alerts fall due, by one clock:
the server's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
from conftest import wait_for
from durable_sessions_collector.store.postgres import ServerClock
from sidecar_clients import Agent, grpc_exporter
from webhook_server import WebhookServer

pytestmark = pytest.mark.postgres


@contextlib.contextmanager
def host_clock_off_by(monkeypatch: pytest.MonkeyPatch, seconds: float) -> Iterator[None]:
    """This host's wall clock (``time.time``, which every part of the sidecar but the store
    would read) ``seconds`` off while the block runs. The replicas share the process, so
    the block is where one of them acts; a store on the server's clock ignores it."""
    true_time = time.time
    monkeypatch.setattr(time, "time", lambda: true_time() + seconds)
    try:
        yield
    finally:
        monkeypatch.setattr(time, "time", true_time)


def test_a_replica_whose_clock_is_ahead_neither_ends_live_sessions_nor_dates_activity_ahead(
    start_sidecar, postgres_url, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # (A clock behind cannot be played here: grpcio dates a call's deadline by time.time,
    # so the exporter's calls would expire before they are sent.)
    judge = start_sidecar(postgres_url, evaluation__idle_s=30)
    writer = start_sidecar(postgres_url, evaluation__idle_s=3600)
    agent = Agent(grpc_exporter(writer.grpc_endpoint), "inc-1")
    agent.action("live", "e1", "email", status="started")  # a still-running side effect
    agent.shutdown()
    pipeline = judge.service.pipeline
    with host_clock_off_by(monkeypatch, 45):  # the judge's host clock 45 s early
        assert pipeline.sweep(pipeline.now()) == 0  # active 45 s ago by the early clock: not idle
    session = judge.session("live")
    assert session["state"] == "active" and session["verdict"] == "ok"
    with host_clock_off_by(monkeypatch, 3600):  # the writer's host clock an hour early
        agent = Agent(grpc_exporter(writer.grpc_endpoint), "inc-1")
        agent.action("later", "e2", "email", status="started")
        agent.shutdown()
    assert abs(judge.session("later")["last_seen"] - time.time()) < 5  # the server's time, not the host's


def test_an_alert_written_by_a_replica_whose_clock_is_ahead_is_due_for_the_others(
    start_sidecar, postgres_url, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer() as hook:
        ahead = start_sidecar(postgres_url, alerts__webhook__url=hook.url)
        ahead.service.webhook.stop()  # it writes the alert; another replica delivers it
        with host_clock_off_by(monkeypatch, 3600):  # the host's clock an hour early while `ahead` writes
            agent = Agent(grpc_exporter(ahead.grpc_endpoint), "inc-1")
            agent.action("pay", "charge", "payment")  # no idempotency key: a violation at once
            agent.shutdown()
        # Started after: due an hour from now by the early clock, it would wait that hour.
        deliverer = start_sidecar(postgres_url, alerts__webhook__url=hook.url, alerts__webhook__timeout_s=1)
        [alert] = wait_for(lambda: hook.accepted)
        assert alert.body["session_id"] == "pay"
        assert abs(alert.body["detected_at"] - time.time()) < 5  # the server's time
        # A host an hour late neither waits an hour for alerts due nor takes a claim early.
        true_now = time.time()
        with host_clock_off_by(monkeypatch, -3600):
            assert abs(deliverer.service.webhook.now() - true_now) < 5


def test_the_server_clock_is_read_again_only_after_its_interval() -> None:
    readings = iter([1000.0, 5000.0])
    clock = ServerClock(lambda: next(readings), read_every_s=3600)
    first = clock.now()
    assert 1000.0 <= first < 1001.0
    assert first <= clock.now() < 1001.0  # carried by the monotonic clock, not read again
    clock.read_every_s = 0
    assert clock.now() >= 5000.0
