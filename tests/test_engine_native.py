"""The native feed reports what ``Checker.feed`` reports and leaves the same memory.

``durable_sessions._engine.Feed.feed`` does the engine's per-record dispatch in C and hands
the Python method every record it does not handle itself. These tests feed generated
records (several sessions, action ids seen again, span redeliveries, missing and
ill-typed identifiers, a bounded number of sessions) to two checkers, one through the
Python method and one natively, and compare the violations of every record, the counts,
the memory of every session and the end-of-input findings; then whole example logs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_sessions.check import check_paths
from durable_sessions.engine import Checker
from durable_sessions.record import line_location, span_location
from durable_sessions.rules import select_rules
from durable_sessions.rules.base import Explanation, Rule
from durable_sessions.rules.state import SessionState
from durable_sessions.violation import Severity
from tests.support.actions import IDENTIFIERS, OPTIONAL, locations, retries, session_memory
from tests.support.senders import require_native

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RULES = select_rules("all", strict=True)

odd_identifier = st.sampled_from(["", 7, None, True, ["s-1"]])
records = st.fixed_dictionaries(
    {
        **IDENTIFIERS,
        "session_id": st.sampled_from(["s-1", "s-2", "s-3"]),
        "name": st.sampled_from(["search", "book"]),
    },
    optional=OPTIONAL,
)
odd_records = st.tuples(records, st.sampled_from(list(IDENTIFIERS)), odd_identifier).map(
    lambda drawn: {**drawn[0], drawn[1]: drawn[2]} if drawn[2] is not None else _without(*drawn[:2])
)
steps = st.lists(
    st.tuples(st.one_of(records, records, records, odd_records, retries), locations),
    max_size=30,
)


def _without(record: dict[str, Any], name: str) -> dict[str, Any]:
    return {key: value for key, value in record.items() if key != name}


@pytest.fixture(scope="module")
def native() -> None:
    require_native("_engine")


def python_feed(checker: Checker) -> Any:
    return Checker.feed.__get__(checker)


def memory_of(checker: Checker) -> dict[str, Any]:
    return {session_id: session_memory(session) for session_id, session in checker._sessions.items()}


def feed_both(steps: list, *, max_sessions: int | None) -> None:
    python, native = (Checker(RULES, max_sessions=max_sessions) for _ in range(2))
    assert native.feed != python_feed(native), "the native feed should be selected"
    feed = python_feed(python)
    for record, where in steps:
        assert native.feed(dict(record), where) == feed(dict(record), where), (record, where)
        assert (native.actions, native.sessions) == (python.actions, python.sessions)
        assert memory_of(native) == memory_of(python)
    assert native.finish() == python.finish()


@settings(max_examples=400, deadline=None)
@given(steps=steps)
def test_native_feed_reports_and_remembers_as_the_python_feed(native: None, steps: list) -> None:
    feed_both(steps, max_sessions=None)


@settings(max_examples=150, deadline=None)
@given(steps=steps)
def test_native_feed_with_a_bound_on_sessions(native: None, steps: list) -> None:
    feed_both(steps, max_sessions=2)  # three session ids: which one is evicted depends on recency


def test_a_redelivered_span_is_not_counted_again(native: None) -> None:
    checker = Checker(RULES)
    record = {"session_id": "s-1", "action_id": "a1", "kind": "email", "status": "ok"}
    where = span_location("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")
    first = checker.feed(dict(record), where)
    assert [v.rule for v in first] == ["unkeyed-side-effect"]
    assert checker.feed(dict(record), where) == []
    assert checker.actions == 1
    assert checker.feed(dict(record), line_location("run.jsonl", 2)) != []
    assert checker.actions == 2


def test_a_caller_that_drops_redeliveries_has_every_span_checked(native: None) -> None:
    """``dropped_redeliveries`` (the sidecar, whose store drops them by trace, span and
    status): an action's span id again, in another trace, is another span, checked in C
    and in Python alike; without it both feeds skip it as a redelivery."""
    record = {"session_id": "s-1", "action_id": "a1", "kind": "tool_call", "status": "ok"}
    span_id = "00f067aa0ba902b7"
    for dropped, expected in ((True, ["duplicate-action-id"]), (False, [])):
        native, python = (Checker(RULES, dropped_redeliveries=dropped) for _ in range(2))
        for checker, feed in ((native, native.feed), (python, python_feed(python))):
            assert feed(dict(record), span_location("1" * 32, span_id)) == []
            again = feed(dict(record), span_location("2" * 32, span_id))
            assert [v.rule for v in again] == expected
            assert checker.actions == 1 + dropped


def test_unusual_records_go_to_the_python_feed(native: None) -> None:
    """A dict subclass and a record without its identifiers: the same findings either way."""

    class Record(dict):
        pass

    record = {"session_id": "s-1", "action_id": "a1", "kind": "payment", "status": "ok", "result": 1}
    for unusual in (
        Record(record),
        _without(record, "kind"),
        {**record, "status": ""},
        {**record, "kind": 3},
    ):
        python, native = Checker(RULES), Checker(RULES)
        assert native.feed(unusual) == python_feed(python)(unusual)
        assert native.actions == python.actions == 1


def test_an_exception_in_a_rule_reaches_the_caller(native: None) -> None:
    """The engine does not swallow errors (the processor's fail-open wrapper does)."""

    def broken(record: dict[str, Any]) -> str | None:
        raise RuntimeError("rule failed")

    rule = Rule("broken", Severity.ERROR, "record", "fix it", Explanation("s", "w", "e", "u"), check=broken)
    checker = Checker([rule])
    with pytest.raises(RuntimeError, match="rule failed"):
        checker.feed({"session_id": "s-1", "action_id": "a1", "kind": "tool_call", "status": "error"})


def test_whole_example_logs_report_the_same(native: None) -> None:
    logs = [str(path) for path in sorted(EXAMPLES.rglob("*.jsonl"))]
    assert len(logs) > 20
    natively = list(check_paths(logs, Checker(RULES)))
    reference = Checker(RULES)
    reference.feed = python_feed(reference)  # type: ignore[method-assign]
    assert natively == list(check_paths(logs, reference))
    assert len(natively) > 20


def test_a_replay_is_judged_alike_by_both_feeds(native: None) -> None:
    """The record rules that judge an execution skip a replay of an action seen before,
    natively too: the dispatch cache is keyed by shape, and has_prior is part of it."""
    payment = {"session_id": "s-1", "action_id": "a04", "kind": "payment", "status": "ok", "result": {"c": 1}}
    steps = [
        ({**payment, "incarnation": "run-1"}, line_location("t.jsonl", 1)),
        ({**payment, "incarnation": "run-2", "replayed": True}, line_location("t.jsonl", 2)),
        ({**payment, "session_id": "s-2", "replayed": True}, line_location("t.jsonl", 3)),
    ]
    feed_both(steps, max_sessions=None)
    checker = Checker(RULES)
    lines = [v.line for record, where in steps for v in checker.feed(dict(record), where)]
    assert lines == [1, 3]


def test_the_session_memory_is_the_engines(native: None) -> None:
    checker = Checker(RULES)
    checker.feed({"session_id": "s-1", "action_id": "a1", "kind": "user_prompt", "status": "ok", "result": 1})
    session = checker._sessions["s-1"]
    assert isinstance(session, SessionState)
    memory = session.recall("a1")
    assert memory is not None and memory.recorded and memory.kind == "user_prompt"


# Integers around 64 bits, bare (read exactly by the Python line checker) or in a string.
long_number_lines = st.builds(
    lambda action_id, n, shape: (
        b'{"session_id":"s-1","action_id":'
        + json.dumps(action_id).encode()
        + b',"kind":"llm_call","status":"ok","result":'
        + shape % str(n).encode()
        + b"}"
    ),
    st.text("a0-: ", max_size=40),
    st.integers(10**16, 10**22),
    st.sampled_from([b"%s", b" -%s", b"[1,%s]", b'"%s"', b'"x-%s"', b'{"n":%s.5}', b"%se3"]),
)
# What files hold around and inside a record: a byte order mark, CRLF or a lone CR, blank
# padding, a NUL, invalid UTF-8 in a value, a key escaped or given twice (the last wins).
MANGLINGS = [
    lambda line: b"\xef\xbb\xbf" + line,
    lambda line: line + b"\r\n",
    lambda line: line + b"\r",
    lambda line: b" \t" + line + b"  ",
    lambda line: line.replace(b'"kind"', b'\x00"kind"', 1),
    lambda line: line.replace(b'"status": "', b'"status": "\xff', 1),
    lambda line: line.replace(b'"session_id"', b'"session\\u005fid"', 1),
    lambda line: line[:-1] + b', "session_id": "s-2"}',
    lambda line: line.replace(b'"action_id"', b'"action_id": 7, "action_id"', 1),
]
raw_lines = st.one_of(
    long_number_lines,
    records.map(lambda record: json.dumps(record).encode()),
    records.map(lambda record: json.dumps(record).encode() + b"\n"),
    st.tuples(records, st.sampled_from(MANGLINGS)).map(lambda drawn: drawn[1](json.dumps(drawn[0]).encode())),
    st.sampled_from([b"[1, 2]", b"null", b"{not json", b"\xff\xfe", b"", b"# a comment", b'"text"']),
)
numbered_lines = st.lists(
    st.tuples(st.one_of(raw_lines, st.none()), st.sampled_from([True, False, 1])), max_size=20
).map(lambda drawn: [(number, raw, owned) for number, (raw, owned) in enumerate(drawn, start=1)])


def python_feed_lines(checker: Checker) -> Any:
    return Checker.feed_lines.__get__(checker)


@settings(max_examples=300, deadline=None)
@given(lines=numbered_lines)
def test_native_feed_lines_feeds_and_hands_over_as_the_python_method(native: None, lines: list) -> None:
    python, native = Checker(RULES), Checker(RULES)
    python.feed = python_feed(python)  # type: ignore[method-assign]
    handed: dict[str, list] = {"python": [], "native": []}

    def other(name: str, checker: Checker) -> Any:
        def check_line(number: int, raw: bytes | None, owned: bool) -> list[Any]:
            handed[name].append((number, raw, owned))
            return [f"other {number}"]

        return check_line

    assert native.feed_lines != python_feed_lines(native), "the native feed_lines should be selected"
    found = native.feed_lines(lines, "run.jsonl", other("native", native))
    assert found == python_feed_lines(python)(lines, "run.jsonl", other("python", python))
    assert handed["native"] == handed["python"]
    assert (native.actions, native.sessions) == (python.actions, python.sessions)
    assert memory_of(native) == memory_of(python)


def test_feed_lines_cites_each_line(native: None) -> None:
    record = {"session_id": "s-1", "action_id": "a1", "kind": "payment", "status": "ok", "result": 1}
    lines = [(7, orjson.dumps(record), True), (9, b"{broken", True), (12, orjson.dumps(record), False)]
    handed: list[int] = []
    found = Checker(RULES).feed_lines(
        lines, "run.jsonl", lambda number, raw, owned: handed.append(number) or []
    )
    assert [(v.rule, v.file, v.line) for v in found] == [("unkeyed-side-effect", "run.jsonl", 7)]
    assert handed == [9, 12]


class _KeyThatCannotCompare:
    """A dict key that collides with ``session_id`` and raises when compared."""

    def __hash__(self) -> int:
        return hash("session_id")

    def __eq__(self, other: object) -> bool:
        raise LookupError("cannot compare")


def test_an_error_reading_the_record_reaches_the_caller_counted_as_in_python(native: None) -> None:
    record = {_KeyThatCannotCompare(): 1, "action_id": "a1", "kind": "email", "status": "ok"}
    python, native = Checker(RULES), Checker(RULES)
    with pytest.raises(LookupError):
        python_feed(python)(record)
    with pytest.raises(LookupError):
        native.feed(record)
    assert native.actions == python.actions == 1


def test_a_subclass_keeps_its_own_feed(native: None) -> None:
    """The C methods stand in only for methods the class left as they are."""
    seen: list[str] = []

    class CountingChecker(Checker):
        def feed(self, record: Any, where: Any = None) -> list[Any]:
            seen.append(record["action_id"])
            return super().feed(record, where) if where is not None else super().feed(record)

    checker = CountingChecker(RULES)
    record = {"session_id": "s-1", "action_id": "a1", "kind": "payment", "status": "ok", "result": 1}
    assert [v.rule for v in checker.feed(record)] == ["unkeyed-side-effect"]
    lines = [(1, orjson.dumps({**record, "action_id": "a2"}), True)]
    checker.feed_lines(lines, "run.jsonl", lambda number, raw, owned: [])
    assert seen == ["a1", "a2"]
    plain = Checker(RULES)
    assert plain.feed != python_feed(plain), "the plain class still gets the C feed"


def test_a_feed_made_without_init_raises_instead_of_crashing(native: None) -> None:
    # Found under AddressSanitizer: Feed.__new__ alone left NULL objects that feed() called.
    from durable_sessions._engine import Feed

    feed = Feed.__new__(Feed)
    record = {"session_id": "s-1", "action_id": "a1", "kind": "email", "status": "ok"}
    with pytest.raises(RuntimeError, match="not initialised"):
        feed.feed(record)
    with pytest.raises(RuntimeError, match="not initialised"):
        feed.feed_lines([(1, orjson.dumps(record), True)], "run.jsonl", lambda *line: [])


def test_a_long_lived_checker_forgets_each_runs_incarnation_with_its_sessions() -> None:
    """One checker behind many short process runs (the sidecar's): each run's
    ``service.instance.id`` is numbered by its sessions, not kept by the checker forever;
    a session still tells its runs apart (natively or not, whichever this run selects)."""
    checker = Checker(RULES, max_sessions=10)
    for n in range(2_000):
        record = {"session_id": f"s{n}", "action_id": "a1", "kind": "tool_call", "status": "ok"}
        checker.feed({**record, "incarnation": f"run-{n}"}, span_location("ab" * 16, f"{n + 1:016x}"))
    checker.finish()
    assert len(checker._symbols.texts) < 10  # kinds and statuses only
    retried = {"session_id": "r", "action_id": "p1", "kind": "payment", "idempotency_key": "k"}
    checker.feed({**retried, "status": "error", "incarnation": "run-a"}, span_location("cd" * 16, "1" * 16))
    session = checker._sessions["r"]
    memory = session.recall("p1")
    assert memory is not None and memory.incarnation == "run-a"
    checker.feed({**retried, "status": "ok", "incarnation": "run-b"}, span_location("cd" * 16, "2" * 16))
    memory = session.recall("p1")
    assert memory is not None and memory.incarnation == "run-b"
    assert session.incarnations == ["run-a", "run-b"]
