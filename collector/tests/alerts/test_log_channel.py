"""The ``log`` alert channel and its journal of written lines.

A line is marked delivered in the store only after it is written, and the store's mark
takes a transaction: a process killed between the two would write the line again at its
next start. The journal (one append right after the write) lets the next start mark it
without writing it again. These tests stop "a process" between write and mark by
delivering with one :class:`LogAlerts` and marking nothing, then starting another.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_for
from durable_sessions_collector.alerts import LOG, RESOLVED, change_payload, outbox_key
from durable_sessions_collector.alerts.log import LogAlerts, WrittenJournal
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import SqliteStore
from sidecar_clients import Agent, grpc_exporter


def store_with_pending(path: Path, keys: list[str]) -> SqliteStore:
    store = SqliteStore(str(path))
    with store.writer() as writer:
        for key in keys:
            writer.enqueue_alert(LOG, key, {"key": key, "rule": "unkeyed-side-effect"}, 1.0)
    return store


def violation_lines(stream: io.StringIO) -> list[str]:
    return [json.loads(line)["key"] for line in stream.getvalue().splitlines() if '"violation"' in line]


def written_but_not_marked(store: SqliteStore, journal: WrittenJournal) -> list[str]:
    """What a process killed after writing its pending alerts' lines, before marking them, left."""
    stream = io.StringIO()
    dying = LogAlerts(store, JsonLog(stream), journal=journal)
    assert dying._write(store.pending_alerts(LOG, 10.0, limit=500))
    return violation_lines(stream)


def test_lines_written_before_a_crash_are_marked_at_the_next_start_not_written_again(tmp_path: Path) -> None:
    store = store_with_pending(tmp_path / "s.db", ["a", "b"])
    journal = WrittenJournal(str(tmp_path / "s.db.log-written"))
    try:
        assert written_but_not_marked(store, journal) == ["a", "b"]
        with store.writer() as writer:  # a violation found after the crash
            writer.enqueue_alert(LOG, "c", {"key": "c"}, 2.0)
        stream = io.StringIO()
        assert LogAlerts(store, JsonLog(stream), journal=journal).deliver_pending() == 3
        assert violation_lines(stream) == ["c"]
        assert store.pending_alerts(LOG, 10.0) == []
        assert journal.keys() == set()  # every key in it is marked: it starts empty again
    finally:
        store.close()


def test_a_resolution_of_a_violation_whose_line_is_in_the_journal_is_still_written(tmp_path: Path) -> None:
    # The journal names outbox rows, not violations: a violation's resolution is another
    # row (and line) with the same violation key in its payload.
    store = store_with_pending(tmp_path / "s.db", ["a"])
    journal = WrittenJournal(str(tmp_path / "s.db.log-written"))
    try:
        assert written_but_not_marked(store, journal) == ["a"]
        resolution = change_payload({"key": "a", "rule": "unkeyed-side-effect"}, RESOLVED, "ok", 2.0)
        with store.writer() as writer:  # committed before the crash, its line not yet written
            writer.enqueue_alert(LOG, outbox_key(resolution), resolution, 2.0)
        stream = io.StringIO()
        assert LogAlerts(store, JsonLog(stream), journal=journal).deliver_pending() == 2
        [line] = [json.loads(text) for text in stream.getvalue().splitlines()]
        assert (line["event"], line["key"], line["status"]) == ("violation-resolved", "a", "resolved")
        assert store.pending_alerts(LOG, 10.0) == []
    finally:
        store.close()


def test_without_a_journal_the_lines_are_written_again(tmp_path: Path) -> None:
    # What the journal prevents: at least once, not exactly once.
    store = store_with_pending(tmp_path / "s.db", ["a"])
    try:
        stream = io.StringIO()
        LogAlerts(store, JsonLog(stream))._write(store.pending_alerts(LOG, 10.0))
        LogAlerts(store, JsonLog(stream)).deliver_pending()
        assert violation_lines(stream) == ["a", "a"]
    finally:
        store.close()


