"""One span, every front end, the same findings.

The same SDK span goes through the span processor's step (``span_check.check_span``,
in process and after the hand-over to a checker process), ``durable-sessions check``'s
reader on the line ``FileSpanExporter`` writes, and the sidecar's decoders (the C
``_wire`` decoder and the Python reference on the SDK's OTLP protobuf bytes, the
OTLP/JSON decoder on the file's line), each record checked by a fresh engine. The
violations must be the same. The hand-written OTLP/JSON half feeds the check reader and
the sidecar's JSON decoder values no SDK writes: they must refuse the same spans in the
same words, and judge the others alike. A last case runs a real sidecar.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import io
import json
import logging
import marshal
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from durable_sessions_collector.otlp import decode
from durable_sessions_collector.otlp.receiver import scrub
from durable_sessions_collector.store.stored import checked_record, stored_record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Status, StatusCode
from test_wire_native import requests as wire_requests

from durable_sessions import instrument, otlp_json, readers
from durable_sessions.check import OfflineCheck, check_paths, offline_checker
from durable_sessions.engine import Checker
from durable_sessions.json_text import json_line
from durable_sessions.mapping import (
    exact_attributes,
    map_attributes,
    reference_map_attributes,
    sdk_attributes,
    sdk_span_facts,
    with_problems,
)
from durable_sessions.otlp_json import FileSpanExporter
from durable_sessions.record import span_location
from durable_sessions.rules import select_rules
from durable_sessions.span_check import SpanParts, check_span
from tests.support import otlp_json_values, undated_spans
from tests.support.senders import require_native
from tests.support.typed import typed
from tests.support.undated_spans import end_undated_payments

RULES = select_rules("all")
Finding = tuple[str, str, Any, Any, str]
"""A violation as compared: rule, severity, session id, action id, message."""


def findings(violations: list[Any]) -> list[Finding]:
    # "a tuple" on one path is "a list" on another for the same array value: cosmetic
    return sorted(
        (v.rule, v.severity.name, v.session_id, v.action_id, v.message.replace("a tuple", "a list"))
        for v in violations
    )


def judged(record: dict[str, Any], where: Any) -> list[Finding]:
    checker = Checker(RULES)
    return findings(checker.feed(record, where) + checker.finish())


# -- the front ends, in process ---------------------------------------------------------


def processor(span: ReadableSpan, *, handed_over: bool) -> list[Finding]:
    """What the span processor finds: ``check_span`` on the span's parts, as inline
    checking runs it, or after the parts crossed to a checker process (marshal)."""
    attributes, limit = sdk_attributes(span)
    error, start, end, trace_id, span_id, resource = sdk_span_facts(span)
    resource_attributes = exact_attributes(resource.attributes)
    if handed_over:
        attributes = marshal.loads(marshal.dumps(dict(exact_attributes(attributes))))
        resource_attributes = marshal.loads(marshal.dumps(dict(resource_attributes)))
    checker = Checker(RULES)
    parts = SpanParts(attributes, error, start, end, trace_id, span_id, limit)
    return findings(check_span(checker, parts, resource_attributes) + checker.finish())


def file_line(span: ReadableSpan) -> bytes:
    return json_line(otlp_json.encode_spans([span]))


def check_reader(line: bytes, limit: int | None) -> list[Any]:
    """``durable-sessions check``'s reader on one OTLP/JSON line: the findings of each
    record, or ``("unreadable", reason)``."""
    out: list[Any] = []
    for item in readers.read_otlp_json(io.BytesIO(line), "f.jsonl", attribute_value_limit=limit):
        if type(item) is readers.Unreadable:
            out.append(("unreadable", item.reason.split(" ", 1)[1]))
        else:
            out.append(judged(*item))  # type: ignore[misc]
    return out


def sidecar(parts: list[decode.SpanParts], rejected: list[str], limit: int | None) -> list[Any]:
    """What the sidecar judges of decoded parts: mapped, scrubbed and stored as the
    receiver and the store do; ``("unreadable", reason)`` for each rejected span."""
    out: list[Any] = [("unreadable", reason.split(": ", 1)[1]) for reason in rejected]
    for _name, attributes, resource, error, start, trace_id, span_id, end in parts:
        mapped = map_attributes(attributes, resource, error, start, trace_id, span_id, limit, False, end)
        if mapped is None:
            continue
        record, problems = mapped
        scrub(record)
        checked = checked_record(record, stored_record(record))  # type: ignore[arg-type]
        out.append(judged(with_problems(checked, problems), span_location(trace_id, span_id)))
    return out


def sidecar_json(line: bytes, limit: int | None) -> list[Any]:
    rejected: list[str] = []
    parts = decode.json_span_parts(line, rejected)
    return sidecar(parts, rejected, limit)


def sidecar_protobuf(body: bytes, limit: int | None, *, native: bool) -> list[Any] | None:
    """None when the C decoder is not built or declines the request (the reference then runs)."""
    rejected: list[str] = []
    if native:
        parts = decode._WIRE.span_parts(body) if decode._WIRE is not None else None
        if parts is None:
            return None
    else:
        parts = list(
            decode.span_parts(decode.parse_protobuf(body), None, rejected, decode.mapped_attributes_of)
        )
    return sidecar(parts, rejected, limit)


# -- SDK spans with random contract attributes --------------------------------------------

INT64 = (-(2**63), 2**63 - 1)
ints = st.sampled_from([0, 1, 3, -1, 2**31, 2**53 + 1, *INT64])
floats = st.sampled_from([3.0, 0.0, -0.0, 1.5, float("inf"), float("nan"), 1e20])
texts = st.one_of(
    st.sampled_from(
        ["", "3", "true", "ok", "error", "started", "skip", "abort", "__REDACTED__", "sha256:" + "a" * 64]
    ),
    st.text(max_size=6),
)
scalars = st.one_of(st.booleans(), ints, floats, texts)
values = st.one_of(
    scalars,
    st.lists(st.booleans(), max_size=3).map(tuple),
    st.lists(ints, max_size=3).map(tuple),
    st.lists(texts, max_size=3).map(tuple),
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=4),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=5,
)
results = st.one_of(
    json_values.map(json.dumps),
    st.sampled_from(["1e999", "NaN", "{", "", "__REDACTED__", '"__REDACTED__"', "null", "1" * 20]),
    values,
)


class Cap(int, enum.Enum):
    THREE = 3


FIELDS = [
    "id", "status", "result_ref", "result_digest", "idempotency_key", "replay", "replayed", "side_effects",
    "retryable", "max_attempts", "attempts", "cacheable", "cache_key", "ttl_s", "on_failure", "name", "prompt",
]  # fmt: skip
OTHER_KEYS = [
    "session.id", "gen_ai.conversation.id", "gen_ai.operation.name", "openinference.span.kind",
    "gen_ai.tool.call.result", "output.value", "gen_ai.request.model", "gen_ai.system",
]  # fmt: skip


@st.composite
def contract_spans(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], bool | None, int | None]:
    attributes: dict[str, Any] = {}
    if draw(st.booleans()):
        attributes["agent.action.kind"] = draw(
            st.one_of(st.sampled_from(["payment", "llm_call", "tool_call", "user_prompt", "clock"]), values)
        )
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        attributes[f"agent.action.{name}"] = draw(
            st.one_of(values, st.just(Cap.THREE)) if name in ("max_attempts", "attempts") else values
        )
    if draw(st.booleans()):
        attributes["agent.action.result"] = draw(results)
    for key in draw(st.lists(st.sampled_from(OTHER_KEYS), max_size=3, unique=True)):
        attributes[key] = draw(
            st.one_of(st.sampled_from(["chat", "execute_tool", "LLM", "TOOL", "s-1"]), values)
        )
    resource = {"service.instance.id": draw(st.sampled_from(["run-1", "run-2"]))}
    if draw(st.booleans()):
        resource["session.id"] = draw(texts)
    return (
        attributes,
        resource,
        draw(st.sampled_from([None, True, False])),
        draw(st.sampled_from([None, 8, 16])),
    )


def sdk_span(
    attributes: dict[str, Any], resource: dict[str, Any], error: bool | None, limit: int | None
) -> ReadableSpan:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create(resource), span_limits=SpanLimits(max_span_attribute_length=limit)
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span = provider.get_tracer("agree").start_span("act")
    span.set_attributes(attributes)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR if error else StatusCode.OK))
    span.end()
    (finished,) = exporter.get_finished_spans()
    return finished


def otlp_carries(span: ReadableSpan) -> bool:
    """No attribute holds an integer OTLP cannot carry (the SDK's exporter drops it)."""

    def fits(value: Any) -> bool:
        if isinstance(value, tuple):
            return all(map(fits, value))
        return not (type(value) is int and not INT64[0] <= value <= INT64[1])

    return all(fits(value) for value in (span.attributes or {}).values())


@pytest.fixture(autouse=True)
def _quiet_exporter_errors() -> Iterator[None]:
    logger = logging.getLogger("opentelemetry.exporter.otlp.proto.common._internal")
    disabled, logger.disabled = logger.disabled, True
    yield
    logger.disabled = disabled


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(contract_spans())
def test_an_sdk_span_is_judged_alike_by_every_front_end(example: Any) -> None:
    attributes, resource, error, limit = example
    span = sdk_span(attributes, resource, error, limit)
    inline = processor(span, handed_over=False)
    actions = [inline] if inline or _is_action(span) else []
    assert processor(span, handed_over=True) == inline
    line = file_line(span)
    assert check_reader(line, limit) == actions
    assert sidecar_json(line, limit) == actions
    if otlp_carries(span):  # else the SDK's OTLP exporter drops the attribute: test_an_integer_…
        body = encode_spans([span]).SerializeToString()
        assert sidecar_protobuf(body, limit, native=False) == actions
        assert sidecar_protobuf(body, limit, native=True) in (None, actions)


def assert_every_front_end_finds(span: Any, inline: list[Any]) -> None:
    """The processor handed ``span`` over, ``check``'s reader of its file line and the
    sidecar's decoders (JSON; protobuf, with and without the C reader, which may decline)
    find what the processor found inline."""
    line = file_line(span)
    body = encode_spans([span]).SerializeToString()
    assert processor(span, handed_over=True) == inline
    assert check_reader(line, None) == sidecar_json(line, None) == [inline]
    assert sidecar_protobuf(body, None, native=False) == [inline]
    assert sidecar_protobuf(body, None, native=True) in (None, [inline])


def test_a_span_without_a_start_time_is_dated_by_its_end_by_every_front_end() -> None:
    """An SDK span started with ``start_time=0`` is exported with OTLP's unset start time:
    every front end dates its action by the span's end, and reports the missing start in
    the same words (the records' ``ts`` was 0, 1970, in all of them)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.instance.id": "run-1"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    attributes = {"session.id": "s-1", "agent.action.id": "p1", "agent.action.kind": "payment"}
    provider.get_tracer("agree").start_span("pay", attributes=attributes, start_time=0).end(end_time=END_NS)
    (span,) = exporter.get_finished_spans()
    inline = processor(span, handed_over=False)
    assert [(rule, action) for rule, _, _, action, _ in inline] == [
        ("invalid-field", "p1"),
        ("unkeyed-side-effect", "p1"),
    ]
    assert "span has no start time" in inline[0][4] and "its end time dates the action" in inline[0][4]
    assert_every_front_end_finds(span, inline)
    (record,) = [item[0] for item in readers.read_otlp_json(io.BytesIO(file_line(span)), "f.jsonl")]
    assert (record["seq"], record["ts"]) == (END_NS, END_NS / 1e9)


END_NS = 1_767_225_600_000_000_000


@pytest.mark.parametrize(
    ("kind", "known"), [("Payment", "payment"), (" payment ", "payment"), ("user-prompt", "user_prompt")]
)
def test_a_known_kind_written_otherwise_is_reported_by_every_front_end(kind: str, known: str) -> None:
    """A kind the rules know, in another case or with spaces or a hyphen, is an
    ``invalid-field`` naming the kind meant, in every front end: each passed the span
    (an unkeyed 'Payment' charged twice on replay went unreported)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.instance.id": "run-1"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    attributes = {"session.id": "s-1", "agent.action.id": "p1", "agent.action.kind": kind}
    provider.get_tracer("agree").start_span("act", attributes=attributes).end()
    (span,) = exporter.get_finished_spans()
    inline = processor(span, handed_over=False)
    assert [(rule, action) for rule, _, _, action, _ in inline] == [("invalid-field", "p1")]
    assert f"kind is the string {kind!r}, expected {known!r}" in inline[0][4]
    assert_every_front_end_finds(span, inline)


def _is_action(span: ReadableSpan) -> bool:
    attributes, _ = sdk_attributes(span)
    error, start, end, trace_id, span_id, resource = sdk_span_facts(span)
    return (
        map_attributes(attributes, resource.attributes, error, start, trace_id, span_id, None, False, end)
        is not None
    )


# -- hand-written OTLP/JSON: check's reader and the sidecar's JSON decoder ------------------

json_scalars = otlp_json_values.json_scalars("AAE=", "AAE", "-_8")
any_values = otlp_json_values.any_values(
    json_scalars,
    st.sampled_from([{}, {"unknown": 1}, {"intValue": "3", "stringValue": "x"}, 3, "x", None]),
    kinds=(*otlp_json_values.VALUE_KINDS, "int_value"),
    max_leaves=5,
)
JSON_KEYS = [
    "agent.action." + name for name in ("kind", "status", "max_attempts", "retryable", "result", "id")
]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    st.lists(st.tuples(st.sampled_from([*JSON_KEYS, "session.id", "http.route"]), any_values), max_size=5),
    st.lists(
        st.tuples(st.sampled_from(["session.id", "service.instance.id", "host.name"]), any_values), max_size=2
    ),
    st.one_of(st.none(), json_scalars),
    st.one_of(
        st.none(), st.sampled_from(["1767225600000000000", 1767225600000000000, "-1", 1.5, str(2**64)])
    ),
    st.one_of(st.none(), st.sampled_from(["1767225601000000000", 0, "-1", 1.5, str(2**64)])),
)
def test_hand_written_json_is_read_alike_by_check_and_the_sidecar(
    attributes: list[tuple[str, Any]], resource: list[tuple[str, Any]], code: Any, start: Any, end: Any
) -> None:
    span: dict[str, Any] = {
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": "eee19b7ec3c1b174",
        "name": "act",
        "attributes": [{"key": "agent.action.kind", "value": {"stringValue": "payment"}}]
        + [{"key": key, "value": value} for key, value in attributes],
        "status": {"code": code},
    }
    if start is not None:
        span["startTimeUnixNano"] = start
    if end is not None:
        span["endTimeUnixNano"] = end
    document = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": key, "value": value} for key, value in resource]},
                "scopeSpans": [{"scope": {"name": "t"}, "spans": [span]}],
            }
        ]
    }
    line = json.dumps(document).encode()
    assert check_reader(line + b"\n", None) == sidecar_json(line, None)


