"""Decoding OTLP into SpanData: values, ids, OTLP/JSON's hex ids, and decompression; and the
receivers' decoder, which keeps only the attributes the mapping reads."""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import time
import zlib
from typing import Any

import pytest
from durable_sessions_collector.otlp.content_encoding import TooLarge, coding_of, decompress
from durable_sessions_collector.otlp.decode import (
    MAPPED_KEYS,
    MAPPED_PREFIXES,
    BadData,
    json_span_parts,
    mapped_attributes_of,
    parse_json,
    parse_protobuf,
    span_parts,
    spans_of,
    to_otlp_json,
    value_of,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from sidecar_clients import any_value

from durable_sessions import semconv as sc
from durable_sessions.mapping import map_attributes, map_span


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


def test_a_time_of_more_digits_than_python_reads_rejects_its_span_only() -> None:
    """int() refuses a decimal string of more than 4,300 digits: its ValueError went up
    out of the decoder (the offline checker's reader, whose functions it shares, too).
    The span is rejected in the reader's words now, and the span beside it kept."""
    document = otlp_json_document("5B8EFFF798038103D269B633813FC60C", "EEE19B7EC3C1B174")
    spans = document["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans.append({**spans[0], "spanId": "EEE19B7EC3C1B175", "endTimeUnixNano": "9" * 4301})
    request, problems = parse_json(json.dumps(document).encode())
    assert problems == {(0, 0, 1): "endTimeUnixNano '99999999999999999...' is not an unsigned 64-bit integer"}
    decoded = spans_of(request, problems)
    assert [span.span_id for span in decoded.spans] == ["eee19b7ec3c1b174"]
    assert len(decoded.rejected) == 1


def test_protobuf_json_base64_ids_are_rejected_with_the_reason() -> None:
    body = json.dumps(otlp_json_document("W47/95gDgQPSabYzgT/GDA==", "7uGbfsPBsXQ=")).encode()
    request, problems = parse_json(body)
    decoded = spans_of(request, problems)
    assert decoded.spans == []
    assert decoded.rejected == [
        "resource_spans[0].scope_spans[0].spans[0] 'step': traceId 'W47/95gDgQPSabYzgT/GDA==' is not hex"
        f"{BASE64}; spanId '7uGbfsPBsXQ=' is not hex{BASE64}"
    ]
    # Base64 of another size, or text that is neither, is only not hex.
    body = json.dumps(otlp_json_document("W47/95gDgQPSabYzgT/GDA==", "W47/95gDgQPSabYzgT/GDA==")).encode()
    assert (
        spans_of(*parse_json(body))
        .rejected[0]
        .endswith(f"{BASE64}; spanId 'W47/95gDgQPSabYzgT/GDA==' is not hex")
    )


BASE64 = ": it is base64, as protobuf's JSON mapping writes bytes, where OTLP/JSON writes ids in hex"
"""What a rejection adds for an id in base64 of its size."""


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
    assert decompress(zlib.compress(data), "zlib", 1000) == data  # the Collector's "zlib" coding


def test_zstd_is_decoded_bounded_and_checked() -> None:
    import zstandard

    data = b"x" * 1000 + os.urandom(3000)
    frame = zstandard.ZstdCompressor().compress(data)
    assert decompress(frame, "zstd", 4000) == data
    assert decompress(frame + frame, "zstd", 8000) == data * 2  # frames one after the other
    streamed = zstandard.ZstdCompressor().compressobj()  # no content size in the header
    assert decompress(streamed.compress(data) + streamed.flush(), "zstd", 4000) == data
    with pytest.raises(TooLarge, match="over the 3999-byte limit after zstd decompression"):
        decompress(frame, "zstd", 3999)
    with pytest.raises(BadData, match="truncated zstd stream"):
        decompress(frame[:-5], "zstd", 4000)
    with pytest.raises(BadData, match="not valid zstd data"):
        decompress(b"plain text, not zstd", "zstd", 4000)
    with pytest.raises(BadData, match="not valid zstd data"):
        decompress(frame + b"trailing junk", "zstd", 8000)


def peak_growth_stopping_at_the_limit(bomb: bytes, encoding: str) -> float:
    """MiB the process's peak memory grew while ``bomb`` was decoded, which must stop at a
    64 MiB limit with :class:`TooLarge`."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(TooLarge):
        decompress(bomb, encoding, 64 * 1024 * 1024)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def test_a_zstd_bomb_stops_at_the_limit_without_inflating() -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (1 << 30))  # 1 GiB in ~32 KiB
    assert len(bomb) < 100_000
    grown_mib = peak_growth_stopping_at_the_limit(bomb, "zstd")
    assert grown_mib < 300, f"peak memory grew {grown_mib:.0f} MiB decoding a 1 GiB bomb"


def test_a_zstd_frame_asking_for_a_huge_window_is_refused() -> None:
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(19, window_log=27)  # 128 MiB
    streamed = zstandard.ZstdCompressor(compression_params=params).compressobj()
    body = streamed.compress(os.urandom(1 << 20) * 20) + streamed.flush()
    with pytest.raises(BadData, match="not valid zstd data"):
        decompress(body, "zstd", 64 * 1024 * 1024)


def test_snappy_is_decoded_framed_or_as_a_block_bounded_and_checked() -> None:
    import cramjam

    data = os.urandom(70_000) + b"x" * 200_000  # over 64 KiB: several chunks in the framed format
    framed = bytes(cramjam.snappy.compress(data))
    block = bytes(cramjam.snappy.compress_raw(data))
    assert framed.startswith(b"\xff\x06\x00\x00sNaPpY") and not block.startswith(b"\xff")
    assert decompress(framed, "snappy", len(data)) == data
    assert decompress(block, "snappy", len(data)) == data
    assert decompress(framed + framed, "snappy", 2 * len(data)) == data * 2  # streams one after the other
    for body in (framed, block):
        with pytest.raises(TooLarge, match=f"over the {len(data) - 1}-byte limit after snappy decompression"):
            decompress(body, "snappy", len(data) - 1)
    with pytest.raises(BadData, match="truncated snappy stream"):
        decompress(framed[:-5], "snappy", len(data))
    with pytest.raises(BadData, match="not valid snappy data"):
        decompress(block[:-5], "snappy", len(data))
    corrupt = bytearray(framed)
    corrupt[30] ^= 0xFF  # inside the first chunk: its CRC no longer matches
    with pytest.raises(BadData, match="not valid snappy data"):
        decompress(bytes(corrupt), "snappy", len(data))
    with pytest.raises(BadData, match="chunk type 0x02"):  # reserved and unskippable
        decompress(framed[:10] + b"\x02\x01\x00\x00z", "snappy", len(data))
    assert (
        decompress(framed[:10] + b"\xfe\x02\x00\x00pd" + framed[10:], "snappy", len(data)) == data
    )  # padding


def test_x_snappy_framed_is_the_framing_format_only() -> None:
    """The Collector's ``x-snappy-framed`` (confighttp: ``snappy.NewReader``) is the framing
    format, bounded and checked as snappy's; a bare block under that name is refused, as
    the Collector's own receiver refuses it."""
    import cramjam

    data = os.urandom(70_000) + b"x" * 200_000
    framed = bytes(cramjam.snappy.compress(data))
    assert coding_of("X-Snappy-Framed") == "x-snappy-framed"
    assert decompress(framed, "x-snappy-framed", len(data)) == data
    assert decompress(framed + framed, "x-snappy-framed", 2 * len(data)) == data * 2
    with pytest.raises(TooLarge, match="after snappy decompression"):
        decompress(framed, "x-snappy-framed", len(data) - 1)
    with pytest.raises(BadData, match="truncated snappy stream"):
        decompress(framed[:-5], "x-snappy-framed", len(data))
    with pytest.raises(BadData, match="not the snappy framing format"):
        decompress(bytes(cramjam.snappy.compress_raw(data)), "x-snappy-framed", len(data))


def test_a_snappy_bomb_stops_at_the_limit_without_inflating() -> None:
    import cramjam

    # Snappy inflates about 21 times at most: 256 MiB of zeros take some 12 MiB.
    chunk = bytes(cramjam.snappy.compress(b"\0" * 65536))[10:]  # one chunk, without the stream identifier
    bomb = b"\xff\x06\x00\x00sNaPpY" + chunk * 4096
    assert len(bomb) < 16_000_000
    grown_mib = peak_growth_stopping_at_the_limit(bomb, "snappy")
    assert grown_mib < 150, f"peak memory grew {grown_mib:.0f} MiB decoding a 256 MiB bomb"
    block_bomb = b"\x80\x80\x80\x80\x04" + b"\0" * 16  # a block that says it decodes to 1 GiB
    with pytest.raises(TooLarge):
        decompress(block_bomb, "snappy", 64 * 1024 * 1024)


def test_lz4_is_decoded_bounded_and_checked() -> None:
    import lz4.frame

    data = os.urandom(2000) + b"y" * 2000
    frame = lz4.frame.compress(data)
    assert decompress(frame, "lz4", 4000) == data
    assert decompress(frame + frame, "lz4", 8000) == data * 2  # frames one after the other
    with pytest.raises(TooLarge, match="over the 3999-byte limit after lz4 decompression"):
        decompress(frame, "lz4", 3999)
    with pytest.raises(BadData, match="truncated lz4 stream"):
        decompress(frame[:-5], "lz4", 4000)
    with pytest.raises(BadData, match="not valid lz4 data"):
        decompress(b"plain text, not lz4 at all", "lz4", 4000)


def _lz4_frame(data: bytes, declared: int) -> bytes:
    """An LZ4 frame of ``data`` whose header says it decodes to ``declared`` bytes."""
    import lz4.frame

    header = lz4.frame.LZ4FrameCompressor().begin(source_size=declared)
    compressor = lz4.frame.LZ4FrameCompressor()
    frame = compressor.begin(source_size=len(data)) + compressor.compress(data) + compressor.flush()
    return header + frame[len(header) :]  # the same flags: only the size (and its checksum) differ


def test_lz4_frames_are_decoded_into_buffers_of_their_own_size() -> None:
    """lz4 allocates the ``max_length`` asked of each call whole: asked 1 MiB whatever the
    frame, a body of many small frames cost a 1 MiB allocation per frame (390 us each
    under ASan). The buffer is now the size the frame's header declares, or, when it
    declares none, starts small and doubles while the frame fills it."""
    import tracemalloc

    import lz4.frame

    data = os.urandom(3000)
    declared, undeclared = lz4.frame.compress(b"ab"), lz4.frame.compress(b"ab", store_size=False)
    for body, expected in (
        (declared * 100, b"ab" * 100),
        (undeclared * 100, b"ab" * 100),
        (lz4.frame.compress(data, store_size=False), data),
    ):
        tracemalloc.start()
        try:
            assert decompress(body, "lz4", 64 * 1024 * 1024) == expected
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 * 1024, f"{peak} bytes allocated to decode {len(expected)} bytes"


@pytest.mark.parametrize("declared", [0, 1, 2999, 3001, 1 << 40])
def test_an_lz4_frame_declaring_a_wrong_size_is_bad_data(declared: int) -> None:
    # The declared size only sizes the buffers the output is asked in: lz4 itself checks
    # the output against it, and the limit is checked on the output.
    data = os.urandom(1000) + b"z" * 2000
    with pytest.raises(BadData, match="not valid lz4 data"):
        decompress(_lz4_frame(data, declared), "lz4", 64 * 1024 * 1024)
    with pytest.raises((BadData, TooLarge)):
        decompress(_lz4_frame(data, declared), "lz4", 2999)
    assert decompress(_lz4_frame(data, len(data)), "lz4", 3000) == data
    with pytest.raises(TooLarge, match="over the 2999-byte limit after lz4 decompression"):
        decompress(_lz4_frame(data, len(data)), "lz4", 2999)


def test_an_lz4_bomb_stops_at_the_limit_without_inflating() -> None:
    import lz4.frame

    bomb = lz4.frame.compress(b"\0" * (1 << 30))  # 1 GiB in ~4 MiB
    assert len(bomb) < 8_000_000
    grown_mib = peak_growth_stopping_at_the_limit(bomb, "lz4")
    assert grown_mib < 300, f"peak memory grew {grown_mib:.0f} MiB decoding a 1 GiB bomb"


def _compressor(encoding: str) -> Any:
    import lz4.frame
    import zstandard

    return {
        "gzip": gzip.compress,
        "zstd": zstandard.ZstdCompressor().compress,
        "lz4": lz4.frame.compress,
    }[encoding]


@pytest.mark.parametrize("encoding", ["gzip", "zstd", "lz4"])
def test_members_of_every_size_one_after_the_other_are_one_body(encoding: str) -> None:
    """Members (gzip) or frames (zstd, lz4) from empty to several MiB, one after the other:
    each starts where the one before ended, wherever that falls in what was fed."""
    compress = _compressor(encoding)
    rng = random.Random(7)
    parts = [os.urandom(size) for size in (0, 1, 255, 256, 257, 5000, 70_000, 1_300_000, 3_000_000, 0, 9)]
    parts += [os.urandom(rng.randrange(3000)) for _ in range(200)]
    body = b"".join(compress(part) for part in parts)
    assert decompress(body, encoding, 64 * 1024 * 1024) == b"".join(parts)


def _decoding_time(encoding: str, count: int) -> float:
    """CPU seconds to decode ``count`` members (or frames) of ``b"ab"``, best of two."""
    body = _compressor(encoding)(b"ab") * count
    best = math.inf
    for _ in range(2):
        start = time.process_time()
        decoded = decompress(body, encoding, 64 * 1024 * 1024)
        best = min(best, time.process_time() - start)
    assert decoded == b"ab" * count
    return best


@pytest.mark.parametrize("encoding", ["gzip", "zstd", "lz4"])
def test_a_body_of_many_small_members_is_decoded_in_time_linear_in_its_size(encoding: str) -> None:
    """Each member or frame was followed by a copy of the rest of the body (the decoder's
    ``unused_data``): 1.6 MB of tiny zstd frames took 17 s of CPU, 16 MB half an hour,
    from one request. Now the leftover is at most the piece fed. Eight times the members
    cost about eight times as much (up to 64 times, copied); a ratio within one run, so
    the machine's speed, or a sanitizer's slowing, does not decide it."""
    ratio = _decoding_time(encoding, 32_000) / _decoding_time(encoding, 4_000)
    assert ratio < 16, f"eight times the {encoding} members took {ratio:.1f} times as long"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(["gzip", "zstd", "deflate", "zlib", "snappy", "lz4"]))
def test_any_body_in_any_coding_decodes_or_fails_cleanly(body: bytes, encoding: str) -> None:
    try:
        decoded = decompress(body, encoding, 10_000)
    except (BadData, TooLarge):
        return
    assert len(decoded) <= 10_000


# --- the receiver's decoder: only the attributes the mapping reads ---------------------------

_SEMCONV_STRINGS = sorted(
    {value for name, value in vars(sc).items() if name.isupper() and isinstance(value, str)}
    | {
        value
        for name, value in vars(sc).items()
        if name.isupper() and isinstance(value, frozenset | tuple)
        for value in value
    }
)
"""Every attribute name and value semconv spells: what the mapping could read, and the
values (``chat``, ``TOOL``, ``__REDACTED__``, …) that steer it."""

_ATTRIBUTE_KEYS = st.one_of(
    st.sampled_from(_SEMCONV_STRINGS),
    st.sampled_from([sc.ACTION_PREFIX, sc.GEN_AI_COMPLETION_PREFIX, sc.LLM_OUTPUT_MESSAGES_PREFIX]).flatmap(
        lambda prefix: st.sampled_from(["0.content", "color", "1.message.content", "kind"]).map(
            prefix.__add__
        )
    ),
    st.sampled_from(
        ["http.method", "custom.attribute", "agent.actions", "gen_ai.completion", "service.name"]
    ),
    st.text(max_size=8),
)
_SCALARS = st.one_of(
    st.sampled_from(_SEMCONV_STRINGS),
    st.sampled_from(['{"answer": "yes"}', "not json", "[1, 2]"]),
    st.text(max_size=8),
    st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1),
    st.booleans(),
    st.floats(allow_nan=False),
    st.binary(max_size=4),
)
_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=3).map(tuple))


