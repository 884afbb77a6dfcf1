"""The C rows (``store/_rows.c``) against their reference, ``reference_action_row``: for
every record they build a row of, the same row field for field (the JSON text byte for
byte, the checked record the very object the reference gives); they decline (None) only
records that are not plain, and build every record the sidecar's benchmark sends."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from typing import Any

import orjson
import pytest
from durable_sessions_collector.otlp.decode import protobuf_span_parts
from durable_sessions_collector.otlp.receiver import scrub
from durable_sessions_collector.store import ActionRow, action_row, base
from durable_sessions_collector.store.base import reference_action_row
from durable_sessions_collector.store.stored import MAX_TEXT, STORED_FIELDS, hidden, native_rows_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.collector_ingest import build_round
from durable_sessions.mapping import map_attributes
from tests.support.senders import require_native

RULES = native_rows_settings()
IDENTIFIERS = sorted(RULES["identifiers"])
CHOICES = {name: sorted(values) for name, values in RULES["choices"].items()}
DIGESTS = sorted(RULES["digests"])
NO_TEXT = sorted(STORED_FIELDS.difference(IDENTIFIERS, CHOICES, DIGESTS))
INT64 = 2**63


@pytest.fixture(autouse=True)
def _native_rows() -> None:
    require_native("_rows", package="durable_sessions_collector.store")
    assert base.native_rows_in_use(), "built, but DURABLE_SESSIONS_NATIVE turned it off"


def native(record: Any, trace_id: str = "t" * 32, span_id: str = "s" * 16) -> ActionRow | None:
    assert base._ROWS is not None
    return base._ROWS.row(record, trace_id, span_id)  # type: ignore[no-any-return]


def assert_same_row(record: Any, row: ActionRow, trace_id: str = "t" * 32, span_id: str = "s" * 16) -> None:
    expected = reference_action_row(record, trace_id, span_id)
    assert type(row) is ActionRow
    for field in dataclasses.fields(ActionRow):
        got, want = getattr(row, field.name), getattr(expected, field.name)
        assert type(got) is type(want), field.name
        assert got == want, field.name
    assert row.record is expected.record  # the record itself, as checked_record gives it
    assert row == expected


# --- plain values: each stored as given --------------------------------------------------------

hex_digits = st.text("0123456789abcdefABCDEF", min_size=64, max_size=64)
plain_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20).filter(
    lambda text: not text.startswith("hidden:sha256:")
)
plain_numbers = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-INT64, INT64 - 1),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x == 0 or abs(x) >= 1e-4),
)


def plain_field(name: str) -> st.SearchStrategy[Any]:
    if name in IDENTIFIERS:
        text = st.one_of(plain_text, st.integers(MAX_TEXT - 2, MAX_TEXT).map(lambda n: "é" * n))
    elif name in DIGESTS:
        text = st.one_of(st.just(""), hex_digits.map(lambda digits: "sha256:" + digits))
    elif name in CHOICES:
        text = st.sampled_from(["", *CHOICES[name]])
    else:
        text = st.just("")
    return st.one_of(text, plain_numbers)


# --- any value: plain or not ---------------------------------------------------------------------

not_plain = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=8),  # lone surrogates, NUL
    st.integers(MAX_TEXT + 1, MAX_TEXT + 3).map(lambda n: "k" * n),
    hex_digits.map(lambda digits: "sha256:" + digits[:63]),
    hex_digits.map(lambda digits: "sha256:" + digits + "\n"),
    hex_digits.map(lambda digits: "SHA256:" + digits),
    st.text("0123456789abcdefABCDEFgG", min_size=64, max_size=64).map(lambda digits: "sha256:" + digits),
    st.sampled_from(["OK", "Error", "skipped", "ask", "span", "hidden:sha256:", "hidden:sha256:zz"]),
    st.text(max_size=5).map(hidden),
    st.text(max_size=5).map(lambda text: hidden(text) + "~2026-01-01"),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e-5, -5e-324, 2.5e-7]),
    st.sampled_from([INT64, -INT64 - 1, 2**64, -(2**70), 10**30]),
    st.binary(max_size=4),
    st.binary(max_size=4).map(bytearray),
    st.lists(st.integers(), max_size=2),
    st.lists(st.integers(), max_size=2).map(tuple),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just(frozenset({1})),
    st.text(max_size=4).map(type("Text", (str,), {})),
    st.integers(0, 3).map(type("Number", (int,), {})),
)
anything = st.one_of(plain_numbers, plain_text, not_plain)
plain_records = st.lists(
    st.sampled_from([*IDENTIFIERS, *CHOICES, *DIGESTS, *NO_TEXT, "notes", "result", "other"]), unique=True
).flatmap(
    lambda names: st.fixed_dictionaries(
        {name: plain_field(name) if name not in ("notes", "result", "other") else anything for name in names}
    )
)

any_records = st.dictionaries(
    st.sampled_from([*IDENTIFIERS, *CHOICES, *DIGESTS, *NO_TEXT, "notes", "result"]),
    st.one_of(anything, st.sampled_from([v for values in CHOICES.values() for v in values])),
    max_size=10,
)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "600")), deadline=None)
@given(plain_records)
def test_every_plain_record_is_built_as_the_reference_builds_it(record: dict[str, Any]) -> None:
    """Plain: every stored field holds a value stored as given (the fields no record
    stores may hold anything, since no row holds them)."""
    row = native(record)
    assert row is not None
    assert_same_row(record, row)


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "1500")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(any_records, st.one_of(st.text(max_size=3), st.none()), st.text(max_size=3))
def test_any_record_is_built_as_the_reference_builds_it_or_declined(
    record: dict[str, Any], trace_id: Any, span_id: str
) -> None:
    row = native(record, trace_id, span_id)
    if row is not None:
        assert_same_row(record, row, trace_id, span_id)
    assert action_row(record, trace_id, span_id) == reference_action_row(record, trace_id, span_id)


EDGES = [
    ("seq", INT64 - 1, True),
    ("seq", -INT64, True),
    ("seq", INT64, False),  # the reference holds it to the column's range
    ("seq", -INT64 - 1, False),
    ("seq", 2**64, False),
    ("seq", True, True),  # no int: no seq column
    ("result_digest", "sha256:" + "aB" * 32, True),
    ("result_digest", "sha256:" + "a" * 63 + "G", False),
    ("result_digest", "sha256:" + "a" * 63 + "g", False),
    ("result_digest", "sha256:" + "a" * 63, False),
    ("result_digest", "sha256:" + "a" * 64 + "\n", False),
    ("prompt_digest", "SHA256:" + "a" * 64, False),
    ("prompt_digest", "sha256:" + "é" * 64, False),
    ("result_digest", hidden("x"), False),
    ("session_id", "é" * MAX_TEXT, True),
    ("session_id", "é" * (MAX_TEXT + 1), False),
    ("session_id", "", True),
    ("kind", hidden("x"), True),  # kept as given by either rule
    ("kind", "hidden:sha256:zz", True),
    ("kind", "a\x00b", True),
    ("kind", "\ud800", False),  # orjson refuses it: json writes it
    ("status", "OK", False),
    ("status", "", True),
    ("status", None, True),
    ("status", 1.5, True),
    ("status", False, True),
    ("on_failure", "abort", True),
    ("on_failure", "skip", False),
    ("ts", 1e-4, True),
    ("ts", 9.99e-5, False),  # orjson writes 0.0000999, json 9.99e-05
    ("ts", -0.0, True),
    ("ts", math.nan, False),
    ("ts", -math.inf, False),
    ("attempts", "3", False),
    ("attempts", b"3", False),
    ("attempts", (3,), False),
    ("notes", b"anything", True),  # no stored field: never read
]


@pytest.mark.parametrize(("name", "value", "built"), EDGES)
def test_edges_are_built_or_declined(name: str, value: Any, built: bool) -> None:
    record = {"session_id": "s", "status": "ok", "seq": 3, name: value}
    row = native(record)
    assert (row is not None) == built
    if row is not None:
        assert_same_row(record, row)
    assert action_row(record, "t" * 32, "s" * 16) == reference_action_row(record, "t" * 32, "s" * 16)


def benchmark_records() -> list[tuple[dict[str, Any], str, str]]:
    """The records of the sidecar's throughput benchmark, decoded and mapped as the
    receivers do it."""
    records = []
    for body in build_round("rows", 4, 100, 10):
        for parts in protobuf_span_parts(body, []):
            name, attributes, resource, status_error, start_ns, trace_id, span_id, end_ns = parts
            mapped = map_attributes(
                attributes, resource, status_error, start_ns, trace_id, span_id, None, False, end_ns
            )
            assert mapped is not None, name
            record, _ = mapped
            scrub(record)
            records.append((record, trace_id, span_id))
    return records


def test_the_benchmark_records_are_all_built_in_c() -> None:
    records = benchmark_records()
    assert len(records) == 400
    for record, trace_id, span_id in records:
        row = native(record, trace_id, span_id)
        assert row is not None, record
        assert_same_row(record, row, trace_id, span_id)


def test_a_row_the_c_rows_decline_is_built_in_python() -> None:
    """A long session id: the stored record holds its digest, and the engine checks it."""
    record = {"session_id": "s" * (MAX_TEXT + 1), "status": "ok", "seq": 2**64, "notes": b"x"}
    assert native(record) is None
    row = action_row(record, "t" * 32, "s" * 16)
    assert row.session_id == hidden("s" * (MAX_TEXT + 1))
    assert row.record["session_id"] == row.session_id and row.record is not record
    assert row.seq == INT64 - 1
    assert row == reference_action_row(record, "t" * 32, "s" * 16)


def test_the_switch_turns_the_c_rows_off() -> None:
    """With DURABLE_SESSIONS_NATIVE=false action_row is the reference alone."""
    script = (
        "from durable_sessions_collector.store import base\nprint(base.native_rows_in_use(), base._ROWS)\n"
    )
    for value, expected in (("false", "False None"), ("true", "True ")):
        env = {**os.environ, "DURABLE_SESSIONS_NATIVE": value}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        assert done.stdout.startswith(expected), (value, done.stdout, done.stderr)


def test_rows_refuse_a_row_type_of_other_fields() -> None:
    """A field added to ActionRow alone would be left unset in every row built in C."""
    from durable_sessions_collector.store import _rows  # type: ignore[attr-defined]

    @dataclasses.dataclass(slots=True)
    class Wider:
        session_id: str
        trace_id: str
        span_id: str
        status: str
        record: dict[str, Any]
        action_id: str | None
        kind: str | None
        seq: int | None
        text: str
        extra: int

    with pytest.raises(TypeError, match="slots are not those _rows fills"):
        _rows.Rows(
            **native_rows_settings(),
            row_type=Wider,
            dumps=orjson.dumps,
            smallest_float=base._ORJSON_SMALLEST_FLOAT,
        )
