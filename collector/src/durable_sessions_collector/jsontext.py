"""JSON text that every JSON parser reads.

Python's :mod:`json` writes a NaN or an infinity as ``NaN`` / ``Infinity``, which JSON
has no number for: JavaScript's ``JSON.parse``, Go's ``encoding/json`` and log shippers
refuse the whole document. A stored record can hold one (an OTLP/JSON ``doubleValue`` of
``"NaN"``), so the HTTP API and the log write them as protobuf's JSON mapping does: the
strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(document: Any, **options: Any) -> str:
    """``json.dumps(document, **options)``, with non-finite floats written as strings."""
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