def _key_values(pairs: list[tuple[str, Any]]) -> list[KeyValue]:
    return [KeyValue(key=key, value=any_value(value)) for key, value in pairs]


_ATTRIBUTES = st.lists(st.tuples(_ATTRIBUTE_KEYS, _VALUES), max_size=12)  # repeated keys too


def _request(
    spans: list[list[tuple[str, Any]]], resource: list[tuple[str, Any]], error: bool
) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=_key_values(resource)),
                scope_spans=[
                    ScopeSpans(
                        spans=[
                            Span(
                                trace_id=bytes([1] * 16),
                                span_id=bytes([2] * 7 + [n]),
                                name=f"span {n}",
                                start_time_unix_nano=1_700_000_000_000_000_000 + n,
                                attributes=_key_values(attributes),
                                status=Status(
                                    code=Status.STATUS_CODE_ERROR if error else Status.STATUS_CODE_OK
                                ),
                            )
                            for n, attributes in enumerate(spans)
                        ]
                    )
                ],
            )
        ]
    )


def assert_mapped_alike(request: ExportTraceServiceRequest) -> list[dict[str, Any] | None]:
    """Each span's record and problems from the receiver's decoder are those of the full
    decode and ``map_span``; returns the records."""
    full = [map_span(span, keep_result=False) for span in spans_of(request, attribute_value_limit=17).spans]
    rejected: list[str] = []
    parts = list(span_parts(request, None, rejected, mapped_attributes_of))
    assert rejected == [] and len(parts) == len(full)
    records = []
    for mapped, (_name, attributes, resource, error, start, trace_id, span_id, end) in zip(
        full, parts, strict=True
    ):
        assert all(key in MAPPED_KEYS or key.startswith(MAPPED_PREFIXES) for key in (*attributes, *resource))
        filtered = map_attributes(attributes, resource, error, start, trace_id, span_id, 17, False, end)
        if mapped is None:
            assert filtered is None
            records.append(None)
            continue
        assert filtered is not None
        record, problems = filtered
        # the same fields in the same order (the stored JSON text), the same problems reported
        assert list(record.items()) == list(mapped.record.items())
        assert problems == mapped.problems
        records.append(record)
    return records


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None)
@given(st.lists(_ATTRIBUTES, min_size=1, max_size=3), _ATTRIBUTES, st.booleans())
def test_the_receivers_decoder_maps_every_span_as_the_full_decode_does(
    spans: list[list[tuple[str, Any]]], resource: list[tuple[str, Any]], error: bool
) -> None:
    assert_mapped_alike(_request(spans, resource, error))


