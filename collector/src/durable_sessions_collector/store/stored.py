"""The action record as the sidecar stores it: contract fields only, bounded values.

Traces may carry personal data, and a span's ``agent.action.*`` attributes are its record:
an ``agent.action.notes`` of 6 MB, an ``agent.action.question`` or a prompt's text in
``agent.action.prompt_digest`` would otherwise be stored word for word and returned by the
APIs. :func:`stored_record` keeps what the rules read, and nothing else:

- **Fields**: only those of the contract (``docs/semconv.md``) and the ones the mapping
  sets (``session_source``, ``redacted``, ``result_length``, ``value_limit``,
  ``mapping_problems``). Any other field is **dropped**: no rule reads it, its name is
  itself text the client chose (``agent.action.<anything>``), and a span may carry any
  number of them, so even a digest of each would be unbounded.
- **Identifiers** (``session_id``, ``action_id``, ``kind``, ``name``,
  ``idempotency_key``, ``cache_key``, ``result_ref``, ``incarnation``) are kept as given up
  to :data:`MAX_TEXT` characters; a longer one is stored as its :func:`hidden` digest.
- **Values from a list** (``status``, ``replay``, ``on_failure``, ``session_source``) are
  kept when they are one of the contract's values, **digests** (``result_digest``,
  ``prompt_digest``) when they are ``sha256:`` and 64 hex digits of either case
  (:func:`~durable_sessions.digest.sha256_digest`); any other string there, and a string
  in a boolean or integer field, is stored as its digest.
- Booleans, numbers and null are kept. A non-empty list, object or bytes value (no field
  of the contract holds one) becomes one holding the value's digest.

A digest keeps what the rules need: the value's type, whether it is empty, equality
(equal values, equal digests), and that it is not one of the listed values or not a
well-formed digest, so a record judges the same with it as with the value.

The engine checks :func:`checked_record`: the record as mapped, but for the fields that
are compared with other records of the session (identifiers and digests), which it
takes from the stored record. A session rebuilt from the store (after a restart or an
eviction) then holds the state the engine first had: a long key of a new record is
compared with a rebuilt session's keys digest to digest. The other fields are judged
within their record only, so the engine sees them as given, and a violation quotes a bad
value as the offline checker does: its first 37 characters at most.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from durable_sessions import semconv as sc
from durable_sessions.digest import PREFIX, digest_value, sha256_digest
from durable_sessions.record import ON_FAILURE_VALUES, STATUSES, ActionRecord
from durable_sessions.rules.record_rules import time_component

MAX_TEXT = 256
"""The longest identifier stored as given, in characters (a SHA-256 digest is 71, a UUID
36, an ``idempotency_key()`` key 36; Stripe allows idempotency keys of 255)."""

HIDDEN_PREFIX = "hidden:sha256:"
_HIDDEN = re.compile(r"hidden:sha256:[0-9a-f]{7}(?:-[0-9a-f]{7}){7}(?:~[^~]{1,40})?")

_IDENTIFIERS = frozenset(
    {
        "session_id",
        "action_id",
        "kind",
        "name",
        "idempotency_key",
        "cache_key",
        "result_ref",
        "incarnation",
    }
)
_CHOICES: dict[str, frozenset[str]] = {
    "status": STATUSES,
    "replay": frozenset({sc.REPLAY_SKIP}),
    "on_failure": ON_FAILURE_VALUES,
    "session_source": frozenset({sc.SESSION_SOURCE_TRACE}),
}
_DIGESTS = frozenset({"result_digest", "prompt_digest"})
_NOT_TEXT = frozenset(
    {
        "replayed",
        "side_effects",
        "retryable",
        "cacheable",
        "cache_hit",
        "redacted",
        "max_attempts",
        "attempts",
        "ttl_s",
        "seq",
        "ts",
        "result_length",
        "value_limit",
        "mapping_problems",
    }
)
STORED_FIELDS = _IDENTIFIERS | frozenset(_CHOICES) | _DIGESTS | _NOT_TEXT
"""Every field a stored record may hold."""

_SCALARS = frozenset({bool, int, float, type(None)})


def native_rows_settings() -> dict[str, Any]:
    """The rules of :func:`stored_record` that the C rows (``store/_rows.c``) judge a record
    by, as ``_rows.Rows`` takes them: it builds a row only where these keep every value."""
    return {
        "identifiers": _IDENTIFIERS,
        "digests": _DIGESTS,
        "choices": _CHOICES,
        "no_text": _NOT_TEXT,
        "max_text": MAX_TEXT,
    }


def stored_record(record: ActionRecord) -> ActionRecord:
    """``record`` as the store keeps it (see the module's description); a new dict, in
    ``record``'s order. Applied to a stored record, it returns an equal one."""
    stored: dict[str, Any] = {}
    for name, value in record.items():
        if name not in STORED_FIELDS:
            continue
        kind = type(value)
        if kind in _SCALARS:
            stored[name] = value
        elif kind is not str:
            stored[name] = _hidden_container(value)
        # The prefix first: most values are no hidden form, and the regex alone cost each about
        # twice what the prefix test does (stored_record runs on every field of every span).
        elif not value or (value.startswith(HIDDEN_PREFIX) and _HIDDEN.fullmatch(value)):
            stored[name] = value
        elif name in _IDENTIFIERS:
            stored[name] = value if len(value) <= MAX_TEXT else _hidden_identifier(name, value)
        elif name in _DIGESTS:
            stored[name] = value if sha256_digest(value) is not None else hidden(value)
        elif name in _CHOICES:
            stored[name] = value if value in _CHOICES[name] else hidden(value)
        else:
            stored[name] = hidden(value)
    return stored  # type: ignore[return-value]


_COMPARED = _IDENTIFIERS | _DIGESTS
"""The fields the session rules compare across records (and the ones they quote whole)."""


def checked_record(record: ActionRecord, stored: ActionRecord) -> ActionRecord:
    """The record the engine checks: ``record`` with the identifiers and digests of
    ``stored`` (its :func:`stored_record`); ``record`` itself when they are the same."""
    changed = {
        name: stored[name] for name in _COMPARED.intersection(stored) if stored[name] is not record[name]
    }  # type: ignore[literal-required]
    if not changed:
        return record
    return {**record, **changed}  # type: ignore[typeddict-item]


def stored_text(value: str) -> str:
    """An identifier as a stored record holds it: ``value``, or its digest when longer than
    :data:`MAX_TEXT`. What a session is looked up by: the stored id of a long one."""
    if len(value) <= MAX_TEXT or _HIDDEN.fullmatch(value):
        return value
    return hidden(value)


def hidden(value: Any) -> str:
    """``hidden:sha256:`` and the SHA-256 of ``value`` (of its UTF-8 text; of the bytes; of
    the canonical JSON of anything else): its first 56 hex digits, in eight groups of seven
    joined by ``-``.

    Not a well-formed ``sha256:`` digest, so a bad ``result_digest`` stays one; and no date,
    epoch number or UUID can be read in it (no run of eight digits: groups of eight could
    read as a compact date, ``20261101``), so ``time-derived-key`` finds in a hidden key
    only what :func:`_hidden_identifier` appends."""
    if type(value) is str:
        data = value.encode("utf-8", "surrogatepass")
    elif isinstance(value, bytes | bytearray):
        data = bytes(value)
    else:
        data = None
    digits = hashlib.sha256(data).hexdigest() if data is not None else digest_value(value)[len(PREFIX) :]
    return HIDDEN_PREFIX + "-".join(digits[i : i + 7] for i in range(0, 56, 7))


def _hidden_identifier(name: str, value: str) -> str:
    """A long identifier's digest. A long idempotency key that holds a date, an epoch
    timestamp, a time-based UUID or a ULID keeps that part after a ``~``, so that
    ``time-derived-key`` reports the stored key as it reported the key (a time is no
    free text)."""
    shown = hidden(value)
    if name == "idempotency_key":
        component = time_component(value)
        if component is not None:
            found = component[component.index("'") + 1 : component.rindex("'")]
            shown += "~" + found
    return shown


def _hidden_container(value: Any) -> Any:
    """A list, object or bytes value of a field: empty as it is, else one of its kind that
    holds the value's digest (a type and a truth value the rules read, and no content)."""
    if not value:
        return value
    if isinstance(value, bytes | bytearray):
        if _HIDDEN.fullmatch(bytes(value).decode("ascii", "replace")):
            return value
        return hidden(value).encode()
    if isinstance(value, dict):
        if len(value) == 1 and type(value.get("hidden")) is str and _HIDDEN.fullmatch(value["hidden"]):
            return value
        return {"hidden": hidden(value)}
    if isinstance(value, list | tuple):
        if len(value) == 1 and type(value[0]) is str and _HIDDEN.fullmatch(value[0]):
            return list(value)
        return [hidden(value)]
    return hidden(repr(value))
