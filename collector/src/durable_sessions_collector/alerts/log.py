"""The ``log`` alert channel: one JSON line per new violation."""

from __future__ import annotations

import time

from durable_sessions_collector.alerts import LOG
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import Store


class LogAlerts:
    """Delivers pending ``log`` outbox rows as JSON lines, then marks them delivered.

    Rows are marked once their lines are written, so that a crash in between writes a
    line again rather than never. While standard error is blocked (see :mod:`..jsonlog`)
    the lines are only queued when they are marked: delivery does not wait on the log.
    """

    channel = LOG

    def __init__(self, store: Store, log: JsonLog, on_delivered=None) -> None:  # type: ignore[no-untyped-def]
        self.store = store
        self.log = log
        self.on_delivered = on_delivered

    def deliver_pending(self) -> int:
        delivered = 0
        while True:
            now = time.time()
            pending = self.store.pending_alerts(LOG, now, limit=500)
            if not pending:
                return delivered
            for alert in pending:
                self.log.write("WARNING", "violation", force=True, wait=False, **alert.payload)
            self.log.flush()
            with self.store.writer() as writer:
                writer.mark_delivered([alert.id for alert in pending], now)
            delivered += len(pending)
            if self.on_delivered is not None:
                self.on_delivered(LOG, len(pending))
