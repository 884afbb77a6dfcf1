"""JSON text that every JSON parser reads.

Python's :mod:`json` writes a NaN or an infinity as ``NaN`` / ``Infinity``, which JSON
has no number for: JavaScript's ``JSON.parse``, Go's ``encoding/json`` and log shippers
refuse the whole document. A stored record can hold one (an OTLP/JSON ``doubleValue`` of
``"NaN"``), so the HTTP API and the log write them as protobuf's JSON mapping does: the
strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.

JavaScript's ``JSON.parse`` (and every parser that reads numbers as doubles) also reads
an integer past 2^53 as another number: a record's ``seq`` (a span's start in
nanoseconds, about 1.8e18) came out off by up to 256. With ``exact_ints``, as the HTTP
API writes, such an integer is written as its decimal text (:func:`exact_int`), as
protobuf's JSON mapping writes an int64; smaller ones stay numbers.
"""

from __future__ import annotations

import json
import math
from typing import Any

EXACT_INT = 2**53
"""The largest magnitude up to which every integer is a double exactly."""


def exact_int(value: int) -> int | str:
    """``value``, or its decimal text when a double cannot hold it exactly (past ±2^53)."""
    return value if -EXACT_INT <= value <= EXACT_INT else str(value)


def dumps(document: Any, *, exact_ints: bool = False, **options: Any) -> str:
    """``json.dumps(document, **options)``, with non-finite floats written as strings and,
    with ``exact_ints``, integers past 2^53 too (:func:`exact_int`)."""
    if exact_ints:
        # Walked each time: whether a document holds such an integer is not known without
        # walking it (a page of actions always does: seq), and the walk costs less than
        # json.dumps itself.
        document = _exact_ints(document)
    try:
        return json.dumps(document, allow_nan=False, **options)
    except ValueError:  # a NaN or an infinity somewhere: rare, so only then is the document walked
        return json.dumps(_finite(document), allow_nan=False, **options)


def _finite(node: Any) -> Any:
    if type(node) is float and not math.isfinite(node):
        return "NaN" if math.isnan(node) else ("Infinity" if node > 0 else "-Infinity")
    if isinstance(node, dict):
        return {key: _finite(value) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return [_finite(value) for value in node]
    return node


def _exact_ints(node: Any) -> Any:
    if isinstance(node, int) and not isinstance(node, bool):
        return exact_int(node)
    if isinstance(node, dict):
        return {key: _exact_ints(value) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return [_exact_ints(value) for value in node]
    return node
