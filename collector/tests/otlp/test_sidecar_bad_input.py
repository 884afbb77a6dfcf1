"""Bad input, on both receivers: each answered with the documented code and message,
the valid spans of a mixed batch kept, and the server still healthy afterwards."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import zlib
from typing import Any

import grpc
import pytest
from durable_sessions_collector.store.stored import hidden
from google.rpc import status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from sidecar_clients import any_value, export_call, request_of

MIB = 1024 * 1024


def span(n: int, *, trace_id: bytes | None = None, span_id: bytes | None = None, **attributes) -> Span:  # type: ignore[no-untyped-def]
    attributes.setdefault("session.id", "bad-input")
    attributes.setdefault("agent.action.id", f"a{n}")
    attributes.setdefault("agent.action.kind", "tool_call")
    return Span(
        trace_id=bytes([1] * 15 + [n]) if trace_id is None else trace_id,
        span_id=bytes([2] * 7 + [n]) if span_id is None else span_id,
        name=f"action {n}",
        start_time_unix_nano=1_700_000_000_000_000_000 + n,
        end_time_unix_nano=1_700_000_000_000_000_000 + n + 1,
        attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()],
    )


def post(
    sidecar, body: bytes, content_type: str | None = "application/x-protobuf", method: str = "POST", **headers
):  # type: ignore[no-untyped-def]
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    all_headers = {"Content-Type": content_type} if content_type else {}
    all_headers.update({k.replace("_", "-"): v for k, v in headers.items()})
    connection.request(method, "/v1/traces", body=body, headers=all_headers)
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, response.headers, data


def status_of(headers, data: bytes) -> status_pb2.Status:  # type: ignore[no-untyped-def]
    status = status_pb2.Status()
    if headers["Content-Type"] == "application/json":
        from google.protobuf import json_format

        json_format.Parse(data, status)
    else:
        status.ParseFromString(data)
    return status


def grpc_export(sidecar, body: bytes) -> ExportTraceServiceResponse:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(
        sidecar.grpc_endpoint, options=[("grpc.max_send_message_length", 256 * MIB)]
    ) as channel:
        call = export_call(channel)
        return call(body, timeout=30)


def assert_healthy(sidecar) -> None:  # type: ignore[no-untyped-def]
    assert sidecar.get("/healthz") == (200, {"status": "ok"})
    status, _, _ = post(sidecar, request_of(span(99, **{"session.id": "after"})).SerializeToString())
    assert status == 200
    assert sidecar.session("after")["action_count"] == 1


VALID = request_of(span(1)).SerializeToString()


@pytest.mark.parametrize(
    ("body", "content_type", "expected"),
    [
        (
            VALID[: len(VALID) // 2],
            "application/x-protobuf",
            "not a valid protobuf ExportTraceServiceRequest",
        ),
        (
            b"\xff\xff\xff\xff\xff\x0f garbage",
            "application/x-protobuf",
            "not a valid protobuf ExportTraceServiceRequest",
        ),
        (b"{not json", "application/json", "not valid JSON"),
        (b"[1, 2]", "application/json", "must be a JSON object"),
        (b'{"resourceSpans": "nope"}', "application/json", "not an OTLP/JSON ExportTraceServiceRequest"),
        (
            b'{"resourceSpans": [{"schemaUrl": 5, "scopeSpans": [{"spans": []}]}]}',
            "application/json",
            "schemaUrl",
        ),
    ],
    ids=[
        "truncated-protobuf",
        "garbage-protobuf",
        "invalid-json",
        "json-array",
        "json-wrong-shape",
        "json-wrong-type-outside-spans",
    ],
)
def test_undecodable_http_bodies_are_400_with_a_message(sidecar, body, content_type, expected) -> None:  # type: ignore[no-untyped-def]
    status, headers, data = post(sidecar, body, content_type)
    assert status == 400
    assert headers["Content-Type"] == content_type
    assert expected in status_of(headers, data).message
    assert_healthy(sidecar)


def test_undecodable_grpc_bodies_are_invalid_argument_never_internal(sidecar) -> None:  # type: ignore[no-untyped-def]
    for body in (VALID[: len(VALID) // 2], b"\xff\xff\xff\xff\xff\x0f garbage"):
        with pytest.raises(grpc.RpcError) as caught:
            grpc_export(sidecar, body)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf ExportTraceServiceRequest" in caught.value.details()
    assert_healthy(sidecar)


def test_wrong_content_type_encoding_and_method(sidecar) -> None:  # type: ignore[no-untyped-def]
    for content_type in ("text/plain", None, "application/grpc"):
        status, headers, data = post(sidecar, VALID, content_type)
        assert status == 415
        assert "unsupported Content-Type" in status_of(headers, data).message
    status, headers, data = post(sidecar, VALID, Content_Encoding="br")
    assert status == 415 and "unsupported Content-Encoding 'br'" in status_of(headers, data).message
    status, headers, data = post(sidecar, b"not gzip at all", Content_Encoding="gzip")
    assert status == 400 and "not valid gzip data" in status_of(headers, data).message
    status, headers, data = post(sidecar, b"", method="GET")
    assert status == 405 and headers["Allow"] == "OPTIONS, POST"
    assert_healthy(sidecar)


def test_gzip_and_deflate_bodies_are_accepted(sidecar) -> None:  # type: ignore[no-untyped-def]
    status, _, data = post(
        sidecar, gzip.compress(request_of(span(1)).SerializeToString()), Content_Encoding="gzip"
    )
    assert status == 200 and not ExportTraceServiceResponse.FromString(data).HasField("partial_success")
    status, _, _ = post(
        sidecar, zlib.compress(request_of(span(2)).SerializeToString()), Content_Encoding="deflate"
    )
    assert status == 200
    assert sidecar.session("bad-input")["action_count"] == 2


def gzip_bomb(size: int) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(MIB)
    parts = [compressor.compress(zeros) for _ in range(size // MIB)]
    return b"".join(parts) + compressor.flush()


def test_gzip_bomb_stops_at_the_64_mib_default_limit(sidecar) -> None:  # type: ignore[no-untyped-def]
    bomb = gzip_bomb(100 * MIB)
    assert len(bomb) < MIB
    status, headers, data = post(sidecar, bomb, Content_Encoding="gzip")
    assert status == 413
    message = status_of(headers, data).message
    assert f"over the {64 * MIB}-byte limit after gzip decompression" in message
    assert_healthy(sidecar)


def test_requests_over_the_limit_are_413_and_resource_exhausted(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(receivers__max_request_bytes=MIB)
    big = request_of(span(1, **{"agent.action.name": "x" * (MIB + 10)})).SerializeToString()
    status, headers, data = post(sidecar, big)
    assert status == 413 and f"over the {MIB}-byte limit" in status_of(headers, data).message
    status, headers, _ = post(sidecar, gzip.compress(big), Content_Encoding="gzip")
    assert status == 413
    with pytest.raises(grpc.RpcError) as caught:
        grpc_export(sidecar, big)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        sidecar.metric("durable_sessions_export_requests_total", transport="http", outcome="too_large") == 2
    )
    assert_healthy(sidecar)


def test_bad_ids_reject_only_their_spans_partial_success(sidecar) -> None:  # type: ignore[no-untyped-def]
    mixed = request_of(
        span(1),
        span(2, trace_id=b"\x01\x02\x03"),
        span(3, span_id=bytes(8)),
        span(4),
    )
    for send in ("http", "grpc"):
        if send == "http":
            status, _, data = post(sidecar, mixed.SerializeToString())
            assert status == 200
            response = ExportTraceServiceResponse.FromString(data)
        else:
            response = grpc_export(sidecar, mixed.SerializeToString())
        assert response.partial_success.rejected_spans == 2
        message = response.partial_success.error_message
        assert message.startswith("rejected 2 of 4 span(s): ")
        assert "spans[1] 'action 2': trace_id is 3 bytes, expected 16" in message
        assert "spans[2] 'action 3': span_id is all zeros" in message
        assert [a["action_id"] for a in sidecar.session("bad-input")["actions"]] == ["a1", "a4"]  # kept once

    # OTLP/JSON: ids must be hex; a span with a bad one is rejected, its batch kept.
    good_trace = "5B8EFFF798038103D269B633813FC60C"  # upper case is valid hex (the spec's example)
    document = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.instance.id", "value": {"stringValue": "inc-json"}}]
                },
                "scopeSpans": [
                    {
                        "spans": [
                            json_span(good_trace, "EEE19B7EC3C1B174", "j1", kind=2),
                            json_span("zz" * 16, "EEE19B7EC3C1B175", "j2"),
                            json_span(good_trace, "AAAAAAAAAAAAAAAAAAAAAA==", "j3"),
                            json_span(good_trace, "EEE19B7E", "j4"),
                            json_span(good_trace, "EEE19B7EC3C1B17", "j5"),  # hex digits, one short
                        ]
                    }
                ],
            }
        ]
    }
    status, headers, data = post(sidecar, json.dumps(document).encode(), "application/json")
    assert status == 200 and headers["Content-Type"] == "application/json"
    answer = json.loads(data)
    assert answer["partialSuccess"]["rejectedSpans"] == "4"
    message = answer["partialSuccess"]["errorMessage"]
    assert "spans[1] 'j2': traceId 'zzzzzzzz" in message and "is not hex" in message
    assert "spans[2] 'j3': spanId 'AAAAAAAAAAAAAAAAAAAAAA==' is not hex" in message
    assert "spans[3] 'j4': spanId 'EEE19B7E' is 4 bytes, expected 8 (16 hex digits)" in message
    assert "spans[4] 'j5': spanId 'EEE19B7EC3C1B17' is 15 hex digits, expected 16" in message
    stored = sidecar.session("json")["actions"]
    assert [(a["action_id"], a["trace_id"], a["span_id"], a["incarnation"]) for a in stored] == [
        ("j1", good_trace.lower(), "eee19b7ec3c1b174", "inc-json")
    ]
    assert (
        sidecar.metric("durable_sessions_spans_rejected_total", transport="http", reason="invalid") == 2 + 4
    )
    assert_healthy(sidecar)


def json_span(trace_id: str, span_id: str, action_id: str, kind: int = 1) -> dict:  # type: ignore[type-arg]
    return {
        "traceId": trace_id,
        "spanId": span_id,
        "name": action_id,
        "kind": kind,
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000000000000001",
        "unknownFutureField": {"ignored": True},
        "attributes": [
            {"key": "session.id", "value": {"stringValue": "json"}},
            {"key": "agent.action.id", "value": {"stringValue": action_id}},
            {"key": "agent.action.kind", "value": {"stringValue": "tool_call"}},
        ],
        "status": {"code": 1},
    }


def test_a_json_span_with_a_field_json_format_refuses_rejects_only_that_span(sidecar) -> None:  # type: ignore[no-untyped-def]
    """Fields the mapping never reads (a count of dropped events, the name) were parsed for the
    whole request at once: one bad span was a 400 that lost its valid neighbours."""
    trace = "5B8EFFF798038103D269B633813FC60C"
    spans = [
        json_span(trace, "EEE19B7EC3C1B101", "k1"),
        {**json_span(trace, "EEE19B7EC3C1B102", "k2"), "droppedEventsCount": "many"},
        {**json_span(trace, "EEE19B7EC3C1B103", "k3"), "name": 5},
        json_span(trace, "EEE19B7EC3C1B104", "k4"),
    ]
    for span_ in spans:
        span_["attributes"][0]["value"]["stringValue"] = "json-fields"
    document = {"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}
    status, _, data = post(sidecar, json.dumps(document).encode(), "application/json")
    assert status == 200, data
    partial = json.loads(data)["partialSuccess"]
    assert partial["rejectedSpans"] == "2"
    message = partial["errorMessage"]
    assert "spans[1] '': not an OTLP/JSON span: " in message and "droppedEventsCount" in message
    assert "spans[2] '': not an OTLP/JSON span: Failed to parse name field" in message
    assert [a["action_id"] for a in sidecar.session("json-fields")["actions"]] == ["k1", "k4"]
    assert_healthy(sidecar)


def test_ten_thousand_attributes_are_accepted(sidecar) -> None:  # type: ignore[no-untyped-def]
    attributes = {f"custom.attribute.{i}": i for i in range(10_000)}
    status, _, data = post(sidecar, request_of(span(1, **attributes)).SerializeToString())
    assert status == 200 and not ExportTraceServiceResponse.FromString(data).HasField("partial_success")
    response = grpc_export(sidecar, request_of(span(2, **attributes)).SerializeToString())
    assert not response.HasField("partial_success")
    assert sidecar.session("bad-input")["action_count"] == 2
    assert_healthy(sidecar)


def test_wrong_attribute_types_become_violations_not_errors(sidecar) -> None:  # type: ignore[no-untyped-def]
    spans = [
        span(1, **{"agent.action.retryable": True, "agent.action.max_attempts": "3"}),
        span(2, **{"agent.action.kind": 7}),
        span(3, **{"agent.action.kind": "llm_call", "agent.action.result": 42}),
        span(4, **{"agent.action.kind": "payment", "agent.action.idempotency_key": b"\x00\x01"}),
        span(5, **{"agent.action.retryable": "yes", "agent.action.ttl_s": 1.5}),
    ]
    status, _, data = post(sidecar, request_of(*spans).SerializeToString())
    assert status == 200 and not ExportTraceServiceResponse.FromString(data).HasField("partial_success")
    session = sidecar.session("bad-input")
    assert session["action_count"] == 5
    found = {(v["rule"], v["action_id"]) for v in session["violations"]}
    assert ("unbounded-retry", "a1") in found  # "3" is not a cap
    assert ("missing-field", "a2") in found  # a kind that is not a string
    assert ("invalid-field", "a3") in found  # a result that is not JSON text
    assert ("invalid-field", "a4") in found  # an idempotency key that is bytes
    assert ("invalid-field", "a5") in found  # retryable "yes", ttl_s 1.5
    # Stored values keep their types (bytes included, as bytes of their digest) and the
    # server is fine.
    assert session["actions"][3]["idempotency_key"] == {"bytes_hex": hidden(b"\x00\x01").encode().hex()}
    assert_healthy(sidecar)


def test_start_times_past_int64_are_stored_not_failed(sidecar) -> None:  # type: ignore[no-untyped-def]
    # start_time_unix_nano is a fixed64: a span may start after 2262, as far as OTLP goes.
    # Its seq does not fit a 64-bit integer column; the span must still be stored, with
    # the valid spans of its write batch.
    late = span(1)
    late.start_time_unix_nano = 2**64 - 1
    response = grpc_export(sidecar, request_of(late, span(2)).SerializeToString())
    assert not response.HasField("partial_success")
    session = sidecar.session("bad-input")
    assert session["action_count"] == 2
    assert max(int(action["seq"]) for action in session["actions"]) == 2**64 - 1  # served as text
    assert_healthy(sidecar)


def not_utf8(body: bytes, *texts: str) -> bytes:
    """``body`` with each of ``texts`` (two characters, written once) made bytes that are
    not UTF-8: what a client's faulty encoder sends, which protobuf's builders refuse."""
    for text in texts:
        assert body.count(text.encode()) == 1, text
        body = body.replace(text.encode(), b"\xc3\x28")
    return body


def export_both_ways(sidecar, body: bytes) -> list[ExportTraceServiceResponse]:  # type: ignore[no-untyped-def]
    status, _, data = post(sidecar, body)
    assert status == 200, status_of({"Content-Type": "application/x-protobuf"}, data).message
    return [ExportTraceServiceResponse.FromString(data), grpc_export(sidecar, body)]


def test_text_that_is_not_utf8_rejects_only_its_span(sidecar) -> None:  # type: ignore[no-untyped-def]
    """upb refuses a whole message for one ``string`` field that is not UTF-8: one span's
    bad text was a 400 / INVALID_ARGUMENT that lost every valid span of the request.
    Now that span alone is rejected, named by its ids and the field."""
    event = Span.Event(name="e", attributes=[KeyValue(key="note", value=any_value("Z1"))])
    bad_event = span(2, **{"session.id": "utf8"})
    bad_event.events.append(event)
    bad_name = span(3, **{"session.id": "utf8"})
    bad_name.name = "Z2"
    body = not_utf8(
        request_of(
            span(1, **{"session.id": "utf8"}), bad_event, bad_name, span(4, **{"session.id": "utf8"})
        ).SerializeToString(),
        "Z1",
        "Z2",
    )
    for response in export_both_ways(sidecar, body):
        assert response.partial_success.rejected_spans == 2
        assert response.partial_success.error_message == (
            "rejected 2 of 4 span(s): resource_spans[0].scope_spans[0].spans[1] 'action 2': span "
            "0202020202020202 (trace 01010101010101010101010101010102): "
            "events[0].attributes[0].value.string_value is not valid UTF-8; "
            "resource_spans[0].scope_spans[0].spans[2] '': span 0202020202020203 "
            "(trace 01010101010101010101010101010103): name is not valid UTF-8"
        )
        assert [a["action_id"] for a in sidecar.session("utf8")["actions"]] == ["a1", "a4"]
    assert_healthy(sidecar)


def test_a_resource_or_scope_that_is_not_utf8_rejects_only_its_spans(sidecar) -> None:  # type: ignore[no-untyped-def]
    """As OTLP/JSON rejects each span of a resource it cannot read: a resource, scope or
    schema URL whose text is not UTF-8 rejects its spans, and the other groups are kept."""
    groups = [
        ResourceSpans(
            resource=Resource(attributes=[KeyValue(key="service.name", value=any_value("R1"))]),
            scope_spans=[ScopeSpans(spans=[span(1, **{"session.id": "groups"})])],
        ),
        ResourceSpans(
            scope_spans=[
                ScopeSpans(
                    scope=InstrumentationScope(name="S1"), spans=[span(2, **{"session.id": "groups"})]
                ),
                ScopeSpans(schema_url="U1", spans=[span(3, **{"session.id": "groups"})]),
                ScopeSpans(spans=[span(4, **{"session.id": "groups"})]),
            ]
        ),
        ResourceSpans(schema_url="U2", scope_spans=[ScopeSpans(spans=[span(5, **{"session.id": "groups"})])]),
    ]
    body = not_utf8(
        ExportTraceServiceRequest(resource_spans=groups).SerializeToString(), "R1", "S1", "U1", "U2"
    )
    for response in export_both_ways(sidecar, body):
        assert response.partial_success.rejected_spans == 4
        reasons = response.partial_success.error_message.split("; ")
        assert [reason.rpartition("): ")[2] for reason in reasons] == [
            "resource.attributes[0].value.string_value is not valid UTF-8",
            "scope.name is not valid UTF-8",
            "its ScopeSpans' schema_url is not valid UTF-8",
            "its ResourceSpans' schema_url is not valid UTF-8",
        ]
        assert [a["action_id"] for a in sidecar.session("groups")["actions"]] == ["a4"]
    assert_healthy(sidecar)


def assert_refused_as_not_protobuf(sidecar, body: bytes) -> None:  # type: ignore[no-untyped-def]
    """``body`` is refused whole on both ports: 400 and INVALID_ARGUMENT, as not protobuf."""
    status, headers, data = post(sidecar, body)
    assert status == 400
    assert "not a valid protobuf ExportTraceServiceRequest" in status_of(headers, data).message
    with pytest.raises(grpc.RpcError) as caught:
        grpc_export(sidecar, body)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bytes_that_are_not_protobuf_in_one_span_still_refuse_the_request(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Only depth and text are a span's own refusal: a span whose bytes are cut short
    # (a field longer than the span) is a request that is not protobuf, as before.
    cut_span = b"\x0a\x05"  # trace_id (field 1) of 5 bytes, where the span ends
    body = (
        request_of(span(1, **{"session.id": "cut"})).SerializeToString()
        + b"\x0a\x06\x12\x04\x12\x02"
        + cut_span
    )
    assert_refused_as_not_protobuf(sidecar, body)
    assert sidecar.get("/api/sessions/cut")[0] == 404
    assert_healthy(sidecar)


def test_a_resource_or_scope_that_is_not_utf8_with_no_spans_is_still_bad_data(sidecar) -> None:  # type: ignore[no-untyped-def]
    """Bad text that rejects no span is the request's (400 / INVALID_ARGUMENT), beside a
    span rejected for its own text too: it was answered 200 then, the bad group dropped
    unsaid, and 400 alone."""
    bad_span = span(2, **{"session.id": "empty-groups"})
    bad_span.name = "Z1"
    for group in (
        ResourceSpans(resource=Resource(attributes=[KeyValue(key="k", value=any_value("R1"))])),
        ResourceSpans(scope_spans=[ScopeSpans(scope=InstrumentationScope(name="R1"))]),
    ):
        spans = ResourceSpans(
            scope_spans=[ScopeSpans(spans=[span(1, **{"session.id": "empty-groups"}), bad_span])]
        )
        body = not_utf8(
            ExportTraceServiceRequest(resource_spans=[spans, group]).SerializeToString(), "R1", "Z1"
        )
        assert_refused_as_not_protobuf(sidecar, body)
    assert sidecar.get("/api/sessions/empty-groups")[0] == 404
    assert_healthy(sidecar)


def test_a_json_resource_or_scope_json_format_refuses_rejects_only_its_spans(sidecar) -> None:  # type: ignore[no-untyped-def]
    """A value json_format refuses in a resource (beside the attributes, which are read as
    the checker reads them), a scope or a schema URL refused the whole request, every valid
    span with it; now its spans are rejected, as a protobuf resource or scope whose text
    is not UTF-8 rejects its spans."""
    trace = "5B8EFFF798038103D269B633813FC60C"

    def group(n: int, **fields: Any) -> dict[str, Any]:
        span_ = json_span(trace, f"EEE19B7EC3C1B1{n:02d}", f"g{n}")
        span_["attributes"][0]["value"]["stringValue"] = "json-groups"
        scope = {"spans": [span_], **fields.pop("scope_fields", {})}
        return {"scopeSpans": [scope], **fields}

    document = {
        "resourceSpans": [
            group(1, resource={"droppedAttributesCount": "many"}),
            group(2, schemaUrl=5),
            group(3, scope_fields={"scope": {"name": 5}}),
            group(4, scope_fields={"schemaUrl": ["x"]}),
            group(5, resource={"attributes": []}, scope_fields={"scope": {"name": "fine"}}),
        ]
    }
    status, _, data = post(sidecar, json.dumps(document).encode(), "application/json")
    assert status == 200, data
    partial = json.loads(data)["partialSuccess"]
    assert partial["rejectedSpans"] == "4"
    reasons = partial["errorMessage"].split("; ")
    expected = ["ResourceSpans", "ResourceSpans", "ScopeSpans", "ScopeSpans"]
    assert [
        f"spans[0] 'g{n}': its {kind} is not OTLP/JSON: " in reason
        for n, (kind, reason) in enumerate(zip(expected, reasons, strict=True), 1)
    ] == [True] * 4
    assert "droppedAttributesCount" in reasons[0] and "schemaUrl" in reasons[1]
    assert "Failed to parse scope field" in reasons[2] and "schemaUrl" in reasons[3]
    assert [a["action_id"] for a in sidecar.session("json-groups")["actions"]] == ["g5"]
    assert_healthy(sidecar)


TRACE = "5B8EFFF798038103D269B633813FC60C"


def bad_json_text(document: dict[str, Any], **texts: bytes) -> bytes:
    """``document`` as OTLP/JSON, with each placeholder of ``texts`` (written once) made the
    text given for it: a lone surrogate escape (``rb"\\udc80"``), which orjson refuses, or
    bytes that are not UTF-8, which no JSON encoder writes but a client's faulty one may."""
    body = json.dumps(document).encode()
    for placeholder, text in texts.items():
        assert body.count(placeholder.encode()) == 1, placeholder
        body = body.replace(placeholder.encode(), text)
    return body


