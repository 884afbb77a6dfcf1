"""A binary ``ExportTraceServiceRequest`` read part by part, for the refusals of
protobuf's parser that belong to a span, or to a resource or scope and so to its spans,
rather than to the request: nesting too deep, and text that is not UTF-8.

upb (and the pure-Python parser) refuse a whole message for either: one nested deeper
than they read (101 messages, the request included: see :mod:`.depth`), or one whose ``string`` field holds
bytes that are not UTF-8, anywhere in it. So one such span made the whole request a 400,
its valid spans with it, where OTLP/JSON rejects that span alone.
:func:`without_refused_parts` reads the request's envelope (its ResourceSpans and
ScopeSpans, with each span, resource and scope left as bytes) and parses each span,
resource and scope in a request of its own (as deep as it is in the whole). Each one
refused is read again with a copy of the OTLP schema whose ``string`` fields are
``bytes``, to name the field that is not UTF-8. A refused span is replaced by its ids
and name (it is rejected with the reason); a refused resource or scope is left out and
each of its spans rejected. Any other refusal (bytes that are not protobuf) is the
request's, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from durable_sessions.bad_text import not_utf8

_PACKAGE = "durable_sessions_collector.envelope"

_TOO_DEEP = ("MaxDepth", "too many levels of nesting")
"""How protobuf's parsers word a message nested deeper than they read: upb's
``Exceeded upb_DecodeOptions_MaxDepth``, the pure-Python parser's ``too many levels of
nesting``."""

_REFUSED = (DecodeError, ValueError)
"""What protobuf's parsers raise for a message they refuse (the pure-Python parser raises
``UnicodeDecodeError`` for text that is not UTF-8)."""

_FIELDS = {
    "Request": [(1, "resource_spans", "ResourceSpans")],
    "ResourceSpans": [(1, "resource", None), (2, "scope_spans", "ScopeSpans"), (3, "schema_url", None)],
    "ScopeSpans": [(1, "scope", None), (2, "spans", None), (3, "schema_url", None)],
    "SpanHead": [(1, "trace_id", None), (2, "span_id", None), (5, "name", None)],
}
"""The envelope's messages and their fields, numbered as in OTLP: a message of the
envelope, or bytes (None). ``SpanHead`` is a span's ids and name, whatever the rest of
it holds (the parser skips the other fields without reading into them)."""

Position = tuple[int, int, int]


@cache
def _envelope() -> tuple[Any, Any, Any, Any]:
    """The classes of the envelope's Request, ResourceSpans, ScopeSpans and SpanHead. Each
    field is repeated: a message field given twice stays two, merged when the whole is
    parsed (and a scalar given twice keeps its last value, as protobuf does)."""
    file = descriptor_pb2.FileDescriptorProto(
        name="durable_sessions_collector/envelope.proto", package=_PACKAGE
    )
    kind = descriptor_pb2.FieldDescriptorProto
    for name, fields in _FIELDS.items():
        message = file.message_type.add(name=name)
        for number, field_name, type_name in fields:
            field = message.field.add(
                name=field_name, number=number, label=kind.LABEL_REPEATED, type=kind.TYPE_BYTES
            )
            if type_name is not None:
                field.type, field.type_name = kind.TYPE_MESSAGE, f".{_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    request, resource_spans, scope_spans, head = (
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}")) for name in _FIELDS
    )
    return request, resource_spans, scope_spans, head


@cache
def _lenient_request() -> Any:
    """``ExportTraceServiceRequest`` with every ``string`` field read as ``bytes``: a class
    of its own (in a pool of its own) that parses whatever text a request holds."""
    pool = descriptor_pool.DescriptorPool()
    for file in _files_in_dependency_order(ExportTraceServiceRequest.DESCRIPTOR.file):
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        proto.ClearField("service")  # its methods' types are not needed to parse
        for message in proto.message_type:
            _strings_as_bytes(message)
        pool.Add(proto)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName(ExportTraceServiceRequest.DESCRIPTOR.full_name)
    )


def _files_in_dependency_order(file: Any) -> Iterator[Any]:
    seen: set[str] = set()

    def visit(current: Any) -> Iterator[Any]:
        if current.name in seen:
            return
        seen.add(current.name)
        for dependency in current.dependencies:
            yield from visit(dependency)
        yield current

    return visit(file)


def _strings_as_bytes(message: descriptor_pb2.DescriptorProto) -> None:
    for field in message.field:
        if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
            field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    for nested in message.nested_type:
        _strings_as_bytes(nested)


def without_refused_parts(body: bytes) -> tuple[bytes, dict[Position, str]] | None:
    """``body`` with each span that protobuf's parser refuses for its depth or its text
    replaced by its ids and name alone, and each resource or scope it refuses so left out;
    and why, by span position ``(resource, scope, span)``, for each such span and each
    span of such a resource or scope. None when no part is refused for that alone (the
    request's envelope cannot be read, a part is refused for another reason, a refused
    resource or scope has no span to reject, or none is refused)."""
    envelope = _envelope()[0]()
    try:
        envelope.ParseFromString(body)
        return _without_refused_parts(envelope)
    except (DecodeError, _RequestRefused):
        return None


def _without_refused_parts(envelope: Any) -> tuple[bytes, dict[Position, str]] | None:
    problems: dict[Position, str] = {}
    for i, resource_spans in enumerate(envelope.resource_spans):
        resource_problem = _group_problem(resource_spans, "resource", "ResourceSpans")
        if resource_problem and not any(scope_spans.spans for scope_spans in resource_spans.scope_spans):
            raise _RequestRefused  # no span to reject for it: the bad data is the request's
        for j, scope_spans in enumerate(resource_spans.scope_spans):
            scope_problem = _group_problem(scope_spans, "scope", "ScopeSpans")
            if scope_problem and not scope_spans.spans:
                raise _RequestRefused
            for k, span in enumerate(scope_spans.spans):
                span_problem = _part_problem("span", span)
                reasons = [reason for reason in (resource_problem, scope_problem, span_problem) if reason]
                if reasons:
                    problems[(i, j, k)] = _named(span, "; ".join(reasons))
                if span_problem:
                    scope_spans.spans[k] = _head_only(span)
    return (envelope.SerializeToString(), problems) if problems else None


class _RequestRefused(Exception):
    """The parser refuses the request for more than a part's depth or text (or its
    envelope): the request is refused, in the parser's words."""


