"""The store contract, run against both stores (SQLite, and PostgreSQL when configured:
see ``postgres_support``): deduplication, rollback, unique violations, verdicts, the
outbox, paging and the violation feed; then what only one of them has (WAL for SQLite)."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import os
import sqlite3
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import loopback_config
from durable_sessions_collector.service import Service
from durable_sessions_collector.store import ActionRow, Store, StoreError, action_row, open_store, postgres
from durable_sessions_collector.store.base import (
    TEXT_COLUMNS,
    DetailPages,
    RecordRefused,
    decode_record,
    encode_record,
    refuse_nul,
)
from durable_sessions_collector.store.stored import stored_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    return action_row(body, "t" * 32, span_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("column", TEXT_COLUMNS)
def test_nul_in_any_id_column_is_refused_and_named(column: str) -> None:
    # refuse_nul scans the columns run together before it looks at each: a column left out
    # of that scan would let a NUL through to PostgreSQL's text.
    nul = dataclasses.replace(row("s1"), **{column: "a\x00b"})
    with pytest.raises(RecordRefused, match=f"its {column} 'a\\\\x00b' holds NUL"):
        refuse_nul(nul)
    refuse_nul(
        row("s1", notes="a\x00b", action_id=None)
    )  # NUL outside the id columns, and a None column, pass


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'nested' / 's.db'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    opened = open_store(store_url)
    yield opened
    opened.close()


def test_sqlite_store_uses_wal(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'nested' / 's.db'}")
    with sqlite3.connect(tmp_path / "nested" / "s.db") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_dedup_and_rollback(store) -> None:  # type: ignore[no-untyped-def]
    assert store.migrated_from is None  # a new store
    with store.writer() as writer:
        assert writer.add_action(row("s1"), 1.0) is True
        assert writer.add_action(row("s1"), 2.0) is False  # same trace, span and status
        assert writer.add_action(row("s1", "started"), 2.0) is True  # the intent of the same span
    with pytest.raises(RuntimeError), store.writer() as writer:
        writer.add_action(row("s2"), 3.0)
        raise RuntimeError("boom")
    with store.writer() as writer:
        assert [where.span_id for _, where in writer.session_records("sess")] == ["s1", "s1"]
        # is_stored says what add_action would: the evaluator asks before rebuilding a session
        assert writer.is_stored(row("s1")) and writer.is_stored(row("s1", "started"))
        assert not writer.is_stored(row("s1", "error")) and not writer.is_stored(row("s2"))
    assert store.count_actions() == 2


def test_a_span_without_a_session_is_stored_once(store) -> None:  # type: ignore[no-untyped-def]
    sessionless = action_row({"action_id": "a9", "kind": "tool_call", "status": "ok"}, "f" * 32, "s9")
    with store.writer() as writer:
        assert writer.add_action(sessionless, 1.0) is True
        assert writer.add_action(row("s9"), 1.0) is True  # the same ids in a session: another trace
    with store.writer() as writer:
        assert writer.is_stored(sessionless)
        assert writer.add_action(sessionless, 2.0) is False  # redelivered
    assert store.count_actions() == 2


def test_the_same_span_in_two_sessions_is_kept_in_both_and_a_redelivery_in_neither(store) -> None:  # type: ignore[no-untyped-def]
    # Both stores key an action by its session, trace, span and status, so the same OTLP
    # input gives the same sessions whichever store holds it (PostgreSQL's key was once
    # the ids and status alone, and dropped the second session's span).
    other = row("s1", session_id="other")
    with store.writer() as writer:
        assert writer.add_action(row("s1"), 1.0) is True
        assert writer.add_action(other, 1.0) is True  # the same ids and status, another session
    with store.writer() as writer:
        assert writer.is_stored(row("s1")) and writer.is_stored(other)
        assert not writer.is_stored(row("s1", session_id="third"))
        assert writer.add_action(row("s1"), 2.0) is False  # redelivered, each
        assert writer.add_action(other, 2.0) is False
        for session in ("sess", "other"):
            assert [where.span_id for _, where in writer.session_records(session)] == ["s1"]
    assert store.count_actions() == 2


def test_violations_are_unique_and_drive_the_verdict(store) -> None:  # type: ignore[no-untyped-def]
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
        settled = writer.resolve_end_violations("sess", keep=set(), now=5.0)
        assert [(v["rule"], v["resolved"]) for v in settled.resolved] == [("unresolved-side-effect", True)]
        assert settled.held_again == set()
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


def test_a_session_is_rebuilt_from_its_rows_a_page_at_a_time(store, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """session_records streams: a rebuild holds a page of rows, not the whole session
    (a session of a million actions was read at once, ~550 B an action)."""
    monkeypatch.setattr(postgres, "SESSION_RECORDS_PAGE", 7)  # pages end mid-session
    count = 3_000
    with store.writer() as writer:
        for n in range(count):
            writer.add_action(
                row(f"{n:016x}", action_id=f"a{n}", kind="payment", idempotency_key=f"k{n}"), 1.0
            )
    with store.writer() as writer:
        tracemalloc.start()
        read = sum(1 for _ in writer.session_records("sess"))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert read == count
        assert peak < 100_000, f"{peak} B held while reading {count} rows"
        assert [where.span_id for _, where in writer.session_records("sess")] == [
            f"{n:016x}" for n in range(count)
        ]


def test_an_end_of_session_violation_resolves_and_holds_again_once_per_change(store) -> None:  # type: ignore[no-untyped-def]
    """resolve_end_violations reports each change of a violation's status once: the
    transaction that makes it writes its alerts (add_violation of a stored one is no change)."""
    effect = violation("unresolved-side-effect", span="s2")
    ended = [(1.0, {effect.key}), (2.0, set()), (3.0, set()), (4.0, {effect.key}), (5.0, {effect.key})]
    changes = []
    for now, keep in ended:
        with store.writer() as writer:
            writer.touch_session("sess", now, 1)
            if keep:
                writer.add_violation(effect, at_end=True, now=now)
            settled = writer.resolve_end_violations("sess", keep, now=now)
            writer.end_session("sess", now)
            changes.append(
                ([v["key"] for v in settled.resolved], settled.held_again, writer.refresh_verdict("sess"))
            )
    assert changes == [
        ([], set(), "unrecoverable"),  # new: alerted as new, no change
        ([effect.key], set(), "ok"),  # resolved
        ([], set(), "ok"),  # still resolved: no change
        ([], {effect.key}, "unrecoverable"),  # holds again
        ([], set(), "unrecoverable"),  # still holds: no change
    ]
    detail = store.get_session("sess")
    assert detail is not None
    assert [(v["key"], v["resolved"], v["at_session_end"]) for v in detail.violations] == [
        (effect.key, False, True)
    ]


def test_a_reopened_session_has_no_end(store) -> None:  # type: ignore[no-untyped-def]
    """sessions.proto: ended_at is unset while the session is active."""
    with store.writer() as writer:
        writer.touch_session("sess", 1.0, 1)
        writer.end_session("sess", 5.0)
    [summary] = store.list_sessions()
    assert (summary.state, summary.ended_at) == ("ended", 5.0)
    with store.writer() as writer:
        writer.touch_session("sess", 9.0, 1)  # a later span re-opens it
    [summary] = store.list_sessions()
    assert (summary.state, summary.ended_at, summary.actions) == ("active", None, 2)
    detail = store.get_session("sess")
    assert detail is not None and detail.summary.ended_at is None


def test_outbox_once_per_channel_and_violation(store) -> None:  # type: ignore[no-untyped-def]
    with store.writer() as writer:
        writer.enqueue_alert("log", "k1", {"key": "k1"}, 1.0)
        writer.enqueue_alert("log", "k1", {"key": "k1"}, 2.0)
        writer.enqueue_alert("webhook", "k1", {"key": "k1"}, 1.0)
    [alert] = store.pending_alerts("log", now=10.0)
    assert alert.payload == {"key": "k1"}
    with store.writer() as writer:
        writer.mark_delivered([alert], 3.0)
        [hook] = store.pending_alerts("webhook", now=10.0)
        writer.mark_failed(hook, "503", retry_at=20.0)
    assert store.pending_alerts("log", now=10.0) == []
    assert store.pending_alerts("webhook", now=10.0) == []
    assert len(store.pending_alerts("webhook", now=20.0)) == 1
    assert store.alert_counts() == {("log", "delivered"): 1, ("webhook", "pending"): 1}


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


_RECORD_VALUES = st.one_of(
    st.text(),
    st.integers(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
    st.floats(min_value=-1e-3, max_value=1e-3),  # where orjson's and json's float notations part
    st.binary(max_size=8),
    st.lists(st.one_of(st.integers(), st.text()), max_size=3),
)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None)
@given(st.dictionaries(st.text(max_size=12), _RECORD_VALUES, max_size=8))
def test_every_record_round_trips_and_reads_as_json_would(record: dict[str, Any]) -> None:
    text = encode_record(record)  # type: ignore[arg-type]
    assert decode_record(text) == record
    if all(type(value) in (str, int, bool, type(None), float) for value in record.values()):
        # orjson's text, where it writes it, is the text json wrote before it
        assert text == json.dumps(record, separators=(",", ":"), ensure_ascii=False)


_COLUMN_FIELDS = st.fixed_dictionaries(
    {},
    optional={name: _RECORD_VALUES for name in ("session_id", "action_id", "kind", "status", "seq")},
)


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")) // 3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # one store serves every example
)
@given(columns=_COLUMN_FIELDS, rest=st.dictionaries(st.text(max_size=12), _RECORD_VALUES, max_size=4))
def test_every_record_is_stored_whatever_its_field_types(store, columns, rest) -> None:  # type: ignore[no-untyped-def]
    # A value the store's columns cannot hold (a seq past 64 bits, a kind that is a list,
    # bytes for a session id) must not fail the write: it stays in the record (as the
    # record is stored: contract fields, digests of the rest), the column holds NULL. A
    # failing write would fail the spans batched with it.
    record = {**rest, **columns}
    span_id = f"{next(_SPAN_IDS):016x}"
    row = action_row(record, "e" * 32, span_id)  # type: ignore[arg-type]
    with store.writer() as writer:
        assert writer.add_action(row, 1.0) is True
        if row.session_id is not None:
            stored = [
                found for found, where in writer.session_records(row.session_id) if where.span_id == span_id
            ]
            assert stored == [stored_record(record)]  # type: ignore[arg-type]


_SPAN_IDS = itertools.count(1)


@pytest.mark.parametrize(
    "value",
    [1764374400.1234567, 0.0, -0.0, 1e-4, 9.99e-5, -1e-5, 5e-324, 1e16, 1e22, math.inf, -math.inf, math.nan],
)
def test_floats_are_written_as_json_writes_them(value: float) -> None:
    # Every record carries a float (ts): orjson writes it only where its text is json's.
    record = {"session_id": "s", "ts": value}
    assert encode_record(record) == json.dumps(record, separators=(",", ":"), ensure_ascii=False)  # type: ignore[arg-type]


def test_unusable_store_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(StoreError, match="cannot open store"):
        open_store(f"sqlite:///{tmp_path / 'dir.db'}")
    with pytest.raises(StoreError, match="unsupported URL"):
        open_store("mysql://x")
    assert Location  # re-exported type used by the writer


def test_sessions_page_by_activity_then_id(store) -> None:  # type: ignore[no-untyped-def]
    with store.writer() as writer:
        for n, at in enumerate([1.0, 2.0, 2.0, 2.0, 3.0]):
            writer.touch_session(f"s{n}", at, 1)
        writer.add_violation(
            Violation("re-asked", Severity.ERROR, "x", "s2", "a1", trace_id="t", span_id="s"),
            at_end=False,
            now=2.0,
        )
        writer.refresh_verdict("s2")
    everything = [s.session_id for s in store.list_sessions(limit=100)]
    assert everything == ["s4", "s3", "s2", "s1", "s0"]  # ties on last_seen by id, descending
    pages, after = [], None
    while True:
        page = store.list_sessions(limit=2, after=after)
        if not page:
            break
        pages.append([s.session_id for s in page])
        after = (page[-1].last_seen, page[-1].session_id)
    assert pages == [["s4", "s3"], ["s2", "s1"], ["s0"]]
    assert [s.session_id for s in store.list_sessions("unrecoverable")] == ["s2"]
    assert store.list_sessions("unrecoverable", after=(2.0, "s2")) == []
    assert [s.session_id for s in store.list_sessions("ok", limit=1, after=(2.0, "s2"))] == ["s1"]


def test_violation_feed_is_in_commit_order_from_a_cursor(store) -> None:  # type: ignore[no-untyped-def]
    with store.writer() as writer:
        writer.touch_session("sess", 1.0, 1)
        writer.add_violation(violation("re-asked"), at_end=False, now=1.0)
        writer.refresh_verdict("sess")
    cursor = store.violation_cursor()
    assert store.violations_after(cursor) == ([], cursor)  # what was committed before is not new
    with store.writer() as writer:
        writer.add_violation(violation("unbounded-retry", Severity.WARNING, span="s2"), at_end=False, now=2.0)
        writer.add_violation(violation("re-asked"), at_end=False, now=2.0)  # not new: no feed item
        writer.refresh_verdict("sess")
    with store.writer() as writer:
        writer.add_violation(violation("unresolved-side-effect", span="s3"), at_end=True, now=3.0)
    items, middle = store.violations_after(cursor, limit=1)
    assert [i["rule"] for i in items] == ["unbounded-retry"]
    assert items[0]["session_verdict"] == "unrecoverable" and items[0]["severity"] == "warning"
    items, end = store.violations_after(middle)
    assert [(i["rule"], i["at_session_end"]) for i in items] == [("unresolved-side-effect", True)]
    assert store.violations_after(end) == ([], end)
    with pytest.raises(ValueError, match="not a cursor"):
        store.violations_after("nonsense:1")


def feed_of(store: Store, cursor: str, limit: int = 100) -> tuple[list[tuple[str, str, float]], str]:
    """The feed after ``cursor`` as (rule, status, detected_at), and the cursor after it."""
    items, after = store.violations_after(cursor, limit)  # type: ignore[attr-defined]
    return [(i["rule"], i["status"], i["detected_at"]) for i in items], after


def end_once(store: Store, keep: set[str], now: float) -> None:
    """One end of "sess": its end-of-session findings are ``keep``."""
    with store.writer() as writer:
        writer.touch_session("sess", now, 1)
        writer.resolve_end_violations("sess", keep, now=now)
        writer.end_session("sess", now)
        writer.refresh_verdict("sess")


def test_the_feed_gives_changes_of_status_in_commit_order_from_a_cursor(store) -> None:  # type: ignore[no-untyped-def]
    """A resolution and a second firing are feed items of their own, between the new
    violations committed before and after them, each read once from any cursor."""
    effect = violation("unresolved-side-effect", span="s2")
    start = store.violation_cursor()
    with store.writer() as writer:
        writer.touch_session("sess", 1.0, 1)
        writer.add_violation(effect, at_end=True, now=1.0)
        writer.resolve_end_violations("sess", {effect.key}, now=1.0)  # new: no change
        writer.refresh_verdict("sess")
    end_once(store, set(), 2.0)  # resolved
    end_once(store, set(), 2.5)  # still resolved: nothing
    with store.writer() as writer:
        writer.add_violation(violation("re-asked", span="s3"), at_end=False, now=3.0)
    end_once(store, {effect.key}, 4.0)  # holds again
    with pytest.raises(RuntimeError), store.writer() as writer:  # rolled back: no change
        writer.resolve_end_violations("sess", set(), now=4.5)
        raise RuntimeError("boom")
    expected = [
        ("unresolved-side-effect", "firing", 1.0),
        ("unresolved-side-effect", "resolved", 2.0),
        ("re-asked", "firing", 3.0),
        ("unresolved-side-effect", "firing", 4.0),
    ]
    found, end = feed_of(store, start)
    assert found == expected
    assert feed_of(store, end) == ([], end)
    assert store.violation_cursor() != start
    # One at a time: each cursor resumes right after its item, none missed or repeated.
    cursor, one_by_one, cursors = start, [], []
    for _ in expected:
        [item], cursor = feed_of(store, cursor, limit=1)
        one_by_one.append(item)
        cursors.append(cursor)
    assert one_by_one == expected and feed_of(store, cursor) == ([], cursor)
    for position, after in enumerate(cursors):
        assert feed_of(store, after)[0] == expected[position + 1 :]
    items, _ = store.violations_after(cursors[0], 1)
    # The violation as stored now (it holds), the session's verdict now, the change's time.
    assert (items[0]["key"], items[0]["resolved"], items[0]["session_verdict"]) == (
        effect.key,
        False,
        "unrecoverable",
    )
    with pytest.raises(ValueError, match="not a cursor"):
        store.violations_after(start.split(":")[0] + ":1:2:3:4")


def test_retention_deletes_a_sessions_changes_and_the_feed_goes_on(store) -> None:  # type: ignore[no-untyped-def]
    effect = violation("unresolved-side-effect", span="s2")
    with store.writer() as writer:
        writer.touch_session("sess", 1.0, 1)
        writer.add_violation(effect, at_end=True, now=1.0)
    end_once(store, set(), 2.0)
    end_once(store, {effect.key}, 3.0)
    other = Violation(
        "re-asked", Severity.ERROR, "re-asked broken", "newer", "a1", trace_id="t" * 32, span_id="s9"
    )
    with store.writer() as writer:  # the newest violation, of a session kept
        writer.touch_session("newer", 20.0, 1)
        writer.add_violation(other, at_end=False, now=20.0)
    cursor = store.violation_cursor()
    with store.writer() as writer:
        assert writer.prune(10.0, 10).sessions == ["sess"]
        assert writer._db.execute("SELECT count(*) FROM violation_changes").fetchone()[0] == 0
    assert feed_of(store, cursor)[0] == []
    if not store.shared:  # SQLite: no change id is given again behind a cursor
        assert store.violation_cursor() == cursor
    with store.writer() as writer:  # the session starts afresh: its changes follow the cursor
        writer.touch_session("sess", 30.0, 1)
        writer.add_violation(effect, at_end=True, now=30.0)
    end_once(store, set(), 31.0)
    assert feed_of(store, cursor)[0] == [
        ("unresolved-side-effect", "firing", 30.0),
        ("unresolved-side-effect", "resolved", 31.0),
    ]


def test_lock_sessions_tells_a_shared_store_from_a_private_one(store_url: str, store) -> None:  # type: ignore[no-untyped-def]
    with store.writer() as writer:
        writer.add_action(row("s1"), 1.0)
        writer.touch_session("sess", 1.0, 1)
    with store.writer() as writer:
        counts = writer.lock_sessions(["new", "sess"])
    if store_url.startswith("sqlite"):
        assert counts is None  # the only writer: the evaluator's memory is the truth
    else:
        assert counts == {"new": (0, None), "sess": (1, 1.0)}  # actions, first_seen


SCHEMA_V1 = (Path(__file__).parent / "sqlite_schema_v1.sql").read_text()


def _store_of_version_1(path: Path) -> None:
    """A store as version 1 of the sidecar left it: its schema, some actions, a session."""
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA_V1)
        db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
        insert = (
            "INSERT INTO actions (id, session_id, trace_id, span_id, status, action_id, kind, seq, "
            "received_at, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        )
        for id_, session_id, span_id in ((3, "sess", "s1"), (7, None, "s2"), (9, "sess", "s0")):
            record = {"session_id": session_id, "action_id": span_id, "kind": "tool_call", "status": "ok"}
            db.execute(
                insert,
                (
                    id_,
                    session_id,
                    "t" * 32,
                    span_id,
                    "ok",
                    span_id,
                    "tool_call",
                    1,
                    1.0,
                    encode_record(record),
                ),
            )
        db.execute(
            "INSERT INTO sessions (session_id, first_seen, last_seen, actions) VALUES ('sess', 1, 1, 2)"
        )
    db.close()


def test_a_version_1_store_is_migrated_keeping_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    _store_of_version_1(path)
    store = open_store(f"sqlite:///{path}")
    assert store.migrated_from == "1"
    with store.writer() as writer:  # the rows, in their order, and their duplicates still dropped
        assert [where.span_id for _, where in writer.session_records("sess")] == ["s1", "s0"]
        assert writer.add_action(row("s1"), 2.0) is False
        assert writer.add_action(action_row({"status": "ok"}, "t" * 32, "s2"), 2.0) is False
        assert writer.add_action(row("s4"), 2.0) is True
    assert store.count_actions() == 4
    assert store.get_session("sess").summary.actions == 2  # type: ignore[union-attr]
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("5",)
        assert db.execute("SELECT id FROM actions ORDER BY id").fetchall() == [(3,), (7,), (9,), (10,)]
        indexes = {
            name
            for (name,) in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'actions'"
            )
        }
    db.close()
    assert indexes == {"actions_by_session_span", "actions_sessionless_by_age"}
    again = open_store(f"sqlite:///{path}")  # and it opens again as it is
    assert again.migrated_from is None
    again.close()


def test_a_version_2_store_gets_the_forgetting_table_keeping_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "v2.db"
    store = open_store(f"sqlite:///{path}")
    with store.writer() as writer:
        assert writer.add_action(row("s1"), 1.0)
    store.close()
    with sqlite3.connect(path) as db:  # as version 2 left it
        db.execute("DROP TABLE forgetting")
        db.execute("DROP TABLE session_states")
        db.execute("DROP TABLE violation_changes")
        db.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    db.close()
    store = open_store(f"sqlite:///{path}")
    assert store.migrated_from == "2"
    assert store.count_actions() == 1
    with store.writer() as writer:
        assert writer.prune(10.0, 10, max_actions=10).full is False  # reads the new table
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("5",)
        assert db.execute("SELECT count(*) FROM forgetting").fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM session_states").fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM violation_changes").fetchone() == (0,)
    db.close()


def test_a_version_4_store_gets_the_feed_of_changes_and_its_cursors_still_resume(tmp_path: Path) -> None:
    path = tmp_path / "v4.db"
    url = f"sqlite:///{path}"
    effect = violation("unresolved-side-effect", span="s2")
    store = open_store(url)
    with store.writer() as writer:
        writer.touch_session("sess", 1.0, 1)
        writer.add_violation(violation("re-asked"), at_end=False, now=1.0)
        writer.add_violation(effect, at_end=True, now=1.0)
    store.close()
    with sqlite3.connect(path) as db:  # as version 4 left it, and a WatchAlerts cursor of it
        db.execute("DROP TABLE violation_changes")
        db.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
        (first,) = db.execute("SELECT min(id) FROM violations").fetchone()
    db.close()
    old_cursor = f"sqlite:{first}"  # version 4's format: the last violation id passed
    store = open_store(url)
    assert store.migrated_from == "4"
    assert feed_of(store, old_cursor)[0] == [("unresolved-side-effect", "firing", 1.0)]
    end_once(store, set(), 2.0)
    found, after = feed_of(store, old_cursor)
    assert found == [("unresolved-side-effect", "firing", 1.0), ("unresolved-side-effect", "resolved", 2.0)]
    assert after.startswith("sqlite:") and after.count(":") == 2
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("5",)
        assert db.execute("SELECT status FROM violation_changes").fetchall() == [("resolved",)]
    db.close()


def test_a_store_of_an_unknown_version_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "v99.db"
    _store_of_version_1(path)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = '99'")
    db.close()
    with pytest.raises(
        StoreError, match="schema version 99, this sidecar reads 5; it was made by a newer sidecar"
    ):
        open_store(f"sqlite:///{path}")
    with sqlite3.connect(path) as db:
        assert db.execute(
            "SELECT COUNT(*) FROM sqlite_master WHERE name = 'actions_by_session'"
        ).fetchone() == (1,)
    db.close()


OPEN_STORE = """
import sys
from durable_sessions_collector.store import open_store
print("opening", flush=True)
open_store(sys.argv[1]).close()
"""


def test_a_migration_killed_midway_leaves_version_1_whole(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    _store_of_version_1(path)
    rows = 200_000
    with sqlite3.connect(path) as db:
        db.executemany(
            "INSERT INTO actions (session_id, trace_id, span_id, status, received_at, record) "
            "VALUES (?, ?, ?, 'ok', 1, '{}')",
            ((f"s{n % 1000}", f"{n:032x}", f"{n:016x}") for n in range(rows)),
        )
    db.close()
    wal = Path(f"{path}-wal")
    # Killed once the migration has written 1 MiB of its copy to the WAL, uncommitted.
    child = subprocess.Popen(
        [sys.executable, "-c", OPEN_STORE, f"sqlite:///{path}"], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "opening\n"
    deadline = time.monotonic() + 60
    while (
        not (wal.exists() and wal.stat().st_size > 2**20)
        and child.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.001)
    child.kill()
    assert child.wait() != 0, "the migration finished before it could be killed"
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("1",)
        assert db.execute("SELECT COUNT(*) FROM actions").fetchone() == (rows + 3,)
    db.close()
    store = open_store(f"sqlite:///{path}")  # and the next start migrates it
    assert store.count_actions() == rows + 3
    with store.writer() as writer:
        assert [where.span_id for _, where in writer.session_records("sess")] == ["s1", "s0"]
    store.close()


def test_the_sidecar_logs_a_migration(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    _store_of_version_1(path)
    config = loopback_config(f"sqlite:///{path}")
    log = io.StringIO()
    with Service(config, log_stream=log):
        pass
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    migrated = [line for line in lines if line["event"] == "store-migrated"]
    assert len(migrated) == 1 and migrated[0]["from_version"] == "1"


def test_reads_from_many_threads_keep_few_connections(store) -> None:  # type: ignore[no-untyped-def]
    # The HTTP server reads the store from a new thread per client connection: those
    # threads come and go, and the read connections must not pile up with them.
    import threading

    from durable_sessions_collector.store.pool import MAX_IDLE

    def read() -> None:
        assert store.verdict_counts()["ok"] == 0

    for _ in range(50):  # one after another, as health probes come
        thread = threading.Thread(target=read)
        thread.start()
        thread.join()
    assert store.readers.opened == 1
    barrier = threading.Barrier(12)

    def read_together() -> None:
        with store.readers.lend():  # hold one while the others take theirs
            barrier.wait(timeout=10)
        read()

    threads = [threading.Thread(target=read_together) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.readers.opened == 12  # as many as were read with at once, no more
    assert store.readers.idle == MAX_IDLE  # the others were closed when given back


@pytest.mark.postgres
def test_reads_after_the_server_dropped_the_read_connections_succeed(postgres_url: str) -> None:
    # A PostgreSQL restart, a failover or a proxy's idle timeout drops every pooled read
    # connection: the read that finds one dead runs again on a new connection, and the
    # other idle ones are dropped with it, so no read fails (no 503 from /healthz).
    import contextlib

    import psycopg

    store = open_store(postgres_url)
    try:
        with contextlib.ExitStack() as lent:  # four idle read connections in the pool
            pids = [lent.enter_context(store.readers.lend()).info.backend_pid for _ in range(4)]
        assert store.readers.idle == 4
        with psycopg.connect(postgres_url.partition("?")[0], autocommit=True) as admin:
            for pid in pids:  # only this store's own backends
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        opened = store.readers.opened
        store.check()
        assert store.list_sessions() == [] and store.get_session("s") is None and store.count_actions() == 0
        assert store.verdict_counts()["ok"] == 0
        assert store.readers.opened == opened + 1  # one new connection; no dead one lent again
        with psycopg.connect(postgres_url.partition("?")[0], autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (store._write.info.backend_pid,))  # type: ignore[attr-defined]
        with store.writer() as writer:  # the dead write connection fails BEGIN: begun again
            writer.touch_session("s", 1.0, 1)
        assert store.list_sessions()[0].session_id == "s"
    finally:
        store.close()


@pytest.mark.postgres
@pytest.mark.parametrize(
    "read",
    [
        lambda store: store.alert_counts(),
        lambda store: store.dead_alerts(),
        lambda store: store.violation_cursor(),
        lambda store: store.violations_after("pg:0:0"),
        lambda store: store.pending_alerts("webhook", 10.0) == [],  # the claim, once the other is gone
        lambda store: store.hold_alert(store.claimed, 10.0, 5.0).claim > store.claimed.claim,
        lambda store: store.release_alerts([store.claimed], 10.0),
    ],
    ids=["alert_counts", "dead_alerts", "violation_cursor", "violations_after", "claim", "hold", "release"],
)
def test_alert_and_feed_reads_after_a_dropped_connection_succeed(postgres_url: str, read: Any) -> None:
    """The metrics' alert counts, ``alerts dead``, the WatchAlerts feed and the outbox's
    claims ran once on a dead pooled connection and failed (a 'failed' log line, a
    stream's failed poll, an alert delivery that stopped for a second)."""
    import psycopg

    store = open_store(postgres_url)
    try:
        with store.writer() as writer:
            writer.enqueue_alert("webhook", "k", {"key": "k"}, 1.0)
        [store.claimed] = store.pending_alerts("webhook", 2.0)  # type: ignore[attr-defined]
        with store.readers.lend() as connection:
            pid = connection.info.backend_pid
        with psycopg.connect(postgres_url.partition("?")[0], autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))  # only this store's own backend
        assert read(store) is not False  # raised StoreError before
    finally:
        store.close()


