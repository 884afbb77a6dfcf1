"""Decoding OTLP trace requests into :class:`~durable_sessions.mapping.SpanData`, or, for
the receivers, into the parts ``map_attributes`` takes (:func:`span_parts`), with only the
attributes the mapping reads turned into Python values (:func:`mapped_attributes_of`).

The receivers call :func:`protobuf_span_parts` and :func:`json_span_parts`. Where the
optional extension ``_wire`` is built, a binary request is read into those parts straight
from its bytes; whatever it declines (anything unusual, any error) takes the path here,
which is the reference and words every error.

Both receivers share this module. Request-level problems (a body that is not an
``ExportTraceServiceRequest``, JSON that does not parse) raise :class:`BadData`, which
the receivers answer with ``INVALID_ARGUMENT`` / HTTP 400. Span-level problems (a trace
or span id of the wrong length, or in JSON not hex, nesting too deep for protobuf's parsers,
text that is not UTF-8 (in OTLP/JSON also a lone surrogate escape: see :mod:`durable_sessions.bad_text`),
in the span or in its resource or scope) reject that span only: the rest of the request is kept and the answer is a partial
success that names the rejected spans.

OTLP/JSON differs from protobuf's canonical JSON mapping: ``traceId``/``spanId``/
``parentSpanId`` are hex strings, not base64. They are converted here before the
document is handed to ``json_format``, which would otherwise decode them as base64.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from durable_sessions import bad_text, otlp_json
from durable_sessions import semconv as sc
from durable_sessions.json_text import exact_integers
from durable_sessions.mapping import SpanData
from durable_sessions.native import native_module
from durable_sessions_collector.otlp import depth
from durable_sessions_collector.otlp.envelope import Position, named, without_refused_parts
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


def parse_protobuf_spans(body: bytes) -> tuple[ExportTraceServiceRequest, dict[tuple[int, int, int], str]]:
    """:func:`parse_protobuf`, and the spans that cannot be read, as :func:`parse_json`
    gives them: those nested too deeply for protobuf's parser or holding text that is
    not UTF-8, and those of a resource or scope that does, which the parser refuses the
    whole request for (see :mod:`.envelope`). Raise :class:`BadData` when the request is
    refused for anything else."""
    try:
        return parse_protobuf(body), {}
    except BadData:
        # Only after a refusal: a request the parser reads costs nothing more.
        readable = without_refused_parts(body)
        if readable is not None:
            rest, problems = readable
            with contextlib.suppress(BadData):  # refused for more besides: the request is
                return parse_protobuf(rest), problems
        raise


@dataclass(slots=True)
class JsonAttributes:
    """The attributes the mapping reads, as read from an OTLP/JSON document by the offline
    checker's reader (``durable_sessions.otlp_json``): per resource index, and per span
    position ``(resource, scope, span)``."""

    resources: dict[int, dict[str, Any]] = field(default_factory=dict)
    spans: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)


def parse_json(
    body: bytes, *, mapped_only: bool = False
) -> tuple[ExportTraceServiceRequest, dict[tuple[int, int, int], str]]:
    """An OTLP/JSON ``ExportTraceServiceRequest`` and the spans that cannot be read.

    Returns the request and, per span position, why the span is unusable: ids that are
    not hex, or a value the OTLP/JSON encoding does not allow where the mapping reads it
    (see :func:`read_json`); those spans carry neither ids nor the bad values in the
    request and are rejected by :func:`spans_of`. ``mapped_only``: without what the
    mapping never reads (see :func:`read_json`).
    """
    request, problems, _ = read_json(body, mapped_only=mapped_only)
    return request, problems


def read_json(
    body: bytes, *, mapped_only: bool = False
) -> tuple[ExportTraceServiceRequest, dict[tuple[int, int, int], str], JsonAttributes | None]:
    """:func:`parse_json`, and with ``mapped_only`` the attributes the mapping reads.

    Values are read as the offline checker reads the same document: with its functions
    (``otlp_json.span_fields``, ``otlp_json.resource_of``), not with ``json_format``,
    which coerces some values (``"3.0"`` to 3, status code ``true`` to OK) and refuses
    the whole request for others. A span whose values cannot be read is rejected with
    the reader's words; a resource's bad value rejects each of its spans. With
    ``mapped_only`` the attributes and events are left out of the document before
    ``json_format`` builds messages of them (they cost about 0.5 s of CPU and 20 times
    the body's size in memory per MiB of an ordinary SDK request) and returned as read.
    A request holding the legacy ``instrumentationLibrarySpans`` is refused whole, as
    the reader refuses it.
    """
    document, body, problems = _loaded(body)
    if not isinstance(document, dict):
        raise BadData(
            f"request body must be a JSON object (ExportTraceServiceRequest), got {otlp_json.json_kind(document)}"
        )
    legacy = otlp_json.legacy_group(document)
    if legacy is not None:
        raise BadData(f"resourceSpans[{legacy}] {otlp_json.LEGACY_SCOPE_SPANS}")
    read = JsonAttributes() if mapped_only else None
    check_depth = depth.may_nest_too_deep(body)
    resource_problems = _read_resources(document, read, check_depth)
    for position, span in _json_spans(document):
        too_deep = depth.too_deep(depth.SPAN_DEPTH, span) if check_depth else None
        if too_deep is not None:
            _add_problem(problems, position, too_deep)
            span.clear()  # rejected for its depth alone, as protobuf's parser would
            continue
        if mapped_only:
            span.pop("events", None)
        reasons = _hex_ids_to_base64(span, read=_READ_IDS)
        links = span.get("links")
        for link in links if isinstance(links, list) else ():  # json_format refuses a non-list
            if isinstance(link, dict):
                _hex_ids_to_base64(link, read=())
        reasons.extend(_read_span(position, span, read, resource_problems.get(position[0])))
        if reasons:
            _add_problem(problems, position, "; ".join(reasons))
    try:
        request = _request_of(document)
    except _UNPARSABLE as error:
        # Whatever json_format refuses in a span (a field the mapping never reads, say),
        # or in a span's resource or scope, rejects that span, not the request: its valid
        # neighbours are kept. (Both are asked: ``|``, not ``or``.)
        if not (
            _set_aside_unparsable_spans(document, problems)
            | _set_aside_groups(document, problems, _json_format_problem)
        ):
            raise BadData(f"request body is not an OTLP/JSON ExportTraceServiceRequest: {error}") from None
        try:
            request = _request_of(document)
        except _UNPARSABLE as again:
            raise BadData(f"request body is not an OTLP/JSON ExportTraceServiceRequest: {again}") from None
    return request, problems, read


def _add_problem(problems: dict[Position, str], position: Position, problem: str) -> None:
    """``problem`` after those already found for the span at ``position``."""
    problems[position] = "; ".join(filter(None, (problems.get(position), problem)))


def _loaded(body: bytes) -> tuple[Any, bytes, dict[Position, str]]:
    """The JSON document of ``body``, the body it was read from, and the spans rejected for
    text that is not UTF-8 (see :mod:`durable_sessions.bad_text`), which the document holds no more: each
    such span is left its ids and name, each such resource or scope is left out. Raise
    :class:`BadData` when ``body`` is not JSON, or holds such text outside any span."""
    try:
        # integers beyond 64 bits as the reader reads them (orjson turns them into floats)
        return exact_integers(body, orjson.loads(body)), body, {}
    except orjson.JSONDecodeError as error:
        refusal = f"request body is not valid JSON: {error}"
    # Only after a refusal: a body orjson reads costs nothing more.
    read = bad_text.read(body)
    if read is None:  # no bad text, or refused for more than its text
        raise BadData(refusal)
    document, found = read
    return document, found.body, _set_aside_text(document, found)


_HEAD = ("traceId", "trace_id", "spanId", "span_id", "name")
"""What a span rejected for its text keeps, to be named by (as in protobuf)."""


def _set_aside_text(document: Any, found: bad_text.Marked) -> dict[Position, str]:
    """The spans of ``document`` rejected for the text ``found`` marks in them, or in
    their resource or scope, by position; each such span is left its ids and name (those
    that are text), each such resource or scope is left out. Raise :class:`BadData` for a
    mark outside any span, or in a resource or scope without spans."""
    problems: dict[Position, str] = {}
    if isinstance(document, dict):
        _set_aside_groups(document, problems, lambda own, level: _group_text_problem(found, own, level))
        for position, span in _json_spans(document):
            if found.holds(span):
                _add_problem(problems, position, found.first(span, "") or "")
                head = {key: span[key] for key in _HEAD if key in span and not found.holds(span[key])}
                span.clear()
                span.update(head)
        for position, span in _json_spans(document):
            if position in problems:
                problems[position] = named(_id_of(span, 0), _id_of(span, 1), problems[position])
    if found.holds(document):
        raise BadData(f"request body is not valid OTLP/JSON: {found.first(document, '')}, outside any span")
    return problems


def _group_text_problem(found: bad_text.Marked, own: dict[str, Any], level: int) -> str | None:
    """The first text ``found`` marks in ``own``, the values of a ResourceSpans (``level``
    0) or ScopeSpans (1) but for what is below it, named as protobuf's are."""
    if not found.holds(own):
        return None
    name = _GROUPS[level][0].DESCRIPTOR.name
    for key, value in own.items():
        problem = found.first(key, f"a key of its {name}") or found.first(
            value, key if key in ("resource", "scope") else f"its {name}' {key}"
        )
        if problem is not None:
            return problem
    return None


def _id_of(span: dict[str, Any], which: int) -> bytes:
    """The trace id (``which`` 0) or span id (1) of a JSON span, empty when not hex."""
    camel, snake, _ = _ID_FIELDS[which]
    value = otlp_json.field(span, camel, snake)
    return (_hex_bytes(value) if isinstance(value, str) else None) or b""


_UNPARSABLE = (json_format.ParseError, ValueError, TypeError, RecursionError)
"""What ``json_format`` raises for a document it cannot make a message of."""


def _request_of(document: dict[str, Any]) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    json_format.ParseDict(document, request, ignore_unknown_fields=True, max_recursion_depth=depth.MAX_DEPTH)
    return request


def _set_aside_unparsable_spans(document: dict[str, Any], problems: dict[tuple[int, int, int], str]) -> bool:
    """Empty each span ``json_format`` cannot parse on its own, saying why in ``problems``
    (an emptied span has no ids: it is rejected with that reason); whether any was. A
    span is read as deep as it is in the request: one nested too deeply there is refused
    here too, not left to refuse the request."""
    found = False
    span_room = depth.MAX_DEPTH - depth.SPAN_DEPTH + 1  # json_format counts the span too
    for position, span in _json_spans(document):
        try:
            json_format.ParseDict(span, Span(), ignore_unknown_fields=True, max_recursion_depth=span_room)
        except _UNPARSABLE as error:
            _add_problem(problems, position, f"not an OTLP/JSON span: {error}")
            span.clear()
            found = True
    return found


_GROUPS = ((ResourceSpans, ("scopeSpans", "scope_spans")), (ScopeSpans, ("spans",)))
"""A ResourceSpans and a ScopeSpans: their message, and the keys that hold what is below
them."""


GroupProblem = Callable[[dict[str, Any], int], str | None]
"""Why the values of a ResourceSpans (level 0) or ScopeSpans (level 1), but for what is
below it, cannot be read, or None."""


def _set_aside_groups(
    document: dict[str, Any], problems: dict[Position, str], problem_of: GroupProblem
) -> bool:
    """Leave out the resource and schema URL of each ResourceSpans, and the scope and
    schema URL of each ScopeSpans, that cannot be read (``problem_of`` says why), saying
    why for each of its spans in ``problems``; whether any was. A group without spans is
    left as it is: its bad value is the request's."""
    found = False
    resources = otlp_json.field(document, "resourceSpans", "resource_spans")
    for i, resource_spans in enumerate(resources if isinstance(resources, list) else ()):
        if not isinstance(resource_spans, dict):
            continue
        scopes = otlp_json.field(resource_spans, "scopeSpans", "scope_spans")
        scopes = [
            (j, scope)
            for j, scope in enumerate(scopes if isinstance(scopes, list) else ())
            if isinstance(scope, dict)
        ]
        positions = [(i, j, k) for j, scope in scopes for k in _span_indexes(scope)]
        found |= _set_aside_group(resource_spans, 0, positions, problems, problem_of)
        for j, scope in scopes:
            found |= _set_aside_group(
                scope, 1, [(i, j, k) for k in _span_indexes(scope)], problems, problem_of
            )
    return found


def _span_indexes(scope_spans: dict[str, Any]) -> list[int]:
    spans = scope_spans.get("spans")
    return [k for k, span in enumerate(spans if isinstance(spans, list) else ()) if isinstance(span, dict)]


def _set_aside_group(
    group: dict[str, Any],
    level: int,
    positions: list[Position],
    problems: dict[Position, str],
    problem_of: GroupProblem,
) -> bool:
    own = {key: value for key, value in group.items() if key not in _GROUPS[level][1]}
    reason = problem_of(own, level) if positions and own else None
    if reason is None:
        return False
    for key in own:
        del group[key]
    for position in positions:
        _add_problem(problems, position, reason)
    return True


def _json_format_problem(own: dict[str, Any], level: int) -> str | None:
    """Why ``json_format`` cannot parse ``own`` (read as deep as in the request): a
    :data:`GroupProblem`."""
    message = _GROUPS[level][0]
    room = depth.MAX_DEPTH - 1 - level  # json_format counts the group, and the request is above it
    try:
        json_format.ParseDict(own, message(), ignore_unknown_fields=True, max_recursion_depth=room)
    except _UNPARSABLE as error:
        return f"its {message.DESCRIPTOR.name} is not OTLP/JSON: {error}"
    return None


def _read_resources(
    document: dict[str, Any], read: JsonAttributes | None, check_depth: bool
) -> dict[int, str]:
    """Read each resource's attributes (into ``read``, when given, leaving them out of the
    document); return why a resource cannot be read (``check_depth``: or is nested too
    deeply), by resource index. A resource that cannot be read is left out of the
    document: its spans are rejected."""
    problems: dict[int, str] = {}
    resources = otlp_json.field(document, "resourceSpans", "resource_spans")
    for i, resource_spans in enumerate(resources if isinstance(resources, list) else ()):
        if not isinstance(resource_spans, dict):
            continue
        attributes, problem = otlp_json.resource_of(resource_spans, only_mapped=read is not None)
        if problem is None and check_depth:
            too_deep = depth.too_deep(depth.RESOURCE_DEPTH, resource_spans.get("resource"))
            problem = None if too_deep is None else f"resource is {too_deep}"
        if problem is not None:
            problems[i] = problem
            resource_spans.pop("resource", None)
            continue
        if read is not None:
            read.resources[i] = attributes
            if resource_spans.get("resource"):
                resource_spans["resource"].pop("attributes", None)
    return problems


def _read_span(
    position: tuple[int, int, int],
    span: dict[str, Any],
    read: JsonAttributes | None,
    resource_problem: str | None,
) -> list[str]:
    """Read a span's values as the offline checker does (into ``read``, when given, leaving
    its attributes out of the document); return why it cannot be read, its resource's
    problem first, as the reader words it."""
    if resource_problem is not None:
        _leave_out_values(span)
        return [resource_problem]
    try:
        _start, _end, _error, attributes = otlp_json.span_fields(span, only_mapped=read is not None)
    except otlp_json.BadValue as error:
        _leave_out_values(span)
        return [str(error)]
    if read is not None:
        read.spans[position] = attributes
        span.pop("attributes", None)
    return []


def _leave_out_values(span: dict[str, Any]) -> None:
    """Leave out of a rejected span the values ``json_format`` may refuse the request for."""
    for name in (
        "status",
        "startTimeUnixNano",
        "start_time_unix_nano",
        "endTimeUnixNano",
        "end_time_unix_nano",
        "attributes",
    ):
        span.pop(name, None)


def _json_spans(document: dict[str, Any]) -> Iterator[tuple[tuple[int, int, int], dict[str, Any]]]:
    resources = otlp_json.field(document, "resourceSpans", "resource_spans")
    if not isinstance(resources, list):
        return
    for i, resource in enumerate(resources):
        if not isinstance(resource, dict):
            continue
        scopes = otlp_json.field(resource, "scopeSpans", "scope_spans")
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


def _base64_hint(value: str, size: int) -> str:
    """Why an id that is not hex may be so: it is base64 of ``size`` bytes, as protobuf's
    canonical JSON writes ids (``MessageToJson``), and OTLP/JSON does not."""
    try:
        if len(base64.b64decode(value, validate=True)) != size:
            return ""
    except ValueError:  # binascii.Error
        return ""
    return ": it is base64, as protobuf's JSON mapping writes bytes, where OTLP/JSON writes ids in hex"


def _hex_ids_to_base64(node: dict[str, Any], *, read: tuple[str, ...]) -> list[str]:
    """Rewrite the hex id fields of a span or link in place as base64 (what json_format
    expects), leaving out each that is no id; return why, for those named in ``read``.
    Any other (a parent span id, a link's ids) is only left out: no front end reads it,
    and protobuf's parser takes one of any length unread, so the same span sent in
    protobuf, or read by ``check``, is kept."""
    problems = []
    for camel, snake, size in _ID_FIELDS:
        for name in (camel, snake):
            value = node.get(name)
            if value is None or value == "":
                continue
            raw = _hex_bytes(value) if isinstance(value, str) else None
            if raw is not None and len(raw) == size:
                node[name] = base64.b64encode(raw).decode("ascii")
                continue
            del node[name]
            if camel in read:
                problems.append(_json_id_problem(camel, value, raw, size))
    return problems


_READ_IDS = ("traceId", "spanId")
"""The ids of a span the receivers read (see :func:`span_parts`)."""


def _json_id_problem(camel: str, value: Any, raw: bytes | None, size: int) -> str:
    """Why the OTLP/JSON id ``value`` (``raw``: its bytes, when it is hex) is no id of ``size`` bytes."""
    if not isinstance(value, str):
        return f"{camel} must be a hex string, got {otlp_json.json_kind(value)}"
    if raw is None and _hex_bytes(value + "0") is not None:  # hex digits, an odd number of them
        return f"{camel} {quoted(value, 40)} is {len(value)} hex digits, expected {size * 2}"
    if raw is None:
        return f"{camel} {quoted(value, 40)} is not hex{_base64_hint(value, size)}"
    return f"{camel} {quoted(value, 40)} is {len(raw)} bytes, expected {size} ({size * 2} hex digits)"


SpanParts = tuple[str, dict[str, Any], dict[str, Any], bool, int, str, str, int]
"""A span as ``(name, attributes, resource, status_error, start_time_ns, trace_id,
span_id, end_time_ns)``: :class:`SpanData`'s fields but for ``attribute_value_limit``,
in its order, and what ``map_attributes`` takes."""


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
        SpanData(*parts[:7], attribute_value_limit, parts[7])
        for parts in span_parts(request, problems, decoded.rejected, attributes_of)
    ]
    return decoded


