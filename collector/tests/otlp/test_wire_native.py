"""The native OTLP decoder (``otlp/_wire.c``) against its reference, ``parse_protobuf`` and
``span_parts`` with ``mapped_attributes_of``: for every request it reads, the same span
parts with the same types; for every request it declines (None), the reference decides;
it never accepts a request the reference rejects."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest
from durable_sessions_collector.otlp import decode
from durable_sessions_collector.otlp.decode import (
    MAPPED_KEYS,
    MAPPED_PREFIXES,
    BadData,
    mapped_attributes_of,
    parse_protobuf,
    protobuf_span_parts,
    span_parts,
)
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import (
    AnyValue,
    ArrayValue,
    EntityRef,
    InstrumentationScope,
    KeyValue,
    KeyValueList,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from tests.support.senders import require_native
from tests.support.typed import typed


@pytest.fixture(autouse=True)
def _native_decoder() -> None:
    require_native("_wire", package="durable_sessions_collector.otlp")
    assert decode._WIRE is not None, "built, but DURABLE_SESSIONS_NATIVE turned it off"


def native(body: bytes) -> list[Any] | None:
    assert decode._WIRE is not None
    return decode._WIRE.span_parts(body)  # type: ignore[no-any-return]


def reference(body: bytes) -> tuple[list[Any], list[str]]:
    rejected: list[str] = []
    return list(span_parts(parse_protobuf(body), None, rejected, mapped_attributes_of)), rejected


# --- generated requests ------------------------------------------------------------------

mapped_names = st.sampled_from(sorted(MAPPED_KEYS))
prefixed_names = st.builds(
    lambda prefix, rest: prefix + rest, st.sampled_from(MAPPED_PREFIXES), st.text(max_size=8)
)
other_names = st.one_of(
    st.sampled_from(["service.name", "http.method", "", "agent.actio"]), st.text(max_size=12)
)
names = st.one_of(mapped_names, prefixed_names, other_names)
int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)

scalars = st.one_of(
    st.just(AnyValue()),
    st.text().map(lambda v: AnyValue(string_value=v)),
    st.booleans().map(lambda v: AnyValue(bool_value=v)),
    int64s.map(lambda v: AnyValue(int_value=v)),
    st.floats().map(lambda v: AnyValue(double_value=v)),
    st.binary(max_size=12).map(lambda v: AnyValue(bytes_value=v)),
)
any_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda vs: AnyValue(array_value=ArrayValue(values=vs))),
        st.lists(st.tuples(names, inner), max_size=3).map(
            lambda kvs: AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key=k, value=v) for k, v in kvs]))
        ),
    ),
    max_leaves=6,
)
key_values = st.lists(
    st.one_of(
        st.builds(lambda k, v: KeyValue(key=k, value=v), names, any_values),
        st.builds(lambda k: KeyValue(key=k), names),  # no value: None
    ),
    max_size=6,
)
ids16 = st.binary(min_size=16, max_size=16).filter(any)
ids8 = st.binary(min_size=8, max_size=8).filter(any)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
u64 = st.integers(min_value=0, max_value=2**64 - 1)

events = st.builds(
    Span.Event,
    time_unix_nano=u64,
    name=st.text(max_size=6),
    attributes=key_values,
    dropped_attributes_count=u32,
)
links = st.builds(
    Span.Link,
    trace_id=st.binary(max_size=16),
    span_id=st.binary(max_size=8),
    trace_state=st.text(max_size=6),
    attributes=key_values,
    dropped_attributes_count=u32,
    flags=u32,
)
statuses = st.builds(Status, message=st.text(max_size=6), code=st.integers(min_value=0, max_value=2))
spans = st.builds(
    Span,
    trace_id=ids16,
    span_id=ids8,
    trace_state=st.text(max_size=6),
    parent_span_id=st.binary(max_size=8),
    flags=u32,
    name=st.text(max_size=10),
    kind=st.integers(min_value=0, max_value=5),
    start_time_unix_nano=u64,
    end_time_unix_nano=u64,
    attributes=key_values,
    dropped_attributes_count=u32,
    events=st.lists(events, max_size=2),
    dropped_events_count=u32,
    links=st.lists(links, max_size=2),
    dropped_links_count=u32,
    status=statuses,
)
scopes = st.builds(
    InstrumentationScope, name=st.text(max_size=6), version=st.text(max_size=4), attributes=key_values
)
entity_refs = st.builds(
    EntityRef,
    schema_url=st.text(max_size=4),
    type=st.text(max_size=4),
    id_keys=st.lists(st.text(max_size=4), max_size=2),
    description_keys=st.lists(st.text(max_size=4), max_size=2),
)
resources = st.builds(
    Resource,
    attributes=key_values,
    dropped_attributes_count=u32,
    entity_refs=st.lists(entity_refs, max_size=1),
)
scope_spans = st.builds(
    ScopeSpans, scope=scopes, spans=st.lists(spans, max_size=3), schema_url=st.text(max_size=4)
)
resource_spans = st.builds(
    ResourceSpans,
    resource=resources,
    scope_spans=st.lists(scope_spans, max_size=2),
    schema_url=st.text(max_size=4),
)
requests = st.builds(ExportTraceServiceRequest, resource_spans=st.lists(resource_spans, max_size=3))


def fields_shuffled(message: Any, draw: Any) -> bytes:
    """``message`` serialized one field at a time in a drawn order (protobuf's wire format
    lets fields come in any order; a repeated field's items keep theirs)."""
    chunks = []
    for descriptor, value in message.ListFields():
        single = type(message)()
        if descriptor.is_repeated:
            getattr(single, descriptor.name).extend(value)
        elif descriptor.message_type is not None:
            getattr(single, descriptor.name).CopyFrom(value)
        else:
            setattr(single, descriptor.name, value)
        chunks.append(single.SerializeToString())
    return b"".join(draw(st.permutations(chunks)))


def assert_same(body: bytes) -> list[Any] | None:
    """The native parts equal the reference's, or it declined; return the native parts."""
    try:
        expected, rejected = reference(body)
    except BadData:
        assert native(body) is None, "the native decoder accepted a request the reference rejects"
        return None
    found = native(body)
    if found is not None:
        assert rejected == []
        assert typed(found) == typed(expected)
    return found


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests)
def test_generated_requests_decode_as_the_reference_does(request: ExportTraceServiceRequest) -> None:
    found = assert_same(request.SerializeToString())
    assert found is not None, "a plain request was declined"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests, data=st.data())