_NOISE = [("http.method", "POST"), ("service.name", "agent"), ("custom.count", 3)]


@pytest.mark.parametrize(
    ("attributes", "resource", "expected"),
    [
        (
            [("session.id", "s"), ("agent.action.id", "a"), ("agent.action.kind", "llm_call"),
             ("agent.action.result", "not json"), ("agent.action.colour", "blue")],
            [],
            {"session_id": "s", "colour": "blue", "result_digest": ...},
        ),
        (
            [("gen_ai.operation.name", "execute_tool"), ("gen_ai.tool.call.id", "call-1"),
             ("gen_ai.tool.call.result", "42"), ("gen_ai.tool.name", "search"), ("gen_ai.conversation.id", "c")],
            [],
            {"kind": "tool_call", "action_id": "call-1", "name": "search", "session_id": "c", "result_digest": ...},
        ),
        (
            [("gen_ai.operation.name", "chat"), ("gen_ai.output.messages", "[]"),
             ("gen_ai.output.messages_ref", "s3://out"), ("gen_ai.request.model", "m")],
            [],
            {"kind": "llm_call", "result_ref": "s3://out", "name": "m", "result_digest": ...},
        ),
        (
            [("gen_ai.system", "openai"), ("gen_ai.request.model", "m"), ("gen_ai.completion.0.content", "hi")],
            [],
            {"kind": "llm_call", "result_length": 2, "result_digest": ...},
        ),
        (
            [("gen_ai.provider.name", "openai"), ("gen_ai.request.model", "m"), ("langfuse.session.id", "l")],
            [],
            {"kind": "llm_call", "session_id": "l"},
        ),
        (
            [("openinference.span.kind", "LLM"), ("llm.output_messages.0.message.content", "hi")],
            [("session.id", "from-resource"), ("service.instance.id", "i-1")],
            {"kind": "llm_call", "session_id": "from-resource", "incarnation": "i-1", "result_digest": ...},
        ),
        (
            [("openinference.span.kind", "TOOL"), ("tool_call.id", "t1"), ("output.value", "ok"), ("tool.name", "x")],
            [],
            {"kind": "tool_call", "action_id": "t1", "name": "x", "result_digest": ...},
        ),
        (
            [("openinference.span.kind", "TOOL"), ("tool.id", "t2")],
            [],
            {"kind": "tool_call", "action_id": "t2"},
        ),
        (
            [("openinference.span.kind", "RETRIEVER"), ("output.value", "docs")],
            [],
            {"kind": "external_read", "result_digest": ...},
        ),
        (
            [("traceloop.span.kind", "tool"), ("traceloop.entity.output", "{}"),
             ("traceloop.association.properties.session_id", "t")],
            [],
            {"kind": "tool_call", "session_id": "t", "result_digest": ...},
        ),
    ],
)  # fmt: skip
def test_every_attribute_the_mapping_reads_reaches_it(
    attributes: list[tuple[str, Any]], resource: list[tuple[str, Any]], expected: dict[str, Any]
) -> None:
    [record] = assert_mapped_alike(_request([_NOISE + attributes + _NOISE], _NOISE + resource, False))
    assert record is not None
    assert all(field in record for field in expected)
    exact = {field: value for field, value in expected.items() if value is not ...}  # ...: any value
    assert {field: record[field] for field in exact} == exact