@pytest.mark.parametrize("bad", ["abcd", "zz", 5, None, "7uGbfsPBsXQ="])
def test_a_parent_or_link_id_that_is_no_id_is_read_past_by_check_and_the_sidecar(bad: Any) -> None:
    ids = {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174"}
    span = {
        **ids,
        "parentSpanId": bad,
        "name": "act",
        "attributes": [{"key": "agent.action.kind", "value": {"stringValue": "payment"}}],
        "links": [{"traceId": bad, "spanId": bad}],
    }
    line = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()
    found = sidecar_json(line, None)
    assert found == check_reader(line + b"\n", None)
    assert len(found) == 1 and found[0][0] != "unreadable"


def test_an_attribute_without_a_key_is_one_of_key_empty_for_every_front_end() -> None:
    """Protobuf's JSON mapping leaves out a field of its default value: an attribute (or a
    key-value list's entry) of key "" is written without ``key``, as protobuf's printer
    and the Collector's write it. Every front end reads it as the same key "", as
    protobuf's parser does; the JSON readers rejected the span ("has no string key")."""
    attributes = {"session.id": "s-1", "agent.action.id": "p1", "agent.action.kind": "payment"}
    request = ExportTraceServiceRequest()
    span = (
        request.resource_spans.add()
        .scope_spans.add()
        .spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="pay", start_time_unix_nano=END_NS)
    )
    for key, text in attributes.items():
        span.attributes.add(key=key).value.string_value = text
    span.attributes.add(key="").value.string_value = "no key"
    entry = span.attributes.add(key="agent.action.result").value.kvlist_value.values.add()
    entry.value.int_value = 7
    line = decode.to_otlp_json(request)
    keyless = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"]
    assert "key" not in keyless[3] and "key" not in keyless[4]["value"]["kvlistValue"]["values"][0]
    body = request.SerializeToString()
    found = sidecar_protobuf(body, None, native=False)
    assert found is not None and len(found) == 1 and found[0][0] != "unreadable"
    assert check_reader(line + b"\n", None) == sidecar_json(line, None) == found
    assert sidecar_protobuf(body, None, native=True) in (None, found)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=wire_requests)
