"""The OTLP/JSON reader on hand-written and malformed input: it reports, never crashes."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_sessions import readers
from durable_sessions.engine import Checker
from durable_sessions.rules import select_rules
from tests.support import otlp_json_values

DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")
TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PAYMENT = [
    ("session.id", {"stringValue": "s-1"}),
    ("agent.action.id", {"stringValue": "a1"}),
    ("agent.action.kind", {"stringValue": "payment"}),
    ("agent.action.idempotency_key", {"stringValue": "k-s-1-a1"}),
]


def request(attributes: list[tuple[str, Any]], **span_fields: Any) -> dict[str, Any]:
    """One OTLP/JSON request of one span with these attributes."""
    span = {
        "traceId": TRACE_ID,
        "spanId": SPAN_ID,
        "name": "act",
        "startTimeUnixNano": "1767225600000000000",
        "attributes": [{"key": key, "value": value} for key, value in attributes],
        **span_fields,
    }
    return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"scope": {"name": "t"}, "spans": [span]}]}]}


def read(document: dict[str, Any]) -> list[readers.Item]:
    line = json.dumps(document).encode() + b"\n"
    return list(readers.read_otlp_json(io.BytesIO(line), "f.jsonl"))


def check_file(path: Path) -> tuple[int, dict[str, Any], str]:
    result = subprocess.run(
        [str(DURABLE_SESSIONS), "check", "--format", "json", str(path)], capture_output=True, text=True
    )
    return result.returncode, json.loads(result.stdout) if result.stdout else {}, result.stderr


def test_a_status_that_is_an_array_or_a_key_value_list_is_reported_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    statuses = (
        {"arrayValue": {"values": [{"boolValue": True}, {"boolValue": False}]}},
        {"kvlistValue": {"values": [{"key": "a", "value": {"stringValue": "ok"}}]}},
    )
    with path.open("w") as out:
        for status in statuses:
            out.write(json.dumps(request([*PAYMENT, ("agent.action.status", status)])) + "\n")
    code, report, stderr = check_file(path)
    assert "Traceback" not in stderr
    assert code == 1
    assert [(v["line"], v["rule"]) for v in report["violations"]] == [
        (1, "missing-field"),
        (2, "missing-field"),
    ]


# -- the reader never raises, whatever the values --------------------------------------

# A decimal string of more digits than Python reads: int() raised ValueError out of the reader.
json_scalars = otlp_json_values.json_scalars("eyJhIjoxfQ==", "9" * 5000, "-" + "1" * 4301)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
any_values = otlp_json_values.any_values(json_values, json_values, max_leaves=6)
FIELDS = ["status", "max_attempts", "attempts", "retryable", "result", "result_digest", "kind", "id", "ttl_s"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    st.dictionaries(st.sampled_from(FIELDS), any_values, max_size=5),
    st.one_of(st.none(), json_values),
    st.one_of(st.none(), json_values),
)
def test_the_reader_reports_every_value_and_never_raises(
    values: dict[str, Any], status_code: Any, start: Any
) -> None:
    fields: dict[str, Any] = {"status": {"code": status_code}}
    if start is not None:
        fields["startTimeUnixNano"] = start
    document = request([*PAYMENT, *((f"agent.action.{k}", v) for k, v in values.items())], **fields)
    checker = Checker(select_rules("all"))
    for item in read(document):
        if type(item) is readers.Unreadable:
            assert item.reason
            continue
        checker.feed(*item)  # type: ignore[misc]
    checker.finish()


# -- values the encoding does not allow are refused, not coerced ------------------------


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("agent.action.max_attempts", {"intValue": 3.5}, "intValue 3.5 is not an integer"),
        ("agent.action.max_attempts", {"intValue": True}, "intValue true is not an integer"),
        ("agent.action.attempts", {"intValue": "3.0"}, "intValue '3.0' is not an integer"),
        ("agent.action.attempts", {"stringValue": 3}, "stringValue 3 is not a string"),
        (
            "agent.action.attempts",
            {"intValue": "9" * 4301},
            "intValue '99999999999999999...' has more than 4300 digits, the most Python reads",
        ),
        ("agent.action.retryable", {"boolValue": "true"}, "boolValue 'true' is not true or false"),
        ("agent.action.ttl_s", {"doubleValue": "soon"}, "doubleValue 'soon' is not a number"),
        ("agent.action.result", {"bytesValue": "not base64!"}, "bytesValue is not base64 text"),
        (
            "agent.action.attempts",
            {"intValue": "3", "stringValue": "x"},
            "value sets intValue and stringValue",
        ),
        ("agent.action.status", {"arrayValue": {"values": [3]}}, "value is a number, not an AnyValue object"),
        ("session.id", {"kvlistValue": {"values": [{"key": 5, "value": {}}]}}, "entry without a string key"),
    ],
)
def test_a_value_the_encoding_does_not_allow_makes_the_span_unreadable(
    key: str, value: Any, reason: str
) -> None:
    """The reader turned intValue 3.5 into 3 and true into 1 (a valid cap), where the
    sidecar refused them: the two readers of one contract disagreed on the record."""
    (item,) = read(request([*PAYMENT, (key, value)]))
    assert type(item) is readers.Unreadable
    assert item.reason.startswith(f"resourceSpans[0].scopeSpans[0].spans[0] attribute {key!r}: ")
    assert reason in item.reason


def test_a_bad_value_the_mapping_never_reads_is_of_no_consequence() -> None:
    ((record, _),) = read(request([*PAYMENT, ("http.status_code", {"intValue": 3.5})]))
    assert record["action_id"] == "a1"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"status": {"code": "2"}}, "error"),  # a decimal string, as protobuf's JSON mapping reads it
        ({"status": {"code": "STATUS_CODE_ERROR"}}, "error"),
        ({"status": {"code": 2}}, "error"),
        ({"status": {"code": "1"}}, "ok"),
        ({"status": {}}, "ok"),
        ({"status": {"code": 2.0}}, "status.code 2.0 is not a status code"),
        ({"status": {"code": True}}, "status.code true is not a status code"),
        ({"status": {"code": "error"}}, "status.code 'error' is not a status code"),
        ({"startTimeUnixNano": "-5"}, "startTimeUnixNano '-5' is not an unsigned 64-bit integer"),
        ({"startTimeUnixNano": str(2**64)}, "is not an unsigned 64-bit integer"),
        ({"startTimeUnixNano": 1.5}, "startTimeUnixNano 1.5 is not an unsigned 64-bit integer"),
    ],
)
def test_status_codes_and_start_times_are_read_as_protobuf_s_json_mapping_allows(
    fields: dict[str, Any], expected: str
) -> None:
    (item,) = read(request(PAYMENT, **fields))
    if type(item) is readers.Unreadable:
        assert expected in item.reason
    else:
        assert item[0]["status"] == expected  # type: ignore[index]


def test_the_legacy_instrumentation_library_spans_are_refused_with_the_reason() -> None:
    """OTLP renamed them scopeSpans and removed them; the sidecar's decoder drops unknown
    fields, so it read no span there (200 OK) while the reader read them."""
    document = request(PAYMENT)
    group = document["resourceSpans"][0]
    group["instrumentationLibrarySpans"] = group.pop("scopeSpans")
    (item,) = read(document)
    assert type(item) is readers.Unreadable
    assert item.reason.startswith("resourceSpans[0] holds instrumentationLibrarySpans")


def test_a_bad_resource_value_makes_each_of_its_spans_unreadable() -> None:
    document = request(PAYMENT)
    document["resourceSpans"][0]["resource"] = {
        "attributes": [{"key": "service.instance.id", "value": {"intValue": 1.5}}]
    }
    document["resourceSpans"][0]["scopeSpans"][0]["spans"] *= 2
    items = read(document)
    assert [(type(item), item.occurrence) for item in items] == [
        (readers.Unreadable, 0),
        (readers.Unreadable, 1),
    ]  # type: ignore[union-attr]
    assert "resource attribute 'service.instance.id': intValue 1.5 is not an integer" in items[0].reason  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("broken", "place", "reason"),
    [
        (lambda group: group.update(scopeSpans={"spans": group["scopeSpans"][0]["spans"]}),
         "resourceSpans[0].scopeSpans", "is an object, not a list"),
        (lambda group: group.update(scopeSpans=""), "resourceSpans[0].scopeSpans", "is a string, not a list"),
        (lambda group: group["scopeSpans"].__setitem__(0, "junk"), "resourceSpans[0].scopeSpans[0]",
         "is a string, not an object"),
        (lambda group: group["scopeSpans"][0].update(spans={"0": group["scopeSpans"][0]["spans"][0]}),
         "resourceSpans[0].scopeSpans[0].spans", "is an object, not a list"),
    ],
)  # fmt: skip
def test_a_scope_or_span_list_that_cannot_be_read_is_reported_not_passed_over(
    tmp_path: Path, broken: Any, place: str, reason: str
) -> None:
    """Such a request held spans no one can read: they were dropped without a word, so a
    file of them passed as clean (exit 0, "no actions found"). The well-formed line after
    it is still checked."""
    document = request([("session.id", {"stringValue": "s-1"}), *PAYMENT[1:3]])  # an unkeyed payment
    broken(document["resourceSpans"][0])
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(document) + "\n" + json.dumps(request(PAYMENT[:3])) + "\n")
    code, report, stderr = check_file(path)
    assert code == 1, stderr
    assert [(v["line"], v["rule"]) for v in report["violations"]] == [
        (1, "unreadable-line"),
        (2, "unkeyed-side-effect"),
    ]
    assert report["violations"][0]["message"].startswith(f"{place} {reason} — ")


@pytest.mark.parametrize(
    "empty", [{"scopeSpans": None}, {"scopeSpans": []}, {"scopeSpans": [{"spans": None}]}]
)
def test_absent_or_null_scope_and_span_lists_hold_no_span(empty: dict[str, Any]) -> None:
    """protobuf's JSON mapping reads null as the empty list: nothing to report."""
    assert read({"resourceSpans": [{"resource": {}, **empty}]}) == []


