"""The ``log`` alert channel: one JSON line per new violation (``"event": "violation"``),
and one per change of an end-of-session violation's status: ``"violation-resolved"``
(level ``INFO``) when later spans settled it, ``"violation"`` when it holds again."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable

from durable_sessions_collector.alerts import LOG, RESOLVED
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import Alert, Store


class WrittenJournal:
    """The keys of alert lines written and perhaps not yet marked delivered in the store.

    Marking an alert delivered is a store transaction, which takes milliseconds after its
    line was written: a process killed in between would write the line again at its next
    start. The log's thread appends the keys here right after it writes their lines (one
    ``write`` to a file, which outlives the process as soon as it returns), and the next
    start marks those alerts delivered without writing them again. A torn last line (the
    process died inside the append) is ignored: its alert is written again.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None

    @staticmethod
    def encode(keys: list[str]) -> bytes:
        """The bytes :meth:`append_encoded` appends for ``keys``: computed before the
        lines are written, so that nothing but the append itself follows them."""
        return "".join(json.dumps(key) + "\n" for key in keys).encode("utf-8", "surrogatepass")

    def append(self, keys: list[str]) -> None:
        self.append_encoded(self.encode(keys))

    def append_encoded(self, data: bytes) -> None:
        """Append what :meth:`encode` made, in one ``write`` to a descriptor kept open: a
        process killed between its lines and this append writes them again at its next
        start, so the time between the two is kept to the system call."""
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(self._fd, data)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def keys(self) -> set[str]:
        try:
            with open(self.path, encoding="utf-8", errors="surrogatepass") as journal:
                text = journal.read()
        except FileNotFoundError:
            return set()
        keys = set()
        for line in text.splitlines():
            with contextlib.suppress(ValueError):  # the torn last line of an append the process died in
                keys.add(json.loads(line))
        return keys

    def clear(self) -> None:
        with self._lock, contextlib.suppress(FileNotFoundError):
            os.truncate(self.path, 0)


class LogAlerts:
    """Delivers pending ``log`` outbox rows as JSON lines, then marks them delivered.

    Rows are marked once their lines are written, so that a crash in between writes a
    line again rather than never; with a :class:`WrittenJournal`, not even then. A mark
    the store refuses (a full disk, say) is made by the next delivery, which does not
    write those lines again. While
    standard error is blocked (see :mod:`..jsonlog`) the lines are only queued when they
    are marked: delivery does not wait on the log.
    """

    channel = LOG

    def __init__(
        self,
        store: Store,
        log: JsonLog,
        on_delivered: Callable[[str, list[Alert], float], object] | None = None,
        *,
        journal: WrittenJournal | None = None,
    ) -> None:
        self.store = store
        self.log = log
        self.on_delivered = on_delivered
        self.journal = journal
        # Written by an earlier process that died before marking them delivered, or by
        # this one before the store refused their mark (see deliver_pending).
        self._written_before = journal.keys() if journal is not None else set()
        self._flushed = True  # no line queued and not yet written (nor its key appended)

    def deliver_pending(self) -> int:
        delivered = 0
        while True:
            now = self.store.now()
            pending = self.store.pending_alerts(LOG, now, limit=500)
            if not pending:
                if self._written_before:  # each was marked by now, or was no longer pending
                    self._written_before.clear()
                    self._forget_marked()
                return delivered
            unwritten = [alert for alert in pending if alert.violation_key not in self._written_before]
            self._flushed = self._write(unwritten)
            try:
                with self.store.writer() as writer:
                    writer.mark_delivered(pending, now)
            except BaseException:
                # The lines are out (or queued): the next delivery marks them without
                # writing them again, as a next start would from the journal.
                self._written_before.update(alert.violation_key for alert in unwritten)
                raise
            if not self._written_before:
                self._forget_marked()
            delivered += len(pending)
            if self.on_delivered is not None:
                self.on_delivered(LOG, pending, now)

    def close(self) -> None:
        """Close the journal's descriptor (an append after this opens it again)."""
        if self.journal is not None:
            self.journal.close()

    def _forget_marked(self) -> None:
        """Empty the journal once every key in it is marked delivered: when the lines
        queued so far are out (their keys were appended), and none is left from before."""
        if self.journal is not None and self._flushed:
            self.journal.clear()

    def _write(self, alerts: list[Alert]) -> bool:
        """Write the alerts' lines; return whether they are out (not just queued)."""
        for alert in alerts:
            if alert.payload.get("status") == RESOLVED:
                self.log.write("INFO", "violation-resolved", force=True, wait=False, **alert.payload)
            else:
                self.log.write("WARNING", "violation", force=True, wait=False, **alert.payload)
        journal = self.journal
        # While the stream is blocked the rows are marked before their lines are out, so
        # the journal has nothing to save; queued appends would only pile up behind it.
        # A row's key is its outbox key: a violation's changes of status have their own.
        if alerts and journal is not None and not self.log.stuck():
            data = journal.encode([alert.violation_key for alert in alerts])
            self.log.then(lambda: journal.append_encoded(data))
        return self.log.flush()
