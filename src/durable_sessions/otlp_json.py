"""OTLP/JSON trace files, as the OpenTelemetry Collector's ``file`` exporter writes them.

Each line holds one ``ExportTraceServiceRequest`` in the OTLP/JSON encoding: ids are
hex strings, 64-bit integers may be written as strings, enums as integers (or their
names), attribute values as ``{"stringValue": …}`` and the like. This module walks such
a request as plain JSON — no protobuf needed on the application side — and yields every
span as the :class:`~durable_sessions.mapping.SpanData` that the mapping reads.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

from durable_sessions.mapping import SpanData

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