def test_a_file_in_the_proto_field_names_is_detected_as_otlp_json(tmp_path: Path) -> None:
    """The reader takes ``resource_spans``, ``scope_spans``, ``start_time_unix_nano`` (as
    docs/readers.md says), but detection looked for ``resourceSpans`` only: such a file
    was read as an action log, four missing-field errors a line and its spans unchecked."""
    span = request(PAYMENT[:3])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["trace_id"], span["span_id"] = span.pop("traceId"), span.pop("spanId")
    span["start_time_unix_nano"] = span.pop("startTimeUnixNano")
    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps({"resource_spans": [{"scope_spans": [{"spans": [span]}]}]}) + "\n")
    code, report, stderr = check_file(path)
    assert code == 1, stderr
    assert [(v["line"], v["rule"], v["action_id"]) for v in report["violations"]] == [
        (1, "unkeyed-side-effect", "a1")
    ]


KEY_VALUE_LIST = {"kvlistValue": {"values": [{"key": "kind", "value": {"stringValue": "LLM"}}]}}


@pytest.mark.parametrize(
    "marker", ["gen_ai.operation.name", "openinference.span.kind", "traceloop.span.kind"]
)
@pytest.mark.parametrize(
    "value", [KEY_VALUE_LIST, {"arrayValue": {"values": [KEY_VALUE_LIST]}}, {"intValue": "7"}]
)
def test_a_convention_marker_that_is_no_string_marks_no_action_and_crashes_nothing(
    tmp_path: Path, marker: str, value: dict[str, Any]
) -> None:
    """A key-value list (a dict) as ``gen_ai.operation.name`` or a span kind was looked up
    in the conventions' tables: TypeError, a traceback, the file's other spans unchecked.
    It names no operation the conventions know, as an unknown string does not: no action."""
    path = tmp_path / "traces.jsonl"
    marked = request([("session.id", {"stringValue": "s-1"}), (marker, value)])
    path.write_text(json.dumps(marked) + "\n" + json.dumps(request(PAYMENT[:3])) + "\n")
    code, report, stderr = check_file(path)
    assert "Traceback" not in stderr
    assert (code, [(v["line"], v["rule"]) for v in report["violations"]]) == (1, [(2, "unkeyed-side-effect")])


