"""Replicas sharing a PostgreSQL store judge idleness by one clock: the server's."""

from __future__ import annotations

import time

import pytest
from durable_sessions_collector.store.postgres import ServerClock
from sidecar_clients import Agent, grpc_exporter

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


def test_the_server_clock_is_read_again_only_after_its_interval() -> None:
    readings = iter([1000.0, 5000.0])
    clock = ServerClock(lambda: next(readings), read_every_s=3600)
    first = clock.now()
    assert 1000.0 <= first < 1001.0
    assert first <= clock.now() < 1001.0  # carried by the monotonic clock, not read again
    clock.read_every_s = 0
    assert clock.now() >= 5000.0
