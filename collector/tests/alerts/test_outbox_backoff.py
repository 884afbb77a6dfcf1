"""The outbox loop's backoff for any count of attempts (real SQLite store, real webhook
receiver): ``alerts.webhook.max_attempts`` has no upper bound, and an alert tried more
than about 1,024 times is still retried after ``max_backoff_s``, not the channel stuck."""

from __future__ import annotations

import io
import sqlite3
import time
from pathlib import Path

from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.alerts.outbox import DeliveryPolicy
from durable_sessions_collector.alerts.webhook import WebhookAlerts
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import SqliteStore
from webhook_server import WebhookServer


def alert(n: int) -> dict[str, object]:
    return {"key": f"k-{n}", "session_id": "s-1", "rule": "unkeyed-side-effect", "action_id": f"a-{n}"}


def test_an_alert_failed_over_a_thousand_times_is_retried_at_the_cap_and_the_others_go_on(
    tmp_path: Path,
) -> None:
    # 2 ** 1100 is no float: the backoff raised OverflowError, the failure was never
    # recorded, the alert was due again at once, and the alerts behind it were never sent.
    path = str(tmp_path / "sessions.db")
    store = SqliteStore(path)
    try:
        now = time.time()
        with store.writer() as writer:
            for n in (1, 2):
                writer.enqueue_alert("webhook", f"k-{n}", alert(n), now)
        with sqlite3.connect(path) as db:
            db.execute("UPDATE outbox SET attempts = 1100 WHERE violation_key = 'k-1'")
        policy = DeliveryPolicy(
            max_attempts=5000, timeout_s=2.0, backoff_s=1.0, max_backoff_s=60.0
        )  # as config gives
        log = io.StringIO()
        with WebhookServer(fail_first=1, fail_status=500) as hook:
            channel = WebhookAlerts(store, JsonLog(log), Metrics(store), hook.url, policy=policy)
            assert channel.deliver_due() == 1
            assert [r.body["violation_key"] for r in hook.accepted] == ["k-2"]
        with sqlite3.connect(path) as db:
            state, attempts, due = db.execute(
                "SELECT state, attempts, next_attempt_at FROM outbox WHERE violation_key = 'k-1'"
            ).fetchone()
        assert (state, attempts) == ("pending", 1101)
        assert now + 30 - 1 <= due <= now + 60 + 5  # the cap, with its jitter
        assert "alert-delivery-retry" in log.getvalue()
    finally:
        store.close()
