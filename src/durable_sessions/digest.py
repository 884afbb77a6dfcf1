"""Digests of recorded outcomes and prompts.

The sidecar keeps digests instead of text: traces may carry personal data, and the rules
need only presence and equality. A digest is ``sha256:<hex>`` of the value's canonical
JSON: keys sorted, no insignificant whitespace, UTF-8.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

PREFIX = "sha256:"


def canonical_json(value: Any) -> bytes:
    """The canonical JSON bytes of ``value`` (sorted keys, compact, UTF-8)."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def digest_bytes(data: bytes) -> str:
    """``sha256:<hex>`` of raw bytes."""
    return PREFIX + hashlib.sha256(data).hexdigest()


def digest_value(value: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``value``.

    Values orjson cannot serialise (integers beyond 64 bits, say) fall back to their
    ``repr``, so a digest is always produced and equal values still digest equally.
    """
    try:
        return digest_bytes(canonical_json(value))
    except (TypeError, orjson.JSONEncodeError):
        return digest_bytes(repr(value).encode("utf-8", "surrogatepass"))


def digest_text(text: str) -> str:
    """``sha256:<hex>`` of a string, e.g. the question put to a person."""
    return digest_bytes(text.encode("utf-8", "surrogatepass"))


Fingerprint = str | bytes
"""An outcome's identity for equality checks: a given ``sha256:`` digest (str), or the
canonical JSON itself when short (bytes prefixed ``=``), or its raw SHA-256 (``#``)."""

_SHORT = 64


def fingerprint(value: Any) -> bytes:
    """A cheap identity of ``value``: equal for equal canonical JSON, never the text of a long value."""
    try:
        canonical = canonical_json(value)
    except (TypeError, orjson.JSONEncodeError):
        canonical = repr(value).encode("utf-8", "surrogatepass")
    if len(canonical) <= _SHORT:
        return b"=" + canonical
    return b"#" + hashlib.sha256(canonical).digest()


def as_digest(print_: Fingerprint) -> str:
    """The ``sha256:<hex>`` digest a fingerprint stands for."""
    if type(print_) is str:
        return print_
    if print_[:1] == b"=":
        return digest_bytes(print_[1:])
    return PREFIX + print_[1:].hex()


def same_outcome(a: Fingerprint, b: Fingerprint) -> bool:
    """Whether two fingerprints identify the same outcome."""
    if type(a) is type(b):
        return a == b
    return as_digest(a) == as_digest(b)
