"""OTLP/JSON trace files, as the OpenTelemetry Collector's ``file`` exporter writes them.

Each line holds one ``ExportTraceServiceRequest`` in the OTLP/JSON encoding: ids are
hex strings, 64-bit integers may be written as strings, enums as integers (or their
names), attribute values as ``{"stringValue": …}`` and the like. This module walks such
a request as plain JSON — no protobuf needed on the application side — and yields every
span as the :class:`~durable_sessions.mapping.SpanData` that the mapping reads.

:class:`FileSpanExporter` writes such a file from the SDK: the kill-and-resume harness
reads what an agent's processes exported, and ``durable-sessions check`` reads it too.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from durable_sessions import disk, forking
from durable_sessions import semconv as sc
from durable_sessions.bad_text import Marked
from durable_sessions.json_text import json_line
from durable_sessions.mapping import SpanData, exact

logger = logging.getLogger("durable_sessions")

_HEX_ID = {32: re.compile(r"[0-9a-f]{32}"), 16: re.compile(r"[0-9a-f]{16}")}


class BadSpan(NamedTuple):
    """A span (or a part of the request) that cannot be read, and where it is."""

    where: str
    reason: str


class BadValue(ValueError):
    """A value that the OTLP/JSON encoding does not allow where it stands; the message
    says what it is and where (``attribute 'agent.action.max_attempts': intValue 3.5 is
    not an integer``). The sidecar's OTLP/JSON decoder reads with the same functions, so
    a value one refuses the other refuses in the same words."""


LEGACY_SCOPE_SPANS = (
    "holds instrumentationLibrarySpans, which OTLP renamed scopeSpans and then removed; it is "
    "not read: export the spans with a current SDK or Collector"
)
"""Why a request with the legacy field is refused, by the reader and by the sidecar."""


def is_otlp_request(obj: dict[str, Any]) -> bool:
    """Whether ``obj`` looks like an ``ExportTraceServiceRequest``: it holds
    ``resourceSpans``, or ``resource_spans`` as protobuf writes it with its field names
    kept (``MessageToJson(..., preserving_proto_field_name=True)``), which is read alike."""
    return "resourceSpans" in obj or "resource_spans" in obj


def field(node: dict[str, Any], camel: str, snake: str) -> Any:
    """A field by its OTLP/JSON name or its protobuf name (protobuf's JSON mapping reads both)."""
    return node[camel] if camel in node else node.get(snake)


def legacy_group(request: dict[str, Any]) -> int | None:
    """The index of the first ``resourceSpans`` entry holding ``instrumentationLibrarySpans``."""
    groups = field(request, "resourceSpans", "resource_spans")
    for r, group in enumerate(groups if isinstance(groups, list) else ()):
        if isinstance(group, dict) and (
            "instrumentationLibrarySpans" in group or "instrumentation_library_spans" in group
        ):
            return r
    return None


def spans_of(
    request: dict[str, Any], *, attribute_value_limit: int | None = None, marked: Marked | None = None
) -> Iterator[SpanData | BadSpan]:
    """Every span of one OTLP/JSON request, or what is wrong with it and where.

    ``attribute_value_limit``: the attribute value length limit the spans were recorded
    under, when known (``SpanData.attribute_value_limit``). A value the mapping reads that
    the encoding does not allow (``{"intValue": 3.5}``, ``{"boolValue": "true"}``), a status
    code, start or end time that is none, makes the span unreadable; so does one in the
    resource, for each span of that resource. A ``scopeSpans`` that is not a list, an
    entry of it that is not an object, or ``spans`` that are not a list, is one BadSpan
    naming it: the spans it held cannot be known, so they must not pass as none. A
    request holding the legacy ``instrumentationLibrarySpans`` is refused whole
    (:data:`LEGACY_SCOPE_SPANS`).

    ``marked``: the line's strings that are not UTF-8 text, as marks in ``request``
    (:func:`durable_sessions.bad_text.marked`). A span holding one is unreadable, and so
    is each span of a resource or scope holding one, as the sidecar rejects them; one
    outside any resource, scope or span makes the whole request unreadable.
    """
    if marked is not None and (problem := _text_problem(marked, request, "resourceSpans", "resource_spans")):
        yield BadSpan("the request", f"{problem}, outside any span")
        return
    resource_spans = field(request, "resourceSpans", "resource_spans")
    if not isinstance(resource_spans, list):
        yield BadSpan("resourceSpans", "is not a list")
        return
    legacy = legacy_group(request)
    if legacy is not None:
        yield BadSpan(f"resourceSpans[{legacy}]", LEGACY_SCOPE_SPANS)
        return
    for r, group in enumerate(resource_spans):
        where = f"resourceSpans[{r}]"
        if not isinstance(group, dict):
            yield BadSpan(where, "is not an object")
            continue
        resource_attributes, resource_problem = resource_of(group)
        if marked is not None:
            resource_problem = _text_problem(marked, group, "scopeSpans", "scope_spans") or resource_problem
        scopes = field(group, "scopeSpans", "scope_spans")
        if scopes is not None and not isinstance(scopes, list):
            yield BadSpan(f"{where}.scopeSpans", f"is {json_kind(scopes)}, not a list")
            continue
        for s, scope in enumerate(scopes or ()):
            spans = _scope_spans(scope, f"{where}.scopeSpans[{s}]")
            if type(spans) is BadSpan:
                yield spans
                continue
            scope_problem = resource_problem
            if marked is not None and scope_problem is None:
                scope_problem = _text_problem(marked, scope, "spans")
            for n, span in enumerate(spans):  # type: ignore[arg-type]
                place = f"{where}.scopeSpans[{s}].spans[{n}]"
                if scope_problem is None and marked is not None and marked.holds(span):
                    yield BadSpan(place, marked.first(span, "") or "")
                elif scope_problem is not None:
                    yield BadSpan(place, scope_problem)
                else:
                    yield _span(span, resource_attributes, place, attribute_value_limit)


def _text_problem(marked: Marked, node: dict[str, Any], *below: str) -> str | None:
    """The first text that is not UTF-8 in ``node`` but for its ``below`` fields (what
    is below it: a resource's scopes, a scope's spans), named from ``node``."""
    return marked.first({key: value for key, value in node.items() if key not in below}, "")


def _scope_spans(scope: Any, where: str) -> list[Any] | BadSpan:
    """The spans of one ``scopeSpans`` entry (absent or null: none, as protobuf's JSON
    mapping reads them), or why the entry cannot be read: its spans are then unknown,
    and must be reported rather than passed over as if there were none."""
    if not isinstance(scope, dict):
        return BadSpan(where, f"is {json_kind(scope)}, not an object")
    spans = scope.get("spans")
    if spans is None:
        return []
    if not isinstance(spans, list):
        return BadSpan(f"{where}.spans", f"is {json_kind(spans)}, not a list")
    return spans


def resource_of(group: dict[str, Any], *, only_mapped: bool = False) -> tuple[dict[str, Any], str | None]:
    """The attributes of a ``resourceSpans`` entry's resource (:func:`attributes_of`), and
    why they cannot be read (every span of the entry is then unreadable), or None."""
    resource = group.get("resource")
    try:
        if resource is not None and not isinstance(resource, dict):
            raise BadValue(f"is {json_kind(resource)}, not an object")
        return attributes_of(resource.get("attributes") if resource else None, only_mapped=only_mapped), None
    except BadValue as error:
        return {}, f"resource {error}"


def _span(span: Any, resource: dict[str, Any], where: str, limit: int | None) -> SpanData | BadSpan:
    if not isinstance(span, dict):
        return BadSpan(where, "is not an object")
    trace_id, span_id = field(span, "traceId", "trace_id"), field(span, "spanId", "span_id")
    for name, value, width in (("traceId", trace_id, 32), ("spanId", span_id, 16)):
        if not isinstance(value, str) or not _HEX_ID[width].fullmatch(value.lower()):
            return BadSpan(where, f"{name} {value!r} is not {width} hex digits")
        if not value.strip("0"):  # as the sidecar words it
            return BadSpan(where, f"{_SNAKE_ID[name]} is all zeros, which OTLP defines as invalid")
    try:
        start, end, error, attributes = span_fields(span)
    except BadValue as problem:
        return BadSpan(where, str(problem))
    name = span.get("name")
    return SpanData(
        name if isinstance(name, str) else "",
        attributes,
        resource,
        error,
        start,
        trace_id.lower(),  # type: ignore[union-attr]
        span_id.lower(),  # type: ignore[union-attr]
        limit,
        end,
    )


def span_fields(span: dict[str, Any], *, only_mapped: bool = False) -> tuple[int, int, bool, dict[str, Any]]:
    """A span's start and end times (:func:`unix_nano`), whether its status is ERROR
    (:func:`status_error`) and its attributes (:func:`attributes_of`); raise
    :class:`BadValue` for the first of them that cannot be read."""
    return (
        unix_nano(span, "startTimeUnixNano", "start_time_unix_nano"),
        unix_nano(span, "endTimeUnixNano", "end_time_unix_nano"),
        status_error(span.get("status")),
        attributes_of(span.get("attributes"), only_mapped=only_mapped),
    )


_SNAKE_ID = {"traceId": "trace_id", "spanId": "span_id"}
_DECIMAL = re.compile(r"-?[0-9]+")
_UINT64_END = 2**64


def unix_nano(span: dict[str, Any], name: str, proto_name: str) -> int:
    """A span's time ``name`` (``startTimeUnixNano``, a ``fixed64``; ``proto_name`` is its
    ``.proto`` spelling): a JSON integer or a decimal string, from 0 to 2**64 - 1; absent
    is 0. Raise :class:`BadValue` otherwise."""
    value = field(span, name, proto_name)
    if value is None:
        return 0
    number = _integer(value)
    if number is None or not 0 <= number < _UINT64_END:
        raise BadValue(f"{name} {_shown(value)} is not an unsigned 64-bit integer")
    return number


_STATUS_CODES = {"STATUS_CODE_UNSET": 0, "STATUS_CODE_OK": 1, "STATUS_CODE_ERROR": 2}
_STATUS_CODE_ERROR = 2


def status_error(status: Any) -> bool:
    """Whether a span's ``status`` says ERROR. Its ``code`` is an enum: a JSON integer, a
    decimal string (``"2"``) or the name (``"STATUS_CODE_ERROR"``); absent is UNSET.
    Raise :class:`BadValue` for anything else (``2.0``, ``true``, ``"error"``)."""
    if status is None:
        return False
    if not isinstance(status, dict):
        raise BadValue(f"status is {json_kind(status)}, not an object")
    code = status.get("code")
    if code is None:
        return False
    number = _STATUS_CODES.get(code) if type(code) is str else None
    if number is None:
        number = _integer(code)
    if number is None or not -(2**31) <= number < 2**31:
        raise BadValue(f"status.code {_shown(code)} is not a status code")
    return number == _STATUS_CODE_ERROR


def _integer(value: Any) -> int | None:
    """A JSON integer, or a decimal string of one, as an int; None for anything else (a
    boolean, ``3.0``, ``"3.5"``, ``" 3"``): protobuf's JSON parser turns some of those
    into integers, and values are never coerced. None too for a decimal string of more
    digits than Python reads (:func:`_too_long_to_read`), which no 64-bit field holds."""
    if type(value) is int:
        return value
    if (
        type(value) is str
        and _DECIMAL.fullmatch(value)
        and (len(value) <= _ALWAYS_READ or not _too_long_to_read(value))
    ):
        return int(value)
    return None


_ALWAYS_READ = sys.int_info.str_digits_check_threshold
"""Digits ``int()`` reads whatever its limit (640): a timestamp needs no look at the limit."""


def _too_long_to_read(decimal: str) -> bool:
    """Whether ``int()`` refuses the decimal string ``decimal`` (``sys.int_info``'s limit
    of digits, 4,300 unless ``PYTHONINTMAXSTRDIGITS`` says otherwise): it raised
    ValueError into the reader, a traceback for one span's ``"endTimeUnixNano"``."""
    limit = sys.get_int_max_str_digits()
    return limit > 0 and len(decimal.lstrip("-")) > limit


def attributes_of(key_values: Any, *, only_mapped: bool = False) -> dict[str, Any]:
    """``[{"key": k, "value": {…}}, …]`` as a plain mapping (a repeated key keeps its last
    value; no key is key "": see :func:`_key_of`). Raise :class:`BadValue` for a list
    that is none, an entry that is no object or whose key is not text, or a value the mapping reads (``semconv.is_mapped``) that the encoding does not
    allow; a value the mapping never reads is None then, as it is of no consequence.
    ``only_mapped``: leave out the attributes the mapping never reads (the sidecar)."""
    attributes: dict[str, Any] = {}
    if key_values is None:
        return attributes
    if not isinstance(key_values, list):
        raise BadValue(f"attributes is {json_kind(key_values)}, not a list")
    is_mapped = sc.is_mapped
    for index, entry in enumerate(key_values):
        key = _key_of(entry)
        if key is None:
            raise BadValue(f"attributes[{index}] has no string key")
        if only_mapped and not is_mapped(key):
            continue
        try:
            attributes[key] = any_value(entry.get("value"))
        except BadValue as error:
            if is_mapped(key):
                raise BadValue(f"attribute {key!r}: {error}") from None
            attributes[key] = None
    return attributes


def _key_of(entry: Any) -> str | None:
    """The key of a JSON ``KeyValue``, or None when it has none that is text. A key absent
    or null is "", as protobuf's JSON mapping leaves out (and reads) a field of its
    default value: an attribute of key "" in protobuf is the same attribute."""
    if not isinstance(entry, dict):
        return None
    key = entry.get("key")
    if key is None:
        return ""
    return key if type(key) is str else None


_VALUE_FIELDS = {
    "stringValue": "stringValue",
    "string_value": "stringValue",
    "boolValue": "boolValue",
    "bool_value": "boolValue",
    "intValue": "intValue",
    "int_value": "intValue",
    "doubleValue": "doubleValue",
    "double_value": "doubleValue",
    "arrayValue": "arrayValue",
    "array_value": "arrayValue",
    "kvlistValue": "kvlistValue",
    "kvlist_value": "kvlistValue",
    "bytesValue": "bytesValue",
    "bytes_value": "bytesValue",
}


def any_value(value: Any) -> Any:
    """One OTLP/JSON ``AnyValue`` as the Python value an SDK attribute would hold: arrays
    as tuples, key-value lists as dicts, bytes as bytes; None when empty (or null, or of
    fields this version does not know).

    Each field takes the JSON types protobuf's JSON mapping gives it, and no more: a
    ``stringValue`` a string, a ``boolValue`` true or false, an ``intValue`` an integer or
    a decimal string (of any size: the mapping reports one OTLP cannot carry), a
    ``doubleValue`` a number, a number in a string, ``"NaN"`` or ``"Infinity"``, a
    ``bytesValue`` base64. Anything else raises :class:`BadValue`: values are never
    coerced, and a value that means something else on another path is no value.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadValue(f"value is {json_kind(value)}, not an AnyValue object")
    present = [(_VALUE_FIELDS[name], inner) for name, inner in value.items() if name in _VALUE_FIELDS]
    if not present:
        return None
    if len(present) > 1:
        raise BadValue(f"value sets {' and '.join(name for name, _ in present)}; an AnyValue holds one")
    kind, inner = present[0]
    if inner is None:
        return None
    try:
        return _READERS[kind](inner)
    except RecursionError:
        raise BadValue("value is nested too deeply") from None


def _string(inner: Any) -> str:
    if type(inner) is not str:
        raise BadValue(f"stringValue {_shown(inner)} is not a string")
    return inner


def _bool(inner: Any) -> bool:
    if type(inner) is not bool:
        raise BadValue(f"boolValue {_shown(inner)} is not true or false")
    return inner


def _int(inner: Any) -> int:
    number = _integer(inner)
    if number is None and type(inner) is str and _DECIMAL.fullmatch(inner):
        raise BadValue(
            f"intValue {_shown(inner)} has more than {sys.get_int_max_str_digits()} digits, the most Python reads"
        )
    if number is None:
        raise BadValue(f"intValue {_shown(inner)} is not an integer")
    return number


# Protobuf's JSON mapping writes a double that is not finite as one of these strings.
_SPECIAL_DOUBLES = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
_SPECIAL_DOUBLE_NAMES = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _double(inner: Any) -> float:
    """A ``doubleValue`` as a float, as the span processor and the sidecar read it.

    Go's protojson (so the Collector's ``file`` exporter) writes the double 3.0 as ``3``,
    which JSON reads as an integer: left so, ``max_attempts`` 3.0 would pass for an integer
    cap here while the sidecar reports it. The mapping also allows a number as a string.
    """
    if type(inner) is float:
        return inner
    if type(inner) is int:
        try:
            return float(inner)
        except OverflowError:  # beyond a double's range: infinite, as the literal 1e999 reads
            return math.inf if inner > 0 else -math.inf
    if type(inner) is str:
        if inner in _SPECIAL_DOUBLES:
            return _SPECIAL_DOUBLES[inner]
        if _JSON_NUMBER.fullmatch(inner):
            return float(inner)
    raise BadValue(f"doubleValue {_shown(inner)} is not a number")


_URL_SAFE = str.maketrans("-_", "+/")


def _bytes(inner: Any) -> bytes:
    """Base64, standard or URL-safe, with or without padding (protobuf's JSON mapping)."""
    if type(inner) is str and inner.isascii():
        text = inner.translate(_URL_SAFE)
        try:
            return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
        except ValueError:
            pass
    raise BadValue("bytesValue is not base64 text")  # the value itself may be anything: not shown


def _values(inner: Any, kind: str) -> list[Any]:
    if not isinstance(inner, dict):
        raise BadValue(f"{kind} is {json_kind(inner)}, not an object")
    values = inner.get("values")
    if values is None:
        return []
    if not isinstance(values, list):
        raise BadValue(f"{kind}.values is {json_kind(values)}, not a list")
    return values


def _array(inner: Any) -> tuple[Any, ...]:
    return tuple(any_value(item) for item in _values(inner, "arrayValue"))


def _kvlist(inner: Any) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for entry in _values(inner, "kvlistValue"):
        key = _key_of(entry)
        if key is None:
            raise BadValue("kvlistValue holds an entry without a string key")
        entries[key] = any_value(entry.get("value"))
    return entries


_READERS = {
    "stringValue": _string,
    "boolValue": _bool,
    "intValue": _int,
    "doubleValue": _double,
    "bytesValue": _bytes,
    "arrayValue": _array,
    "kvlistValue": _kvlist,
}


def json_kind(value: Any) -> str:
    """What a JSON value is, for a message: "an object", "an array", "a string", "null",
    "a boolean" or "a number"."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"


def _shown(value: Any) -> str:
    """A value for a message: a number as written, a string quoted and cut short, a
    container by its kind (values may be personal data: messages reach logs)."""
    if type(value) is bool:
        return "true" if value else "false"
    if type(value) in (int, float):
        text = repr(value)
        return text if len(text) <= 24 else text[:21] + "..."
    if type(value) is str:
        return repr(value if len(value) <= 20 else value[:17] + "...")
    return json_kind(value)


# -- writing -----------------------------------------------------------------------------


class FileSpanExporter(SpanExporter):
    """Append each export to a file as one line of OTLP/JSON, as the Collector's ``file``
    exporter writes it.

    Each line is written whole, unbuffered, before ``export`` returns, so a process killed
    after an export loses none of it. A line cut short, by a full disk (the export fails)
    or by a process killed during an export (a ``SIGKILL`` stops a long ``write`` between
    pages), is ended before the next line, the resumed process's after a kill, so that
    the next line is not lost with the cut one (:class:`~durable_sessions.disk.LineAppender`).
    Meant for ``SimpleSpanProcessor`` in tests and in the kill-and-resume harness, where
    every ended span should be on disk at once; under ``BatchSpanProcessor`` it works as
    any exporter does.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        # Unbuffered: a buffer would keep the rest of a line a full disk cut short, and write
        # it out later with the next line (after other processes' lines, in a shared file).
        self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - held open until shutdown
        self._lines = disk.LineAppender(self._file.fileno(), self.path)
        forking.after_fork(self, _fresh_lock)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write the spans as one line; a failure is logged and returned, never raised."""
        try:
            line = json_line(encode_spans(spans))
            with self._lock:
                if self._file.closed:
                    return SpanExportResult.FAILURE
                self._lines.append(line)
        except Exception:
            logger.exception("durable_sessions: could not write %d spans to %s", len(spans), self.path)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _fresh_lock(exporter: FileSpanExporter) -> None:
    exporter._lock = threading.Lock()


def encode_spans(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """An ``ExportTraceServiceRequest`` in OTLP/JSON, spans grouped by resource and scope."""
    groups: dict[int, tuple[Any, dict[tuple[str, str], list[dict[str, Any]]]]] = {}
    for span in spans:
        scopes = groups.setdefault(id(span.resource), (span.resource, {}))[1]
        scope = span.instrumentation_scope
        name = (scope.name, scope.version or "") if scope is not None else ("", "")
        scopes.setdefault(name, []).append(_encode_span(span))
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": _key_values(resource.attributes)},
                "scopeSpans": [
                    {"scope": _scope(*name), "spans": encoded} for name, encoded in scopes.items()
                ],
            }
            for resource, scopes in groups.values()
        ]
    }


def _scope(name: str, version: str) -> dict[str, Any]:
    return {"name": name, **({"version": version} if version else {})}


def _encode_span(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    encoded: dict[str, Any] = {
        "traceId": f"{context.trace_id:032x}",
        "spanId": f"{context.span_id:016x}",
        "name": span.name,
        "kind": span.kind.value + 1,  # the SDK counts from INTERNAL = 0, OTLP from UNSPECIFIED = 0
        "startTimeUnixNano": str(span.start_time or 0),
        "endTimeUnixNano": str(span.end_time or 0),
        "attributes": _key_values(span.attributes or {}),
        "status": {"code": span.status.status_code.value},
    }
    if span.parent is not None:
        encoded["parentSpanId"] = f"{span.parent.span_id:016x}"
    if span.status.description:
        encoded["status"]["message"] = span.status.description
    if context.trace_state:
        encoded["traceState"] = context.trace_state.to_header()
    if span.events:
        encoded["events"] = [_encode_event(event) for event in span.events]
    if span.links:
        encoded["links"] = [_encode_link(link) for link in span.links]
    for name, count in (
        ("droppedAttributesCount", span.dropped_attributes),
        ("droppedEventsCount", span.dropped_events),
        ("droppedLinksCount", span.dropped_links),
    ):
        if count:
            encoded[name] = count
    encoded["flags"] = _flags(span.parent)
    return encoded


def _encode_event(event: Any) -> dict[str, Any]:
    return {
        "timeUnixNano": str(event.timestamp),
        "name": event.name,
        "attributes": _key_values(event.attributes or {}),
    }


def _encode_link(link: Any) -> dict[str, Any]:
    encoded = {
        "traceId": f"{link.context.trace_id:032x}",
        "spanId": f"{link.context.span_id:016x}",
        "attributes": _key_values(link.attributes or {}),
        "flags": _flags(link.context),
    }
    if link.context.trace_state:
        encoded["traceState"] = link.context.trace_state.to_header()
    return encoded


_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # SpanFlags: whether the parent (or linked) context is remote


def _flags(context: Any) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if context is not None and context.is_remote else 0)


_PLAIN = frozenset({str, int, float, bool, bytes, tuple})


def _key_values(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": key, "value": encoded_value(value)} for key, value in attributes.items()]


def encoded_value(value: Any) -> dict[str, Any]:
    """One attribute value in OTLP/JSON. A subclass of a plain type (an ``(int, Enum)``
    cap, a ``StrEnum`` kind) is written as its plain value, as the SDK's OTLP exporter
    sends it: ``str()`` of such an enum member is its name (``"Cap.THREE"``)."""
    if type(value) not in _PLAIN:
        value = exact(value)
    if value is None:  # the SDK allows None inside a sequence; OTLP writes an empty value
        return {}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value if math.isfinite(value) else _SPECIAL_DOUBLE_NAMES[str(value)]}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, Sequence):
        return {"arrayValue": {"values": [encoded_value(item) for item in value]}}
    return {"stringValue": str(value)}