def test_a_torn_last_journal_line_writes_its_alert_again(tmp_path: Path) -> None:
    store = store_with_pending(tmp_path / "s.db", ["a", "b"])
    journal = WrittenJournal(str(tmp_path / "s.db.log-written"))
    try:
        written_but_not_marked(store, journal)
        text = Path(journal.path).read_bytes()
        Path(journal.path).write_bytes(text[:-3])  # died inside the append of "b"
        assert journal.keys() == {"a"}
        stream = io.StringIO()
        LogAlerts(store, JsonLog(stream), journal=journal).deliver_pending()
        assert violation_lines(stream) == ["b"]  # at least once: never lost
    finally:
        store.close()


def test_the_journal_is_appended_only_after_the_lines_are_written(tmp_path: Path) -> None:
    store = store_with_pending(tmp_path / "s.db", ["a"])
    journal = WrittenJournal(str(tmp_path / "s.db.log-written"))
    appended_after: list[str] = []

    class Watching(io.StringIO):
        def write(self, text: str) -> int:
            appended_after.append("journal" if journal.keys() else "lines")
            return super().write(text)

    try:
        LogAlerts(store, JsonLog(Watching()), journal=journal)._write(store.pending_alerts(LOG, 10.0))
        assert appended_after == ["lines"] and journal.keys() == {"a"}
    finally:
        store.close()


def test_keys_of_any_text_survive_the_journal(tmp_path: Path) -> None:
    journal = WrittenJournal(str(tmp_path / "j"))
    keys = ["s|rule|a\nb|0", 'q"uote', "\ud800-lone", "ünï"]
    journal.append(keys[:2])
    journal.append(keys[2:])
    assert journal.keys() == set(keys)
    journal.clear()
    assert journal.keys() == set()


