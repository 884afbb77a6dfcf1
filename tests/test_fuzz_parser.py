"""Property tests: the line parser, the readers and the engine never raise on any input.

The strategies draw arbitrary bytes lines, arbitrary JSON values and records whose keys
mix the real record field names (``record.ActionRecord``) with random ones and whose
values are any JSON type. The properties are the reader/engine contract: a line becomes a
record or a message, every violation names a known rule, carries a message and points at
the line that caused it.

Integers span any size (a JSON number may have hundreds of digits), floats include the
infinities ``1e999`` parses to, and any field may hold a list or an object. The
``@example`` cases are crashes found while writing these tests, kept as regressions.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from durable_sessions import bad_text, kinds, readers
from durable_sessions.check import check_paths, offline_checker
from durable_sessions.engine import Checker
from durable_sessions.record import REQUIRED_FIELDS, STATUSES, ActionRecord, Location
from durable_sessions.report import text_line
from durable_sessions.rules import CATALOGUE, select_rules
from durable_sessions.violation import Severity, Violation

FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RULE_IDS = frozenset(rule.id for rule in CATALOGUE)
RECORD_FIELDS = tuple(ActionRecord.__annotations__)
TRACING_FIELDS = ("trace_id", "span", "step", "agent", "tool", "parent", "meta", "error")

# -- JSON values ------------------------------------------------------------------------

INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
ANY_INT = st.one_of(
    st.integers(), st.sampled_from([10**40, -(10**40), 10**400, -(10**400), 2**64, -(2**63) - 1])
)


def json_scalars(ints: st.SearchStrategy[int]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        ints,
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
    )


def json_values(ints: st.SearchStrategy[int], *, infinite: bool = False) -> st.SearchStrategy[Any]:
    scalars = json_scalars(ints)
    if infinite:  # what 1e999 / -1e999 parse to
        scalars = scalars | st.sampled_from([math.inf, -math.inf])
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=8,
    )


ANY_VALUES = json_values(ANY_INT, infinite=True)


def plausible(field: str) -> st.SearchStrategy[Any]:
    """Values that reach deep into the rules for ``field``, not just type errors."""
    timestamps = st.datetimes().map(lambda d: d.isoformat() + "Z") | st.sampled_from(
        ["2026-11-01T09:00:00Z", "2026-11-03T09:00:00Z", "2026-11-01", "not a date"]
    )
    table: dict[str, st.SearchStrategy[Any]] = {
        "session_id": st.sampled_from(["s1", "s2", "", "s-\u00e9"]),
        "action_id": st.sampled_from(["a1", "a2", "a3", "a4", ""]),
        "kind": st.sampled_from([*sorted(kinds.KNOWN), "", "other"]),
        "status": st.sampled_from([*sorted(STATUSES), "done", "skipped"]),
        "idempotency_key": st.sampled_from(["k1", "k2", "pay-1764581640123", "k-2026-11-01", ""]),
        "incarnation": st.sampled_from(["run-1", "run-2"]),
        "replay": st.sampled_from(["skip", "again"]),
        "on_failure": st.sampled_from(["ask_user", "abort", "compensate", "later"]),
        "result_digest": st.sampled_from(["sha256:aa", "sha256:bb"]),
        "result_ref": st.sampled_from(["blob://r1", ""]),
        "result": st.sampled_from(["__REDACTED__", {"a": 1}, None]),
        "prompt_digest": st.sampled_from(["sha256:p1", "sha256:p2"]),
        "name": st.sampled_from(["book", "search"]),
        "ts": st.one_of(timestamps, st.integers(0, 4_102_444_800), st.floats(allow_nan=False)),
        "value_limit": st.integers(0, 8),
        "result_length": st.integers(0, 8),
    }
    if field in table:
        return table[field]
    if field in ("attempts", "max_attempts", "ttl_s", "seq"):
        return st.integers(-2, 6)
    if field in ("replayed", "side_effects", "retryable", "cacheable", "cache_hit", "redacted"):
        return st.booleans()
    return st.nothing()


PLAUSIBLE = {name: plausible(name) for name in (*RECORD_FIELDS, *TRACING_FIELDS)}
FIELD_VALUES = {name: strategy | ANY_VALUES for name, strategy in PLAUSIBLE.items()}


@st.composite
def records(draw: st.DrawFn, *, tracing: bool = False) -> dict[str, Any]:
    """A JSON object with record (and optionally tracing) field names plus random keys."""
    values = ANY_VALUES
    names = RECORD_FIELDS + (TRACING_FIELDS if tracing else ())
    obj: dict[str, Any] = {}
    # Usually a well-formed head, so the record and session rules run too.
    if draw(st.integers(0, 9)) > 1:
        for name in REQUIRED_FIELDS:
            obj[name] = draw(PLAUSIBLE[name])
    for name in draw(st.lists(st.sampled_from(names), max_size=8, unique=True)):
        obj[name] = draw(FIELD_VALUES[name])
    obj.update(draw(st.dictionaries(st.text(max_size=10), values, max_size=2)))
    if tracing and draw(st.booleans()):
        obj.update(
            trace_id=draw(st.sampled_from(["t1", "t2"])),
            span=draw(st.sampled_from(["s1", "s2", "s3"])),
            step=draw(st.integers(0, 9)),
            kind=draw(
                st.sampled_from(["trace_start", "step_start", "step_complete", "tool_call", "tool_result"])
            ),
            status=draw(st.sampled_from(["started", "ok", "error", "skipped"])),
        )
        obj.pop("action_id", None)
    return obj


def assert_violation_ok(
    violation: Violation, *, file: str | None = None, lines: set[int] | None = None
) -> None:
    assert isinstance(violation, Violation)
    assert violation.rule in RULE_IDS
    assert violation.severity in (Severity.ERROR, Severity.WARNING)
    assert isinstance(violation.message, str) and violation.message.strip()
    assert " — " in violation.message  # `<what> — <consequence>`
    if file is not None:
        assert violation.file == file
    if lines is not None:
        assert violation.line in lines
    # Every output channel can render it.
    json.dumps(violation.as_dict())
    text_line(violation).encode("utf-8")
    assert violation.key


# -- the line parser ----------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=300))
def test_parse_object_never_raises_on_bytes(line: bytes) -> None:
    parsed = readers.parse_object(line)
    assert type(parsed) is dict or (type(parsed) is str and parsed.startswith("line "))


@FUZZ
@given(json_values(INT64))
def test_parse_object_round_trips_json(value: Any) -> None:
    """An encoded JSON object comes back equal; anything else is named by its type."""
    for encoded in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode()):
        parsed = readers.parse_object(encoded)
        if isinstance(value, dict):
            assert parsed == value
        else:
            assert isinstance(parsed, str)
            assert parsed.endswith("not a JSON object")


@FUZZ
@given(st.lists(st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"0"]), min_size=1))
def test_parse_object_literals(numbers: list[bytes]) -> None:
    """NaN and Infinity are not JSON; 1e999 is (an infinite float)."""
    line = b'{"n":[' + b",".join(numbers) + b"]}"
    parsed = readers.parse_object(line)
    if any(n in (b"NaN", b"Infinity", b"-Infinity") for n in numbers):
        assert isinstance(parsed, str) and parsed.startswith("line is not valid JSON")
    else:
        assert isinstance(parsed, dict)
        assert [math.copysign(1, x) if math.isinf(x) else x for x in parsed["n"]] == [
            1.0 if n == b"1e999" else -1.0 if n == b"-1e999" else 0 for n in numbers
        ]


def expected_numbers(lines: list[bytes]) -> list[int]:
    """The line numbers a reader must yield an item for: non-blank, non-comment lines.

    A UTF-8 byte order mark at the very start of the input is not content.
    """
    stripped = [line.strip() for line in lines]
    if stripped and stripped[0].startswith(readers.UTF8_BOM):
        stripped[0] = stripped[0][len(readers.UTF8_BOM) :].strip()
    return [n for n, line in enumerate(stripped, 1) if line and not line.startswith(b"#")]


def log_lines(objects: st.SearchStrategy[dict[str, Any]], size: int = 12) -> st.SearchStrategy[list[bytes]]:
    return st.lists(
        st.one_of(
            st.binary(max_size=120).map(lambda b: b.replace(b"\n", b"")),
            objects.map(lambda r: json.dumps(r).encode()),
            st.sampled_from([b"", b"   ", b"# comment", b"  # indented", b"\r", b"[]", b"null", b"{"]),
        ),
        max_size=size,
    )


LINES = log_lines(records())


@FUZZ
@given(LINES, st.booleans())
def test_read_actions_yields_one_item_per_line(lines: list[bytes], trailing_newline: bool) -> None:
    data = b"\n".join(lines) + (b"\n" if trailing_newline and lines else b"")
    items = list(readers.read_actions(io.BytesIO(data), "f.jsonl"))
    numbers = []
    for item in items:
        if type(item) is readers.Unreadable:
            assert item.location.file == "f.jsonl"
            assert isinstance(item.reason, str) and item.reason.startswith("line ")
            numbers.append(item.location.line)
        else:
            obj, location = item
            assert type(obj) is dict
            assert location.file == "f.jsonl"
            numbers.append(location.line)
    assert numbers == expected_numbers(lines)


@FUZZ
@example([b"{}"], 2)  # exactly the limit: was once reported as longer
@example([b'{"k":1}     {}', b"{}"], 8)  # the rest of line 1 was once read as line 2
@given(LINES, st.integers(1, 80))
def test_read_actions_max_line_bytes(lines: list[bytes], limit: int) -> None:
    """A line over the limit (not counting its newline) is reported, never parsed."""
    data = b"\n".join(lines) + b"\n"
    numbers = []
    for item in readers.read_actions(io.BytesIO(data), "f", max_line_bytes=limit):
        number = item.location.line if type(item) is readers.Unreadable else item[1].line
        numbers.append(number)
        too_long = len(lines[number - 1]) > limit
        is_too_long = type(item) is readers.Unreadable and item.reason == readers.too_long(limit)
        assert too_long == is_too_long
    over = {n for n, line in enumerate(lines, 1) if len(line) > limit}
    assert numbers == sorted(set(expected_numbers(lines)) | over)


@FUZZ
@example("hello")  # was once reported with the message "hello"
@given(st.text(max_size=30))
def test_read_actions_json_string_line(text: str) -> None:
    """The text of a JSON string line never becomes the reason."""
    items = list(readers.read_actions(io.BytesIO(json.dumps(text).encode() + b"\n"), "f"))
    assert len(items) == 1 and type(items[0]) is readers.Unreadable
    assert items[0].reason == "line is a JSON string, not a JSON object"


@FUZZ
@example([b'{"trace_id":"t","span":["x"],"step":1,"kind":"tool_result","status":"ok"}'])
@example([b'{"trace_id":"t","span":"x","step":1,"kind":["tool_call"],"status":"ok"}'])
@example([b'{"trace_id":"t","span":"x","step":1,"kind":"tool_call","status":{}}'])
@given(st.lists(records(tracing=True).map(lambda r: json.dumps(r).encode()), max_size=6))
def test_read_tracing_never_raises(lines: list[bytes]) -> None:
    items = list(readers.read_tracing(io.BytesIO(b"\n".join(lines)), "t.jsonl"))
    for item in items:
        if type(item) is readers.Unreadable:
            continue
        record, location = item
        assert set(REQUIRED_FIELDS) <= set(record)
        assert location.file == "t.jsonl"
        assert 1 <= location.line <= len(lines)


@FUZZ
@example("\ud800", "session_id")  # once accepted, then unprintable: UnicodeEncodeError in the CLI
@given(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.sampled_from(REQUIRED_FIELDS))
def test_lone_surrogates_never_reach_the_output(surrogate: str, field: str) -> None:
    """A lone surrogate escape is valid JSON syntax but not Unicode: whatever the reader makes
    of it, every violation can be written as UTF-8."""
    obj = {"session_id": "s", "action_id": "a", "kind": "payment", "status": "ok"}
    obj[field] += surrogate
    line = json.dumps(obj).encode() + b"\n"
    assert b"\\ud" in line  # json.dumps writes it as an escape
    checker = Checker(ALL_RULES)
    [item] = readers.read_actions(io.BytesIO(line), "f")
    if type(item) is readers.Unreadable:
        violations = checker.unreadable(item.location, item.reason)
    else:
        violations = checker.feed(*item)
    violations += checker.finish()
    assert violations
    for violation in violations:
        assert_violation_ok(violation, file="f", lines={1})


# -- the engine ---------------------------------------------------------------------------

ALL_RULES = select_rules("all", strict=True)
DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")


@FUZZ
@given(records())
def test_feed_one_record_never_raises(obj: dict[str, Any]) -> None:
    checker = Checker(ALL_RULES)
    for violation in checker.feed(obj, Location("f", 1)):
        assert_violation_ok(violation, file="f", lines={1})
    for violation in checker.finish():
        assert_violation_ok(violation, file="f", lines={1})
    assert checker.actions == 1


def _feed_all(objs: list[dict[str, Any]], key_window_s: float, max_sessions: int | None) -> None:
    checker = Checker(ALL_RULES, key_window_s=key_window_s, max_sessions=max_sessions)
    for number, obj in enumerate(objs, 1):
        for violation in checker.feed(obj, Location("f", number)):
            if max_sessions is None or violation.rule not in (
                "retry-not-escalated",
                "unresolved-side-effect",
            ):
                assert_violation_ok(violation, file="f", lines={number})
            else:  # an evicted session's end-of-session findings point back
                assert_violation_ok(violation, file="f", lines=set(range(1, number + 1)))
    for violation in checker.finish():
        assert_violation_ok(violation, file="f", lines=set(range(1, len(objs) + 1)))
    assert checker.actions <= len(objs)


@FUZZ
@example(
    [{"session_id": "s", "action_id": "a", "kind": "tool_call", "status": "error", "on_failure": []}],
    86_400.0,
    None,
)
@example(
    [
        {"session_id": "s", "action_id": "a", "kind": "user_prompt", "status": "ok", "result": 1},
        {"session_id": "s", "action_id": "b", "kind": "user_prompt", "status": "ok", "prompt_digest": {}},
    ],
    86_400.0,
    None,
)
@example(
    [
        {
            "session_id": "s",
            "action_id": "a",
            "kind": "write",
            "status": "started",
            "idempotency_key": "k",
            "ts": 1,
        },
        {
            "session_id": "s",
            "action_id": "a",
            "kind": "write",
            "status": "ok",
            "idempotency_key": "k",
            "ts": 10**400,
        },
    ],
    1.0,
    None,
)
@given(st.lists(records(), max_size=12), st.sampled_from([1.0, 3600.0, 86_400.0]), st.sampled_from([None, 1]))
def test_feed_a_session_never_raises(
    objs: list[dict[str, Any]], window: float, max_sessions: int | None
) -> None:
    _feed_all(objs, window, max_sessions)


# -- a whole log through check_paths --------------------------------------------------------


@FUZZ
@given(
    st.lists(log_lines(records(tracing=True), size=8), min_size=1, max_size=2),
    st.sampled_from(["auto", "actions", "tracing"]),
    st.lists(records(tracing=True).map(lambda r: json.dumps(r).encode()), max_size=5),
)
def test_check_paths_never_raises(files: list[list[bytes]], fmt: str, tracing_lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        paths, lengths = [], {}
        for index, lines in enumerate([*files, tracing_lines]):
            path = str(Path(tmp) / f"log{index}.jsonl")
            data = b"\n".join(lines)
            # A start like compressed or UTF-16 text (a BOM, or NULs beside ASCII) is refused
            # whole, by design (test_cli_operations), not read line by line.
            assume(not any(magic.match(data[:10]) for magic, _ in readers._UNDECODABLE))
            Path(path).write_bytes(data)
            paths.append(path)
            lengths[path] = len(lines)
        checker = Checker(ALL_RULES)
        for violation in check_paths(paths, checker, fmt=fmt):  # type: ignore[arg-type]
            assert_violation_ok(violation)
            assert violation.file in lengths
            assert 1 <= violation.line <= lengths[violation.file]


# -- documented limits ------------------------------------------------------------------------


@FUZZ
@example(2**64)
@example(-(2**63) - 1)
@example(10**20 + 1)
@given(st.integers())
def test_parse_object_and_parse_line_keep_integers_exact_beyond_64_bits(number: int) -> None:
    """docs/readers.md: an integer is read exactly however many digits it has (the fast
    parser alone reads one beyond 64 bits as the nearest float)."""
    line = b'{"n":%d}' % number
    for parsed in (readers.parse_object(line), readers.parse_line(line, "f", 1, 1 << 20)[0]):  # type: ignore[index]
        assert parsed == {"n": number}
        assert type(parsed["n"]) is int


# -- format detection and text that is not UTF-8 --------------------------------------------

BACKTRACKING_NEXT_STRING = re.compile(
    rb'(?:[^"]*"[\x20\x21\x23-\x5b\x5d-\x7e]*")*[^"]*("[^"\\]*(?:\\.[^"\\]*)*")', re.DOTALL
)
"""bad_text's search for the next string as it was before its quantifiers were made
possessive: the reference its marks must still agree with."""


def marked_by_backtracking(body: bytes) -> bad_text.Marked | None:
    """What :func:`bad_text.marked` gave with the backtracking search, run over every body."""
    mark = bad_text.absent_mark(body)
    if mark is None:
        return None
    details: list[str] = []
    pieces: list[bytes] = []
    start = 0
    while (string := BACKTRACKING_NEXT_STRING.match(body, start)) is not None:
        detail = bad_text._not_text(string[1])
        if detail is not None:
            pieces += (body[start : string.start(1)], orjson.dumps(f"{mark}{len(details)}"))
            details.append(detail)
        else:
            pieces.append(body[start : string.end(1)])
        start = string.end(1)
    pieces.append(body[start:])
    return bad_text.Marked(b"".join(pieces), mark, details) if details else None


JSON_PIECES = st.sampled_from(
    [
        *(b'"', b"\\", b"a", b"\xff", b"\xc3\xa9", b"\xed\xa0\x80", b"\\ud800", b"\\uDC00", b"\\u0041"),
        *(b"\\ud83d\\ude00", b"{", b"}", b":", b",", b" ", b'\\"', b"\\\\", b"\x00", b"1"),
    ]
)


@FUZZ
@example(b'{"a":"x","b":"\xff","c":"unterminated')  # the printable strings before the tail
@example(b'{"a":"\\\\ud800"}')  # an escaped backslash: no escape, nothing marked
@given(st.lists(JSON_PIECES, max_size=40).map(b"".join) | st.binary(max_size=80))
def test_marking_bad_text_finds_what_the_backtracking_search_found(body: bytes) -> None:
    """The possessive search, and the look for bytes that are not UTF-8 and surrogate
    escapes before it, mark the same strings in the same words as the search that gave
    characters back (a 64 MiB line ending in an unterminated string took it 20-40 s)."""
    assert bad_text.marked(body) == marked_by_backtracking(body)


class CountedObjects:
    """``readers._object_on``, counting the lines it is asked about."""

    def __init__(self) -> None:
        self.lines: list[int] = []
        self._object_on = readers._object_on

    def __call__(self, line: bytes, number: int) -> Any:
        self.lines.append(number)
        return self._object_on(line, number)


def test_format_detection_reads_each_line_once(monkeypatch: Any) -> None:
    """Detection read each line up to the first object, then read them all again to say
    the format: a first line of 64 MiB with a byte that is not UTF-8 cost twice its 20 s.
    From a file and from a pipe, each line is read once now, and the format is the same."""
    lines = b'not json\n{"a":"\xff",\n{"resourceSpans":[]}\n{"session_id":"s"}\n'
    counted = CountedObjects()
    monkeypatch.setattr(readers, "_object_on", counted)
    assert readers.sniff_format(io.BytesIO(lines), "f", 1 << 20) == "otlp-json"
    assert counted.lines == [1, 2, 3]
    counted.lines.clear()
    read, write = os.pipe()
    os.write(write, lines)
    os.close(write)
    with open(read, "rb") as pipe:
        fmt, replay = readers.sniff(pipe, "<stdin>", 1 << 20)
        assert (fmt, replay.read()) == ("otlp-json", lines)
    assert counted.lines == [1, 2, 3]


# -- hostile lines among valid ones, in each format -------------------------------------------


def action_line(n: int) -> bytes:
    """An action record of its own session that is always a violation (an unkeyed payment)."""
    return json.dumps({"session_id": f"s{n}", "action_id": "pay", "kind": "payment", "status": "ok"}).encode()


def tracing_line(n: int) -> bytes:
    """The tracing event of an unkeyed payment, in its own trace."""
    event = {"trace_id": f"s{n}", "span": "pay", "step": 1, "kind": "tool_call", "status": "ok"}
    return json.dumps({**event, "tool": "pay", "meta": {"action_kind": "payment"}}).encode()


def otlp_line(n: int) -> bytes:
    """An OTLP/JSON request of one span: an unkeyed payment, in its own session."""
    attributes = [
        {"key": key, "value": {"stringValue": value}}
        for key, value in (
            ("session.id", f"s{n}"),
            ("agent.action.id", "pay"),
            ("agent.action.kind", "payment"),
        )
    ]
    span = {
        **{"traceId": f"{n + 1:032x}", "spanId": f"{n + 1:016x}", "name": "pay", "kind": 1},
        **{"startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000000000001"},
        **{"attributes": attributes, "status": {}},
    }
    scope_spans = [{"scope": {"name": "t"}, "spans": [span]}]
    return json.dumps(
        {"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": scope_spans}]}
    ).encode()


VALID_LINES = {"actions": action_line, "tracing": tracing_line, "otlp-json": otlp_line}


def hostile_lines(fmt: str, n: int, *, at: int, depth: int, noise: bytes, digits: int) -> list[bytes]:
    """Lines of ``fmt``'s log that hold no record, made from its valid line ``n``: never
    blank, a comment, or an object the format reads (an action log reports any object
    without its fields, an OTLP/JSON file any object that is no request; a tracing log
    passes over objects that are no event, as documented, so it gets none). ``at``: where
    to cut or put a NUL (1 to the line's length - 2); ``noise``: random bytes."""
    good = VALID_LINES[fmt](n)
    # inside the first string: the session id's key or value, or the span's name
    quote = good.index(b'"', good.index(b'"s') + 2) if fmt != "otlp-json" else good.index(b'"pay"') + 2
    hostile = [
        good[:at],  # cut short (a full disk, a killed writer)
        b"\xff" + noise.replace(b"\n", b""),  # random bytes, not UTF-8
        good[:at] + b"\x00" + good[at:],  # a NUL byte anywhere
        good[:quote] + b"\xc3\x28" + good[quote:],  # a byte that is not UTF-8 in a string
        good[:quote] + b"\\ud800" + good[quote:],  # a lone surrogate escape in a string
        readers.UTF8_BOM + good,  # a BOM that does not start the file is content
        b"9" * digits,  # a huge number, not an object
        b'{"n":' + b"9" * 4301 + b"}",  # more digits than Python reads
        b"[" * depth + b"]" * depth,  # deep nesting (not an object)
        b'{"a":' * depth + b"1" + b"}" * depth if depth > 3000 else b"[" * depth,  # too deep, or cut
    ]
    if fmt == "otlp-json":  # a span's time of more digits than a 64-bit one, or Python, reads
        hostile.append(good.replace(b'"1700000000000000001"', b'"' + b"9" * digits + b'"'))
    if fmt != "tracing":  # objects of another format
        hostile += [VALID_LINES[other](n) for other in VALID_LINES if other != fmt]
        hostile += [b'{"n":1e999}', b"{}" if fmt == "actions" else b'{"resourceSpans":{}}']
    return hostile


@st.composite
def hostile_line(draw: st.DrawFn, fmt: str, n: int) -> bytes:
    """One of :func:`hostile_lines`."""
    lines = hostile_lines(
        fmt,
        n,
        at=draw(st.integers(1, len(VALID_LINES[fmt](n)) - 2)),
        depth=draw(st.integers(1, 200_000)),
        noise=draw(st.binary(max_size=60)),
        digits=draw(st.integers(20, 6000)),
    )
    return draw(st.sampled_from(lines))


@st.composite
def hostile_logs(draw: st.DrawFn, fmt: str) -> tuple[bytes, list[bytes | None]]:
    """A log of ``fmt``: a valid first line (so that detection has one answer), then valid,
    hostile, blank and comment lines, each ended by LF or CRLF; the first maybe after a
    BOM, the last maybe with no line break. Also each line: its text when valid, None when
    hostile, ``b""`` when blank or a comment (which holds nothing, and is reported never)."""
    valid = VALID_LINES[fmt]
    kinds_of_lines = draw(st.lists(st.sampled_from(["valid", "hostile", "blank"]), max_size=10))
    lines, expected = [valid(0)], [valid(0)]
    for n, kind in enumerate(kinds_of_lines, 1):
        if kind == "valid":
            lines.append(valid(n))
            expected.append(valid(n))
        elif kind == "hostile":
            lines.append(draw(hostile_line(fmt, n)))
            expected.append(None)
        else:
            lines.append(draw(st.sampled_from([b"", b"  \t", b"\r", b"# a comment", b"  # \xff not UTF-8"])))
            expected.append(b"")
    ends = draw(st.lists(st.sampled_from([b"\n", b"\r\n"]), min_size=len(lines), max_size=len(lines)))
    if not draw(st.booleans()):
        ends[-1] = b""
    bom = readers.UTF8_BOM if draw(st.booleans()) else b""
    return bom + b"".join(line + end for line, end in zip(lines, ends, strict=True)), expected


def assert_every_line_judged(
    violations: list[Violation], file: str, expected: list[bytes | None], fmt: str
) -> None:
    """Each valid line's payment is found at its line, each hostile line is reported at its
    line, and no violation points anywhere else."""
    by_line: dict[int, list[Violation]] = {}
    for violation in violations:
        assert_violation_ok(violation, file=file)
        by_line.setdefault(violation.line, []).append(violation)  # type: ignore[arg-type]
    for number, line in enumerate(expected, 1):
        found = by_line.pop(number, [])
        if line is None:
            assert found, f"hostile line {number} was not reported"
        elif line:
            assert [(v.rule, v.session_id) for v in found] == [("unkeyed-side-effect", f"s{number - 1}")]
        else:
            assert not found
    assert not by_line, f"violations on lines past the file: {by_line}"


@FUZZ
@given(st.sampled_from(list(VALID_LINES)).flatmap(lambda fmt: st.tuples(st.just(fmt), hostile_logs(fmt))))
def test_hostile_lines_are_reported_by_line_and_lose_no_valid_one(case: tuple[str, Any]) -> None:
    """Random bytes, lines cut short, NUL bytes, bytes that are not UTF-8, lone surrogates,
    BOMs, huge numbers, deep nesting, CRLF endings and lines of another format, among
    valid lines of each format: the format is detected from the valid first line, every
    hostile line is reported at its line and every valid line's action is still checked."""
    fmt, (data, expected) = case
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "log.jsonl")
        Path(path).write_bytes(data)
        with open(path, "rb") as source:
            assert readers.sniff_format(source, path, readers.DEFAULT_MAX_LINE_BYTES) == fmt
        violations = list(check_paths([path], offline_checker(ALL_RULES)))
    assert_every_line_judged(violations, path, expected, fmt)


