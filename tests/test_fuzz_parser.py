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
import tempfile
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from durable_sessions import bad_text, kinds, readers
from durable_sessions.check import check_paths
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
    mark = next((mark for mark in bad_text._MARKS if not bad_text._holds(body, mark)), None)
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
