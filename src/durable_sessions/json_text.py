"""Strict JSON text beyond what orjson reads: one fallback for the readers and the mapping.

orjson refuses some valid JSON text (RFC 8259): numbers beyond a double (``1e999``), and
integers beyond 64 bits whose nearest double is infinite. Where orjson says no,
:func:`parse_with_stdlib` asks the standard library, which reads those (``1e999`` as an
infinite number), still refuses ``NaN``/``Infinity`` and lone UTF-16 surrogate escapes,
and never runs out of stack. An integer beyond 64 bits that a double can hold, orjson
reads as that double, losing its last digits: :func:`exact_integers` reads it again.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Failure:
    """Not JSON text, and why (phrased about a line)."""

    reason: str


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_with_stdlib(text: bytes | str, error: orjson.JSONDecodeError) -> Any:
    """Second opinion for what orjson refused (``error``) but JSON allows (huge integers,
    ``1e999``): the value, or a :class:`Failure`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as bad:
            return Failure(
                f"line is not valid UTF-8 (byte 0x{text[bad.start]:02x} at column {bad.start + 1})"
            )
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        return Failure("line is JSON nested too deeply to read")
    except ValueError as refused:
        if "integer string conversion" in str(refused):
            # Valid JSON that Python will not read: orjson's own words ("number is
            # infinity when parsed as double") said it was not JSON at all.
            return Failure(
                f"line holds an integer of more than {sys.get_int_max_str_digits()} digits, the most "
                "Python reads (PYTHONINTMAXSTRDIGITS raises that)"
            )
        return Failure(f"line is not valid JSON ({error})")
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError as invalid:
        if "surrogate" in str(invalid):
            return Failure("line holds a lone UTF-16 surrogate escape (such as \\ud800): not valid Unicode")
    return value


def _bare_digits_table() -> bytes:
    table = bytearray(b"." * 256)
    table[ord("0") : ord("9") + 1] = b"0" * 10
    for mark in b":,[ \t\r\n-":
        table[mark] = ord(":")
    return bytes(table)


_BARE_DIGITS = _bare_digits_table()
_BARE_LONG_RUN = b":" + b"0" * 19


def may_hold_long_integer(text: bytes) -> bool:
    """Whether the JSON text ``text`` may hold an integer of 19 digits or more that orjson
    reads inexactly: a run of 19 digits at the start, or after what starts a bare number
    (``:``, ``,``, ``[``, a blank or a minus sign). A run in a string after a quote (an
    OTLP/JSON timestamp, ``"1700000000000000000"``) is not one; one after a blank or a
    minus sign inside a string is taken for one (the text is only read again, at some
    cost). One pass of ``bytes.translate`` and a substring search: under a microsecond a
    line. ``_engine.c`` (``holds_long_integer``) tests the same of a line (an object,
    which never starts with a digit)."""
    return _BARE_LONG_RUN in text.translate(_BARE_DIGITS) or text[:19].isdigit()


def exact_integers(text: str | bytes, value: Any) -> Any:
    """``value``, orjson's reading of ``text``, read again by the standard library when
    ``text`` may hold an integer beyond 64 bits (:func:`may_hold_long_integer`), which
    orjson turns into a float (100000000000000000001 became 1e+20: another digest than
    the recorded one). One test for a span's result text and a log's line."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if not may_hold_long_integer(data):
        return value
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return value


def json_line(document: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """``document`` as one line of JSON text, whatever Python holds in it: what orjson
    will not write goes to the standard library, which writes an integer beyond 64 bits
    exactly (read back exactly: :func:`exact_integers`) and a lone surrogate (text that
    is not valid Unicode, which Python strings may hold) as a ``\\u`` escape. A float that
    is not finite is null either way, as orjson writes it (the standard library's
    ``NaN`` is no JSON). ``default`` turns a value of no JSON type into one."""
    try:
        return orjson.dumps(document, default=default) + b"\n"
    except orjson.JSONEncodeError:
        text = json.dumps(_finite(document), default=default, separators=(",", ":"))
        return text.encode("ascii") + b"\n"


def _finite(value: Any) -> Any:
    """``value`` with each float that is not finite, at any depth, made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


__all__ = ["Failure", "exact_integers", "json_line", "may_hold_long_integer", "parse_with_stdlib"]