def sniffed_from_a_pipe(data: bytes) -> tuple[str, bytes]:
    """The format :func:`readers.sniff` says of ``data`` on a real pipe, and what the stream
    it returns gives back (written from a thread: ``data`` may not fit the pipe's buffer)."""
    read, write = os.pipe()
    writer = threading.Thread(target=lambda: (os.write(write, data) if data else None, os.close(write)))
    writer.start()
    try:
        with open(read, "rb") as pipe:
            fmt, stream = readers.sniff(pipe, "<stdin>", readers.DEFAULT_MAX_LINE_BYTES)
            return fmt, stream.read()
    finally:
        writer.join(timeout=60)


@FUZZ
@given(
    st.lists(
        st.sampled_from(list(VALID_LINES)).flatmap(
            lambda fmt: st.one_of(st.just(VALID_LINES[fmt](1)), hostile_line(fmt, 1))
        )
        | st.sampled_from([b"", b"\r", b"# comment", readers.UTF8_BOM]),
        max_size=5,
    ),
    st.sampled_from([b"\n", b"\r\n"]),
    st.booleans(),
)
def test_a_pipe_and_a_file_are_detected_alike(lines: list[bytes], end: bytes, bom: bool) -> None:
    """Lines of every format, hostile ones and BOMs before the first object: a file (read
    and rewound) and a pipe (read whole up to the first object, then given back) are
    detected as the same format, the first object's, and the pipe loses no byte."""
    data = (readers.UTF8_BOM if bom else b"") + b"".join(line + end for line in lines)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "log.jsonl"
        path.write_bytes(data)
        with open(path, "rb") as source:
            from_file = readers.sniff_format(source, str(path), readers.DEFAULT_MAX_LINE_BYTES)
            assert source.tell() == 0
    assert sniffed_from_a_pipe(data) == (from_file, data)
    objects = (readers._object_on(line, n) for n, line in enumerate(data.split(b"\n"), 1))
    first = next((obj for obj in objects if obj is not None), {})  # {} is an object, and an action log's
    assert from_file == (
        "otlp-json" if "resourceSpans" in first else "tracing" if "trace_id" in first else "actions"
    )