def test_fields_in_any_order_decode_as_the_reference_does(
    request: ExportTraceServiceRequest, data: Any
) -> None:
    # A resource after its spans, a span's ids after its attributes: still one resource
    # dict per ResourceSpans, shared by its spans.
    body = b"".join(
        b"\x0a" + _length(fields_shuffled(item, data.draw))  # resource_spans, field 1
        for item in request.resource_spans
    )
    assert assert_same(body) is not None


def _length(payload: bytes) -> bytes:
    return _varint(len(payload)) + payload


def _varint(value: int, width: int = 1) -> bytes:
    """``value`` as a varint of at least ``width`` bytes: its shortest form, padded with
    continuation bytes of zero bits (an overlong form, which upb takes up to a limit)."""
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value and len(out) + 1 >= width:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


_WIRE_TYPES = {
    FieldDescriptor.TYPE_MESSAGE: 2,
    FieldDescriptor.TYPE_STRING: 2,
    FieldDescriptor.TYPE_BYTES: 2,
    FieldDescriptor.TYPE_FIXED64: 1,
    FieldDescriptor.TYPE_DOUBLE: 1,
    FieldDescriptor.TYPE_FIXED32: 5,
}


def padded_wire(message: Any, width: Callable[[str], int]) -> bytes:
    """``message`` written field by field as protobuf writes it, but each tag, length and
    varint value in ``width("tag")``, ``width("length")`` or ``width("value")`` bytes, or
    its shortest form if longer."""
    out = bytearray()
    for descriptor, value in message.ListFields():
        wire = _WIRE_TYPES.get(descriptor.type, 0)
        for item in value if descriptor.is_repeated else [value]:
            out += _varint(descriptor.number << 3 | wire, width("tag"))
            if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
                payload = padded_wire(item, width)
            elif wire == 2:
                payload = item.encode() if isinstance(item, str) else item
            elif wire == 0:
                out += _varint(int(item) & (2**64 - 1), width("value"))
                continue
            else:
                out += struct.pack({1: "<d" if isinstance(item, float) else "<Q", 5: "<I"}[wire], item)
                continue
            out += _varint(len(payload), width("length")) + payload
    return bytes(out)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests, data=st.data())
