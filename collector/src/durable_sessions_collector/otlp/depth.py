"""How deep an OTLP request may nest, in either encoding, and how deep the parts of an
OTLP/JSON request nest where ``json_format`` never reads them.

Protobuf's parsers (upb, and the pure-Python one) read 100 messages below the message
they parse: a request nesting 101 messages, itself included, is read and one nesting
102 is refused (see :mod:`.envelope` for what is then rejected). ``json_format`` counts
the request too and refuses past its ``max_recursion_depth``, so it is given
:data:`MAX_DEPTH`. But the OTLP/JSON decoder reads the attributes and events of a span,
and the attributes of a resource, with the offline checker's reader or not at all (see
``decode.read_json``), never with ``json_format``: their depth is counted here, so that
a span protobuf's parser would refuse is rejected in OTLP/JSON too, and one it reads
is not.
"""

from __future__ import annotations

from typing import Any

from durable_sessions.otlp_json import field

MAX_DEPTH = 101
"""How many messages deep protobuf's parsers read a request, the request included."""

SPAN_DEPTH = 4
"""The messages a span is at: the request, its ResourceSpans, ScopeSpans and the span."""

RESOURCE_DEPTH = 3
"""The messages a resource is at: the request, its ResourceSpans and the resource."""


_NESTING_KEYS = (b'"arrayValue"', b'"array_value"', b'"kvlistValue"', b'"kvlist_value"')
"""The keys of an AnyValue that nests, as they are written in an OTLP/JSON body."""

_FEWEST_NESTINGS = -(-(MAX_DEPTH + 1 - 7) // 3)
"""How many nesting AnyValues a part too deep holds at least: at most 7 messages from the
request to a KeyValue's AnyValue (a span's event's or link's attribute), and each
nesting adds at most 3 (a key-value list: KeyValueList, KeyValue, AnyValue)."""


def may_nest_too_deep(body: bytes) -> bool:
    """Whether some part of the OTLP/JSON ``body`` may nest deeper than :data:`MAX_DEPTH`;
    when not, :func:`too_deep` need not be asked (counting the keys that nest, in the
    bytes, costs a small part of walking every attribute). A body with a ``\\u`` escape
    may spell a key so: it is walked."""
    return b"\\u" in body or sum(body.count(key) for key in _NESTING_KEYS) >= _FEWEST_NESTINGS


def too_deep(depth_of_part: int, part: dict[str, Any] | None) -> str | None:
    """Why the JSON ``part`` (a span, or a resource when ``depth_of_part`` is
    :data:`RESOURCE_DEPTH`) is nested deeper than :data:`MAX_DEPTH`, or None."""
    if not isinstance(part, dict):
        return None
    room = MAX_DEPTH - depth_of_part
    nested = _attributes_depth(field(part, "attributes", "attributes"), room)
    for name in ("events", "links"):
        items = part.get(name)
        for item in items if isinstance(items, list) else ():
            if isinstance(item, dict):
                nested = max(nested, 1 + _attributes_depth(item.get("attributes"), room - 1))
    if nested <= room:
        return None
    return f"nested too deeply for protobuf's parser (more than {MAX_DEPTH} messages, the request included)"


def _attributes_depth(key_values: Any, room: int) -> int:
    """How many messages deep a JSON list of KeyValues nests below its parent (counting
    stops once past ``room``: the rest cannot matter)."""
    deepest = 0
    for key_value in key_values if isinstance(key_values, list) else ():
        if isinstance(key_value, dict):
            deepest = max(deepest, 1 + _value_depth(key_value.get("value"), room - 1))
            if deepest > room:
                break
    return deepest


def _value_depth(value: Any, room: int) -> int:
    """How many messages deep a JSON AnyValue nests, itself included (0 if absent)."""
    if not isinstance(value, dict):
        return 0
    if room <= 0:
        return 1
    array = field(value, "arrayValue", "array_value")
    if isinstance(array, dict):
        values = array.get("values")
        inner = [_value_depth(item, room - 2) for item in values] if isinstance(values, list) else [0]
        return 2 + max(inner, default=0)
    kvlist = field(value, "kvlistValue", "kvlist_value")
    if isinstance(kvlist, dict):
        return 2 + _attributes_depth(kvlist.get("values"), room - 2)
    return 1