def test_readers_beyond_max_open_wait_then_fail_retryably(tmp_path: Path) -> None:
    from durable_sessions_collector.store.pool import ReadPool

    pool = ReadPool(
        lambda: sqlite3.connect(tmp_path / "s.db"), sqlite3.Connection.close, max_open=2, wait_s=0.2
    )
    with pool.lend(), pool.lend():
        started = time.monotonic()
        with pytest.raises(StoreError, match=r"all 2 read connections stayed busy for 0\.2 s"), pool.lend():
            pass
        assert time.monotonic() - started >= 0.2
    with pool.lend() as connection:  # the slots given back are taken again
        assert connection.execute("SELECT 1").fetchone() == (1,)
    pool.close()
    assert pool.opened == 2 and pool.idle == 0


def test_one_sidecar_per_sqlite_file_and_the_file_must_stay(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    first = open_store(f"sqlite:///{path}")
    with pytest.raises(StoreError, match=rf"in use by another sidecar \(pid {os.getpid()}"):
        open_store(f"sqlite:///{path}")
    first.close()
    again = open_store(f"sqlite:///{path}")  # released on close (and by the kernel on a crash)
    (tmp_path / "other.db").write_bytes(b"")
    os.replace(tmp_path / "other.db", path)
    with pytest.raises(StoreError, match="was replaced while the sidecar ran"), again.writer():
        pass
    with pytest.raises(StoreError, match="was replaced"):
        again.check()
    os.unlink(path)
    with pytest.raises(StoreError, match="was deleted while the sidecar ran"), again.writer():
        pass
    again.close()


def test_pages_walk_every_session_once_in_order_across_ties(store) -> None:  # type: ignore[no-untyped-def]
    ids = [f"s-{n:02d}" for n in range(60)]
    with store.writer() as writer:
        for n, session_id in enumerate(ids):
            writer.touch_session(session_id, 1000.0 + n % 7, 1)  # 7 distinct times: many ties
    everything = [s.session_id for s in store.list_sessions(None, 1000)]
    assert everything == sorted(ids, key=lambda i: (1000.0 + int(i[2:]) % 7, i), reverse=True)
    for size in (1, 4, 7, 59, 60):
        walked: list[str] = []
        after = None
        while page := store.list_sessions(None, size, after):
            walked += [s.session_id for s in page]
            after = (page[-1].last_seen, page[-1].session_id)
        assert walked == everything, size


def test_sqlite_pages_are_ranges_of_the_last_seen_indexes(tmp_path: Path) -> None:
    # The keyset was spelled with OR: SQLite scanned and sorted every older session for
    # each page (43 to 160 ms a page over 1,000,000 sessions, against 0.2 ms now).
    from durable_sessions_collector.store.sqlite import SQL

    open_store(f"sqlite:///{tmp_path / 's.db'}").close()
    with sqlite3.connect(tmp_path / "s.db") as db:
        for verdict, index in ((None, "sessions_by_activity"), ("unrecoverable", "sessions_by_verdict")):
            statement, params = SQL.session_page(verdict, 100, (1000.0, "s-1"))  # type: ignore[arg-type]
            plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + statement, params)]
            assert (
                plan[0].startswith(f"SEARCH sessions USING INDEX {index} (") and "last_seen<?" in plan[0]
            ), plan
            assert not any("MULTI-INDEX OR" in step or step.startswith("SCAN") for step in plan), plan