class BlockedStream(io.StringIO):
    """A stream whose writes block until ``released`` is set (a pipe nobody reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def write(self, text: str) -> int:
        self.released.wait(30)
        return super().write(text)


def test_while_the_stream_is_blocked_nothing_is_journaled(tmp_path: Path) -> None:
    # The rows are marked before their lines are out then: the journal would save nothing,
    # and appends queued behind the blocked stream would only pile up.
    store = store_with_pending(tmp_path / "s.db", ["a", "b"])
    journal = WrittenJournal(str(tmp_path / "s.db.log-written"))
    stream = BlockedStream()
    log = JsonLog(stream, blocked_write_s=0.2)
    try:
        log.write("INFO", "stuck", wait=False)
        wait_for(log.stuck, timeout=5)
        assert LogAlerts(store, log, journal=journal).deliver_pending() == 2  # marked, not waited for
        assert store.pending_alerts(LOG, 10.0) == []
        stream.released.set()
        assert log.flush(5)
        assert violation_lines(stream) == ["a", "b"]  # written once the stream drained
        assert journal.keys() == set()
    finally:
        stream.released.set()
        store.close()


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_journal_appends_through_one_descriptor_kept_open(tmp_path: Path) -> None:
    # A process killed between its lines and their append writes the lines again: the
    # append after the lines is one write to a descriptor already open, nothing else.
    journal = WrittenJournal(str(tmp_path / "j"))
    journal.append(["a"])
    opened = open_descriptors()
    for n in range(50):
        journal.append_encoded(WrittenJournal.encode([f"k{n}"]))
    assert open_descriptors() == opened
    assert len(journal.keys()) == 51
    journal.clear()  # truncated in place: the open descriptor appends at the new end
    journal.append(["b"])
    assert journal.keys() == {"b"}
    journal.close()
    assert open_descriptors() == opened - 1


def test_log_deliveries_have_a_latency_like_the_other_channels(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    # durable_sessions_alert_latency_seconds{channel} had no log series: only the webhook
    # and OTLP channels observed it.
    from sidecar_clients import Agent, grpc_exporter

    sidecar = start_sidecar()
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("log-latency", "charge", "payment")  # unkeyed-side-effect: one alert
    agent.shutdown()
    wait_for(
        lambda: (
            sidecar.metric("durable_sessions_alert_deliveries_total", channel=LOG, outcome="delivered") == 1
        )
    )
    # Observed right after the delivery is counted, by the thread that delivered it.
    wait_for(lambda: sidecar.metric("durable_sessions_alert_latency_seconds_count", channel=LOG) >= 1)
    assert sidecar.metric("durable_sessions_alert_latency_seconds_count", channel=LOG) == 1
    assert 0 <= sidecar.metric("durable_sessions_alert_latency_seconds_sum", channel=LOG) < 30


def test_lines_whose_mark_failed_are_marked_at_the_next_delivery_not_written_again(tmp_path: Path) -> None:
    # The store refuses the mark (a full disk, a lock held past the busy timeout): here a
    # real trigger. The lines are out and their keys journaled; the next delivery of the
    # same process marks them without writing them again, as the next start would.
    path = tmp_path / "s.db"
    store = store_with_pending(path, ["a"])
    journal = WrittenJournal(str(path) + ".log-written")
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TRIGGER refuse_mark BEFORE UPDATE OF state ON outbox "
            "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
        )
    try:
        stream = io.StringIO()
        alerts = LogAlerts(store, JsonLog(stream), journal=journal)
        with pytest.raises(Exception, match="disk is full"):
            alerts.deliver_pending()
        assert violation_lines(stream) == ["a"]
        assert [alert.violation_key for alert in store.pending_alerts(LOG, 10.0)] == ["a"]
        with sqlite3.connect(path) as db:
            db.execute("DROP TRIGGER refuse_mark")
        with store.writer() as writer:  # a violation found meanwhile
            writer.enqueue_alert(LOG, "b", {"key": "b"}, 2.0)
        assert alerts.deliver_pending() == 2
        assert violation_lines(stream) == ["a", "b"]  # "a" once
        assert store.pending_alerts(LOG, 10.0) == []
        assert journal.keys() == set()
    finally:
        store.close()


def test_a_log_delivery_the_store_failed_is_retried_without_further_spans(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # The store refuses to mark the alert's line delivered (a real trigger standing for a
    # full disk), also while its session is ended, after which no span nor sweep comes.
    # Once the store takes writes again the alert is marked, its line written once.
    db = tmp_path / "sessions.db"
    sidecar = start_sidecar(db)
    with sqlite3.connect(db) as connection:
        connection.execute(
            "CREATE TRIGGER refuse_mark BEFORE UPDATE OF state ON outbox "
            "BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
        )
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "run-1")
    agent.action("unkeyed", "charge", "payment")  # unkeyed-side-effect
    agent.shutdown()
    wait_for(lambda: sidecar.session("unkeyed")["state"] == "ended")
    pending = ("durable_sessions_alert_outbox", (("channel", "log"), ("state", "pending")))
    assert sidecar.metrics()[pending] == 1
    time.sleep(2.5)  # tried again each second, and refused
    with sqlite3.connect(db) as connection:
        connection.execute("DROP TRIGGER refuse_mark")
    wait_for(lambda: sidecar.metrics()[pending] == 0)
    assert [line["session_id"] for line in sidecar.alerts()] == ["unkeyed"]
    # The failure that repeated is one line, and one more when it is over, with the count.
    lines = sidecar.log.lines()
    assert [line["failures"] for line in lines if line["event"] == "alert-delivery-failed"] == [1]
    wait_for(lambda: any(line["event"] == "alert-delivery-recovered" for line in sidecar.log.lines()))
    [recovered] = [line for line in sidecar.log.lines() if line["event"] == "alert-delivery-recovered"]
    assert recovered["failures"] >= 3
    assert sidecar.metric("durable_sessions_alert_deliveries_total", channel="log", outcome="delivered") == 1
