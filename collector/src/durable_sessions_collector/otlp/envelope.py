"""A binary ``ExportTraceServiceRequest`` read span by span, for the one refusal of
protobuf's parser that belongs to a span rather than to the request: nesting too deep.

upb (and the pure-Python parser) refuse a whole message nested deeper than they read
(100 messages), so one span whose link, event or attribute nests too deeply made the
whole request a 400, its valid spans with it, where OTLP/JSON rejects that span alone.
:func:`without_too_deep_spans` reads the request's envelope (its ResourceSpans and
ScopeSpans, with each span, resource and scope left as bytes), parses each span in a
request of its own (as deep as it is in the whole), and empties the spans refused for
their depth. Any other refusal (text that is not UTF-8, bytes that are not protobuf) is
the request's, as before.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_PACKAGE = "durable_sessions_collector.envelope"

_TOO_DEEP = ("MaxDepth", "too many levels of nesting")
"""How protobuf's parsers word a message nested deeper than they read: upb's
``Exceeded upb_DecodeOptions_MaxDepth``, the pure-Python parser's ``too many levels of
nesting``."""


_FIELDS = {
    "Request": [("resource_spans", "ResourceSpans")],
    "ResourceSpans": [("resource", None), ("scope_spans", "ScopeSpans"), ("schema_url", None)],
    "ScopeSpans": [("scope", None), ("spans", None), ("schema_url", None)],
}
"""The envelope's messages and their fields, numbered from 1 as in OTLP: a message of the
envelope, or bytes (None)."""


@cache
def _envelope() -> tuple[Any, Any, Any]:
    """The classes of the envelope's Request, ResourceSpans and ScopeSpans. Each field is
    repeated: a message field given twice stays two, merged when the whole is parsed."""
    file = descriptor_pb2.FileDescriptorProto(
        name="durable_sessions_collector/envelope.proto", package=_PACKAGE
    )
    kind = descriptor_pb2.FieldDescriptorProto
    for name, fields in _FIELDS.items():
        message = file.message_type.add(name=name)
        for number, (field_name, type_name) in enumerate(fields, 1):
            field = message.field.add(
                name=field_name, number=number, label=kind.LABEL_REPEATED, type=kind.TYPE_BYTES
            )
            if type_name is not None:
                field.type, field.type_name = kind.TYPE_MESSAGE, f".{_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    request, resource_spans, scope_spans = (
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}")) for name in _FIELDS
    )
    return request, resource_spans, scope_spans


def without_too_deep_spans(body: bytes) -> tuple[bytes, dict[tuple[int, int, int], str]] | None:
    """``body`` with each span that protobuf's parser refuses for its depth emptied (it has
    no ids left), and why, by position ``(resource, scope, span)``; None when no span is
    refused for that alone (the request's envelope cannot be read, a span is refused for
    another reason, or none is refused)."""
    envelope = _envelope()[0]()
    try:
        envelope.ParseFromString(body)
    except DecodeError:
        return None
    problems: dict[tuple[int, int, int], str] = {}
    for i, resource_spans in enumerate(envelope.resource_spans):
        for j, scope_spans in enumerate(resource_spans.scope_spans):
            for k, span in enumerate(scope_spans.spans):
                refusal = _refusal(span)
                if refusal is None:
                    continue
                if not any(words in refusal for words in _TOO_DEEP):
                    return None  # the request's to refuse, in the parser's words
                problems[(i, j, k)] = f"span is nested too deeply for protobuf's parser ({refusal})"
                scope_spans.spans[k] = b""
    return (envelope.SerializeToString(), problems) if problems else None


def _refusal(span: bytes) -> str | None:
    """Why protobuf's parser refuses ``span`` in a request of its own, or None."""
    request, resource_spans, scope_spans = _envelope()
    alone = request(resource_spans=[resource_spans(scope_spans=[scope_spans(spans=[span])])])
    try:
        ExportTraceServiceRequest.FromString(alone.SerializeToString())
    except DecodeError as error:
        return str(error)
    return None