def test_a_convention_marker_that_is_no_string_is_mapped_as_the_sidecar_decodes_it() -> None:
    """The sidecar's protobuf decoder gives a key-value list as a dict too: the mapping it
    shares maps such a span to no action rather than raising."""
    from durable_sessions.mapping import map_attributes

    for marker in ("gen_ai.operation.name", "openinference.span.kind", "traceloop.span.kind"):
        attributes = {marker: {"kind": "LLM"}, "session.id": "s-1"}
        assert map_attributes(attributes, {}, False, 0, TRACE_ID, SPAN_ID, None, True) is None


# -- the attribute value length limit ----------------------------------------------------


def cut_results_file(path: Path, limit: int) -> None:
    """Two results cut by the SDK at ``limit``: one no longer JSON, one still JSON (a number)."""
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from durable_sessions.otlp_json import FileSpanExporter

    provider = TracerProvider(span_limits=SpanLimits(max_span_attribute_length=limit))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    for action, result in (("a1", '{"text": "' + "x" * 40 + '"}'), ("a2", "1" * 50)):
        with provider.get_tracer("t").start_as_current_span("llm") as span:
            span.set_attributes(
                {
                    "session.id": "s-t",
                    "agent.action.id": action,
                    "agent.action.kind": "llm_call",
                    "agent.action.result": result,
                }
            )
    provider.shutdown()


