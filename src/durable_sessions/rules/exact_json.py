"""Record values as JSON that orjson writes and reads back exactly, for session snapshots.

A session's memory keeps a few values as records gave them (the incarnation beside an
answered prompt, a location's line), and records are read by the standard library too:
an integer beyond 64 bits, an infinite number (``1e999``), a tuple from a span attribute.
orjson refuses the first and writes the others as ``null`` and a list, which would not
compare equal to the value again. :func:`to_json` tags those as one-key objects, and
tags every object, so that a tag cannot be mistaken for one::

    2**70          -> {"int": "1180591620717411303424"}
    float("inf")   -> {"float": "inf"}
    ("a", 1)       -> {"tuple": ["a", 1]}
    {"k": [1]}     -> {"dict": [["k", [1]]]}

:func:`from_json` reverses it and raises ``ValueError`` for anything it did not write.
Nothing is evaluated: a tag only names the built-in type to make.
"""

from __future__ import annotations

import math
from typing import Any

_INT64_MIN, _UINT64_END = -(1 << 63), 1 << 64
"""orjson writes the integers in this range."""
_PLAIN = (str, bool, type(None))


class NotJson(ValueError):
    """A value that is no JSON value (nor a tuple): no snapshot can carry it exactly."""


def to_json(value: Any) -> Any:
    """``value`` as a JSON value orjson writes exactly; raises :class:`NotJson` for a
    value of any other type (a subclass included: it would come back as its base)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is int:
        return value if _INT64_MIN <= value < _UINT64_END else {"int": str(value)}
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [to_json(item) for item in value]
    if kind is tuple:
        return {"tuple": [to_json(item) for item in value]}
    if kind is dict:
        return {"dict": [[to_json(key), to_json(item)] for key, item in value.items()]}
    raise NotJson(f"a {kind.__name__} is not JSON")


def from_json(value: Any) -> Any:
    """The value :func:`to_json` gave ``value`` for; ``ValueError`` (or ``TypeError``, for
    an unhashable key) when it is not one it writes."""
    kind = type(value)
    if kind in _PLAIN or kind is int or kind is float:
        return value
    if kind is list:
        return [from_json(item) for item in value]
    if kind is not dict or len(value) != 1:
        raise ValueError(f"not a tagged value: {value!r:.80}")
    ((tag, inner),) = value.items()
    if tag == "int" and type(inner) is str:
        return int(inner)
    if tag == "float" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if tag == "tuple" and type(inner) is list:
        return tuple(from_json(item) for item in inner)
    if tag == "dict" and type(inner) is list:
        return {from_json(key): from_json(item) for key, item in map(_pair, inner)}
    raise ValueError(f"unknown tag or value: {value!r:.80}")


def _pair(item: Any) -> tuple[Any, Any]:
    if type(item) is not list or len(item) != 2:
        raise ValueError(f"not a [key, value] pair: {item!r:.80}")
    return item[0], item[1]
