"""The SQLite store: WAL, deduplication, unique violations, verdicts, outbox, round trips."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

import pytest
from durable_sessions_collector.store import ActionRow, StoreError, open_store
from durable_sessions_collector.store.base import decode_record, encode_record

from durable_sessions.record import Location
from durable_sessions.violation import Severity, Violation


def violation(rule: str, severity: Severity = Severity.ERROR, span: str = "s1") -> Violation:
    return Violation(rule, severity, f"{rule} broken", "sess", "a1", trace_id="t" * 32, span_id=span)


def row(span_id: str, status: str = "ok", **record) -> ActionRow:  # type: ignore[no-untyped-def]
    body = {
        "session_id": "sess",
        "action_id": "a1",
        "kind": "tool_call",
        "status": status,
        "seq": 1,
        **record,
    }
    return ActionRow("sess", "t" * 32, span_id, status, body)  # type: ignore[arg-type]


def test_wal_dedup_and_rollback(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'nested' / 's.db'}")
    with sqlite3.connect(tmp_path / "nested" / "s.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with store.writer() as writer:
        assert writer.add_action(row("s1"), 1.0) is True
        assert writer.add_action(row("s1"), 2.0) is False  # same trace, span and status
        assert writer.add_action(row("s1", "started"), 2.0) is True  # the intent of the same span
    with pytest.raises(RuntimeError), store.writer() as writer:
        writer.add_action(row("s2"), 3.0)
        raise RuntimeError("boom")
    with store.writer() as writer:
        assert [where.span_id for _, where in writer.session_records("sess")] == ["s1", "s1"]
    assert store.count_actions() == 2
    store.close()


def test_violations_are_unique_and_drive_the_verdict(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    with store.writer() as writer:
        writer.touch_session("sess", 1.0, 1)
        assert writer.add_violation(violation("re-asked"), at_end=False, now=1.0) is True
        assert writer.add_violation(violation("re-asked"), at_end=False, now=2.0) is False
        assert writer.add_violation(
            violation("disguised-retry-loop", Severity.WARNING), at_end=False, now=1.0
        )
        assert writer.refresh_verdict("sess") == "unrecoverable"
        assert writer.add_violation(violation("unresolved-side-effect", span="s2"), at_end=True, now=1.0)
    with store.writer() as writer:
        # At the next end the end-of-session finding is gone: resolved, out of the verdict.
        assert writer.resolve_end_violations("sess", keep=set()) == 1
        writer.end_session("sess", 5.0)
        assert writer.refresh_verdict("sess") == "unrecoverable"
    [summary] = store.list_sessions("unrecoverable")
    assert (summary.state, summary.errors, summary.warnings, summary.ended_at) == ("ended", 1, 1, 5.0)
    assert store.list_sessions("ok") == []
    assert store.verdict_counts() == {"ok": 0, "at_risk": 0, "unrecoverable": 1}
    detail = store.get_session("sess")
    assert detail is not None
    assert [(v["rule"], v["resolved"]) for v in detail.violations] == [
        ("re-asked", False),
        ("disguised-retry-loop", False),
        ("unresolved-side-effect", True),
    ]
    store.close()


def test_outbox_once_per_channel_and_violation(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 's.db'}")
    with store.writer() as writer:
        writer.enqueue_alert("log", "k1", {"key": "k1"}, 1.0)
        writer.enqueue_alert("log", "k1", {"key": "k1"}, 2.0)
        writer.enqueue_alert("webhook", "k1", {"key": "k1"}, 1.0)
    [alert] = store.pending_alerts("log", now=10.0)
    assert alert.payload == {"key": "k1"}
    with store.writer() as writer:
        writer.mark_delivered([alert.id], 3.0)
        [hook] = store.pending_alerts("webhook", now=10.0)
        writer.mark_failed(hook.id, "503", retry_at=20.0)
    assert store.pending_alerts("log", now=10.0) == []
    assert store.pending_alerts("webhook", now=10.0) == []
    assert len(store.pending_alerts("webhook", now=20.0)) == 1
    assert store.alert_counts() == {("log", "delivered"): 1, ("webhook", "pending"): 1}
    store.close()


def test_records_round_trip_with_the_types_the_engine_saw() -> None:
    record = {
        "session_id": "s",
        "ttl_s": 1.5,
        "key": b"\x00\xff",
        "max_attempts": "3",
        "x": math.inf,
        "l": [1, "a"],
    }
    assert decode_record(encode_record(record)) == record  # type: ignore[arg-type]
    assert math.isnan(decode_record(encode_record({"v": math.nan}))["v"])  # type: ignore[typeddict-item]


def test_unusable_store_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StoreError, match="cannot open store"):
        open_store(f"sqlite:///{tmp_path / 'dir.db'}")
    with pytest.raises(StoreError, match="unsupported URL"):
        open_store("postgres://x")
    assert Location  # re-exported type used by the writer