def test_a_generated_request_decodes_alike_in_protobuf_and_otlp_json(
    request: ExportTraceServiceRequest,
) -> None:
    """The same request, in binary protobuf and in OTLP/JSON as protobuf's JSON mapping
    writes it with hex ids (``to_otlp_json``): the same span parts, of the same types,
    and the same spans rejected. Found an attribute of key "" (written without ``key``)
    rejected in OTLP/JSON alone."""
    in_protobuf: list[str] = []
    in_json: list[str] = []
    parts = decode.reference_span_parts(request.SerializeToString(), in_protobuf)
    assert typed(decode.json_span_parts(decode.to_otlp_json(request), in_json)) == typed(parts)
    assert len(in_json) == len(in_protobuf)


# -- what the reviewer's crafted spans showed, end to end ---------------------------------


@dataclasses.dataclass
class Quote:
    price: int
    currency: str


def crafted_spans(path: Path) -> None:
    """The findings' spans: an array status, a malformed digest beside a result, a
    dataclass result recorded then replayed as its dict, an int-enum cap, a cap past
    int64, and a result cut at the limit (32)."""
    exporter = FileSpanExporter(path)
    for run in ("run-1", "run-2"):
        provider = TracerProvider(
            resource=Resource.create({"service.instance.id": run}),
            span_limits=SpanLimits(max_span_attribute_length=32),
        )
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("crafted")

        def act(session: str, action: str, attributes: dict[str, Any], *, tracer: Any = tracer) -> None:
            with tracer.start_as_current_span(action) as span:
                span.set_attributes({"session.id": session, "agent.action.id": action, **attributes})

        with (
            instrument.session("quote"),
            instrument.action("quote", kind="external_read", tracer_provider=provider) as recorded,
        ):
            if run == "run-2":  # replay hands back the dict the dataclass was recorded as
                recorded.set(replayed=True)
            recorded.record(Quote(2400, "GBP") if run == "run-1" else {"price": 2400, "currency": "GBP"})
        if run == "run-1":
            act(
                "s-1",
                "pay",
                {
                    "agent.action.kind": "payment",
                    "agent.action.idempotency_key": "k",
                    "agent.action.status": ("ok",),
                },
            )
            act(
                "s-2",
                "plan",
                {
                    "agent.action.kind": "llm_call",
                    "agent.action.result": '{"p": 1}',
                    "agent.action.result_digest": "",
                },
            )
            act(
                "s-3",
                "call",
                {
                    "agent.action.kind": "tool_call",
                    "agent.action.retryable": True,
                    "agent.action.max_attempts": Cap.THREE,
                },
            )
            act(
                "s-4",
                "call",
                {
                    "agent.action.kind": "tool_call",
                    "agent.action.retryable": True,
                    "agent.action.max_attempts": 2**64,
                },
            )
            act(
                "s-5",
                "say",
                {"agent.action.kind": "llm_call", "agent.action.result": '{"text": "' + "x" * 40 + '"}'},
            )
    exporter.shutdown()


