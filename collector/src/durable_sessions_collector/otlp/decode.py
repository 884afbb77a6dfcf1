"""Decoding OTLP trace requests into :class:`~durable_sessions.mapping.SpanData`, or, for
the receivers, into the parts ``map_attributes`` takes (:func:`span_parts`), with only the
attributes the mapping reads turned into Python values (:func:`mapped_attributes_of`).

The receivers call :func:`protobuf_span_parts` and :func:`json_span_parts`. Where the
optional extension ``_wire`` is built, a binary request is read into those parts straight
from its bytes; whatever it declines (anything unusual, any error) takes the path here,
which is the reference and words every error.

Both receivers share this module. Request-level problems (a body that is not an
``ExportTraceServiceRequest``, JSON that does not parse) raise :class:`BadData`, which
the receivers answer with ``INVALID_ARGUMENT`` / HTTP 400. Span-level problems (an id of
the wrong length, a JSON id that is not hex) reject that span only: the rest of the
request is kept and the answer is a partial success that names the rejected spans.

OTLP/JSON differs from protobuf's canonical JSON mapping: ``traceId``/``spanId``/
``parentSpanId`` are hex strings, not base64. They are converted here before the
document is handed to ``json_format``, which would otherwise decode them as base64.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from durable_sessions import semconv as sc
from durable_sessions.mapping import SpanData
from durable_sessions.native import native_module
from durable_sessions_collector.quote import quoted

STATUS_CODE_ERROR = Status.STATUS_CODE_ERROR
MAX_NAMED_REJECTIONS = 10
_ID_FIELDS = (("traceId", "trace_id", 16), ("spanId", "span_id", 8), ("parentSpanId", "parent_span_id", 8))


class BadData(ValueError):
    """The request as a whole cannot be decoded (answered 400 / INVALID_ARGUMENT)."""


@dataclass(slots=True)
class Decoded:
    """The spans of one request: those that decoded, and why the others were rejected."""

    spans: list[SpanData] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.spans) + len(self.rejected)


def parse_protobuf(body: bytes) -> ExportTraceServiceRequest:
    """A binary ``ExportTraceServiceRequest``; raise :class:`BadData` with the decoder's reason."""
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as error:
        raise BadData(
            f"request body is not a valid protobuf ExportTraceServiceRequest ({len(body)} bytes): {error}"
        ) from None
    return request