def test_the_receivers_decoder_skips_only_what_the_mapping_never_reads() -> None:
    attributes = _key_values(
        [
            ("http.method", "POST"),
            ("agent.action.colour", "blue"),  # unknown to us, still a record field
            ("gen_ai.operation.name", "execute_tool"),
            ("gen_ai.tool.call.id", "call-1"),
            ("gen_ai.tool.name", "search"),
            ("gen_ai.conversation.id", "conv-1"),
            ("gen_ai.completion.0.content", "hi"),
            ("llm.output_messages.0.message.content", "hi"),
            ("http.url", "https://example.com"),
            ("agent.action.max_attempts", "3"),  # ill-typed: kept as it is, for the rules to report
        ]
    )
    assert mapped_attributes_of(attributes) == {
        "agent.action.colour": "blue",
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.call.id": "call-1",
        "gen_ai.tool.name": "search",
        "gen_ai.conversation.id": "conv-1",
        "gen_ai.completion.0.content": "hi",
        "llm.output_messages.0.message.content": "hi",
        "agent.action.max_attempts": "3",
    }
    resource = _key_values([("service.name", "agent"), ("service.instance.id", "i-1"), ("session.id", "s")])
    assert mapped_attributes_of(resource) == {"service.instance.id": "i-1", "session.id": "s"}