def span_parts(
    request: ExportTraceServiceRequest,
    problems: dict[tuple[int, int, int], str] | None,
    rejected: list[str],
    decode_attributes: Callable[[Any], dict[str, Any]],
    read: JsonAttributes | None = None,
) -> Iterator[SpanParts]:
    """The spans of ``request`` with usable ids, their attributes and their resource's
    decoded by ``decode_attributes`` (or, for an OTLP/JSON request, as ``read`` holds
    them); each of the others is described in ``rejected``."""
    problems = problems or {}
    for i, resource_spans in enumerate(request.resource_spans):
        resource = (
            decode_attributes(resource_spans.resource.attributes)
            if read is None
            else read.resources.get(i, {})
        )
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
                    decode_attributes(span.attributes) if read is None else read.spans.get((i, j, k), {}),
                    resource,
                    span.status.code == STATUS_CODE_ERROR,
                    span.start_time_unix_nano,
                    trace_id.hex(),
                    span_id.hex(),
                    span.end_time_unix_nano,
                )


def _id_problem(value: bytes, size: int, name: str) -> str | None:
    if len(value) != size:
        return f"{name} is {len(value)} bytes, expected {size}"
    if not any(value):
        return f"{name} is all zeros, which OTLP defines as invalid"
    return None


MAPPED_KEYS = sc.MAPPED_KEYS
"""The span and resource attributes ``map_attributes`` reads by name (``docs/semconv.md``)."""