def test_overlong_tags_lengths_and_varints_are_read_as_the_reference_reads_them_or_declined(
    request: ExportTraceServiceRequest, data: Any
) -> None:
    # Generated messages are written in shortest forms; upb takes a varint value padded
    # to 10 bytes but refuses a tag or a length in more than 5.
    widths = st.sampled_from([1, 1, 1, 2, 5, 6, 10])
    assert_same(padded_wire(request, lambda _: data.draw(widths)))


@pytest.mark.parametrize("width", [5, 6, 10])
@pytest.mark.parametrize("padded", ["tag", "length"])
def test_a_tag_or_length_of_more_than_five_bytes_is_declined_as_upb_refuses_it(
    padded: str, width: int
) -> None:
    attribute = KeyValue(key="agent.action.kind", value=AnyValue(string_value="x"))
    body = padded_wire(
        ExportTraceServiceRequest.FromString(body_of(one_span(attributes=[attribute]))),
        lambda kind: width if kind == padded else 1,
    )
    found = assert_same(body)
    assert (found is not None) == (width <= 5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests, data=st.data())
def test_mutated_bytes_are_read_as_the_reference_reads_them_or_declined(
    request: ExportTraceServiceRequest, data: Any
) -> None:
    body = bytearray(request.SerializeToString())
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        where = data.draw(st.integers(min_value=0, max_value=len(body)))
        match data.draw(st.sampled_from(["truncate", "set", "insert", "delete"])):
            case "truncate":
                del body[where:]
            case "set" if where < len(body):
                body[where] = data.draw(st.integers(min_value=0, max_value=255))
            case "insert":
                body[where:where] = data.draw(st.binary(min_size=1, max_size=4))
            case _:
                del body[where : where + data.draw(st.integers(min_value=1, max_value=4))]
    assert_same(bytes(body))


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=64))
def test_garbage_is_declined_or_read_as_the_reference_reads_it(body: bytes) -> None:
    assert_same(body)


# --- what it declines, and what the receivers then answer --------------------------------


def one_span(**fields: Any) -> Span:
    return Span(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="tool", **fields)


def body_of(*spans_: Span, resource: Resource | None = None) -> bytes:
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(resource=resource, scope_spans=[ScopeSpans(spans=list(spans_))])]
    ).SerializeToString()


def test_text_that_is_not_utf8_anywhere_is_declined_and_its_span_rejected_by_the_reference() -> None:
    # In an attribute the mapping never reads, inside an event: upb still refuses the
    # request for it. The reference then rejects that span alone (it was the request).
    event = Span.Event(name="e", attributes=[KeyValue(key="note", value=AnyValue(string_value="ZZ"))])
    second = Span(trace_id=b"\x01" * 16, span_id=b"\x03" * 8, name="kept")
    body = body_of(one_span(events=[event]), second).replace(b"ZZ", b"\xc3\x28")
    assert native(body) is None
    with pytest.raises(BadData, match="not a valid protobuf"):
        parse_protobuf(body)
    rejected: list[str] = []
    assert [p[0] for p in protobuf_span_parts(body, rejected)] == ["kept"]
    assert rejected == [
        "resource_spans[0].scope_spans[0].spans[0] 'tool': span 0202020202020202 (trace "
        "01010101010101010101010101010101): events[0].attributes[0].value.string_value is not valid UTF-8"
    ]


MARKER = "\u2603\u2604"  # six bytes of UTF-8, made six that are not
NOT_UTF8 = b"\xc3\x28" * 3