JSON_ATTRIBUTE_VALUES = st.sampled_from(
    [
        {"stringValue": "x" * 300},
        {"intValue": "7"},
        {"boolValue": True},
        {"arrayValue": {"values": [{"stringValue": "a"}]}},
        {"kvlistValue": {"values": [{"key": "k", "value": {"intValue": 1}}]}},
    ]
)
JSON_ATTRIBUTE_KEYS = st.sampled_from(
    ["session.id", "agent.action.id", "agent.action.kind", "agent.action.result", "agent.action.notes",
     "gen_ai.operation.name", "gen_ai.prompt", "http.url", "service.instance.id", "user.email"]
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    span_attributes=st.lists(st.tuples(JSON_ATTRIBUTE_KEYS, JSON_ATTRIBUTE_VALUES), max_size=8),
    resource_attributes=st.lists(st.tuples(JSON_ATTRIBUTE_KEYS, JSON_ATTRIBUTE_VALUES), max_size=4),
    events=st.integers(min_value=0, max_value=3),
)
def test_the_receivers_json_decoding_leaves_out_only_what_the_mapping_never_reads(
    span_attributes: list[tuple[str, dict[str, Any]]],
    resource_attributes: list[tuple[str, dict[str, Any]]],
    events: int,
) -> None:
    """json_span_parts drops events and unmapped attributes before json_format builds
    messages of them (0.5 s of CPU per MiB of an SDK request): the parts are the ones the
    whole request gives."""
    document = otlp_json_document("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174")
    resource = document["resourceSpans"][0]
    resource["resource"]["attributes"] = [{"key": k, "value": v} for k, v in resource_attributes]
    span = resource["scopeSpans"][0]["spans"][0]
    span["attributes"] = [{"key": k, "value": v} for k, v in span_attributes]
    span["events"] = [
        {
            "name": "gen_ai.content.prompt",
            "attributes": [{"key": "gen_ai.prompt", "value": {"stringValue": "p"}}],
        }
    ] * events
    body = json.dumps(document).encode()
    whole, problems = parse_json(body)
    expected = list(span_parts(whole, problems, [], mapped_attributes_of))
    assert json_span_parts(body, []) == expected
    pruned, _ = parse_json(body, mapped_only=True)
    assert not any(s.events for r in pruned.resource_spans for sc_ in r.scope_spans for s in sc_.spans)