def post_lines(url: str, path: Path) -> None:
    for line in path.read_bytes().splitlines():
        request = urllib.request.Request(url, data=line, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200


def test_a_real_sidecar_judges_the_file_as_check_does(
    start_sidecar: Callable[..., Any], tmp_path: Path
) -> None:
    from conftest import wait_for

    path = tmp_path / "traces.jsonl"
    crafted_spans(path)
    checked = sorted(
        (v.session_id, v.rule)
        for v in check_paths([str(path)], offline_checker(RULES), attribute_value_limit=32)
    )
    assert checked == [
        ("s-1", "missing-field"),
        ("s-2", "invalid-field"),
        ("s-4", "invalid-field"),
        ("s-4", "unbounded-retry"),
        ("s-5", "truncated-result"),
    ]
    running = start_sidecar(evaluation__attribute_value_limit=32)
    post_lines(running.http_url + "/v1/traces", path)
    wait_for(lambda: len(running.alerts()) >= len(checked))
    assert sorted((alert["session_id"], alert["rule"]) for alert in running.alerts()) == checked


def test_a_real_sidecar_dates_a_span_without_a_start_time_by_its_end(
    start_sidecar: Callable[..., Any], tmp_path: Path
) -> None:
    """Spans with OTLP's unset start time, over gRPC (the sidecar's binary decoder) and
    as the file exporter writes them over OTLP/HTTP JSON: dated 1970, the first try of a
    payment made its key's retry 10 s later a false key-outlived-window, a retry two days
    on was re-sent before its first use (no warning), and the API listed it first. Dated
    by its end, the sidecar finds what ``durable-sessions check`` finds in the file."""
    from conftest import wait_for
    from sidecar_clients import grpc_exporter

    running = start_sidecar()
    path = tmp_path / "traces.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.instance.id": "run-1"}))
    provider.add_span_processor(SimpleSpanProcessor(grpc_exporter(running.grpc_endpoint)))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    end_undated_payments(provider.get_tracer("undated"))
    provider.shutdown()

    expected = undated_spans.EXPECTED
    checked = [(v.session_id, v.rule) for v in check_paths([str(path)], offline_checker(RULES))]
    assert checked == expected
    wait_for(lambda: len(running.alerts()) >= len(expected))
    assert sorted((alert["session_id"], alert["rule"]) for alert in running.alerts()) == expected
    # seq, past 2**53, is served as its decimal text.
    listed = [(a["attempts"], int(a["seq"])) for a in running.session("s-b")["actions"]]
    assert listed == [(1, undated_spans.T0), (2, undated_spans.T0 + 2 * undated_spans.DAY)]

    # The same spans as OTLP/JSON, the sidecar's other decoder, under other session ids.
    lines = path.read_bytes().replace(b'"s-a"', b'"j-a"').replace(b'"s-b"', b'"j-b"')
    (tmp_path / "renamed.jsonl").write_bytes(lines)
    post_lines(running.http_url + "/v1/traces", tmp_path / "renamed.jsonl")
    wait_for(lambda: len(running.alerts()) >= 2 * len(expected))
    renamed = [(alert["session_id"], alert["rule"]) for alert in running.alerts()[len(expected) :]]
    assert sorted(renamed) == [(session.replace("s-", "j-"), rule) for session, rule in expected]


