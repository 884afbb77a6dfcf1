"""The OTLP/HTTP receiver against the OTLP specification and the Collector's exporter.

Every test starts a real sidecar on free loopback ports and sends real HTTP requests, shaped
as the OpenTelemetry Collector's ``otlphttp`` exporter sends them (``encoding: json`` or
``proto``, ``compression: gzip``) or as the specification allows a client to send them.

References quoted below:

- OTLP: opentelemetry-proto ``docs/specification.md`` (same text as the specification
  repository's ``specification/protocol/otlp.md``), sections "JSON Protobuf Encoding",
  "OTLP/HTTP Request", "OTLP/HTTP Response" (Full Success, Partial Success, Failures,
  Bad Data, OTLP/HTTP Throttling).
- The Collector's ``exporter/otlphttpexporter/otlp.go``: it sets ``Content-Type:
  application/json`` or ``application/x-protobuf``, decodes a 2xx body according to the
  response's exact ``Content-Type``, retries only 429/502/503/504 and reads ``Retry-After``
  with ``strconv.Atoi`` (whole seconds).

Overload (503 with ``Retry-After`` and ``RetryInfo``, in either encoding) is checked on a
really full write queue in ``pipeline/test_sidecar_overload.py``.
"""

from __future__ import annotations

import gzip
import http.client
import json
from pathlib import Path
from typing import Any

import pytest
from durable_sessions_collector.otlp import receiver
from durable_sessions_collector.otlp.content_encoding import ENCODINGS
from durable_sessions_collector.store.stored import hidden
from google.protobuf import json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sidecar_clients import Agent, any_value, http_exporter, request_of

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
PROTOBUF_ALIAS = "application/protobuf"  # accepted too, and answered in it
TRACE_ID = "5b8efff798038103d269b633813fc60c"
SPAN_ID = "eee19b7ec3c1b174"


# --- helpers ---------------------------------------------------------------------------


def post(  # type: ignore[no-untyped-def]
    sidecar,
    body: bytes,
    content_type: str | None = JSON,
    *,
    method: str = "POST",
    path: str = "/v1/traces",
    connection: http.client.HTTPConnection | None = None,
    **headers: str,
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request; ``connection`` reuses a keep-alive connection (left open)."""
    own = connection is None
    conn = connection or http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    all_headers = {"Content-Type": content_type} if content_type else {}
    all_headers.update({k.replace("_", "-"): v for k, v in headers.items()})
    conn.request(method, path, body=body, headers=all_headers)
    response = conn.getresponse()
    data = response.read()
    if own:
        conn.close()
    return response.status, response.headers, data


def strict_status(headers: http.client.HTTPMessage, data: bytes) -> status_pb2.Status:
    """The body as a ``google.rpc.Status`` in the response's encoding; unknown fields fail."""
    status = status_pb2.Status()
    if headers["Content-Type"] == JSON:
        json_format.Parse(data, status)  # no ignore_unknown_fields: the shape must be a Status
    else:
        assert headers["Content-Type"] in (PROTOBUF, PROTOBUF_ALIAS)
        status.ParseFromString(data)
    return status


def accepted(sidecar, body: bytes, content_type: str) -> ExportTraceServiceResponse:  # type: ignore[no-untyped-def]
    """The sidecar's answer to ``body``, which must be a 200, read in ``content_type``."""
    status, headers, data = post(sidecar, body, content_type)
    assert status == 200, strict_status(headers, data).message
    response = ExportTraceServiceResponse()
    if content_type == JSON:
        json_format.Parse(data, response)
    else:
        response.ParseFromString(data)
    return response


def kv(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"key": key, "value": value}


def action_attributes(session: str, action: str, kind: str = "tool_call") -> list[dict[str, Any]]:
    return [
        kv("session.id", {"stringValue": session}),
        kv("agent.action.id", {"stringValue": action}),
        kv("agent.action.kind", {"stringValue": kind}),
    ]


def json_span(
    session: str, action: str, trace_id: str = TRACE_ID, span_id: str = SPAN_ID, **extra: Any
) -> dict:  # type: ignore[type-arg]
    span: dict[str, Any] = {
        "traceId": trace_id,
        "spanId": span_id,
        "name": f"step {action}",
        "kind": 1,
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000000000000001",
        "attributes": action_attributes(session, action),
    }
    span.update(extra)
    return span


def json_request(*spans: dict) -> bytes:  # type: ignore[type-arg]
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": list(spans)}]}]}).encode()


def proto_request(session: str, action: str, n: int = 1) -> bytes:
    attributes = {"session.id": session, "agent.action.id": action, "agent.action.kind": "tool_call"}
    span = Span(
        trace_id=bytes([1] * 15 + [n]),
        span_id=bytes([2] * 7 + [n]),
        name=f"step {action}",
        start_time_unix_nano=1_700_000_000_000_000_000 + n,
        attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()],
    )
    return request_of(span).SerializeToString()


def actions(sidecar, session: str) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    return sidecar.session(session)["actions"]


# --- OTLP/JSON decoding: what a conforming sender may send -------------------------------