def _one_span_document(attribute: tuple[str, Any] | None = None, **span_fields: Any) -> dict[str, Any]:
    document = otlp_json_document("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174")
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    if attribute is not None:
        span["attributes"] = [{"key": attribute[0], "value": attribute[1]}]
    span.update(span_fields)
    return document


@pytest.mark.parametrize(
    ("attribute", "span_fields", "reason"),
    [
        (("agent.action.max_attempts", {"intValue": 3.5}), {}, "intValue 3.5 is not an integer"),
        (("agent.action.max_attempts", {"intValue": True}), {}, "intValue true is not an integer"),
        (("agent.action.attempts", {"intValue": "3.0"}), {}, "intValue '3.0' is not an integer"),
        (("agent.action.attempts", {"stringValue": 3}), {}, "stringValue 3 is not a string"),
        (None, {"status": {"code": True}}, "status.code true is not a status code"),
        (None, {"startTimeUnixNano": "-5"}, "startTimeUnixNano '-5' is not an unsigned 64-bit integer"),
    ],
)
def test_a_json_value_the_encoding_does_not_allow_rejects_its_span_as_check_words_it(
    attribute: tuple[str, Any] | None, span_fields: dict[str, Any], reason: str
) -> None:
    """json_format turned "3.0" into 3 and refused 3.5 and true with a 400 for the whole
    request, where `durable-sessions check` read 3 and 1: both now read with the reader's
    functions, and reject the one span in the same words."""
    import io

    from durable_sessions import readers

    body = json.dumps(_one_span_document(attribute, **span_fields)).encode()
    rejected: list[str] = []
    assert json_span_parts(body, rejected) == []
    (item,) = readers.read_otlp_json(io.BytesIO(body + b"\n"), "f")
    assert type(item) is readers.Unreadable
    named = f"attribute {attribute[0]!r}: {reason}" if attribute else reason
    assert rejected == [f"resource_spans[0].scope_spans[0].spans[0] 'step': {named}"]
    assert item.reason == f"resourceSpans[0].scopeSpans[0].spans[0] {named}"


def test_a_status_code_as_a_decimal_string_is_an_error_on_both_readers() -> None:
    body = json.dumps(
        _one_span_document(("agent.action.kind", {"stringValue": "clock"}), status={"code": "2"})
    )
    [parts] = json_span_parts(body.encode(), [])
    assert parts[3] is True


def test_legacy_instrumentation_library_spans_are_refused_not_dropped() -> None:
    document = _one_span_document()
    group = document["resourceSpans"][0]
    group["instrumentationLibrarySpans"] = group.pop("scopeSpans")
    with pytest.raises(
        BadData, match=r"resourceSpans\[0\] holds instrumentationLibrarySpans, which OTLP renamed"
    ):
        json_span_parts(json.dumps(document).encode(), [])