def test_a_sessions_actions_come_in_pages_in_its_order(store) -> None:  # type: ignore[no-untyped-def]
    # Read whole, a session of a million actions took gigabytes of the sidecar's memory.
    seqs = [5, None, 3, 5, 2**63 + 7, 3, None, 1, 5, 4] * 3  # ties, none, and one past 64 bits
    with store.writer() as writer:
        for n, seq in enumerate(seqs):
            record = {"action_id": f"a{n:02d}"} | ({} if seq is None else {"seq": seq})
            if seq is None:
                body = {"session_id": "sess", "kind": "tool_call", "status": "ok", **record}
                assert writer.add_action(action_row(body, "t" * 32, f"span{n:02d}"), 1.0)  # type: ignore[arg-type]
            else:
                assert writer.add_action(row(f"span{n:02d}", **record), 1.0)
        writer.touch_session("sess", 1.0, len(seqs))
    whole = store.get_session("sess", DetailPages(actions_limit=1000))
    assert whole is not None and whole.next_actions is None
    order = [a["action_id"] for a in whole.actions]
    key = {f"a{n:02d}": (-(2**63) if seq is None else min(seq, 2**63 - 1), n) for n, seq in enumerate(seqs)}
    assert order == sorted(order, key=key.__getitem__)  # no start time first, then start time, then arrival
    for size in (1, 4, 29, 30):
        walked: list[str] = []
        after = None
        while True:
            page = store.get_session("sess", DetailPages(actions_limit=size, actions_after=after))
            assert page is not None and len(page.actions) <= size and page.summary.actions == 30
            walked += [a["action_id"] for a in page.actions]
            if page.next_actions is None:
                break
            after = page.next_actions
        assert walked == order, size
    assert store.get_session("nope") is None