def string_fields(message: Any) -> list[tuple[Any, Any, int | None]]:
    """Each ``string`` field set in ``message`` and below: (message, field, index)."""
    found: list[tuple[Any, Any, int | None]] = []
    for descriptor, value in message.ListFields():
        if descriptor.message_type is not None:
            for item in value if descriptor.is_repeated else [value]:
                found.extend(string_fields(item))
        elif descriptor.type == descriptor.TYPE_STRING:
            found.extend((message, descriptor, i) for i in range(len(value)) if descriptor.is_repeated)
            if not descriptor.is_repeated:
                found.append((message, descriptor, None))
    return found


def parts_of(request: ExportTraceServiceRequest) -> list[tuple[str, Any]]:
    """Each span, resource and scope of ``request``, as ("span"/"resource"/"scope", message)."""
    found: list[tuple[str, Any]] = []
    for group in request.resource_spans:
        found.append(("resource", group.resource))
        for scope in group.scope_spans:
            found.append(("scope", scope.scope))
            found.extend(("span", span_) for span_ in scope.spans)
    return found


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=requests, data=st.data())
def test_text_that_is_not_utf8_rejects_the_spans_it_is_in_and_keeps_the_others(
    request: ExportTraceServiceRequest, data: Any
) -> None:
    """Any ``string`` field of a span, resource or scope made bytes that are not UTF-8:
    the request is decoded as if the span (or the spans of the resource or scope) had no
    ids, and those spans are rejected naming the field; a resource or scope without spans
    leaves the request refused."""
    candidates = [(kind, part) for kind, part in parts_of(request) if string_fields(part)]
    if not candidates:
        return
    kind, part = data.draw(st.sampled_from(candidates))
    message, descriptor, index = data.draw(st.sampled_from(string_fields(part)))
    if index is None:
        setattr(message, descriptor.name, MARKER)
    else:
        getattr(message, descriptor.name)[index] = MARKER
    body = request.SerializeToString()
    if body.count(MARKER.encode()) != 1:
        return
    body = body.replace(MARKER.encode(), NOT_UTF8)
    hit = [
        (i, j, k)
        for i, group in enumerate(request.resource_spans)
        for j, scope in enumerate(group.scope_spans)
        for k, span_ in enumerate(scope.spans)
        if part in (span_, scope.scope, group.resource)
    ]
    rejected: list[str] = []
    if not hit:
        with pytest.raises(BadData, match="not a valid protobuf"):
            protobuf_span_parts(body, rejected)
        return
    parts = protobuf_span_parts(body, rejected)
    for i, j, k in hit:  # the expected: those spans without ids, so rejected
        request.resource_spans[i].scope_spans[j].spans[k].Clear()
    if kind != "span":
        part.Clear()
    expected, expected_rejected = reference(request.SerializeToString())
    assert typed(parts) == typed(expected)
    where = {f"resource_spans[{i}].scope_spans[{j}].spans[{k}]" for i, j, k in hit}
    assert [r for r in rejected if r.split(" ", 1)[0] not in where] == [
        r for r in expected_rejected if r.split(" ", 1)[0] not in where
    ]
    named = [r for r in rejected if r.split(" ", 1)[0] in where]
    assert len(named) == len(hit)
    assert all(r.endswith(" is not valid UTF-8") for r in named), named


def test_spans_with_unusable_ids_are_declined_and_named_by_the_reference() -> None:
    body = body_of(one_span(), Span(trace_id=bytes(16), span_id=b"\x03" * 8, name="zeros"))
    assert native(body) is None
    rejected: list[str] = []
    parts = protobuf_span_parts(body, rejected)
    assert [p[0] for p in parts] == ["tool"]
    assert rejected == [
        "resource_spans[0].scope_spans[0].spans[1] 'zeros': trace_id is all zeros, which OTLP defines as invalid"
    ]


def test_a_singular_field_given_twice_is_declined_and_merged_by_the_reference() -> None:
    # Protobuf merges a message field given twice: the reference keeps the last code.
    ok = one_span(status=Status(code=Status.STATUS_CODE_OK)).SerializeToString()
    error = Span(status=Status(code=Status.STATUS_CODE_ERROR)).SerializeToString()
    assert native(body_of_raw(ok)) is not None
    twice = body_of_raw(ok + error)
    assert native(twice) is None
    assert protobuf_span_parts(twice, [])[0][3] is True  # status_error


