"""``ActionRecord``: the one data type every front end produces.

A record is one agent action exactly as the seed's JSONL log writes it: a JSON object
with the seed's field names. Readers yield the parsed object itself, the span mapping
builds the same shape from span attributes, and rules only ever see records. Keeping
the record a plain mapping costs nothing to produce, which is what lets the checker keep
pace with the JSON parser on multi-gigabyte logs.

Field values are kept as given, never coerced: the rules decide what a wrong type means
(``max_attempts: "3"`` is not a cap, ``retryable: "yes"`` is not ``true``), so nothing is
silently repaired.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, NamedTuple, TypedDict

from durable_sessions import kinds
from durable_sessions.digest import Fingerprint, digest_fingerprint, digest_value, fingerprint

REQUIRED_FIELDS: tuple[str, ...] = ("session_id", "action_id", "kind", "status")
STATUSES: frozenset[str] = frozenset({"ok", "error", "started"})
ON_FAILURE_VALUES: frozenset[str] = frozenset({"ask_user", "abort", "compensate"})
REDACTED = "__REDACTED__"


class ActionRecord(TypedDict, total=False):
    """One agent action: the seed's fields, then the cross-process ones.

    ``result`` present (even ``null``) means the outcome was recorded by value;
    ``result_ref`` by reference; ``result_digest`` is ``sha256:<hex>`` of its canonical
    JSON. The last group is set by the span mapping only: ``redacted`` (the
    instrumentation replaced the result with a placeholder), ``result_length`` and
    ``value_limit`` (for the truncation check), ``session_source`` (``trace`` when no
    session attribute was found and the trace stands in for the session), and
    ``mapping_problems`` (what the span said that no field can carry, reported by
    ``invalid-field``).
    """

    session_id: str
    action_id: str
    kind: str
    status: str
    result: Any
    result_ref: str
    result_digest: str
    idempotency_key: str
    replay: str
    replayed: bool
    side_effects: bool
    retryable: bool
    max_attempts: int
    attempts: int
    cacheable: bool
    cache_key: str
    ttl_s: int
    cache_hit: bool
    on_failure: str
    name: str
    prompt_digest: str
    incarnation: str
    ts: str | float
    seq: int
    redacted: bool
    result_length: int
    value_limit: int
    session_source: str
    mapping_problems: tuple[str, ...]


class Location(NamedTuple):
    """Where a record came from: a file and line, or a trace and span."""

    file: str | None = None
    line: int | None = None
    trace_id: str | None = None
    span_id: str | None = None

    def __str__(self) -> str:
        if self.line is not None:
            return f"{self.file or '-'}:{self.line}"
        if self.span_id is not None:
            # an earlier action recalled from session memory keeps its span id only
            return f"span {self.span_id} (trace {self.trace_id})" if self.trace_id else f"span {self.span_id}"
        return self.file or "-"


NOWHERE = Location()
_new_location = tuple.__new__


def line_location(file: str, line: int) -> Location:
    """A file location, built without NamedTuple's keyword-handling overhead."""
    return _new_location(Location, (file, line, None, None))


def span_location(trace_id: str, span_id: str) -> Location:
    """A span location, built like :func:`line_location`."""
    return _new_location(Location, (None, None, trace_id, span_id))


def missing_fields(record: ActionRecord) -> tuple[str, ...]:
    """The required fields that are absent or not a non-empty string."""
    get = record.get
    if (
        type(get("session_id")) is str
        and type(get("action_id")) is str
        and type(get("kind")) is str
        and type(get("status")) is str
        and record["session_id"]
        and record["action_id"]
        and record["kind"]
        and record["status"]
    ):
        return ()
    return tuple(name for name in REQUIRED_FIELDS if type(get(name)) is not str or not get(name))


def is_redacted(record: ActionRecord) -> bool:
    """The instrumentation replaced the result with a placeholder."""
    return record.get("redacted") is True or record.get("result", None) == REDACTED


def is_recorded(record: ActionRecord) -> bool:
    """The outcome is in the record: by value (even ``null``), by reference or by digest.

    A redacted value is no record of the outcome; a reference beside it still is.
    """
    if "result" in record and record["result"] != REDACTED and record.get("redacted") is not True:
        return True
    return bool(record.get("result_ref") or record.get("result_digest"))


def is_side_effecting(record: ActionRecord) -> bool:
    """The action touches the world: a side-effecting kind or ``side_effects: true``."""
    return record.get("kind") in kinds.SIDE_EFFECTING or record.get("side_effects") is True


def outcome_fingerprint(record: ActionRecord) -> Fingerprint | None:
    """The identity of the recorded outcome: from the given digest, else from ``result``."""
    given = record.get("result_digest")
    if given and type(given) is str:
        return digest_fingerprint(given)
    if "result" in record and record["result"] != REDACTED:
        return fingerprint(record["result"])
    return None


def outcome_digest(record: ActionRecord) -> str | None:
    """The full digest of the recorded outcome, for messages."""
    given = record.get("result_digest")
    if given and type(given) is str:
        return given
    if "result" in record and record["result"] != REDACTED:
        return digest_value(record["result"])
    return None


def is_int(value: Any) -> bool:
    """A JSON integer: ``True`` and ``3.0`` are not integers, ``"3"`` is a string."""
    return type(value) is int


def attempt_number(record: ActionRecord) -> int | None:
    """The attempt ``record`` describes: its ``attempts``, or 1 when it has none (or null).

    A record is at least its action's first attempt, and the instrumentation writes
    ``attempts`` only from the second attempt on. None when ``attempts`` is not an
    integer: no rule reads a number into it (``invalid-field`` reports it).
    """
    attempts = record.get("attempts")
    if attempts is None:
        return 1
    return attempts if is_int(attempts) else None


MAX_EPOCH_S = 1e11
"""Epoch seconds are below this (the year 5138): a larger ``ts`` is in milliseconds, or
finer, which no rule may read as seconds."""


def is_epoch_seconds(value: float) -> bool:
    """A number that can be epoch seconds: finite and within :data:`MAX_EPOCH_S` of 0."""
    return -MAX_EPOCH_S < value < MAX_EPOCH_S


def parse_ts(value: Any) -> float | None:
    """Seconds since the epoch from an ISO-8601 string or a number; None if unusable
    (a number that cannot be epoch seconds, :func:`is_epoch_seconds`, included)."""
    if value is None or type(value) is bool:
        return None
    if type(value) is str:
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.timestamp()
    if type(value) in (int, float):
        try:
            seconds = float(value)
        except OverflowError:
            return None
        return seconds if is_epoch_seconds(seconds) else None
    return None