MAPPED_PREFIXES = sc.MAPPED_PREFIXES
"""The attribute name prefixes it reads every attribute of (see ``semconv``)."""


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


def wire_in_use() -> bool:
    """Whether binary requests are read by ``_wire`` (built, and not turned off by
    ``DURABLE_SESSIONS_NATIVE``) before the reference path."""
    return _WIRE is not None


def protobuf_span_parts(body: bytes, rejected: list[str]) -> list[SpanParts]:
    """The parts of a binary request's spans, as :func:`span_parts` gives them with
    :func:`mapped_attributes_of`; spans with unusable ids are described in ``rejected``.
    Raise :class:`BadData` when ``body`` is not an ``ExportTraceServiceRequest``."""
    parts = wire_span_parts(body)
    return reference_span_parts(body, rejected) if parts is None else parts


def wire_span_parts(body: bytes) -> list[SpanParts] | None:
    """The parts of a binary request's spans as ``_wire`` reads them from its bytes, or
    None where it is not built or declines the request (anything unusual, any error)."""
    return None if _WIRE is None else _WIRE.span_parts(body)  # type: ignore[no-any-return]


def reference_span_parts(body: bytes, rejected: list[str]) -> list[SpanParts]:
    """:func:`protobuf_span_parts` by protobuf's parser and a Python walk of the message."""
    request, problems = parse_protobuf_spans(body)
    return list(span_parts(request, problems, rejected, mapped_attributes_of))


def json_span_parts(body: bytes, rejected: list[str]) -> list[SpanParts]:
    """:func:`protobuf_span_parts` for an OTLP/JSON request."""
    request, problems, read = read_json(body, mapped_only=True)
    return list(span_parts(request, problems, rejected, mapped_attributes_of, read))


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