def _group_problem(group: Any, field: str, label: str) -> str | None:
    """Why the parser refuses ``group``'s ``field`` (its resource or scope) or schema URL
    (both are left out then), or None; ``label`` names the group's message type."""
    problem = _first(
        [_part_problem(field, part) for part in getattr(group, field)]
        + [_text_problem(url, f"its {label}' schema_url") for url in group.schema_url]
    )
    if problem:
        del getattr(group, field)[:]
        del group.schema_url[:]
    return problem


def _first(problems: list[str | None]) -> str | None:
    return next((problem for problem in problems if problem), None)


_PARTS: dict[str, tuple[Callable[[Any], Message], Descriptor]] = {
    "resource": (
        lambda request: request.resource_spans[0].resource,
        ResourceSpans.DESCRIPTOR.fields_by_name["resource"].message_type,
    ),
    "scope": (
        lambda request: request.resource_spans[0].scope_spans[0].scope,
        ScopeSpans.DESCRIPTOR.fields_by_name["scope"].message_type,
    ),
    "span": (lambda request: request.resource_spans[0].scope_spans[0].spans[0], Span.DESCRIPTOR),
}
"""Each part of a request read alone: where it is in a request of its own, and its
(strict) schema."""


def _part_problem(kind: str, part: bytes) -> str | None:
    """Why protobuf's parser refuses the ``kind`` of part ``part`` (in a request of its
    own, as deep as in any): its depth, or the field whose text is not UTF-8; None when
    it is read. Raise :class:`_RequestRefused` for any other refusal."""
    alone = _alone(kind, part)
    try:
        ExportTraceServiceRequest.FromString(alone)
        return None
    except _REFUSED as error:
        refusal = str(error)
    try:
        lenient = _lenient_request().FromString(alone)
    except _REFUSED:
        if any(words in refusal for words in _TOO_DEEP):
            subject = "" if kind == "span" else f"{kind} is "
            return f"{subject}nested too deeply for protobuf's parser ({refusal})"
        raise _RequestRefused from None
    where, descriptor = _PARTS[kind]
    field = _not_utf8(where(lenient), descriptor, "" if kind == "span" else f"{kind}.")
    if field is None:
        raise _RequestRefused
    return not_utf8(field)