def text_span(n: int, session: str, **fields: Any) -> dict[str, Any]:
    """A JSON span of session ``session``, action ``t{n}``, with a note beside its mapped
    attributes, and ``fields`` over its own."""
    span_ = json_span(TRACE, f"EEE19B7EC3C1B1{n:02d}", f"t{n}")
    span_["attributes"][0]["value"]["stringValue"] = session
    span_["attributes"].append({"key": "note", "value": {"stringValue": fields.pop("note", "fine")}})
    return {**span_, **fields}


def post_json(sidecar, body: bytes) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The partial success of a JSON ``body`` the sidecar answers 200."""
    status, headers, data = post(sidecar, body, "application/json")
    assert status == 200, status_of(headers, data).message
    return json.loads(data).get("partialSuccess", {})


def span_named(n: int, problem: str) -> str:
    """How a rejection of ``text_span(n, …)`` reads, by its position and ids."""
    name = f"'t{n}'" if "name is not" not in problem else "''"
    return (
        f"resource_spans[0].scope_spans[0].spans[{n - 1}] {name}: span eee19b7ec3c1b1{n:02d} "
        f"(trace {TRACE.lower()}): {problem}"
    )


def test_json_text_that_is_not_utf8_rejects_only_its_span(sidecar) -> None:  # type: ignore[no-untyped-def]
    """A lone surrogate escape, or bytes that are not UTF-8, anywhere in an OTLP/JSON body
    made orjson refuse it, and the whole request was a 400 that lost every valid span. Now
    the span holding it is rejected alone, named by its ids and the field, as protobuf's."""
    session = "json-text"
    event = {"name": "e", "attributes": [{"key": "k", "value": {"stringValue": "Z3"}}]}
    spans = [
        text_span(1, session),
        text_span(2, session, note="Z1"),
        text_span(3, session, name="Z2"),
        text_span(4, session, events=[event]),
        text_span(5, session, note="Z4"),
        text_span(6, session),
    ]
    body = bad_json_text(
        {"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]},
        Z1=rb"\udc80",
        Z2=rb"a\ud800b",
        Z3=rb"\uDFFF",
        Z4=b"ok \xc3\x28",
    )
    partial = post_json(sidecar, body)
    assert partial["rejectedSpans"] == "4"
    assert partial["errorMessage"] == "rejected 4 of 6 span(s): " + "; ".join(
        [
            span_named(
                2, "attributes[3].value.stringValue is not valid UTF-8 (a lone surrogate escape \\udc80)"
            ),
            span_named(3, "name is not valid UTF-8 (a lone surrogate escape \\ud800)"),
            span_named(
                4,
                "events[0].attributes[0].value.stringValue is not valid UTF-8 (a lone surrogate escape \\udfff)",
            ),
            span_named(5, "attributes[3].value.stringValue is not valid UTF-8 (byte 0xc3)"),
        ]
    )
    assert [a["action_id"] for a in sidecar.session(session)["actions"]] == ["t1", "t6"]
    assert sidecar.metric("durable_sessions_spans_rejected_total", transport="http", reason="invalid") == 4
    assert_healthy(sidecar)


def test_a_json_resource_or_scope_whose_text_is_not_utf8_rejects_only_its_spans(sidecar) -> None:  # type: ignore[no-untyped-def]
    """Bad text in a resource, a scope or a schema URL rejects each span of that group, as
    in protobuf; the other groups are kept."""
    session = "json-group-text"

    def group(n: int, resource: str = "r", scope: str = "s", url: str = "u") -> dict[str, Any]:
        return {
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": resource}}]},
            "scopeSpans": [{"scope": {"name": scope}, "spans": [text_span(n, session)]}],
            "schemaUrl": url,
        }

    body = bad_json_text(
        {"resourceSpans": [group(1, resource="Z1"), group(2, scope="Z2"), group(3, url="Z3"), group(4)]},
        Z1=rb"\udc80",
        Z2=b"\xff",
        Z3=rb"\ud83d",
    )
    partial = post_json(sidecar, body)
    assert partial["rejectedSpans"] == "3"
    reasons = partial["errorMessage"].removeprefix("rejected 3 of 4 span(s): ").split("; ")
    assert reasons == [
        f"resource_spans[{n - 1}].scope_spans[0].spans[0] 't{n}': span eee19b7ec3c1b1{n:02d} "
        f"(trace {TRACE.lower()}): {problem}"
        for n, problem in [
            (
                1,
                "resource.attributes[0].value.stringValue is not valid UTF-8 (a lone surrogate escape \\udc80)",
            ),
            (2, "scope.name is not valid UTF-8 (byte 0xff)"),
            (3, "its ResourceSpans' schemaUrl is not valid UTF-8 (a lone surrogate escape \\ud83d)"),
        ]
    ]
    assert [a["action_id"] for a in sidecar.session(session)["actions"]] == ["t4"]
    assert_healthy(sidecar)


@pytest.mark.parametrize(
    ("document", "text", "expected"),
    [
        (
            {"resourceSpans": [{"scopeSpans": [{"spans": [text_span(1, "json-request-text")]}]}], "x": "Z1"},
            rb"\udc80",
            "request body is not valid OTLP/JSON: x is not valid UTF-8 (a lone surrogate escape \\udc80), "
            "outside any span",
        ),
        (
            {
                "resourceSpans": [
                    {"scopeSpans": [{"spans": [text_span(1, "json-request-text")]}]},
                    {"resource": {"attributes": [{"key": "k", "value": {"stringValue": "Z1"}}]}},
                ]
            },
            b"\xc3\x28",
            "request body is not valid OTLP/JSON: resourceSpans[1].resource.attributes[0].value.stringValue "
            "is not valid UTF-8 (byte 0xc3), outside any span",
        ),
        ({"Z1": 1}, b"\xe2\x82", "not valid UTF-8 (byte 0xe2)"),
        (
            {"k" * 1000: {"Z1": 1}},
            rb"\ud800",
            f"OTLP/JSON: a key of {'k' * 40}… is not valid UTF-8 (a lone surrogate escape \\ud800), outside",
        ),
        ("Z1", rb"\udc80", "request body is not valid OTLP/JSON: "),
    ],
    ids=["top-level", "group-without-spans", "key", "long-key", "not-an-object"],
)
def test_json_text_that_is_not_utf8_outside_any_span_refuses_the_request(  # type: ignore[no-untyped-def]
    sidecar, document, text, expected
) -> None:
    status, headers, data = post(sidecar, bad_json_text(document, Z1=text), "application/json")
    assert status == 400
    assert expected in status_of(headers, data).message
    assert sidecar.get("/api/sessions/json-request-text")[0] == 404
    assert_healthy(sidecar)


def test_a_body_that_is_not_json_with_bytes_that_are_not_utf8_is_still_refused(sidecar) -> None:  # type: ignore[no-untyped-def]
    for body in (b"\xff\xfe{", b'{"resourceSpans": [\xff]}', b'{"resourceSpans": [{"x": "\xff"}]'):
        status, headers, data = post(sidecar, body, "application/json")
        assert status == 400
        assert "request body is not valid JSON" in status_of(headers, data).message
    assert_healthy(sidecar)


_JSON_TEXT = st.sampled_from(["ok", "\udc80", "\ud800", "\ud83d\ude00", "é", "", "Z" * 40])
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _JSON_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_JSON_TEXT, inner, max_size=3),
    max_leaves=8,
)
_SPAN_FIELDS = st.dictionaries(
    st.sampled_from(["name", "traceId", "spanId", "attributes", "events", "status", "kind", "x"]),
    _JSON_VALUES,
    max_size=3,
)