def test_a_real_sidecar_and_check_count_a_resumed_process_s_attempts_afresh(
    start_sidecar: Callable[..., Any], tmp_path: Path
) -> None:
    """Two process runs retry one tool call, each counting from attempt 1: the second
    run's attempt 2 is no duplicate of the first run's, for the sidecar (over gRPC) as for
    ``durable-sessions check`` on the same spans (both reported duplicate-action-id). An
    unkeyed payment in another session, ended last, is the one finding."""
    from conftest import wait_for
    from sidecar_clients import grpc_exporter

    running = start_sidecar()
    path = tmp_path / "traces.jsonl"
    retry = {"agent.action.kind": "tool_call", "agent.action.retryable": True, "agent.action.max_attempts": 3}
    for run, last in (("run-1", StatusCode.ERROR), ("run-2", StatusCode.OK)):
        provider = TracerProvider(resource=Resource.create({"service.instance.id": run}))
        provider.add_span_processor(SimpleSpanProcessor(grpc_exporter(running.grpc_endpoint)))
        provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))  # appends
        tracer = provider.get_tracer("resumed")
        for attempt, status in ((1, StatusCode.ERROR), (2, last)):
            attempts = {"agent.action.attempts": attempt} if attempt > 1 else {}
            attributes = {"session.id": "s-r", "agent.action.id": "book", **retry, **attempts}
            with tracer.start_as_current_span("book", attributes=attributes) as span:
                span.set_status(Status(status))
        if run == "run-2":
            attributes = {"session.id": "s-p", "agent.action.id": "pay", "agent.action.kind": "payment"}
            tracer.start_span("pay", attributes=attributes).end()
        provider.shutdown()

    expected = [("s-p", "unkeyed-side-effect")]
    assert [(v.session_id, v.rule) for v in check_paths([str(path)], offline_checker(RULES))] == expected
    wait_for(lambda: len(running.alerts()) >= len(expected))
    assert [(alert["session_id"], alert["rule"]) for alert in running.alerts()] == expected


