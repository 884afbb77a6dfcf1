"""Digests of recorded outcomes and prompts.

The sidecar keeps digests instead of text: traces may carry personal data, and the rules
need only presence and equality. A digest is ``sha256:<hex>`` of the value's canonical
JSON: keys sorted, no insignificant whitespace, UTF-8.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import math
import re
from collections import Counter
from typing import Any

import orjson

PREFIX = "sha256:"
CANONICAL = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS
"""The orjson options that make JSON canonical. orjson sorts the keys of dicts but not
the fields of a dataclass it writes itself, so dataclasses are handed to
:func:`_dataclass_fields` instead."""


def _dataclass_fields(value: Any) -> dict[str, Any]:
    """A dataclass instance as the dictionary of its fields (its members stay as they are:
    the writer comes back here for a dataclass among them), so that its keys are sorted as
    any dictionary's: a dataclass and the dictionary replay hands back for it are one
    outcome, with one digest. Raises ``TypeError`` for anything else, as a writer's
    ``default`` must."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def canonical_json(value: Any) -> bytes:
    """The canonical JSON bytes of ``value`` (sorted keys, compact, UTF-8); a dataclass
    is written as the dictionary of its fields, its keys sorted too.

    orjson writes them when it can. Valid JSON it refuses (integers beyond 64 bits,
    nesting deeper than its limit) is written as the standard library writes it, sorted,
    compact and UTF-8 too (without recursion, at any depth), so that a result recorded by ``instrument.action`` and the same result
    digested by a reader have one digest. Raises ``TypeError`` or ``ValueError`` for a
    value neither can write (``ValueError`` for NaN and ±Infinity there).
    """
    return _json(value, CANONICAL)


IN_ORDER = CANONICAL & ~orjson.OPT_SORT_KEYS
"""The options of :func:`canonical_json` but for the order of keys: each dictionary's own."""


def _json(value: Any, option: int) -> bytes:
    """``value`` as compact UTF-8 JSON written with orjson's ``option`` (:data:`CANONICAL`
    or :data:`IN_ORDER`), else, where orjson refuses valid JSON, as the standard library
    writes it with keys in the same order."""
    try:
        return orjson.dumps(value, default=_dataclass_fields, option=option)
    except orjson.JSONEncodeError:
        sort_keys = bool(option & orjson.OPT_SORT_KEYS)
        try:
            text = json.dumps(
                value,
                sort_keys=sort_keys,
                separators=(",", ":"),
                ensure_ascii=False,
                allow_nan=False,
                default=_dataclass_fields,
            )
        except RecursionError:
            text = _canonical_text(value, sort_keys=sort_keys)
        return text.encode("utf-8", "surrogatepass")


class _Punctuation(str):
    """Text :func:`_canonical_text` writes as it is, not as a JSON string."""

    __slots__ = ()


_encode_string = json.encoder.encode_basestring  # type: ignore[attr-defined]


def _canonical_text(value: Any, *, sort_keys: bool = True) -> str:
    """``json.dumps(value, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=False,
    allow_nan=False)`` of a value of string keys, without recursion: a result nested 1,000
    deep (readers accept 1,024 levels) is past Python's recursion limit, and a digest must
    still be made."""
    parts: list[str] = []
    pending: list[Any] = [value]
    while pending:
        item = pending.pop()
        if type(item) is _Punctuation:
            parts.append(item)
        elif isinstance(item, str):
            parts.append(_encode_string(item))
        elif item is None or item is True or item is False:
            parts.append("null" if item is None else "true" if item else "false")
        elif isinstance(item, int):
            parts.append(int.__repr__(item))
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValueError(f"{item!r} is not JSON")
            parts.append(float.__repr__(item))
        elif isinstance(item, dict | list | tuple):
            pending.extend(reversed(_members(item, sort_keys)))
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            pending.extend(reversed(_members(_dataclass_fields(item), sort_keys)))
        else:
            raise TypeError(f"a {type(item).__name__} is not JSON")
    return "".join(parts)


def _members(container: dict[Any, Any] | list[Any] | tuple[Any, ...], sort_keys: bool) -> list[Any]:
    """A container's punctuation and members, in writing order (keys sorted, if ``sort_keys``)."""
    if isinstance(container, dict):
        if any(type(key) is not str for key in container):
            raise TypeError("only string keys are written without recursion")
        members: list[Any] = [_Punctuation("{")]
        items = sorted(container.items()) if sort_keys else container.items()
        for index, (key, member) in enumerate(items):
            members += [_Punctuation(("," if index else "") + _encode_string(key) + ":"), member]
        return [*members, _Punctuation("}")]
    members = [_Punctuation("[")]
    for index, member in enumerate(container):
        members += [_Punctuation(","), member] if index else [member]
    return [*members, _Punctuation("]")]


