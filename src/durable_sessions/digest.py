"""Digests of recorded outcomes and prompts.

The sidecar keeps digests instead of text: traces may carry personal data, and the rules
need only presence and equality. A digest is ``sha256:<hex>`` of the value's canonical
JSON: keys sorted, no insignificant whitespace, UTF-8.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import re
from typing import Any

import orjson

PREFIX = "sha256:"
CANONICAL = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS
"""The orjson options that make JSON canonical."""


def canonical_json(value: Any) -> bytes:
    """The canonical JSON bytes of ``value`` (sorted keys, compact, UTF-8).

    orjson writes them when it can. Valid JSON it refuses (integers beyond 64 bits,
    nesting deeper than its limit) comes from the standard library, sorted, compact and
    UTF-8 too, so that a result recorded by ``instrument.action`` and the same result
    digested by a reader have one digest. Raises ``TypeError`` or ``ValueError`` for a
    value neither can write (``ValueError`` for NaN and ±Infinity there).
    """
    try:
        return orjson.dumps(value, option=CANONICAL)
    except orjson.JSONEncodeError:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8", "surrogatepass")


def outcome_json(value: Any) -> bytes:
    """The canonical JSON of an outcome to record (:func:`canonical_json`).

    NaN and ±Infinity raise ``ValueError``: orjson would write ``null``, which a replay
    would serve instead of the number.
    """
    data = canonical_json(value)
    # orjson writes a non-finite float as null: only output holding null can hide one.
    if b"null" in data and _has_non_finite(value):
        raise ValueError("NaN and Infinity are not JSON: orjson would write them as null")
    return data


def _has_non_finite(value: Any) -> bool:
    """Whether a NaN or ±Infinity is anywhere orjson reads one from in ``value``."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_has_non_finite(key) or _has_non_finite(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return any(_has_non_finite(item) for item in value)
    if isinstance(value, enum.Enum):
        return _has_non_finite(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_has_non_finite(getattr(value, field.name, None)) for field in dataclasses.fields(value))
    return False


def digest_bytes(data: bytes) -> str:
    """``sha256:<hex>`` of raw bytes."""
    return PREFIX + hashlib.sha256(data).hexdigest()


def digest_value(value: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``value``.

    Values that are not JSON (a set, NaN) fall back to their ``repr``, so a digest is
    always produced and equal values still digest equally.
    """
    try:
        return digest_bytes(canonical_json(value))
    except (TypeError, ValueError, RecursionError):
        return digest_bytes(repr(value).encode("utf-8", "surrogatepass"))


def digest_text(text: str) -> str:
    """``sha256:<hex>`` of a string, e.g. the question put to a person."""
    return digest_bytes(text.encode("utf-8", "surrogatepass"))


Fingerprint = int | str
"""An outcome's identity, small enough to keep for every action of a long session: the
first 64 bits of its ``sha256:`` digest (an int), or, for a given digest that is not a
well-formed SHA-256, that digest itself (a str)."""

_SHA256_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def fingerprint(value: Any) -> int:
    """The first 64 bits of :func:`digest_value` of ``value``."""
    try:
        canonical = canonical_json(value)
    except (TypeError, ValueError, RecursionError):
        canonical = repr(value).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(canonical).digest()[:8], "big")


def digest_fingerprint(digest: str) -> Fingerprint:
    """The fingerprint of a given digest: comparable with :func:`fingerprint` when it is SHA-256."""
    if _SHA256_DIGEST.fullmatch(digest):
        return int(digest[7:23], 16)
    return digest


def as_digest(print_: Fingerprint) -> str:
    """A fingerprint as text: ``sha256:`` and its first 16 hex digits, or the given digest."""
    if type(print_) is int:
        return f"{PREFIX}{print_:016x}…"
    return print_  # type: ignore[return-value]


def same_outcome(a: Fingerprint, b: Fingerprint) -> bool | None:
    """Whether two fingerprints identify the same outcome; None when they cannot be compared."""
    if type(a) is type(b):
        return a == b
    return None