def test_a_real_sidecar_and_check_let_a_resumed_run_s_escalation_settle_the_cap(
    start_sidecar: Callable[..., Any], tmp_path: Path
) -> None:
    """A first run uses a retry's cap up and dies without asking; the resumed run retries
    it, uses the cap up again and asks the user (on_failure: ask_user). Its last attempt
    escalated: no retry-not-escalated in session s-r, for the sidecar once the session is
    idle as for ``durable-sessions check`` (both reported it). Session s-x, the first run
    alone, is the one finding."""
    from conftest import wait_for
    from sidecar_clients import grpc_exporter

    running = start_sidecar()
    path = tmp_path / "traces.jsonl"
    retry = {"agent.action.kind": "tool_call", "agent.action.retryable": True, "agent.action.max_attempts": 2}
    for run, sessions in (("run-1", ("s-r", "s-x")), ("run-2", ("s-r",))):
        provider = TracerProvider(resource=Resource.create({"service.instance.id": run}))
        provider.add_span_processor(SimpleSpanProcessor(grpc_exporter(running.grpc_endpoint)))
        provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))  # appends
        tracer = provider.get_tracer("resumed")
        for session_id in sessions:
            for attempt in (1, 2):
                attributes = {"session.id": session_id, "agent.action.id": "book", **retry}
                if attempt == 2:
                    attributes["agent.action.attempts"] = 2
                    if run == "run-2":
                        attributes["agent.action.on_failure"] = "ask_user"
                with tracer.start_as_current_span("book", attributes=attributes) as span:
                    span.set_status(Status(StatusCode.ERROR))
        provider.shutdown()

    expected = [("s-x", "retry-not-escalated")]
    assert [(v.session_id, v.rule) for v in check_paths([str(path)], offline_checker(RULES))] == expected
    wait_for(lambda: all(running.session(s)["state"] == "ended" for s in ("s-r", "s-x")))
    wait_for(lambda: len(running.alerts()) >= len(expected))
    assert [(alert["session_id"], alert["rule"]) for alert in running.alerts()] == expected
    assert running.session("s-r")["verdict"] == "ok"