@pytest.mark.parametrize("fmt", list(VALID_LINES))
def test_the_cli_reports_every_hostile_line_and_exits_1(tmp_path: Path, fmt: str) -> None:
    """Every kind of hostile line at once, between valid lines, given to the command as a
    file and on standard input: exit 1 (violations, docs/readers.md), no traceback, each
    hostile line reported at its ``file:line`` and each valid line's payment found."""
    hostile = hostile_lines(fmt, 1, at=7, depth=100_000, noise=bytes(range(256)), digits=5000)
    lines = [line for n, bad in enumerate(hostile, 1) for line in (bad, VALID_LINES[fmt](n))]
    data = b"\r\n".join([VALID_LINES[fmt](0), *lines]) + b"\n"
    path = tmp_path / "log.jsonl"
    path.write_bytes(data)
    for argument, name, stdin in ((str(path), str(path), None), ("-", "<stdin>", data)):
        run = subprocess.run(
            [str(DURABLE_SESSIONS), "check", "--format", "json", argument],
            input=stdin, capture_output=True, timeout=300,
        )  # fmt: skip
        assert (run.returncode, run.stderr) == (1, b"")
        reported: dict[int, set[str]] = {}
        for violation in json.loads(run.stdout)["violations"]:
            assert violation["file"] == name
            reported.setdefault(violation["line"], set()).add(violation["rule"])
        assert reported.pop(1) == {"unkeyed-side-effect"}
        for number in range(2, len(lines) + 2):
            assert reported.pop(number), f"line {number} ({lines[number - 2][:40]!r}) was not reported"
        assert not reported


def test_the_mark_is_one_the_body_holds_in_no_form() -> None:
    """A mark must not be in the body already, as UTF-8 or as an escape in either case of
    its hex digits (or of the ``u``): the body is lowered once for all the marks tried."""
    first, second, third, fourth = bad_text._MARKS[:4]
    assert bad_text.absent_mark(b'["\xff"]') == first
    held = f'["{first}", "\\u{ord(second):04X}", "\\U{ord(third):04x}"]'.encode()
    assert bad_text.absent_mark(held) == fourth
    assert bad_text.absent_mark(f'["\\U{ord(first):04X}"]'.encode()) == second
    assert bad_text.absent_mark("".join(bad_text._MARKS).encode()) is None