def test_a_sessions_violations_come_in_pages_in_the_order_found(store) -> None:  # type: ignore[no-untyped-def]
    rules = [f"rule-{n:02d}" for n in range(23)]
    with store.writer() as writer:
        assert writer.add_action(row("s1"), 1.0)
        writer.touch_session("sess", 1.0, 1)
        for rule in rules:
            assert writer.add_violation(violation(rule), at_end=False, now=1.0)
        assert writer.refresh_verdict("sess") == "unrecoverable"
    for size in (1, 5, 22, 23):
        walked: list[str] = []
        after = None
        while True:
            page = store.get_session("sess", DetailPages(violations_limit=size, violations_after=after))
            assert page is not None and len(page.violations) <= size and len(page.actions) == 1
            walked += [v["rule"] for v in page.violations]
            if page.next_violations is None:
                break
            after = page.next_violations
        assert walked == rules, size


def test_a_postgresql_store_without_psycopg_is_named_once_with_the_install_command(tmp_path: Path) -> None:
    """The path of a user who installed the sidecar without ``[postgresql]``: serve stops
    with one line naming the missing driver and the install command. The store's error
    said ``store:`` itself, and serve put its own before it: ``store: store: …``."""
    hidden = tmp_path / "hidden" / "psycopg"  # psycopg as if it were not installed
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'psycopg'\")\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "durable_sessions_collector",
            "serve",
            "--store",
            "postgresql://u@127.0.0.1:1/db",
        ],
        env={**os.environ, "PYTHONPATH": str(hidden.parent)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (
        2,
        "durable-sessions-collector: store: a PostgreSQL store needs psycopg 3 (No module named 'psycopg'); "
        "pip install 'durable-sessions-collector[postgresql]'\n",
    )