class _OneSpanId(RandomIdGenerator):
    """Gives every span one span id, as OTLP allows: a span id is unique within its trace."""

    def generate_span_id(self) -> int:
        return 0x0707070707070707


def test_a_real_sidecar_and_check_judge_a_span_id_reused_in_another_trace_and_a_redelivery_alike(
    start_sidecar: Callable[..., Any], tmp_path: Path
) -> None:
    """A tool call run twice, in two traces whose spans have one span id, is two spans: a
    duplicate-action-id for the sidecar (its store keeps both) and for ``durable-sessions
    check`` on the same spans, which skipped the second as the first delivered again. The
    first span exported again, at once and after the second (a retried Export), is read
    once by both."""
    from sidecar_clients import grpc_exporter

    running = start_sidecar()
    path = tmp_path / "traces.jsonl"
    provider = TracerProvider(
        resource=Resource.create({"service.instance.id": "run-1"}), id_generator=_OneSpanId()
    )
    ended = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(ended))
    attributes = {"session.id": "s-t", "agent.action.id": "look", "agent.action.kind": "tool_call"}
    for _ in range(2):  # each a root span, in a trace of its own
        provider.get_tracer("reused").start_span("look", attributes=attributes).end()
    first, second = ended.get_finished_spans()
    assert first.context.span_id == second.context.span_id
    assert first.context.trace_id != second.context.trace_id
    sent, written = grpc_exporter(running.grpc_endpoint), FileSpanExporter(path)
    for span in (first, first, second, first):
        assert sent.export([span]) == written.export([span]) == SpanExportResult.SUCCESS
    sent.shutdown()
    written.shutdown()

    check = OfflineCheck([str(path)], RULES)
    checked = [(v.session_id, v.rule, v.trace_id) for v in check]
    assert checked == [("s-t", "duplicate-action-id", f"{second.context.trace_id:032x}")]
    detail = running.session("s-t")
    assert [("s-t", v["rule"], v["trace_id"]) for v in detail["violations"]] == checked
    assert check.actions == len(detail["actions"]) == 2