def rules_of(path: Path, *options: str, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    result = subprocess.run(
        [str(DURABLE_SESSIONS), "check", "--format", "json", *options, str(path)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode in (0, 1), result.stderr
    return [(v["action_id"], v["rule"]) for v in json.loads(result.stdout)["violations"]]


def test_check_is_told_the_attribute_length_limit_by_option_or_as_the_sdk_reads_it(tmp_path: Path) -> None:
    """Without the limit a cut result was an invalid-field (not JSON) or nothing at all
    (still JSON), where the span processor and the sidecar report truncated-result."""
    import os

    path = tmp_path / "traces.jsonl"
    cut_results_file(path, 32)
    clean = {k: v for k, v in os.environ.items() if "ATTRIBUTE_VALUE_LENGTH_LIMIT" not in k}
    truncated = [("a1", "truncated-result"), ("a2", "truncated-result")]
    assert rules_of(path, "--attribute-value-limit", "32", env=clean) == truncated
    assert rules_of(path, env={**clean, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "32"}) == truncated
    assert rules_of(path, env={**clean, "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT": "32"}) == truncated
    assert rules_of(path, env=clean) == [("a1", "invalid-field")]
    bad = subprocess.run(
        [str(DURABLE_SESSIONS), "check", str(path)],
        capture_output=True,
        text=True,
        env={**clean, "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "many"},
    )
    assert bad.returncode == 2 and "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT" in bad.stderr


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (
            {"endTimeUnixNano": "9" * 4301},
            "endTimeUnixNano '99999999999999999...' is not an unsigned 64-bit integer",
        ),
        (
            {"startTimeUnixNano": "1" * 5000},
            "startTimeUnixNano '11111111111111111...' is not an unsigned 64-bit integer",
        ),
        ({"status": {"code": "-" + "2" * 4301}}, "status.code '-2222222222222222...' is not a status code"),
    ],
)
def test_a_decimal_string_of_more_digits_than_python_reads_makes_the_span_unreadable(
    fields: dict[str, Any], reason: str
) -> None:
    """int() refuses a decimal string of more than 4,300 digits: the ValueError went up
    through the reader, a traceback for the whole check. The span is unreadable now, with
    the message any other value out of range gets."""
    [item] = read(request(PAYMENT, **fields))
    assert type(item) is readers.Unreadable
    assert item.reason == f"resourceSpans[0].scopeSpans[0].spans[0] {reason}"