def body_of_raw(span_bytes: bytes) -> bytes:
    scope = b"\x12" + _length(span_bytes)
    resource_spans = b"\x12" + _length(scope)
    return b"\x0a" + _length(resource_spans)


def test_unknown_fields_and_deep_nesting_are_declined_and_read_by_the_reference() -> None:
    unknown = body_of_raw(one_span().SerializeToString() + b"\xf8\x01\x07")  # field 31, varint
    assert native(unknown) is None
    assert [p[0] for p in protobuf_span_parts(unknown, [])] == ["tool"]
    value, expected = AnyValue(string_value="deep"), "deep"
    for _ in range(40):
        value, expected = AnyValue(array_value=ArrayValue(values=[value])), (expected,)
    deep = body_of(one_span(attributes=[KeyValue(key="agent.action.deep", value=value)]))
    assert native(deep) is None
    (parts,) = protobuf_span_parts(deep, [])
    assert parts[1]["agent.action.deep"] == expected


def test_only_mapped_attributes_are_kept_and_the_resource_is_shared() -> None:
    resource = Resource(
        attributes=[
            KeyValue(key="service.name", value=AnyValue(string_value="svc")),
            KeyValue(key="service.instance.id", value=AnyValue(string_value="i-1")),
        ]
    )
    spans_ = [
        one_span(attributes=[KeyValue(key="agent.action.kind", value=AnyValue(string_value="tool_call"))]),
        Span(trace_id=b"\x01" * 16, span_id=b"\x04" * 8, name="second"),
    ]
    first, second = native(body_of(*spans_, resource=resource)) or []
    assert first[1] == {"agent.action.kind": "tool_call"}
    assert first[2] == {"service.instance.id": "i-1"} and first[2] is second[2]
    assert first[5:] == ("01" * 16, "02" * 8, 0)  # no end time: 0, as protobuf reads it


def with_attribute(value_bytes: bytes) -> bytes:
    """A request of one span whose ``agent.action.x`` attribute's AnyValue is ``value_bytes``."""
    key_value = b"\x0a" + _length(b"agent.action.x") + b"\x12" + _length(value_bytes)
    return body_of_raw(one_span().SerializeToString() + b"\x4a" + _length(key_value))


@pytest.mark.parametrize(
    ("value_bytes", "expected"),
    [
        (b"\x10\x02", True),  # a bool sent as 2 is true
        (b"\x18" + b"\xff" * 9 + b"\x01", -1),  # a negative int64: ten bytes
        (b"\x21" + b"\x00" * 7 + b"\x80", -0.0),  # a double, little-endian
    ],
)
def test_scalar_encodings_are_read_as_the_reference_reads_them(value_bytes: bytes, expected: Any) -> None:
    body = with_attribute(value_bytes)
    found = assert_same(body)
    assert found is not None
    assert typed(found[0][1]["agent.action.x"]) == typed(expected)


def test_an_any_value_with_two_fields_is_declined_and_the_last_kept_by_the_reference() -> None:
    body = with_attribute(b"\x0a\x01a" + b"\x18\x05")  # string_value "a", then int_value 5
    assert native(body) is None
    assert protobuf_span_parts(body, [])[0][1] == {"agent.action.x": 5}


def test_a_status_code_outside_int32_is_declined() -> None:
    status = b"\x18\x82\x80\x80\x80\x10"  # code 2 + 2**32: protobuf keeps the low 32 bits
    body = body_of_raw(one_span().SerializeToString() + b"\x7a" + _length(status))
    assert native(body) is None
    assert protobuf_span_parts(body, [])[0][3] is True


def test_a_decoder_made_without_init_raises_instead_of_crashing() -> None:
    # Found under AddressSanitizer: Decoder.__new__ alone left NULL name tuples that
    # span_parts read.
    assert decode._WIRE is not None
    decoder_type = type(decode._WIRE)
    decoder = decoder_type.__new__(decoder_type)
    with pytest.raises(RuntimeError, match="not initialised"):
        decoder.span_parts(with_attribute(b"\x0a\x01v"))