def collector_style_document() -> dict[str, Any]:
    """An ``ExportTraceServiceRequest`` as the Collector's pdata JSON marshaler writes one
    (lowerCamelCase keys, lower-case hex ids, 64-bit integers as strings, integer enums),
    with fields this sidecar's proto may not know and fields no proto has yet."""
    return {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        kv("service.name", {"stringValue": "agent"}),
                        kv("service.instance.id", {"stringValue": "inc-collector"}),
                    ],
                    "droppedAttributesCount": 0,
                    "entityRefs": [{"type": "service", "idKeys": ["service.name"]}],
                    "futureResourceField": {"x": [1, 2, 3]},
                },
                "scopeSpans": [
                    {
                        "scope": {
                            "name": "lib",
                            "version": "1.2.3",
                            "attributes": [kv("scope.attr", {"stringValue": "v"})],
                            "futureScopeField": True,
                        },
                        "spans": [
                            {
                                "traceId": TRACE_ID,
                                "spanId": SPAN_ID,
                                "parentSpanId": "eee19b7ec3c1b173",
                                "traceState": "vendor=value",
                                "flags": 257,
                                "name": "tool call",
                                "kind": 3,
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000000500000000",
                                "attributes": [
                                    *action_attributes("collector-json", "c1"),
                                    {**kv("agent.action.name", {"stringValue": "search"}), "futureKv": 1},
                                ],
                                "droppedAttributesCount": 0,
                                "events": [
                                    {
                                        "timeUnixNano": "1700000000100000000",
                                        "name": "event",
                                        "attributes": [],
                                        "futureEventField": "x",
                                    }
                                ],
                                "links": [
                                    {
                                        "traceId": "5b8efff798038103d269b633813fc60d",
                                        "spanId": "eee19b7ec3c1b175",
                                        "traceState": "",
                                        "flags": 256,
                                        "futureLinkField": [],
                                    }
                                ],
                                "status": {"code": 1, "message": "", "futureStatusField": 0},
                                "futureSpanField": {"nested": {"deeper": None}},
                            }
                        ],
                        "schemaUrl": "https://opentelemetry.io/schemas/1.26.0",
                    }
                ],
                "schemaUrl": "https://opentelemetry.io/schemas/1.26.0",
                "futureResourceSpansField": 42,
            }
        ],
        "futureRequestField": "ignored",
    }


def test_collector_json_with_unknown_fields_is_accepted_as_if_they_were_absent(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Spec, JSON Protobuf Encoding: "OTLP/JSON receivers MUST ignore message fields with
    # unknown names and MUST unmarshal the message as if the unknown field was not present".
    # Sent as the otlphttp exporter sends it with `compression: gzip`.
    body = gzip.compress(json.dumps(collector_style_document()).encode())
    status, headers, data = post(
        sidecar, body, JSON, Content_Encoding="gzip", Accept_Encoding="gzip", User_Agent="otelcol/0.150.0"
    )
    assert status == 200, data
    # "The server MUST use the same Content-Type in the response as it received"; the
    # Collector's exporter matches the response Content-Type exactly.
    assert headers["Content-Type"] == JSON
    # "The server MUST leave the partial_success field unset in case of a successful response."
    assert json.loads(data) == {}
    [stored] = actions(sidecar, "collector-json")
    assert (stored["trace_id"], stored["span_id"], stored["action_id"], stored["name"]) == (
        TRACE_ID,
        SPAN_ID,
        "c1",
        "search",
    )
    assert stored["incarnation"] == "inc-collector"


def test_json_ids_are_case_insensitive_hex(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Spec: "The traceId and spanId byte arrays are represented as case-insensitive
    # hex-encoded strings; they are not base64-encoded".
    upper = json_span("hex-case", "u", TRACE_ID.upper(), SPAN_ID.upper())
    mixed = json_span("hex-case", "m", "5B8eFfF798038103d269B633813Fc60C", "EeE19b7Ec3C1b175")
    status, _, data = post(sidecar, json_request(upper, mixed))
    assert status == 200 and json.loads(data) == {}
    stored = {a["action_id"]: (a["trace_id"], a["span_id"]) for a in actions(sidecar, "hex-case")}
    assert stored == {"u": (TRACE_ID, SPAN_ID), "m": (TRACE_ID, "eee19b7ec3c1b175")}
    # The same span in lower case is the same (trace_id, span_id): stored once.
    status, _, _ = post(sidecar, json_request(json_span("hex-case", "u")))
    assert status == 200
    assert len(actions(sidecar, "hex-case")) == 2


UNREAD_IDS = {
    "parentSpanId": ["abcd", "zz", 5, "7uGbfsPBsXQ="],
    "link traceId": ["ab", "zz" * 16, ["x"]],
    "link spanId": ["cd", "eee19b7ec3c1b17g", True],
}
"""Values of the ids no front end reads that are no id: too short, not hex, not text,
base64 (``"eee19b7ec3c1b17g"``: one digit is not hex)."""


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, values in UNREAD_IDS.items() for v in values])
def test_a_parent_or_link_id_that_is_no_id_rejects_no_span_in_either_encoding(  # type: ignore[no-untyped-def]
    sidecar, field: str, value: Any
) -> None:
    # The sidecar (and check) reads a span's own trace and span id only. Protobuf's parser
    # takes a parent or link id of any length unread, so OTLP/JSON rejected for it alone
    # a span the same request in protobuf (or check reading the file) kept.
    session = f"unread-{field}-{json.dumps(value)}"
    json_ = json_span(session, "j")
    if field == "parentSpanId":
        json_[field] = value
    else:
        json_["links"] = [{"traceId": TRACE_ID, "spanId": SPAN_ID, field.split()[1]: value}]
    status, _, data = post(sidecar, json_request(json_))
    assert (status, json.loads(data)) == (200, {})
    wrong_length = ExportTraceServiceRequest.FromString(proto_request(session, "p"))
    span_ = wrong_length.resource_spans[0].scope_spans[0].spans[0]
    span_.parent_span_id = b"\xab\xcd"
    span_.links.add(trace_id=b"\xab", span_id=b"\xcd")
    assert accepted(sidecar, wrong_length.SerializeToString(), PROTOBUF) == ExportTraceServiceResponse()
    assert sorted(a["action_id"] for a in actions(sidecar, session)) == ["j", "p"]