def outcome_json(value: Any, *, in_order: bool = False) -> bytes:
    """The canonical JSON of an outcome to record (:func:`canonical_json`); with
    ``in_order``, the same JSON with each dictionary's keys in its own order (what a journal
    keeps, since a replay hands the value back: its digest is the canonical JSON's).

    Raises ``ValueError`` for what reading the JSON back would not give: NaN and ±Infinity
    (orjson would write ``null``, which a replay would serve instead of the number), and a
    dictionary two of whose keys have one text (``1`` and ``"1"``: read back, only the
    last would be left). Keys other than text are the one way to such a pair, so the
    common value is written once, as before.
    """
    option = IN_ORDER if in_order else CANONICAL
    try:
        data = orjson.dumps(value, default=_dataclass_fields, option=option & ~orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:  # keys other than text, or JSON orjson does not write
        data = _json(value, option)
        _refuse_shared_key_texts(data)
    # orjson writes a non-finite float as null: only output holding null can hide one.
    if b"null" in data and _has_non_finite(value):
        raise ValueError("NaN and Infinity are not JSON: orjson would write them as null")
    return data


def _refuse_shared_key_texts(data: bytes) -> None:
    """Raise ``ValueError`` when an object in the JSON ``data`` has a key twice."""
    # Past the recursion limit, only _canonical_text wrote it, and it writes text keys alone.
    with contextlib.suppress(RecursionError):
        json.loads(data.decode("utf-8", "surrogatepass"), object_pairs_hook=_distinct_keys)


def _distinct_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) < len(pairs):
        shared = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise ValueError(f"keys of a dictionary share the text {shared!r}: read back, only one would be left")
    return found


def _has_non_finite(value: Any) -> bool:
    """Whether a NaN or ±Infinity is anywhere orjson reads one from in ``value`` (walked
    without recursion, as :func:`_canonical_text` writes it)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
        elif isinstance(item, enum.Enum):
            pending.append(item.value)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            pending.extend(getattr(item, field.name, None) for field in dataclasses.fields(item))
    return False


def digest_bytes(data: bytes) -> str:
    """``sha256:<hex>`` of raw bytes."""
    return PREFIX + hashlib.sha256(data).hexdigest()


def digest_value(value: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of ``value``.

    Values that are not JSON (a set, NaN) fall back to their ``repr``, so a digest is
    always produced and equal values still digest equally.
    """
    return digest_bytes(_digested_bytes(value))


def digest_text(text: str) -> str:
    """``sha256:<hex>`` of a string, e.g. the question put to a person."""
    return digest_bytes(text.encode("utf-8", "surrogatepass"))


Fingerprint = int | str
"""An outcome's identity, small enough to keep for every action of a long session: the
first 64 bits of its ``sha256:`` digest (an int), or, for a given digest that is not a
well-formed SHA-256, that digest itself (a str)."""

_SHA256_DIGEST = re.compile(r"sha256:[0-9a-fA-F]{64}")


def sha256_digest(text: str) -> str | None:
    """``text`` as a well-formed SHA-256 digest, ``sha256:`` and 64 hex digits, in its
    normal form: the digits lower-case, as :func:`digest_bytes` writes them; None when
    ``text`` is no such digest.

    Hex is read in either case (Java's ``HexFormat.of().withUpperCase()`` and .NET's
    ``Convert.ToHexString`` write upper case), so one digest in two cases is one outcome.
    The C fold (``_memory.c``'s ``digest_fingerprint``) reads digests the same way.
    """
    if _SHA256_DIGEST.fullmatch(text):
        return text.lower()
    return None


def normal_digest(digest: str) -> str:
    """A given digest as it is compared with others: :func:`sha256_digest`'s normal form
    of a SHA-256 digest, any other text as it is."""
    return sha256_digest(digest) or digest


def fingerprint(value: Any) -> int:
    """The first 64 bits of :func:`digest_value` of ``value``."""
    return int.from_bytes(hashlib.sha256(_digested_bytes(value)).digest()[:8], "big")


def _digested_bytes(value: Any) -> bytes:
    """What a digest of ``value`` is taken over: its canonical JSON, or for a value that
    is not JSON its ``repr`` (or, nested too deeply for that, its type's name)."""
    try:
        return canonical_json(value)
    except (TypeError, ValueError, RecursionError):
        pass
    try:
        return repr(value).encode("utf-8", "surrogatepass")
    except RecursionError:
        return f"<{type(value).__name__} nested too deeply to show>".encode()


def digest_fingerprint(digest: str) -> Fingerprint:
    """The fingerprint of a given digest: comparable with :func:`fingerprint` when it is
    SHA-256 (:func:`sha256_digest`, hex of either case)."""
    normal = sha256_digest(digest)
    if normal is not None:
        return int(normal[7:23], 16)
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
