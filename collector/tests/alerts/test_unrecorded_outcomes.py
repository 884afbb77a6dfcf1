"""Delivery while the store refuses writes (real SQLite store, real webhook receiver,
real triggers standing for a full disk), on a clock the test moves.

A failed attempt the store refuses to record keeps its backoff and counts towards the
dead letter (in memory until the store takes it), rather than the receiver being asked
again every second, forever; nothing is sent twice because of it. What the channel
remembers of refused writes is bounded: the id of a row retention deleted first is
forgotten.
"""

from __future__ import annotations

import io
import random
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from durable_sessions_collector.alerts.metrics import DEAD_LETTER, RETRY, Metrics
from durable_sessions_collector.alerts.outbox import DeliveryPolicy
from durable_sessions_collector.alerts.webhook import WebhookAlerts
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import SqliteStore, open_store
from durable_sessions_collector.store.postgres import CLAIM_LEASE_S
from webhook_server import WebhookServer

START = 1_000_000.0
POLICY = DeliveryPolicy(max_attempts=3, timeout_s=2.0, backoff_s=10.0, max_backoff_s=10.0)  # 5-15 s


class Clock:
    """The host clock the store reads: moved by the test."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


def alert(n: int) -> dict[str, object]:
    return {"key": f"k-{n}", "session_id": "s-1", "rule": "unkeyed-side-effect", "action_id": f"a-{n}"}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[SqliteStore]:
    store = SqliteStore(str(tmp_path / "sessions.db"), clock=clock)
    yield store
    store.close()


def refuse_writes(store: SqliteStore, table: str = "outbox") -> None:
    with sqlite3.connect(store.path) as db:
        db.execute(
            f"CREATE TRIGGER refuse BEFORE UPDATE ON {table} "
            "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
        )


def refused() -> pytest.RaisesExc[sqlite3.Error]:
    """The store's refusal, as the trigger raises it."""
    return pytest.raises(sqlite3.Error, match="disk is full")


def take_writes(store: SqliteStore) -> None:
    with sqlite3.connect(store.path) as db:
        db.execute("DROP TRIGGER refuse")


def deliveries(metrics: Metrics, outcome: str) -> float | None:
    return metrics.registry.get_sample_value(
        "durable_sessions_alert_deliveries_total", {"channel": "webhook", "outcome": outcome}
    )


def outbox_row(store: SqliteStore, key: str) -> tuple[str, int, str]:
    with sqlite3.connect(store.path) as db:
        return db.execute(
            "SELECT state, attempts, last_error FROM outbox WHERE violation_key = ?", (key,)
        ).fetchone()


def test_while_the_store_refuses_failures_the_backoff_and_the_dead_letter_hold(
    store: SqliteStore, clock: Clock
) -> None:
    with store.writer() as writer:
        writer.enqueue_alert("webhook", "k-1", alert(1), START)
    metrics = Metrics(store)
    log = io.StringIO()
    refuse_writes(store)
    with WebhookServer(fail_first=None, fail_status=500) as hook:
        channel = WebhookAlerts(store, JsonLog(log), metrics, hook.url, policy=POLICY, rng=random.Random(7))
        with refused():
            channel.deliver_due()
        assert len(hook.requests) == 1
        for _ in range(4):  # a second later, and each second until 5 s: not due by its backoff
            clock.now += 1
            assert channel.deliver_due() == 0
        assert len(hook.requests) == 1
        clock.now += 20  # due: the second attempt, refused too
        with refused():
            channel.deliver_due()
        clock.now += 20  # the third and last: dead-lettered, its mark refused
        with refused():
            channel.deliver_due()
        assert len(hook.requests) == 3
        for _ in range(3):
            clock.now += 60
            with refused():  # its dead mark, tried again; no POST
                channel.deliver_due()
        assert len(hook.requests) == 3
        assert deliveries(metrics, RETRY) == 2
        assert deliveries(metrics, DEAD_LETTER) == 1  # the dead letter shows while the store fails
        take_writes(store)
        assert channel.deliver_due() == 0
        assert outbox_row(store, "k-1") == ("dead", 3, "HTTP 500")  # every attempt counted
        clock.now += 600
        assert channel.deliver_due() == 0
        assert len(hook.requests) == 3
    assert log.getvalue().count('"alert-dead-letter"') == 1