def _alone(kind: str, part: bytes) -> bytes:
    """A request holding only ``part``, a ``kind`` of part, where any request holds it."""
    request, resource_spans, scope_spans, _ = _envelope()
    if kind == "resource":
        return request(resource_spans=[resource_spans(resource=[part])]).SerializeToString()  # type: ignore[no-any-return]
    inner = scope_spans(scope=[part]) if kind == "scope" else scope_spans(spans=[part])
    return request(resource_spans=[resource_spans(scope_spans=[inner])]).SerializeToString()  # type: ignore[no-any-return]


def _not_utf8(message: Message, descriptor: Descriptor, path: str) -> str | None:
    """The path of the first ``string`` field (by ``descriptor``, the strict schema) of
    the lenient ``message`` whose bytes are not UTF-8, or None. A message below it that
    protobuf's parser reads in the strict schema is not walked (one span may hold
    thousands of attributes, and only one of them is bad)."""
    for lenient_field, value in message.ListFields():
        field = descriptor.fields_by_name[lenient_field.name]
        items = enumerate(value) if field.is_repeated else [(None, value)]
        for index, item in items:
            if field.message_type is not None:
                if _strictly_read(item, field.message_type):
                    continue
                found = _not_utf8(item, field.message_type, f"{_where(path, field, index)}.")
                if found is not None:
                    return found
            elif field.type == FieldDescriptor.TYPE_STRING and not _is_utf8(item):
                return _where(path, field, index)
    return None


def _where(path: str, field: FieldDescriptor, index: int | None) -> str:
    return f"{path}{field.name}" if index is None else f"{path}{field.name}[{index}]"


def _strictly_read(lenient: Message, descriptor: Descriptor) -> bool:
    """Whether protobuf's parser reads the lenient message ``lenient`` in its strict schema."""
    try:
        _strict_class(descriptor).FromString(lenient.SerializeToString())
    except _REFUSED:
        return False
    return True


@cache
def _strict_class(descriptor: Descriptor) -> Any:
    return message_factory.GetMessageClass(descriptor)


def _text_problem(text: bytes, name: str) -> str | None:
    return None if _is_utf8(text) else not_utf8(name)


def _is_utf8(text: bytes) -> bool:
    """Whether ``text`` is UTF-8 as protobuf's parsers require it (Python's strict decoder
    refuses what upb refuses: overlong forms, surrogates, code points past U+10FFFF)."""
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _head(span: bytes) -> tuple[bytes, bytes, bytes]:
    """The trace id, span id and name of ``span`` (the last of each given, as protobuf
    reads them; empty when not given)."""
    head = _envelope()[3].FromString(span)
    return tuple(values[-1] if values else b"" for values in (head.trace_id, head.span_id, head.name))  # type: ignore[return-value]


def _named(span: bytes, problem: str) -> str:
    """``problem`` naming ``span`` by its ids, which its rejection does not show otherwise."""
    trace_id, span_id, _ = _head(span)
    return named(trace_id, span_id, problem)


def named(trace_id: bytes, span_id: bytes, problem: str) -> str:
    """``problem`` naming a span by its ids, in either encoding."""
    return f"span {span_id.hex() or '(no id)'} (trace {trace_id.hex() or '(no id)'}): {problem}"


def _head_only(span: bytes) -> bytes:
    """``span`` reduced to its ids and (UTF-8) name: what its rejection shows of it."""
    trace_id, span_id, name = _head(span)
    text = name.decode("utf-8") if _is_utf8(name) else ""
    return Span(trace_id=trace_id, span_id=span_id, name=text).SerializeToString()