@st.composite
def json_bodies(draw: st.DrawFn) -> bytes:
    """An OTLP/JSON body of a span and a resource with values of any JSON (lone surrogates
    among its text), or one cut, or with text that is not UTF-8 (or a JSON character) put
    anywhere in its bytes."""
    spans = [text_span(n, "json-fuzz", **draw(_SPAN_FIELDS)) for n in (1, 2)]
    group = {"resource": draw(_JSON_VALUES), "scopeSpans": [{"scope": draw(_JSON_VALUES), "spans": spans}]}
    body = json.dumps({"resourceSpans": [group], draw(_JSON_TEXT): draw(_JSON_VALUES)}).encode()
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(body)))
        inserted = draw(
            st.sampled_from([b"\xff", b"\xc3", rb"\udc80", rb"\ud800", b'"', b"\\", b"}", b",", b"1e999"])
        )
        body = body[:at] + inserted + body[at + draw(st.integers(0, 2)) :]
    return body[: draw(st.integers(0, len(body)))] if draw(st.booleans()) else body


@settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=st.one_of(json_bodies(), st.binary(max_size=300)))
def test_any_json_body_is_answered_200_400_or_413(start_sidecar, body: bytes) -> None:  # type: ignore[no-untyped-def]
    """Whatever a client sends as OTLP/JSON is answered, in time, as the OTLP spec has it:
    a (partial) success, a 400 with a reason, or a 413 over the limit; never a 500."""
    sidecar = fuzz_sidecar(start_sidecar)
    status, headers, data = post(sidecar, body, "application/json")
    assert status in (200, 400, 413), data
    if status == 200:
        assert set(json.loads(data)) <= {"partialSuccess"}
    else:
        assert status_of(headers, data).message


def fuzz_sidecar(start_sidecar):  # type: ignore[no-untyped-def]
    """One sidecar for every example of a test (its fixture's), with a limit some bodies pass."""
    if not hasattr(start_sidecar, "fuzzed"):
        start_sidecar.fuzzed = start_sidecar(receivers__max_request_bytes=1500)
    return start_sidecar.fuzzed