def test_failures_the_store_refused_are_written_with_the_next_one_and_the_count_goes_on(
    store: SqliteStore, clock: Clock
) -> None:
    with store.writer() as writer:
        writer.enqueue_alert("webhook", "k-1", alert(1), START)
    policy = DeliveryPolicy(max_attempts=8, timeout_s=2.0, backoff_s=10.0, max_backoff_s=10.0)
    refuse_writes(store)
    with WebhookServer(fail_first=3, fail_status=500) as hook:
        channel = WebhookAlerts(store, JsonLog(io.StringIO()), Metrics(store), hook.url, policy=policy)
        for _ in range(2):  # two failures the store refuses
            with refused():
                channel.deliver_due()
            clock.now += 20
        take_writes(store)
        assert channel.deliver_due() == 0  # the third failure, written with the two before it
        state, attempts, _ = outbox_row(store, "k-1")
        assert (state, attempts) == ("pending", 3)
        clock.now += 20
        assert channel.deliver_due() == 1
        assert outbox_row(store, "k-1")[:2] == ("delivered", 4)
    assert len(hook.requests) == 4
    assert len({request.headers["idempotency-key"] for request in hook.requests}) == 1


def test_what_the_channel_keeps_of_refused_writes_is_bounded_and_deleted_rows_pass_out_of_it(
    store: SqliteStore,
) -> None:
    # Each alert fails at the receiver and the store refuses to record it; the rows are then
    # deleted (a real DELETE: the trigger refuses updates only), as retention deletes a
    # row whose mark was committed though the store reported a failure. They must not be
    # kept for ever: newer refusals push them out past the bound. SQLite gives the new rows
    # the deleted ones' ids: they are new alerts all the same, sent at once.
    with store.writer() as writer:
        for n in range(3):
            writer.enqueue_alert("webhook", f"k-{n}", alert(n), START)
    refuse_writes(store)
    with WebhookServer(fail_first=None, fail_status=500) as hook:
        channel = WebhookAlerts(store, JsonLog(io.StringIO()), Metrics(store), hook.url, policy=POLICY)
        channel.unrecorded.limit = 3
        for _ in range(3):  # each pass sends the next alert: the earlier ones wait for their retry
            with refused():
                channel.deliver_due()
        assert len(hook.requests) == 3
        assert channel.unrecorded.keys() == ["k-0", "k-1", "k-2"]
        with sqlite3.connect(store.path) as db:
            db.execute("DELETE FROM outbox")
        take_writes(store)
        with store.writer() as writer:
            for n in range(3, 6):
                writer.enqueue_alert("webhook", f"k-{n}", alert(n), START)
        refuse_writes(store)
        for _ in range(3):
            with refused():
                channel.deliver_due()
            assert len(channel.unrecorded) <= 3
        assert len(hook.requests) == 6  # the deleted rows' alerts not sent again
        assert channel.unrecorded.keys() == ["k-3", "k-4", "k-5"]


def test_a_refused_failure_the_store_has_after_all_is_not_counted_twice(
    store: SqliteStore, clock: Clock
) -> None:
    # A commit can fail only to answer (PostgreSQL's connection lost as it commits): the
    # store then holds the failure the channel kept as refused. Here the refusal is a
    # trigger and the commit that landed anyway is made by hand, as the mark would have.
    with store.writer() as writer:
        writer.enqueue_alert("webhook", "k-1", alert(1), START)
    refuse_writes(store)
    policy = DeliveryPolicy(max_attempts=8, timeout_s=2.0, backoff_s=10.0, max_backoff_s=10.0)
    with WebhookServer(fail_first=None, fail_status=500) as hook:
        channel = WebhookAlerts(store, JsonLog(io.StringIO()), Metrics(store), hook.url, policy=policy)
        with refused():
            channel.deliver_due()
        take_writes(store)
        with sqlite3.connect(store.path) as db:
            db.execute(
                "UPDATE outbox SET attempts = 1, last_error = 'HTTP 500', next_attempt_at = ?", (START + 5,)
            )
        clock.now += 20
        assert channel.deliver_due() == 0
        assert len(hook.requests) == 2
    assert outbox_row(store, "k-1")[:2] == ("pending", 2)  # not 3: the first failure counted once


def test_a_mark_counts_the_failed_attempts_it_is_given_on_either_store(store_url: str) -> None:
    # The refused failures are written with the next one, in one mark.
    store = open_store(store_url)
    try:
        with store.writer() as writer:
            for n in (1, 2):
                writer.enqueue_alert("webhook", f"k-{n}", alert(n), 1.0)
        first, second = store.pending_alerts("webhook", 2.0)
        with store.writer() as writer:
            writer.mark_failed(first, "HTTP 500", 100.0, 3)
            writer.mark_failed(second, "HTTP 400", None, 2)
        [again] = store.pending_alerts("webhook", 100.0 + CLAIM_LEASE_S)
        assert (again.violation_key, again.attempts) == ("k-1", 3)
        [dead] = store.dead_alerts("webhook")
        assert (dead.violation_key, dead.attempts, dead.last_error) == ("k-2", 2, "HTTP 400")
    finally:
        store.close()