def parse_json(
    body: bytes, *, mapped_only: bool = False
) -> tuple[ExportTraceServiceRequest, dict[tuple[int, int, int], str]]:
    """An OTLP/JSON ``ExportTraceServiceRequest`` and the spans whose ids were not hex.

    Returns the request and, per span position, why its ids were unusable; those spans
    carry no ids in the request and are rejected by :func:`spans_of`. ``mapped_only``:
    without what the mapping never reads (see :func:`_drop_unmapped`).
    """
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        raise BadData(f"request body is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise BadData(
            f"request body must be a JSON object (ExportTraceServiceRequest), got {_kind(document)}"
        )
    problems: dict[tuple[int, int, int], str] = {}
    if mapped_only:
        _drop_unmapped_resource_attributes(document)
    for position, span in _json_spans(document):
        if mapped_only:
            _drop_unmapped(span)
        reasons = [reason for reason in _hex_ids_to_base64(span) if reason]
        links = span.get("links")
        for link in links if isinstance(links, list) else ():  # json_format refuses a non-list
            if isinstance(link, dict):
                reasons.extend(reason for reason in _hex_ids_to_base64(link, "link ") if reason)
        if reasons:
            problems[position] = "; ".join(reasons)
    request = ExportTraceServiceRequest()
    try:
        json_format.ParseDict(document, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as error:
        raise BadData(f"request body is not an OTLP/JSON ExportTraceServiceRequest: {error}") from None
    return request, problems


def _drop_unmapped(span: dict[str, Any]) -> None:
    """Leave out of a span, before ``json_format`` builds protobuf messages of it, what
    the mapping never reads: its events and the attributes it does not map. Building them
    cost about 0.5 s of CPU and 20 times the body's size in memory per MiB of an ordinary
    SDK request."""
    span.pop("events", None)
    _keep_mapped_attributes(span)


def _drop_unmapped_resource_attributes(document: dict[str, Any]) -> None:
    resources = document.get("resourceSpans", document.get("resource_spans"))
    for resource_spans in resources if isinstance(resources, list) else ():
        resource = resource_spans.get("resource") if isinstance(resource_spans, dict) else None
        if isinstance(resource, dict):
            _keep_mapped_attributes(resource)


def _keep_mapped_attributes(node: dict[str, Any]) -> None:
    """Keep the attributes the mapping reads, and any entry that is not a well-formed
    attribute, so that ``json_format`` still refuses the request for it."""
    attributes = node.get("attributes")
    if isinstance(attributes, list):
        node["attributes"] = [
            kv
            for kv in attributes
            if not (isinstance(kv, dict) and isinstance(key := kv.get("key"), str))
            or key in MAPPED_KEYS
            or key.startswith(MAPPED_PREFIXES)
        ]


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _json_spans(document: dict[str, Any]) -> Iterator[tuple[tuple[int, int, int], dict[str, Any]]]:
    resources = document.get("resourceSpans", document.get("resource_spans"))
    if not isinstance(resources, list):
        return
    for i, resource in enumerate(resources):
        if not isinstance(resource, dict):
            continue
        scopes = resource.get("scopeSpans", resource.get("scope_spans"))
        if not isinstance(scopes, list):
            continue
        for j, scope in enumerate(scopes):
            if not isinstance(scope, dict) or not isinstance(scope.get("spans"), list):
                continue
            for k, span in enumerate(scope["spans"]):
                if isinstance(span, dict):
                    yield (i, j, k), span


def _hex_bytes(text: str) -> bytes | None:
    """``text`` as hex (either case, nothing else: ``bytes.fromhex`` would skip whitespace)."""
    if not (text.isascii() and text.isalnum()):
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def _hex_ids_to_base64(node: dict[str, Any], label: str = "") -> Iterator[str | None]:
    """Rewrite hex id fields in place as base64 (what json_format expects); yield problems."""
    for camel, snake, size in _ID_FIELDS:
        for name in (camel, snake):
            if name not in node:
                continue
            value = node[name]
            if value is None or value == "":
                continue
            if not isinstance(value, str):
                del node[name]
                yield f"{label}{camel} must be a hex string, got {_kind(value)}"
                continue
            raw = _hex_bytes(value)
            if raw is None:
                del node[name]
                yield f"{label}{camel} {quoted(value, 40)} is not hex"
                continue
            if len(raw) != size:
                del node[name]
                yield f"{label}{camel} {quoted(value, 40)} is {len(raw)} bytes, expected {size} ({size * 2} hex digits)"
                continue
            node[name] = base64.b64encode(raw).decode("ascii")
            yield None


SpanParts = tuple[str, dict[str, Any], dict[str, Any], bool, int, str, str]
"""A span as ``(name, attributes, resource, status_error, start_time_ns, trace_id,
span_id)``: :class:`SpanData`'s fields in its order, and what ``map_attributes`` takes."""


def spans_of(
    request: ExportTraceServiceRequest,
    problems: dict[tuple[int, int, int], str] | None = None,
    *,
    attribute_value_limit: int | None = None,
) -> Decoded:
    """Every span of ``request`` as SpanData (with all its attributes), or a rejection
    naming it and why."""
    decoded = Decoded()
    decoded.spans = [
        SpanData(*parts, attribute_value_limit=attribute_value_limit)
        for parts in span_parts(request, problems, decoded.rejected, attributes_of)
    ]
    return decoded


def span_parts(
    request: ExportTraceServiceRequest,
    problems: dict[tuple[int, int, int], str] | None,
    rejected: list[str],
    decode_attributes: Callable[[Any], dict[str, Any]],
) -> Iterator[SpanParts]:
    """The spans of ``request`` with usable ids, their attributes and their resource's
    decoded by ``decode_attributes``; each of the others is described in ``rejected``."""
    problems = problems or {}
    for i, resource_spans in enumerate(request.resource_spans):
        resource = decode_attributes(resource_spans.resource.attributes)
        for j, scope_spans in enumerate(resource_spans.scope_spans):
            for k, span in enumerate(scope_spans.spans):
                trace_id, span_id = span.trace_id, span.span_id
                problem = (
                    problems.get((i, j, k))
                    or _id_problem(trace_id, 16, "trace_id")
                    or _id_problem(span_id, 8, "span_id")
                )
                if problem:
                    rejected.append(
                        f"resource_spans[{i}].scope_spans[{j}].spans[{k}] {quoted(span.name, 40)}: {problem}"
                    )
                    continue
                yield (
                    span.name,
                    decode_attributes(span.attributes),
                    resource,
                    span.status.code == STATUS_CODE_ERROR,
                    span.start_time_unix_nano,
                    trace_id.hex(),
                    span_id.hex(),
                )


def _id_problem(value: bytes, size: int, name: str) -> str | None:
    if len(value) != size:
        return f"{name} is {len(value)} bytes, expected {size}"
    if not any(value):
        return f"{name} is all zeros, which OTLP defines as invalid"
    return None


MAPPED_KEYS = frozenset(
    {
        *sc.SESSION_ATTRIBUTES,
        sc.RESOURCE_SESSION_ID,
        sc.SERVICE_INSTANCE_ID,
        *sc.NAME_FALLBACKS,
        sc.GEN_AI_OPERATION_NAME,
        sc.GEN_AI_SYSTEM,
        sc.GEN_AI_PROVIDER_NAME,
        sc.GEN_AI_REQUEST_MODEL,
        sc.GEN_AI_OUTPUT_MESSAGES,
        sc.GEN_AI_OUTPUT_MESSAGES_REF,
        sc.GEN_AI_TOOL_CALL_ID,
        sc.GEN_AI_TOOL_CALL_RESULT,
        sc.OPENINFERENCE_SPAN_KIND,
        sc.OUTPUT_VALUE,
        sc.TOOL_CALL_ID,
        sc.TOOL_ID,
        sc.TRACELOOP_SPAN_KIND,
        sc.TRACELOOP_ENTITY_OUTPUT,
    }
)
"""The span and resource attributes ``map_attributes`` reads by name (``docs/semconv.md``)."""

MAPPED_PREFIXES = (sc.ACTION_PREFIX, sc.GEN_AI_COMPLETION_PREFIX, sc.LLM_OUTPUT_MESSAGES_PREFIX)
"""The attribute name prefixes it reads every attribute of: ours (an unknown
``agent.action.*`` attribute is a record field, which the rules report) and the
conventions' numbered result parts."""


def attributes_of(key_values) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """OTLP ``KeyValue``s as a plain dict (a repeated key keeps its last value)."""
    return {kv.key: value_of(kv.value) for kv in key_values}


def mapped_attributes_of(key_values) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """:func:`attributes_of`, but only the attributes the mapping reads (:data:`MAPPED_KEYS`,
    :data:`MAPPED_PREFIXES`): the others' values are never turned into Python objects,
    and the mapping finds the same record in the smaller dict."""
    attributes: dict[str, Any] = {}
    for kv in key_values:
        key = kv.key
        if key in MAPPED_KEYS or key.startswith(MAPPED_PREFIXES):
            attributes[key] = value_of(kv.value)
    return attributes


def _wire_decoder() -> Any:
    wire = native_module("_wire", package="durable_sessions_collector.otlp")
    return None if wire is None else wire.Decoder(sorted(MAPPED_KEYS), MAPPED_PREFIXES)


_WIRE = _wire_decoder()


def protobuf_span_parts(body: bytes, rejected: list[str]) -> list[SpanParts]:
    """The parts of a binary request's spans, as :func:`span_parts` gives them with
    :func:`mapped_attributes_of`; spans with unusable ids are described in ``rejected``.
    Raise :class:`BadData` when ``body`` is not an ``ExportTraceServiceRequest``."""
    if _WIRE is not None:
        parts: list[SpanParts] | None = _WIRE.span_parts(body)
        if parts is not None:
            return parts
    return list(span_parts(parse_protobuf(body), None, rejected, mapped_attributes_of))


def json_span_parts(body: bytes, rejected: list[str]) -> list[SpanParts]:
    """:func:`protobuf_span_parts` for an OTLP/JSON request."""
    request, problems = parse_json(body, mapped_only=True)
    return list(span_parts(request, problems, rejected, mapped_attributes_of))


def value_of(value: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as the Python value an SDK attribute would hold.

    Arrays become tuples (as the SDK stores sequences), key-value lists dicts, bytes
    stay bytes, and an empty value is ``None``: the mapping and the rules judge types,
    nothing is coerced here.
    """
    which = value.WhichOneof("value")
    if which == "string_value":
        return value.string_value
    if which == "bool_value":
        return value.bool_value
    if which == "int_value":
        return value.int_value
    if which == "double_value":
        return value.double_value
    if which == "array_value":
        return tuple(value_of(item) for item in value.array_value.values)
    if which == "kvlist_value":
        return {kv.key: value_of(kv.value) for kv in value.kvlist_value.values}
    if which == "bytes_value":
        return value.bytes_value
    return None


def to_otlp_json(request: ExportTraceServiceRequest) -> bytes:
    """``request`` as OTLP/JSON bytes: lowerCamelCase keys, integer enums, hex ids."""
    document = json_format.MessageToDict(request, use_integers_for_enums=True)
    for _, span in _json_spans(document):
        for node in (span, *(link for link in span.get("links") or () if isinstance(link, dict))):
            for camel, _, _ in _ID_FIELDS:
                if isinstance(node.get(camel), str):
                    node[camel] = base64.b64decode(node[camel]).hex()
    return orjson.dumps(document)
