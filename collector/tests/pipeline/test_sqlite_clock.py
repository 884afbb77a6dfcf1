"""A SQLite store's times are the host's clock kept from going back: a clock stepped back
(by hand, or NTP correcting a clock that ran ahead) delays neither the end of idle
sessions nor alert retries by the size of the step, while the sidecar runs or across a
restart. The store reads the host's clock it is given: the tests give it one they move."""

from __future__ import annotations

import time
from pathlib import Path

from conftest import wait_for
from durable_sessions_collector.store import SqliteStore
from durable_sessions_collector.store.sqlite import SteadyClock
from sidecar_clients import Agent, grpc_exporter
from webhook_server import WebhookServer

HOUR = 3600.0


class Moved:
    """A clock the test sets."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_time_goes_on_by_the_monotonic_clock_while_the_wall_clock_is_behind() -> None:
    wall, monotonic = Moved(1000.0), Moved(50.0)
    clock = SteadyClock(wall, monotonic)
    assert clock.now() == 1000.0
    wall.now, monotonic.now = 400.0, 55.0  # stepped back 10 minutes, 5 s later
    assert clock.now() == 1005.0
    wall.now, monotonic.now = 410.0, 65.0
    assert clock.now() == 1015.0
    wall.now, monotonic.now = 1017.0, 66.0  # caught up and ahead: the wall clock again
    assert clock.now() == 1017.0
    wall.now, monotonic.now = 5000.0, 67.0  # a step forward is taken as it comes
    assert clock.now() == 5000.0


def test_a_store_reopened_on_a_clock_stepped_back_starts_from_its_latest_time(tmp_path: Path) -> None:
    path = str(tmp_path / "sessions.db")
    before = 1_767_225_600.0
    store = SqliteStore(path, clock=lambda: before)
    with store.writer() as writer:
        writer.touch_session("s-1", store.now(), 1)
        writer.enqueue_alert("webhook", "k-1", {"key": "k-1"}, store.now() + 5)
    store.close()
    store = SqliteStore(path, clock=lambda: before - HOUR)  # stepped back while it was down
    try:
        assert store.now() >= before + 5  # no earlier than the latest time it holds
        with store.writer() as writer:
            assert writer.idle_sessions(store.now() - 1, 10) == ["s-1"]
    finally:
        store.close()


def test_a_clock_stepped_back_while_the_sidecar_runs_delays_no_end_and_no_retry(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    with WebhookServer(fail_first=1, fail_status=500) as hook:
        sidecar = start_sidecar(
            tmp_path / "sessions.db",
            evaluation__idle_s=1.0,
            alerts__webhook__url=hook.url,
            alerts__webhook__backoff_s=0.5,
            alerts__webhook__max_backoff_s=1.0,
        )
        agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
        agent.action("pay", "charge", "payment")  # unkeyed: an alert at once, its first POST failing
        wait_for(lambda: len(hook.requests) == 1)
        sidecar.service.store.clock.wall = lambda: time.time() - HOUR  # the host's clock, stepped back
        agent.action("mail", "e1", "email", status="started")  # unresolved when the session ends
        agent.shutdown()
        stepped = time.monotonic()
        wait_for(lambda: sidecar.session("mail")["state"] == "ended", timeout=10)
        # The payment's retry, and the end's alert.
        wait_for(
            lambda: {request.body["session_id"] for request in hook.accepted} >= {"pay", "mail"}, timeout=10
        )
        assert time.monotonic() - stepped < 10  # not an hour
        assert abs(sidecar.session("mail")["last_seen"] - time.time()) < 10  # not dated an hour back
