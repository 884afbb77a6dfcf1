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
import json
import logging
import math
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import orjson
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from durable_sessions import forking
from durable_sessions.mapping import SpanData, exact

logger = logging.getLogger("durable_sessions")

_HEX_ID = {32: re.compile(r"[0-9a-f]{32}"), 16: re.compile(r"[0-9a-f]{16}")}
_STATUS_ERROR = (2, "STATUS_CODE_ERROR")


class BadSpan(NamedTuple):
    """A span (or a part of the request) that cannot be read, and where it is."""

    where: str
    reason: str


def is_otlp_request(obj: dict[str, Any]) -> bool:
    return "resourceSpans" in obj


def spans_of(request: dict[str, Any]) -> Iterator[SpanData | BadSpan]:
    """Every span of one OTLP/JSON request, or what is wrong with it and where."""
    resource_spans = request.get("resourceSpans")
    if not isinstance(resource_spans, list):
        yield BadSpan("resourceSpans", "is not a list")
        return
    for r, group in enumerate(resource_spans):
        where = f"resourceSpans[{r}]"
        if not isinstance(group, dict):
            yield BadSpan(where, "is not an object")
            continue
        resource = group.get("resource") or {}
        resource_attributes = attributes_of(
            resource.get("attributes") if isinstance(resource, dict) else None
        )
        scopes = group.get("scopeSpans", group.get("instrumentationLibrarySpans")) or []
        for s, scope in enumerate(scopes if isinstance(scopes, list) else []):
            spans = scope.get("spans") if isinstance(scope, dict) else None
            for n, span in enumerate(spans if isinstance(spans, list) else []):
                yield _span(span, resource_attributes, f"{where}.scopeSpans[{s}].spans[{n}]")


def _span(span: Any, resource: dict[str, Any], where: str) -> SpanData | BadSpan:
    if not isinstance(span, dict):
        return BadSpan(where, "is not an object")
    trace_id, span_id = span.get("traceId"), span.get("spanId")
    for name, value, width in (("traceId", trace_id, 32), ("spanId", span_id, 16)):
        if not isinstance(value, str) or not _HEX_ID[width].fullmatch(value.lower()):
            return BadSpan(where, f"{name} {value!r} is not {width} hex digits")
    try:
        start = int(span.get("startTimeUnixNano") or 0)
    except (TypeError, ValueError):
        return BadSpan(where, f"startTimeUnixNano {span.get('startTimeUnixNano')!r} is not an integer")
    status = span.get("status")
    code = status.get("code") if isinstance(status, dict) else None
    name = span.get("name")
    return SpanData(
        name if isinstance(name, str) else "",
        attributes_of(span.get("attributes")),
        resource,
        code in _STATUS_ERROR,
        start,
        trace_id.lower(),  # type: ignore[union-attr]
        span_id.lower(),  # type: ignore[union-attr]
    )


def attributes_of(key_values: Any) -> dict[str, Any]:
    """``[{"key": k, "value": {…}}, …]`` as a plain mapping; unreadable entries are skipped."""
    attributes: dict[str, Any] = {}
    if not isinstance(key_values, list):
        return attributes
    for entry in key_values:
        if isinstance(entry, dict) and isinstance(entry.get("key"), str):
            attributes[entry["key"]] = any_value(entry.get("value"))
    return attributes


def any_value(value: Any) -> Any:
    """One OTLP/JSON ``AnyValue`` as a Python value (None when empty or unknown)."""
    if not isinstance(value, dict) or not value:
        return None
    kind, inner = next(iter(value.items()))
    if kind == "stringValue" or kind == "boolValue":
        return inner
    if kind == "doubleValue":
        return _double(inner)
    if kind == "intValue":
        try:
            return int(inner)
        except (TypeError, ValueError):
            return inner
    if kind == "arrayValue":
        values = inner.get("values") if isinstance(inner, dict) else None
        return tuple(any_value(v) for v in values) if isinstance(values, list) else ()
    if kind == "kvlistValue":
        values = inner.get("values") if isinstance(inner, dict) else None
        return attributes_of(values)
    if kind == "bytesValue" and isinstance(inner, str):
        try:
            return base64.b64decode(inner, validate=True)
        except ValueError:
            return inner
    return None


# Protobuf's JSON mapping writes a double that is not finite as one of these strings.
_SPECIAL_DOUBLES = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
_SPECIAL_DOUBLE_NAMES = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _double(inner: Any) -> Any:
    """A ``doubleValue`` as a float, as the span processor and the sidecar read it.

    Go's protojson (so the Collector's ``file`` exporter) writes the double 3.0 as ``3``,
    which JSON reads as an integer: left so, ``max_attempts`` 3.0 would pass for an integer
    cap here while the sidecar reports it. The mapping also allows a number as a string.
    Anything else is left as it is, for the rules to report.
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
    return inner


# -- writing -----------------------------------------------------------------------------


class FileSpanExporter(SpanExporter):
    """Append each export to a file as one line of OTLP/JSON, as the Collector's ``file``
    exporter writes it.

    Each line is written with one ``write`` call and flushed before ``export`` returns,
    so a process killed after an export loses none of it. Meant for
    ``SimpleSpanProcessor`` in tests and in the kill-and-resume harness, where every
    ended span should be on disk at once; under ``BatchSpanProcessor`` it works as any
    exporter does.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open until shutdown
        forking.after_fork(self, _fresh_lock)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Write the spans as one line; a failure is logged and returned, never raised."""
        try:
            line = _json_line(encode_spans(spans))
            with self._lock:
                if self._file.closed:
                    return SpanExportResult.FAILURE
                self._file.write(line)
                self._file.flush()
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


def _json_line(document: dict[str, Any]) -> bytes:
    """One line of JSON. Text that is not valid Unicode (a lone surrogate, which Python
    strings may hold) is written as a ``\\u`` escape by the standard library, which orjson
    refuses to write."""
    try:
        return orjson.dumps(document) + b"\n"
    except TypeError:
        return json.dumps(document, separators=(",", ":")).encode("ascii") + b"\n"


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
    return [{"key": key, "value": _any_value(value)} for key, value in attributes.items()]


def _any_value(value: Any) -> dict[str, Any]:
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
        return {"arrayValue": {"values": [_any_value(item) for item in value]}}
    return {"stringValue": str(value)}