def test_an_attribute_without_a_key_is_the_key_empty_as_protobufs_json_mapping_writes_it(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Proto3 JSON leaves out a field of its default value, so a KeyValue of key "" has no
    # "key" (MessageToJson, the Collector's marshaler); the span was rejected for it.
    keyless = [{"value": {"stringValue": "x"}}, {"key": None, "value": {"intValue": "1"}}]
    span = json_span("keyless", "k")
    span["attributes"] += keyless
    status, _, data = post(sidecar, json_request(span))
    assert (status, json.loads(data)) == (200, {})
    assert [a["action_id"] for a in actions(sidecar, "keyless")] == ["k"]


def test_json_ids_in_protobufs_base64_mapping_are_rejected_span_by_span(sidecar) -> None:  # type: ignore[no-untyped-def]
    base64_ids = json_span("b64", "x", "W47/95gDgQPSabYzgT/GDA==", "7uGbfsPBsXQ=")
    status, _, data = post(sidecar, json_request(base64_ids, json_span("b64", "ok")))
    assert status == 200
    partial = json.loads(data)["partialSuccess"]
    assert int(partial["rejectedSpans"]) == 1 and "is not hex" in partial["errorMessage"]
    assert [a["action_id"] for a in actions(sidecar, "b64")] == ["ok"]


def test_json_64_bit_integers_as_strings_or_numbers_and_enums_as_integers(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Spec: "64-bit integer numbers in JSON-encoded payloads are encoded as decimal strings,
    # and either numbers or strings are accepted when decoding"; "Values of enum fields
    # MUST be encoded as integer values".
    as_string = json_span("ints", "s", span_id="0000000000000001", startTimeUnixNano="1700000000000000123")
    as_number = json_span(
        "ints", "n", span_id="0000000000000002", startTimeUnixNano=1700000000000000456, kind=2
    )
    error = json_span("ints", "e", span_id="0000000000000003", status={"code": 2})  # STATUS_CODE_ERROR
    status, _, data = post(sidecar, json_request(as_string, as_number, error))
    assert status == 200 and json.loads(data) == {}
    stored = {a["action_id"]: a for a in actions(sidecar, "ints")}
    assert stored["s"]["seq"] == "1700000000000000123"  # served as text: past 2**53
    assert stored["n"]["seq"] == "1700000000000000456"
    assert stored["e"]["status"] == "error"
    assert stored["s"]["status"] == stored["n"]["status"] == "ok"  # STATUS_CODE_UNSET


def test_json_any_value_kinds(sidecar) -> None:  # type: ignore[no-untyped-def]
    # AnyValue in proto3 JSON: intValue is an int64 (string or number), bytesValue is
    # base64 (only trace/span ids are hex), arrayValue / kvlistValue nest AnyValues.
    attributes = [
        *action_attributes("anyvalue", "v"),
        kv("agent.action.max_attempts", {"intValue": "3"}),
        kv("agent.action.attempts", {"intValue": 9007199254740993}),
        kv("agent.action.ttl_s", {"doubleValue": 0.25}),
        kv("agent.action.retryable", {"boolValue": True}),
        kv("agent.action.cache_key", {"bytesValue": "AAH/"}),
        kv("agent.action.name", {"arrayValue": {"values": [{"stringValue": "a"}, {"intValue": "2"}]}}),
        kv("agent.action.result_ref", {"kvlistValue": {"values": [kv("k", {"boolValue": False})]}}),
        kv("agent.action.incarnation", {"arrayValue": {}}),
        kv("agent.action.custom_field", {"stringValue": "not stored"}),
    ]
    status, _, data = post(sidecar, json_request(json_span("anyvalue", "v", attributes=attributes)))
    assert status == 200 and json.loads(data) == {}
    [stored] = actions(sidecar, "anyvalue")
    assert stored["max_attempts"] == 3
    assert stored["attempts"] == "9007199254740993"  # served as text: past 2**53
    assert stored["ttl_s"] == 0.25
    assert stored["retryable"] is True
    # A list, object or bytes value is stored as one holding its digest (no contract field
    # holds one): the digest of the value decoded exactly. Fields outside the contract are
    # not stored.
    assert stored["cache_key"] == {"bytes_hex": hidden(b"\x00\x01\xff").encode().hex()}
    assert stored["name"] == [hidden(["a", 2])]
    assert stored["result_ref"] == {"hidden": hidden({"k": False})}
    assert stored["incarnation"] == []
    assert "custom_field" not in stored


# --- ids with whitespace -----------------------------------------------------------------


def test_json_ids_with_whitespace_are_rejected_span_by_span(sidecar) -> None:  # type: ignore[no-untyped-def]
    """An id with spaces or a newline in it (``"5b8efff7 98038103 ..."``) is not hex: that
    span is rejected (partial success) and the others in the request are stored. Python's
    own ``bytes.fromhex`` skips ASCII whitespace, so a decoder built on it would take such
    an id as a valid 16-byte trace id.

    Spec, JSON Protobuf Encoding: ids are "case-insensitive hex-encoded strings"
    (RFC 4648 section 8, base16). RFC 4648 section 3.3: "Implementations MUST reject the
    encoded data if it contains characters outside the base alphabet when interpreting
    base-encoded data, unless the specification referring to this document explicitly
    states otherwise." The Collector's own receiver (pdata ``unmarshalJSON``,
    ``hex.Decode``) rejects such an id. The sidecar's policy for a non-hex id is to reject
    that span (partial success), as it does for ``zz…`` or base64 ids.
    """
    spaced = json_span("hex-space", "sp", "5b8efff7 98038103 d269b633 813fc60c", "0000000000000011")
    newline = json_span("hex-space", "nl", span_id=" 0000000000000012\n")
    ok = json_span("hex-space", "ok", span_id="0000000000000013")
    status, _, data = post(sidecar, json_request(spaced, newline, ok))
    assert status == 200
    answer = json.loads(data)
    assert "partialSuccess" in answer, f"ids with whitespace were accepted as hex: {answer}"
    assert int(answer["partialSuccess"]["rejectedSpans"]) == 2
    assert [a["action_id"] for a in actions(sidecar, "hex-space")] == ["ok"]


# --- OTLP/HTTP request handling ------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    ["application/json; charset=utf-8", "Application/JSON", "application/json;charset=UTF-8"],
)
def test_json_content_type_with_parameters_or_any_case(sidecar, content_type) -> None:  # type: ignore[no-untyped-def]
    # Media types are case-insensitive and may carry parameters (RFC 9110 section 8.3.1).
    status, headers, data = post(sidecar, json_request(json_span("params", "p")), content_type)
    assert status == 200
    assert headers["Content-Type"] == JSON and json.loads(data) == {}


def test_protobuf_content_type_with_gzip_as_the_sdk_and_collector_send_it(sidecar) -> None:  # type: ignore[no-untyped-def]
    status, headers, data = post(
        sidecar, gzip.compress(proto_request("proto-gzip", "g")), PROTOBUF, Content_Encoding="gzip"
    )
    assert status == 200 and headers["Content-Type"] == PROTOBUF
    assert not ExportTraceServiceResponse.FromString(data).HasField("partial_success")
    # The real SDK exporter with gzip compression, too.
    agent = Agent(http_exporter(sidecar.http_url, compression=Compression.Gzip), "inc-sdk-gzip")
    agent.action("proto-gzip", "sdk", "tool_call")
    agent.shutdown()
    assert sorted(a["action_id"] for a in actions(sidecar, "proto-gzip")) == ["g", "sdk"]


def test_the_answer_has_the_requests_protobuf_content_type(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Spec, OTLP/HTTP Response: "The server MUST use the same Content-Type in the response as
    # it received in the request". application/protobuf was answered application/x-protobuf.
    for n, content_type in enumerate((PROTOBUF_ALIAS, PROTOBUF), 1):
        status, headers, data = post(sidecar, proto_request("alias", content_type, n), content_type)
        assert (status, headers["Content-Type"]) == (200, content_type)
        assert not ExportTraceServiceResponse.FromString(data).HasField("partial_success")
        status, headers, data = post(sidecar, b"\xff\xff\xff\xff\xff\x0f garbage", content_type)
        assert (status, headers["Content-Type"]) == (400, content_type)
        assert "not a valid protobuf" in status_pb2.Status.FromString(data).message
        status, headers, data = post(sidecar, b"whatever", content_type, Content_Encoding="br")
        assert (status, headers["Content-Type"]) == (415, content_type)
    assert len(actions(sidecar, "alias")) == 2


def test_empty_requests_succeed(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Spec, Full Success: "If the server receives an empty request (a request that does not
    # carry any telemetry data) the server SHOULD respond with success."
    status, headers, data = post(sidecar, b"{}", JSON)
    assert (status, headers["Content-Type"], json.loads(data)) == (200, JSON, {})
    status, headers, data = post(sidecar, b'{"resourceSpans": []}', JSON)
    assert (status, json.loads(data)) == (200, {})
    status, headers, data = post(sidecar, b"", PROTOBUF)  # the empty protobuf message
    assert (status, headers["Content-Type"]) == (200, PROTOBUF)
    assert not ExportTraceServiceResponse.FromString(data).HasField("partial_success")


@pytest.mark.parametrize("content_type", ["text/plain", "application/grpc", "application/otlp+json", None])
def test_unsupported_content_type_is_415_with_a_status(sidecar, content_type) -> None:  # type: ignore[no-untyped-def]
    status, headers, data = post(sidecar, json_request(json_span("ct", "x")), content_type)
    assert status == 415
    assert "unsupported Content-Type" in strict_status(headers, data).message


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-16", 'application/json;charset="latin1"']
)
def test_json_in_another_charset_than_utf8_is_415_naming_it(sidecar, content_type) -> None:  # type: ignore[no-untyped-def]
    # OTLP/JSON is UTF-8 (RFC 8259 section 8.1); UTF-16 text read as UTF-8 was a 400
    # "not valid JSON", which says the body is wrong rather than how it is encoded.
    body = json_request(json_span("cs", "x")).decode().encode("utf-16" if "16" in content_type else "latin1")
    status, headers, data = post(sidecar, body, content_type)
    assert status == 415
    assert "unsupported charset" in strict_status(headers, data).message


@pytest.mark.parametrize("content_type", [JSON, PROTOBUF])
def test_unknown_content_encoding_is_415_in_the_requests_encoding(sidecar, content_type) -> None:  # type: ignore[no-untyped-def]
    # RFC 9110 section 15.5.16: 415 covers "the request's indicated Content-Type or
    # Content-Encoding". The Status is in the request's encoding (OTLP/HTTP Response).
    status, headers, data = post(sidecar, b"whatever", content_type, Content_Encoding="br")
    assert status == 415 and headers["Content-Type"] == content_type
    assert "unsupported Content-Encoding 'br'" in strict_status(headers, data).message


@pytest.mark.parametrize(
    "header",
    [
        "gzip, identity",
        "identity, gzip",
        "Identity,GZIP",
        " gzip ,, identity ",
        "Identity",
        "identity, identity",
    ],
)
def test_identity_in_a_content_encoding_is_no_coding(sidecar, header: str) -> None:  # type: ignore[no-untyped-def]
    # RFC 9110 section 8.4.1 and 18.6: "identity" is no coding at all; a list of codings
    # (section 5.6.1) may name it, and empty elements, beside the one that was applied.
    # "gzip, identity" was a 415, which the Collector does not retry: the data was dropped.
    session = f"identity-{header}"
    body = json_request(json_span(session, "a"))
    status, _, data = post(
        sidecar, gzip.compress(body) if "gzip" in header.lower() else body, Content_Encoding=header
    )
    assert (status, json.loads(data)) == (200, {})
    assert [a["action_id"] for a in actions(sidecar, session)] == ["a"]


@pytest.mark.parametrize(
    ("lines", "status"), [(["identity", "gzip"], 200), (["gzip", "identity"], 200), (["gzip", "gzip"], 415)]
)
def test_content_encoding_on_several_lines_is_one_list(sidecar, lines: list[str], status: int) -> None:  # type: ignore[no-untyped-def]
    # RFC 9110 section 5.3: field lines of one name are one list. Only the first was read:
    # "identity" then "gzip" had the gzip body read as JSON (400), "gzip" twice decoded once.
    session = "lines-" + "-".join(lines)
    body = gzip.compress(json_request(json_span(session, "a")))
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    try:
        connection.putrequest("POST", "/v1/traces")
        for name, value in [("Content-Type", JSON), ("Content-Length", str(len(body)))]:
            connection.putheader(name, value)
        for line in lines:
            connection.putheader("Content-Encoding", line)
        connection.endheaders(body)
        response = connection.getresponse()
        assert (response.status, response.read().startswith(b"{")) == (status, True)
    finally:
        connection.close()
    if status == 200:
        assert [a["action_id"] for a in actions(sidecar, session)] == ["a"]


@pytest.mark.parametrize("header", ["gzip, gzip", "identity, gzip, zstd", "gzip, br"])
def test_stacked_codings_are_415_naming_the_header(sidecar, header: str) -> None:  # type: ignore[no-untyped-def]
    # One coding is decoded; a body coded twice (or with a coding not decoded) is refused
    # with the codings that are, before its body is read.
    status, headers, data = post(sidecar, gzip.compress(gzip.compress(b"{}")), Content_Encoding=header)
    assert status == 415
    assert strict_status(headers, data).message == (
        f"unsupported Content-Encoding {header!r}; send gzip, zstd, deflate, zlib, snappy, x-snappy-framed, lz4 or none"
    )


@pytest.mark.parametrize(
    ("body", "content_type", "expected"),
    [
        (b"{not json", JSON, "not valid JSON"),
        (b'{"resourceSpans": {"not": "a list"}}', JSON, "not an OTLP/JSON ExportTraceServiceRequest"),
        (b"\xff\xff\xff\xff\xff\x0f garbage", PROTOBUF, "not a valid protobuf ExportTraceServiceRequest"),
        (gzip.compress(b"{}")[:-6], JSON, "truncated gzip stream"),
    ],
    ids=["json-syntax", "json-shape", "protobuf", "truncated-gzip"],
)
def test_bad_data_is_400_with_a_status_message_in_the_requests_encoding(
    sidecar, body, content_type, expected
) -> None:  # type: ignore[no-untyped-def]
    # Spec, Bad Data: "the server MUST respond with HTTP 400 Bad Request"; Failures: "The
    # response body for all HTTP 4xx and HTTP 5xx responses MUST be a ... Status message";
    # "The Status.message field SHOULD contain a developer-facing error message".
    encoding = {"Content_Encoding": "gzip"} if expected.startswith("truncated") else {}
    status, headers, data = post(sidecar, body, content_type, **encoding)
    assert status == 400 and headers["Content-Type"] == content_type
    assert expected in strict_status(headers, data).message


# --- a JSON value of the wrong type ---------------------------------------------------------


@pytest.mark.parametrize("links", [5, True, 1.5], ids=["number", "boolean", "float"])
def test_json_links_of_the_wrong_type_reject_their_span(sidecar, links) -> None:  # type: ignore[no-untyped-def]
    """A span whose ``links`` is a JSON number or boolean cannot be decoded: it is rejected
    with a message naming ``links``, and the request's other spans are kept (200 with
    ``partial_success``), as a span with a bad id is. Link ids are converted from hex
    before the protobuf JSON parser sees the document, so that step must tell a ``links``
    that is not a list from one that is: an internal error there would answer 500,
    blaming the server for what is wrong with the data.

    Spec, Partial Success: "If the request is only partially accepted (i.e. when the server
    accepts only parts of the data and rejects the rest), the server MUST respond with
    HTTP 200 OK", with ``rejected_spans`` and an ``error_message``. Until 2026-12 the
    whole request was refused (400, Bad Data), its valid spans with it.
    """
    body = json_request(
        json_span("links", "l", links=links), json_span("links", "kept", span_id="EEE19B7EC3C1B175")
    )
    status, headers, data = post(sidecar, body, JSON)
    assert status == 200, (status, data)
    assert headers["Content-Type"] == JSON
    partial = json.loads(data)["partialSuccess"]
    assert partial["rejectedSpans"] == "1" and "spans[0]" in partial["errorMessage"]
    assert "Failed to parse links field" in partial["errorMessage"]
    assert sidecar.get("/healthz") == (200, {"status": "ok"})
    assert [a["action_id"] for a in actions(sidecar, "links")] == ["kept"]


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (numbers up to 15)."""
    size, length = len(payload), bytearray()
    while True:
        length.append(size & 0x7F | (0x80 if size >> 7 else 0))
        size >>= 7
        if not size:
            return bytes([number << 3 | 2]) + bytes(length) + payload


def _kept_and_deep(session: str) -> list[bytes]:
    """The protobuf bytes of two spans of ``session``, of actions "kept" and "deep", to
    write a request around."""
    return [
        ExportTraceServiceRequest.FromString(proto_request(session, action, n))
        .resource_spans[0]
        .scope_spans[0]
        .spans[0]
        .SerializeToString()
        for n, action in ((1, "kept"), (2, "deep"))
    ]


def _deeply_linked(content_type: str, session: str, depth: int) -> bytes:
    """A request of two spans of ``session``: "kept", and "deep" whose link has an attribute
    nesting ``depth`` arrays, written out as bytes or text (protobuf's own builders refuse
    to make a message nested so deeply)."""
    link_ids = {"traceId": "03" * 16, "spanId": "04" * 8}
    if content_type == JSON:
        link = {**link_ids, "attributes": [kv("deep", {"stringValue": "@deep@"})]}
        body = json_request(
            json_span(session, "kept"), json_span(session, "deep", span_id="eee19b7ec3c1b175", links=[link])
        )
        deep = '{"arrayValue": {"values": [' * depth + '{"stringValue": "x"}' + "]}}" * depth
        return body.replace(b'{"stringValue": "@deep@"}', deep.encode())
    value = _field(1, b"x")  # AnyValue.string_value
    for _ in range(depth):
        value = _field(5, _field(1, value))  # AnyValue.array_value, ArrayValue.values
    link = _field(1, b"\x03" * 16) + _field(2, b"\x04" * 8) + _field(4, _field(1, b"deep") + _field(2, value))
    kept, deep = _kept_and_deep(session)
    scope = _field(2, kept) + _field(2, deep + _field(13, link))
    return _field(1, _field(2, scope))


@pytest.mark.parametrize("depth", [48, 200])
@pytest.mark.parametrize("content_type", [JSON, PROTOBUF])
def test_a_link_nested_too_deeply_rejects_its_span_only(sidecar, content_type: str, depth: int) -> None:  # type: ignore[no-untyped-def]
    """A span whose link holds an attribute nested deeper than protobuf's parsers read (100
    messages from the request) is rejected, and the request's other spans kept, in either
    encoding (DESIGN.md: partial success names the rejected spans, nothing valid is lost).
    In protobuf the whole request was a 400 (upb refuses a message nested too deeply
    whole), in OTLP/JSON too at the depths where the span alone was within the limit."""
    session = f"deep-{content_type.rpartition('/')[2]}-{depth}"
    response = accepted(sidecar, _deeply_linked(content_type, session, depth), content_type)
    assert response.partial_success.rejected_spans == 1
    assert response.partial_success.error_message.startswith(
        "rejected 1 of 2 span(s): resource_spans[0].scope_spans[0].spans[1] "
    )
    assert [a["action_id"] for a in actions(sidecar, session)] == ["kept"]


def _value_nesting(messages: int) -> tuple[bytes, dict[str, Any]]:
    """An AnyValue nesting exactly ``messages`` messages (itself included), as protobuf
    bytes and as OTLP/JSON: arrays (two messages each) around a string, and for an even
    count one key-value list (three) among them."""
    value, document = _field(1, b"x"), {"stringValue": "x"}
    if messages % 2 == 0:
        value = _field(6, _field(1, _field(1, b"k") + _field(2, value)))  # kvlist_value
        document = {"kvlistValue": {"values": [kv("k", document)]}}
        messages -= 3
    for _ in range((messages - 1) // 2):
        value, document = _field(5, _field(1, value)), {"arrayValue": {"values": [document]}}
    return value, document


_NESTING_PLACES = {
    # where the deep attribute is: the messages above its AnyValue (the request included)
    "span attribute": 5,
    "event attribute": 6,
    "link attribute": 6,
    "resource attribute": 4,
}


def _nested_request(content_type: str, session: str, place: str, total: int) -> bytes:
    """Two spans of ``session``, "kept" and "deep", each of a resource of its own; "deep"
    (or its resource) holds an attribute whose value makes the request nest ``total``
    messages deep, the request included."""
    value, document = _value_nesting(total - _NESTING_PLACES[place])
    link_ids = {"traceId": "03" * 16, "spanId": "04" * 8}
    if content_type == JSON:
        deep = kv("deep", document)
        extra: dict[str, Any] = {
            "span attribute": {"attributes": [*action_attributes(session, "deep"), deep]},
            "event attribute": {"events": [{"name": "e", "attributes": [deep]}]},
            "link attribute": {"links": [{**link_ids, "attributes": [deep]}]},
            "resource attribute": {},
        }[place]
        groups = [
            {"scopeSpans": [{"spans": [json_span(session, "kept")]}]},
            {"scopeSpans": [{"spans": [json_span(session, "deep", span_id="eee19b7ec3c1b175", **extra)]}]},
        ]
        if place == "resource attribute":
            groups[1]["resource"] = {"attributes": [deep]}
        return json.dumps({"resourceSpans": groups}).encode()
    deep_kv = _field(1, b"deep") + _field(2, value)
    spans = _kept_and_deep(session)
    extra_bytes = {
        "span attribute": _field(9, deep_kv),
        "event attribute": _field(11, _field(2, b"e") + _field(3, deep_kv)),
        "link attribute": _field(13, _field(1, b"\x03" * 16) + _field(2, b"\x04" * 8) + _field(4, deep_kv)),
        "resource attribute": b"",
    }[place]
    resource = _field(1, _field(1, deep_kv)) if place == "resource attribute" else b""
    return _field(1, _field(2, _field(2, spans[0]))) + _field(
        1, resource + _field(2, _field(2, spans[1] + extra_bytes))
    )


@pytest.mark.parametrize("total", [100, 101, 102])
@pytest.mark.parametrize("place", list(_NESTING_PLACES))
@pytest.mark.parametrize("content_type", [JSON, PROTOBUF])
def test_both_encodings_read_a_request_101_messages_deep_and_reject_a_span_deeper(  # type: ignore[no-untyped-def]
    sidecar, content_type: str, place: str, total: int
) -> None:
    """Protobuf's parsers read a request 101 messages deep (the request included) and
    refuse one deeper: its span is rejected (:mod:`.envelope`). OTLP/JSON refused at 101
    where the span's link nested so deep (json_format's limit was 100), and read any depth
    in the attributes and events ``json_format`` never sees: one encoding accepted at the
    limit what the other rejected. Both now keep the span at the limit and reject it past
    it, wherever it nests."""
    session = f"depth-{content_type.rpartition('/')[2]}-{place.replace(' ', '-')}-{total}"
    response = accepted(sidecar, _nested_request(content_type, session, place, total), content_type)
    stored = [a["action_id"] for a in actions(sidecar, session)]
    if total <= 101:
        assert not response.HasField("partial_success"), response.partial_success.error_message
        assert sorted(stored) == ["deep", "kept"]
        return
    assert response.partial_success.rejected_spans == 1
    message = response.partial_success.error_message
    assert message.startswith("rejected 1 of 2 span(s): resource_spans[1].scope_spans[0].spans[0] ")
    assert "nested too deeply for protobuf's parser" in message
    assert stored == ["kept"]


def test_a_request_refused_for_more_than_depth_or_text_is_still_400(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Only depth and text that is not UTF-8 are a span's own refusal (test_sidecar_bad_input):
    # a span whose bytes are not protobuf (a field longer than the span) is the request's,
    # beside a span nested too deeply too.
    body = _deeply_linked(PROTOBUF, "deep-and-cut", 200) + _field(1, _field(2, _field(2, b"\x0a\x05")))
    status, headers, data = post(sidecar, body, PROTOBUF)
    assert status == 400
    assert "not a valid protobuf ExportTraceServiceRequest" in strict_status(headers, data).message


# --- BadRequest details ----------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [JSON, PROTOBUF])
def test_bad_data_status_details_contain_a_bad_request(sidecar, content_type) -> None:  # type: ignore[no-untyped-def]
    """A 400's ``Status`` carries a ``google.rpc.BadRequest`` describing the bad data in its
    details, over HTTP as the gRPC receiver does for the same decoder errors.

    Spec, Bad Data: "The Status.details field in the response SHOULD contain a BadRequest
    that describes the bad data."
    """
    body = b"{not json" if content_type == JSON else b"\xff\xff\xff\xff\xff\x0f garbage"
    status, headers, data = post(sidecar, body, content_type)
    assert status == 400
    answer = strict_status(headers, data)
    bad_requests = [d for d in answer.details if d.Is(error_details_pb2.BadRequest.DESCRIPTOR)]
    assert bad_requests, f"no google.rpc.BadRequest in Status.details: {answer}"
    bad_request = error_details_pb2.BadRequest()
    bad_requests[0].Unpack(bad_request)
    assert bad_request.field_violations and bad_request.field_violations[0].description
    assert answer.code == code_pb2.INVALID_ARGUMENT


# --- responses: partial success, 413 ---------------------------------------------------------


def test_partial_success_json_shape(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Spec, Partial Success: 200, "the server MUST initialize the partial_success field ...
    # and it MUST set the respective rejected_spans"; "SHOULD populate the error_message".
    # In JSON, field names are lowerCamelCase and an int64 may be a string or a number; the
    # Collector's exporter decodes the body with pdata's UnmarshalJSON (either is fine).
    bad = json_span("partial", "bad", span_id="00000000000000000000")  # 10 bytes
    status, headers, data = post(sidecar, json_request(bad, json_span("partial", "good")))
    assert status == 200 and headers["Content-Type"] == JSON
    document = json.loads(data)
    assert set(document) == {"partialSuccess"}
    assert set(document["partialSuccess"]) == {"rejectedSpans", "errorMessage"}
    response = ExportTraceServiceResponse()
    json_format.Parse(data, response)  # strictly an ExportTraceServiceResponse
    assert response.partial_success.rejected_spans == 1
    assert "spans[0] 'step bad'" in response.partial_success.error_message
    assert [a["action_id"] for a in actions(sidecar, "partial")] == ["good"]


def test_partial_success_protobuf_shape(sidecar) -> None:  # type: ignore[no-untyped-def]
    request = ExportTraceServiceRequest.FromString(proto_request("partial-pb", "good"))
    bad = request.resource_spans[0].scope_spans[0].spans.add()
    bad.CopyFrom(request.resource_spans[0].scope_spans[0].spans[0])
    bad.trace_id = b"\x01\x02"
    status, headers, data = post(sidecar, request.SerializeToString(), PROTOBUF)
    assert status == 200 and headers["Content-Type"] == PROTOBUF
    response = ExportTraceServiceResponse.FromString(data)
    assert response.partial_success.rejected_spans == 1
    assert "trace_id is 2 bytes" in response.partial_success.error_message


@pytest.mark.parametrize("content_type", [JSON, PROTOBUF])
def test_over_the_limit_is_413_with_a_status(start_sidecar, content_type) -> None:  # type: ignore[no-untyped-def]
    # Spec, OTLP/HTTP Request: "The server MUST limit the size of the request body when
    # parsing it, including after decompression ... the server SHOULD respond with HTTP 413".
    sidecar = start_sidecar(receivers__max_request_bytes=4096)
    if content_type == JSON:
        big = json_request(json_span("big", "b", name="x" * 10_000))
    else:
        request = ExportTraceServiceRequest.FromString(proto_request("big", "b"))
        request.resource_spans[0].scope_spans[0].spans[0].name = "x" * 10_000
        big = request.SerializeToString()
    for body, encoding in ((big, {}), (gzip.compress(big), {"Content_Encoding": "gzip"})):
        assert len(body) > 4096 or encoding  # the gzip body is small: the limit is after decompression
        status, headers, data = post(sidecar, body, content_type, **encoding)
        assert status == 413 and headers["Content-Type"] == content_type
        assert "4096-byte limit" in strict_status(headers, data).message


# --- methods, paths, connections --------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
def test_methods_other_than_post_are_405_with_allow(sidecar, method) -> None:  # type: ignore[no-untyped-def]
    # Spec, OTLP/HTTP Request: "Telemetry data is sent via HTTP POST request"; RFC 9110
    # section 15.5.6: a 405 "MUST generate an Allow header field". (The Collector's own
    # receiver answers 405 with a text/plain body too.)
    # Spec, Failures: "The response body for all HTTP 4xx and HTTP 5xx responses MUST be a
    # Protobuf-encoded Status message" (in JSON for a JSON request); it was {"error": ...}.
    for content_type in (JSON, PROTOBUF_ALIAS, None):
        status, headers, data = post(sidecar, b"{}" if content_type else b"", content_type, method=method)
        assert status == 405 and headers["Allow"] == "OPTIONS, POST"
        assert headers["Content-Type"] == content_type or JSON
        answer = strict_status(headers, data)
        assert answer.code == code_pb2.UNIMPLEMENTED
        assert answer.message == f"{method} is not allowed on /v1/traces; use OPTIONS, POST"


def test_an_internal_error_on_v1_traces_is_a_500_with_a_status(sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A bug in the receiver (here a decoder that fails) is answered by the HTTP port, not the
    # receiver; on the OTLP path that answer is a Status too.
    def broken(*_: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(receiver, "json_span_parts", broken)
    status, headers, data = post(sidecar, json_request(json_span("bug", "b")), JSON)
    assert (status, headers["Content-Type"]) == (500, JSON)
    answer = strict_status(headers, data)
    assert (answer.code, answer.message) == (code_pb2.INTERNAL, "internal error; see the sidecar log")
    [line] = [line for line in sidecar.log.lines() if line["event"] == "http-handler-failed"]
    assert line["error"] == "RuntimeError: a bug"
    # The decoding budget was given back: nothing is weighed as being decoded.
    assert sidecar.service.budget.in_use == 0
    assert sidecar.metric("durable_sessions_decoding_bytes") == 0


@pytest.mark.parametrize("path", ["/v1/traces/", "/v1/logs", "/v1/metrics", "/v1/trace"])
def test_paths_other_than_v1_traces_are_404_and_store_nothing(sidecar, path) -> None:  # type: ignore[no-untyped-def]
    status, _, _ = post(sidecar, json_request(json_span("paths", "p")), JSON, path=path)
    assert status == 404
    assert sidecar.get("/api/sessions/paths")[0] == 404


def test_keep_alive_survives_error_answers(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Spec, OTLP/HTTP Connection: "The client SHOULD keep the connection alive between
    # requests." An error answer must leave the connection usable for the next request.
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    try:
        answers = [
            post(sidecar, b"body", "text/plain", connection=connection)[0],
            post(sidecar, b"{bad", JSON, connection=connection)[0],
            post(sidecar, b"x", JSON, Content_Encoding="br", connection=connection)[0],
            post(
                sidecar,
                gzip.compress(json_request(json_span("alive", "a"))),
                JSON,
                Content_Encoding="gzip",
                connection=connection,
            )[0],
        ]
    finally:
        connection.close()
    assert answers == [415, 400, 415, 200]
    assert [a["action_id"] for a in actions(sidecar, "alive")] == ["a"]


def test_chunked_gzip_json_body_is_accepted(sidecar) -> None:  # type: ignore[no-untyped-def]
    # A client that does not know the compressed length up front sends it chunked.
    body = gzip.compress(json_request(json_span("chunked", "c")))
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    try:
        connection.request(
            "POST",
            "/v1/traces",
            body=iter([body[:10], body[10:]]),
            headers={"Content-Type": JSON, "Content-Encoding": "gzip"},
            encode_chunked=True,
        )
        response = connection.getresponse()
        assert (response.status, json.loads(response.read())) == (200, {})
    finally:
        connection.close()
    assert [a["action_id"] for a in actions(sidecar, "chunked")] == ["c"]


def test_the_readmes_table_of_answers_names_every_accepted_coding() -> None:
    """The table said "accepted: gzip, zstd, deflate, zlib, none" after snappy and lz4 were
    accepted: a reader with a Collector set to either took it for a 415."""
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    [row] = [
        line for line in readme.splitlines() if line.startswith("| wrong `Content-Type` / `Content-Encoding`")
    ]
    accepted = row.partition("(accepted: ")[2].partition(")")[0]
    assert set(accepted.replace(" or ", ", ").split(", ")) == {*ENCODINGS, "identity", "none"}


@pytest.mark.parametrize(
    "coding", ["zstd", "zlib", "deflate", "gzip", "snappy", "snappy-block", "x-snappy-framed", "lz4"]
)
def test_every_coding_the_collectors_otlphttp_exporter_sends_is_accepted(sidecar, coding: str) -> None:  # type: ignore[no-untyped-def]
    # The Collector's otlphttp exporter offers compression gzip (its default), zstd, zlib,
    # deflate, snappy (framed, or a bare block behind a feature gate) and lz4. Before, all
    # but gzip and deflate were answered 415, which the Collector does not retry: the data
    # was dropped. Since v0.125 (feature gate confighttp.framedSnappy, beta: on by
    # default) it also offers x-snappy-framed, sent as "Content-Encoding: x-snappy-framed"
    # (config/confighttp/compression.go); that got the 415 until 2026-12-02.
    import zlib

    import cramjam
    import lz4.frame
    import zstandard

    encode = {
        "zstd": zstandard.ZstdCompressor().compress,
        "zlib": zlib.compress,
        "deflate": zlib.compress,
        "gzip": gzip.compress,
        "snappy": lambda data: bytes(cramjam.snappy.compress(data)),
        "snappy-block": lambda data: bytes(cramjam.snappy.compress_raw(data)),
        "x-snappy-framed": lambda data: bytes(cramjam.snappy.compress(data)),
        "lz4": lz4.frame.compress,
    }[coding]
    body = encode(json_request(json_span(f"coded-{coding}", "a")))
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    try:
        connection.request("POST", "/v1/traces", body=body,
                           headers={"Content-Type": JSON, "Content-Encoding": coding.removesuffix("-block")})  # fmt: skip
        response = connection.getresponse()
        assert (response.status, json.loads(response.read())) == (200, {})
        connection.request("POST", "/v1/traces", body=body,
                           headers={"Content-Type": JSON, "Content-Encoding": "br"})  # fmt: skip
        response = connection.getresponse()
        message = json.loads(response.read())["message"]
        assert response.status == 415
        assert (
            message
            == "unsupported Content-Encoding 'br'; send gzip, zstd, deflate, zlib, snappy, x-snappy-framed, lz4 or none"
        )
    finally:
        connection.close()
    assert [a["action_id"] for a in actions(sidecar, f"coded-{coding}")] == ["a"]


def test_json_keys_spelled_with_escapes_nest_as_deep(sidecar) -> None:  # type: ignore[no-untyped-def]
    # The decoder counts the nesting keys in the bytes before it walks the attributes: a
    # key written with an escape must not slip past that count.
    body = _nested_request(JSON, "escaped", "span attribute", 102)
    body = body.replace(b'"arrayValue"', b'"\\u0061rrayValue"')
    status, _, data = post(sidecar, body, JSON)
    assert status == 200
    assert json.loads(data)["partialSuccess"]["rejectedSpans"] == "1"
    assert [a["action_id"] for a in actions(sidecar, "escaped")] == ["kept"]
