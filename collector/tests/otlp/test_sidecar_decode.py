"""Decoding OTLP into SpanData: values, ids, OTLP/JSON's hex ids, and decompression."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest
from durable_sessions_collector.otlp.decode import (
    BadData,
    parse_json,
    parse_protobuf,
    spans_of,
    to_otlp_json,
    value_of,
)
from durable_sessions_collector.otlp.http_receiver import TooLarge, decompress
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList


def test_any_values_keep_their_types() -> None:
    assert value_of(AnyValue(string_value="x")) == "x"
    assert value_of(AnyValue(bool_value=False)) is False
    assert value_of(AnyValue(int_value=3)) == 3 and type(value_of(AnyValue(int_value=3))) is int
    assert value_of(AnyValue(double_value=1.5)) == 1.5
    assert value_of(AnyValue(bytes_value=b"\x00")) == b"\x00"
    assert value_of(AnyValue()) is None
    array = AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=1), AnyValue(string_value="a")]))
    assert value_of(array) == (1, "a")
    kvlist = AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="k", value=AnyValue(bool_value=True))]))
    assert value_of(kvlist) == {"k": True}


def otlp_json_document(trace_id: str, span_id: str) -> dict:  # type: ignore[type-arg]
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.instance.id", "value": {"stringValue": "i-1"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "lib"},
                        "spans": [
                            {
                                "traceId": trace_id,
                                "spanId": span_id,
                                "parentSpanId": "",
                                "name": "step",
                                "kind": 3,
                                "startTimeUnixNano": "1544712660000000000",
                                "attributes": [
                                    {"key": "n", "value": {"intValue": "42"}},
                                    {"key": "f", "value": {"doubleValue": 0.5}},
                                    {"key": "b", "value": {"bytesValue": "AAE="}},
                                ],
                                "status": {"code": 2},
                            }
                        ],
                    }
                ],
            }
        ]
    }


def test_otlp_json_hex_ids_are_decoded_as_hex_not_base64() -> None:
    body = json.dumps(otlp_json_document("5B8EFFF798038103D269B633813FC60C", "EEE19B7EC3C1B174")).encode()
    request, problems = parse_json(body)
    assert problems == {}
    [span] = spans_of(request).spans
    assert (span.trace_id, span.span_id) == ("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174")
    assert span.attributes == {"n": 42, "f": 0.5, "b": b"\x00\x01"}
    assert span.resource == {"service.instance.id": "i-1"}
    assert span.status_error is True and span.start_time_ns == 1544712660000000000
    # And back: the sidecar's writer emits hex ids too.
    assert json.loads(to_otlp_json(request))["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] == (
        "5b8efff798038103d269b633813fc60c"
    )


def test_protobuf_json_base64_ids_are_rejected_with_the_reason() -> None:
    body = json.dumps(otlp_json_document("W47/95gDgQPSabYzgT/GDA==", "7uGbfsPBsXQ=")).encode()
    request, problems = parse_json(body)
    decoded = spans_of(request, problems)
    assert decoded.spans == []
    assert decoded.rejected == [
        "resource_spans[0].scope_spans[0].spans[0] 'step': traceId 'W47/95gDgQPSabYzgT/GDA==' is not hex; "
        "spanId '7uGbfsPBsXQ=' is not hex"
    ]


def test_request_level_garbage_is_bad_data() -> None:
    with pytest.raises(BadData, match="not a valid protobuf ExportTraceServiceRequest"):
        parse_protobuf(b"\x0a\xff\xff\xff\xff\x0f")
    with pytest.raises(BadData, match="not valid JSON"):
        parse_json(b"\xff")


def test_decompression_is_bounded_and_checked() -> None:
    data = b"x" * 1000
    assert decompress(gzip.compress(data), "gzip", 1000) == data
    assert decompress(gzip.compress(data) + gzip.compress(data), "gzip", 2000) == data * 2  # multi-member
    assert decompress(zlib.compress(data), "deflate", 1000) == data
    raw = zlib.compressobj(wbits=-15)
    assert decompress(raw.compress(data) + raw.flush(), "deflate", 1000) == data
    with pytest.raises(TooLarge):
        decompress(gzip.compress(data), "gzip", 999)
    with pytest.raises(BadData, match="truncated gzip stream"):
        decompress(gzip.compress(data)[:-12], "gzip", 1000)
    with pytest.raises(BadData, match="not valid gzip data"):
        decompress(b"plain", "gzip", 1000)