class _OneTraceAndSpanId(_OneSpanId):
    """Gives every span one trace id too: two spans of one id pair, as a client that
    reuses ids gives them."""

    def generate_trace_id(self) -> int:
        return 0x0B0B0B0B0B0B0B0B0B0B0B0B0B0B0B0B


def test_a_real_sidecar_and_check_keep_one_span_key_in_two_sessions_and_drop_its_redelivery(
    start_sidecar: Callable[..., Any], tmp_path: Path
) -> None:
    """An unkeyed payment in each of two sessions, the two spans of one trace id, span id
    and status: the stores key a span by its session too, so the sidecar keeps both, and so
    does ``durable-sessions check`` on the same spans, which read the second as the first
    delivered again. Each span exported again is read once by both."""
    from conftest import wait_for
    from sidecar_clients import grpc_exporter

    running = start_sidecar()
    path = tmp_path / "traces.jsonl"
    provider = TracerProvider(id_generator=_OneTraceAndSpanId())
    ended = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(ended))
    for session_id in ("s-a", "s-b"):
        attributes = {"session.id": session_id, "agent.action.id": "pay", "agent.action.kind": "payment"}
        provider.get_tracer("reused").start_span("pay", attributes=attributes).end()
    first, second = ended.get_finished_spans()
    assert (first.context.trace_id, first.context.span_id) == (
        second.context.trace_id,
        second.context.span_id,
    )
    sent, written = grpc_exporter(running.grpc_endpoint), FileSpanExporter(path)
    for span in (first, second, first, second):
        assert sent.export([span]) == written.export([span]) == SpanExportResult.SUCCESS
    sent.shutdown()
    written.shutdown()

    check = OfflineCheck([str(path)], RULES)
    checked = sorted((v.session_id, v.rule) for v in check)
    assert checked == [("s-a", "unkeyed-side-effect"), ("s-b", "unkeyed-side-effect")]
    assert check.actions == 2
    wait_for(lambda: len(running.alerts()) >= 2)
    assert sorted((alert["session_id"], alert["rule"]) for alert in running.alerts()) == checked
    assert [len(running.session(s)["actions"]) for s in ("s-a", "s-b")] == [1, 1]


def test_the_ingest_benchmarks_spans_are_all_mapped_in_c() -> None:
    """``benchmarks/collector_ingest.py`` measures the sidecar on these spans: were the C
    mapping to decline them, its figures would be the Python mapping's."""
    require_native("_mapping")
    require_native("_wire", package="durable_sessions_collector.otlp")
    from durable_sessions import _mapping  # type: ignore[attr-defined]

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "collector_ingest.py"
    spec = importlib.util.spec_from_file_location("collector_ingest", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    parts = [part for body in bench.build_round("test", 4, 100, 10) for part in decode.wire_span_parts(body)]
    assert len(parts) == 400
    for _name, attributes, resource, error, start, trace_id, span_id, end in parts:
        for keep in (False, True):
            args = (attributes, resource, error, start, trace_id, span_id, None, keep, end)
            mapped = map_attributes.attempt(*args)  # type: ignore[attr-defined]
            assert mapped is not _mapping.DECLINED, attributes
            assert typed(mapped) == typed(reference_map_attributes(*args))
