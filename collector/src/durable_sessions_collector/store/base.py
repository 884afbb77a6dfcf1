"""The store interface: what the sidecar keeps, independent of the database.

The SQLite implementation (:mod:`.sqlite`) is the embedded default; a PostgreSQL one
(several sidecar replicas sharing sessions) implements the same two protocols.

What is kept:

- **actions**: one row per (trace id, span id, status) — OTLP delivers at least once, a
  second delivery is dropped — holding the action record *without* result or prompt
  text (digests only), in arrival order, which is the order the engine saw them in, so
  that re-feeding a session's rows rebuilds exactly the state the engine had;
- **sessions**: first and last ingest time, whether the session is open (spans arrived
  since its end-of-session rules last ran), counts and the verdict;
- **violations**: unique on :attr:`Violation.key`, so re-checking a session never
  duplicates one; end-of-session violations that a later end no longer produces (the
  missing completion arrived after all) are marked resolved and leave the verdict;
- **outbox**: one row per (alert channel, violation), written in the same transaction
  as the violation, so an alert is raised once, also across restarts; and one per
  (alert channel, change of an end-of-session violation's status), written in the
  transaction that makes the change;
- **meta**: the schema version, the store's id (:data:`STORE_ID`), the rules whose findings the verdicts count
  (:data:`VERDICT_RULES`: a verdict counts only unresolved violations of those) and a
  recount of verdicts left to finish after they changed (:data:`RECOUNT`).

Everything is kept until :meth:`Writer.prune` deletes what is older than the retention
(``retention.sessions_s``): ended sessions with their rows, and rows of no session.

Writes happen in a :class:`Writer`, one transaction: everything in it is committed
together or not at all, and an Export is acknowledged only after its writer committed.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

import orjson

from durable_sessions.native import native_module
from durable_sessions.record import ActionRecord, Location
from durable_sessions.report import Verdict, verdict_of
from durable_sessions.violation import Severity, Violation
from durable_sessions_collector.alerts import FIRING, RESOLVED
from durable_sessions_collector.quote import quoted
from durable_sessions_collector.store.stored import checked_record, native_rows_settings, stored_record

SessionState = Literal["active", "ended"]
VERDICTS: tuple[Verdict, ...] = ("ok", "at_risk", "unrecoverable")
_BYTES_TAG = "__bytes_hex__"


class StoreError(RuntimeError):
    """The store cannot be opened or written (answered as retryable: UNAVAILABLE / 503).

    A writer raises it for the store's own state (unreachable, locked, full); any other
    error inside a write comes from the records written."""


def version_refused(name: str, found: object, reads: int, reader: str = "sidecar") -> StoreError:
    """The error for a store of another schema version than ``reads``, saying what to do:
    an older store is migrated by a sidecar of this version when it starts; a newer one
    was made by a newer sidecar, which alone reads it."""
    text = f"store {name!r} has schema version {found}, this {reader} reads {reads}"
    try:
        newer = int(str(found)) > reads
    except ValueError:
        return StoreError(text)
    if newer:
        return StoreError(f"{text}; it was made by a newer sidecar: use that version")
    return StoreError(f"{text}; a sidecar of this version migrates it when it starts")


class RecordRefused(ValueError):
    """The store refuses a record's values, now and on every retry (a value past a limit of
    the store's, text it cannot hold): the span is rejected, not retried.

    Other errors from the records written may also come from the store's state (a
    constraint of a schema being upgraded), so a request none of whose spans could be
    written with those is still answered as retryable."""


@dataclass(slots=True)  # not frozen: built for every ingested span, and a frozen init costs 5x
class ActionRow:
    """One action record to store, with where it came from, in the store's columns.

    Built by :func:`action_row`, one builder for both stores, in the thread that received
    the span (the writer thread only inserts it). The C rows (``_rows.c``) fill its slots
    without calling ``__init__``: it must stay a plain holder (no ``__post_init__``, no
    defaults), and ``_rows.Rows`` refuses it when its fields are not those it fills.
    """

    session_id: str | None
    trace_id: str
    span_id: str
    status: str
    record: ActionRecord
    """The record the engine checks (:func:`~.stored.checked_record`): as mapped, with the
    identifiers and digests of the stored record, which :attr:`text` holds."""
    action_id: str | None
    kind: str | None
    seq: int | None
    text: str
    """The record as :func:`encode_record` writes it."""


_INT64 = 2**63


def action_row(record: ActionRecord, trace_id: str, span_id: str) -> ActionRow:
    """The row ``record`` is stored as: its :func:`~.stored.stored_record` (contract fields
    only, no text longer than an identifier, digests for the rest), and the record the
    engine checks (:func:`~.stored.checked_record`). A column holds a field only when its
    type is the column's: a session id must be a non-empty string. ``seq`` orders the
    session's actions in a 64-bit integer column; a span's start time is unsigned and may
    not fit, so it is held to the column's range (the record keeps it exact), which keeps
    the order.

    The C extension ``_rows`` builds the row of a plain record (every value kept as given);
    :func:`reference_action_row` builds any other, and every row where it is not built."""
    if _ROWS is not None:
        row = _ROWS.row(record, trace_id, span_id)
        if row is not None:
            return row  # type: ignore[no-any-return]
    return reference_action_row(record, trace_id, span_id)


def reference_action_row(record: ActionRecord, trace_id: str, span_id: str) -> ActionRow:
    """:func:`action_row` in Python: the reference of the C rows."""
    stored = stored_record(record)
    session_id, status = stored.get("session_id"), stored.get("status")
    action_id, kind, seq = stored.get("action_id"), stored.get("kind"), stored.get("seq")
    return ActionRow(
        session_id if type(session_id) is str and session_id else None,
        trace_id,
        span_id,
        status if type(status) is str else repr(status),
        checked_record(record, stored),
        action_id if type(action_id) is str else None,
        kind if type(kind) is str else None,
        min(max(seq, -_INT64), _INT64 - 1) if type(seq) is int else None,
        encode_record(stored),
    )


def _native_rows() -> Any:
    rows = native_module("_rows", package="durable_sessions_collector.store", warn=False)  # serve logs it
    if rows is None:
        return None
    return rows.Rows(
        **native_rows_settings(),
        row_type=ActionRow,
        dumps=orjson.dumps,
        smallest_float=_ORJSON_SMALLEST_FLOAT,
    )


def native_rows_in_use() -> bool:
    """Whether :func:`action_row` tries the C rows first (built, and not turned off by
    ``DURABLE_SESSIONS_NATIVE``)."""
    return _ROWS is not None


TEXT_COLUMNS = ("session_id", "action_id", "kind", "status", "trace_id", "span_id")
"""The fields of an :class:`ActionRow` that a store keeps in a text column of their own."""


def refuse_nul(row: ActionRow) -> None:
    """Raise :class:`RecordRefused` when a text column of ``row`` would hold NUL (U+0000).

    PostgreSQL text cannot hold NUL, and writing something else in its place made two ids
    one (``a\\x00b`` and ``a\\ufffdb``) and answered an id the client never sent. Every
    store refuses such a span, so that they answer alike; a NUL in any other field is kept
    (the record is JSON, which escapes it)."""
    # One scan of the columns run together first: this runs for every span on the writer
    # thread, where the loop below took three times as long. The loop only names the column.
    # (Each is a str or None, and "None" holds no NUL.)
    if "\x00" not in f"{row.session_id}{row.action_id}{row.kind}{row.status}{row.trace_id}{row.span_id}":
        return
    for name in TEXT_COLUMNS:
        value = getattr(row, name)
        if value is not None and "\x00" in value:
            raise RecordRefused(
                f"its {name} {quoted(value)} holds NUL (U+0000), which no store keeps in an id"
            )


class StoredSession(NamedTuple):
    """What a store several replicas share holds of a session, read under its lock."""

    actions: int
    """How many actions it has stored (0: none, or no session)."""
    first_seen: float | None
    """When its row was made: the ``now`` of :meth:`Writer.touch_session` in the
    transaction that stored its first action; None when there is no row. A session that
    retention deleted and spans started afresh has another, whatever its action count."""


NO_SESSION = StoredSession(0, None)


class KeptState(NamedTuple):
    """The engine's state of a session as kept in the store (:meth:`Writer.keep_state`)."""

    fed: int
    """How many of the session's stored records the state holds: its first ``fed``."""
    through_id: int
    """The id of the last of them: the records after it are the ones to re-feed."""
    state: bytes
    """What ``Checker.snapshot`` gave."""


@dataclass(frozen=True, slots=True)
class SessionSummary:
    session_id: str
    verdict: Verdict
    state: SessionState
    actions: int
    errors: int
    warnings: int
    first_seen: float
    last_seen: float
    ended_at: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "verdict": self.verdict,
            "state": self.state,
            "actions": self.actions,
            "errors": self.errors,
            "warnings": self.warnings,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
            "ended_at": self.ended_at,
        }


@dataclass(frozen=True, slots=True)
class SessionDetail:
    """A session with a page of its actions and a page of its violations."""

    summary: SessionSummary
    actions: list[dict[str, Any]] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    next_actions: ActionPosition | None = None
    """Where the next page of actions starts; None on the last page."""
    next_violations: int | None = None
    """Where the next page of violations starts (after this id); None on the last page."""

    def as_dict(self) -> dict[str, Any]:
        head = self.summary.as_dict()
        head["action_count"] = head.pop("actions")
        return {**head, "actions": self.actions, "violations": self.violations}


ActionPosition = tuple[int, int]
"""An action's place in its session's order: its order key (:data:`ACTION_ORDER`), its id."""

DEFAULT_DETAIL_PAGE = 1000
MAX_DETAIL_PAGE = 5000
"""Actions, and violations, in one page of a session's detail: a session of a million
actions read whole took gigabytes of the sidecar's memory. A page of 5,000 typical
actions is a gRPC message of about 3 MiB (10,000 were 6 MiB)."""

MAX_PAGE_BYTES = 1_000_000
"""The stored bytes one page of actions, one of violations, or one of the session list
holds at most (always at least one item): pages of large records end sooner, so that
the summary and both pages of a detail stay under gRPC clients' default message limit
of 4 MiB. A session id repeats in every record and every violation of the gRPC answer:
80 actions of a 100 kB session id made a 16 MB message, which no client took."""

ITEM_OVERHEAD_BYTES = 64
"""Counted for each item of a page beyond its text: field tags, lengths, numbers."""


@dataclass(frozen=True, slots=True)
class DetailPages:
    """Which page of a session's actions, and which of its violations, to read: at most
    ``*_limit`` of them, after ``*_after`` (a :class:`SessionDetail`'s ``next_*``)."""

    actions_limit: int = DEFAULT_DETAIL_PAGE
    actions_after: ActionPosition | None = None
    violations_limit: int = DEFAULT_DETAIL_PAGE
    violations_after: int | None = None


FIRST_PAGES = DetailPages()
"""The first page of a session's actions and of its violations, of the default size."""

ACTION_ORDER = "coalesce(seq, -9223372036854775807 - 1)"
"""A session's actions in order: start time (a record without one first, as both stores
sorted them), then arrival. The smallest 64-bit integer is written as a sum: the literal
-9223372036854775808 is a numeric, not a bigint, to PostgreSQL."""


VERDICT_RULES = "verdict_rules"
"""The ``meta`` key of the rules whose findings the store's verdicts count: their ids as
a sorted JSON list (:func:`encode_rules`). Absent in a store no sidecar has recorded it
in yet, whose verdicts counted every finding."""

STORE_ID = "store_id"
"""The ``meta`` key of the store's id: random, written once when a sidecar first opens the
store (a store of an earlier sidecar gets one at its next start), never changed. It tells
a ``WatchAlerts`` cursor of this store from one of a store lost and made anew, whose feed
counts from the start again (see :mod:`~durable_sessions_collector.api.alert_cursor`)."""


def new_store_id() -> str:
    """A store id for :data:`STORE_ID`: 64 random bits, as 16 hexadecimal digits."""
    return secrets.token_hex(8)


RECOUNT = "verdict_recount"
"""The ``meta`` key of a recount of verdicts left to finish after the counted rules
changed: ``{"rules": [changed rule ids], "after": last session id recounted}``
(:func:`encode_recount`). Absent when none is left; each step of the recount moves
``after`` in the transaction that recounts, so a crash resumes where it stopped."""


def encode_rules(rules: Iterable[str]) -> str:
    """A selection of rules as :data:`VERDICT_RULES` holds it: sorted, so equal selections
    are equal text."""
    return json.dumps(sorted(rules), separators=(",", ":"))


def decode_rules(text: str | None) -> frozenset[str] | None:
    """The selection :func:`encode_rules` wrote; None for no text."""
    return None if text is None else frozenset(json.loads(text))


def encode_recount(rules: Iterable[str], after: str) -> str:
    return json.dumps({"rules": sorted(rules), "after": after}, separators=(",", ":"))


def decode_recount(text: str | None) -> tuple[frozenset[str], str] | None:
    """(changed rules, the session id the recount goes on after) from :data:`RECOUNT`."""
    if text is None:
        return None
    found = json.loads(text)
    return frozenset(found["rules"]), str(found["after"])


def counts_in_verdict(rule: str, counted: frozenset[str] | None) -> bool:
    """Whether a finding of ``rule`` counts in its session's verdict when the verdicts
    count ``counted`` (None: every rule, as a store of one sidecar that never chose)."""
    return counted is None or rule in counted


def tally(rows: Iterable[tuple[str, str, int]], counted: frozenset[str] | None) -> tuple[int, int, Verdict]:
    """(errors, warnings, verdict) of a session from its unresolved violations counted by
    (rule, severity, count), counting only the rules of ``counted``
    (:func:`counts_in_verdict`). One per rule and severity is few rows: filtering them
    here keeps the store's statement the same for every selection."""
    errors = warnings = 0
    for rule, severity, count in rows:
        if counts_in_verdict(rule, counted):
            if severity == "error":
                errors += int(count)
            elif severity == "warning":
                warnings += int(count)
    severities = ([Severity.ERROR] if errors else []) + ([Severity.WARNING] if warnings else [])
    return errors, warnings, verdict_of(severities)


def split_page(
    rows: list[Any], limit: int, size_of: Callable[[Any], int] | None = None
) -> tuple[list[Any], bool]:
    """``rows`` read one more than ``limit`` of: the page, and whether there are more.

    With ``size_of``, the page also ends before the row that would take it past
    :data:`MAX_PAGE_BYTES` (its first row is always in it, however large).
    """
    rows, more = rows[:limit], len(rows) > limit
    if size_of is None:
        return rows, more
    total = 0
    for index, row in enumerate(rows):
        total += size_of(row) + ITEM_OVERHEAD_BYTES
        if total > MAX_PAGE_BYTES and index:
            return rows[:index], True
    return rows, more


def text_bytes(*values: str | bytes | None) -> int:
    """How many bytes ``values`` take as UTF-8 (what protobuf and JSON answers send)."""
    return sum(
        len(value) if isinstance(value, bytes) else len(value.encode("utf-8", "surrogatepass"))
        for value in values
        if value is not None
    )


def action_page(
    rows: list[tuple[Any, ...]], limit: int
) -> tuple[list[dict[str, Any]], ActionPosition | None]:
    """A page of actions from ``rows`` — ``(order key, id, trace_id, span_id, received_at,
    record)``, one more than ``limit`` when there are more — and where the next page starts."""
    rows, more = split_page(rows, limit, lambda row: text_bytes(row[2], row[3], row[5]))
    actions = []
    for _key, _id, trace_id, span_id, received_at, record in rows:
        action = {
            "trace_id": trace_id,
            "span_id": span_id,
            "received_at": received_at,
            **decode_record(record),
        }
        for name, value in list(action.items()):
            if isinstance(value, bytes):
                action[name] = {"bytes_hex": value.hex()}
        actions.append(action)
    return actions, ((rows[-1][0], rows[-1][1]) if more and rows else None)


def violation_page(
    rows: list[tuple[Any, ...]], limit: int, session_id: str, counted: frozenset[str] | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """A page of violations of ``session_id`` from ``rows`` — ``(id, *VIOLATION_COLUMNS)``,
    one more than ``limit`` when there are more — and the id after which the next page
    starts. Each violation's size counts the session id, which the gRPC answer repeats.
    Each says ``not_counted`` when its rule is not among ``counted``, the rules the
    verdicts count (:func:`counts_in_verdict`): it stays listed, and leaves the verdict
    and the counts of errors and warnings alone."""
    repeated = text_bytes(session_id)
    rows, more = split_page(
        rows, limit, lambda row: repeated + text_bytes(*(v for v in row[1:] if isinstance(v, (str, bytes))))
    )
    violations = [violation_detail(row[1:]) for row in rows]
    for violation in violations:
        violation["not_counted"] = not counts_in_verdict(violation["rule"], counted)
    return violations, (rows[-1][0] if more and rows else None)


@dataclass(frozen=True, slots=True)
class Alert:
    """A pending alert of one channel, from the outbox."""

    id: int
    channel: str
    violation_key: str
    payload: dict[str, Any]
    attempts: int
    claim: float | None = None
    """On a store several replicas share: the ``next_attempt_at`` this replica's claim set,
    which stays the row's until the claim ends (the claim's token: a mark or a renewal
    applies only while the row still holds it). None on a store of one writer."""


class Settled(NamedTuple):
    """What one :meth:`Writer.resolve_end_violations` changed."""

    resolved: list[dict[str, Any]]
    """The violations resolved now, as :func:`violation_detail` shows them."""
    held_again: set[str]
    """The keys of the violations that were resolved and hold again."""


@dataclass(frozen=True)
class DeadAlert:
    """A dead-lettered alert: delivery gave up after its attempts, or on a refusal."""

    id: int
    channel: str
    violation_key: str
    payload: dict[str, Any]
    attempts: int
    last_error: str | None
    created_at: float


INDEX_BUILT = "built"
INDEX_LEFT_TO_ANOTHER = "left to another replica"
INDEX_FAILED = "failed"
IndexReport = Callable[[str, str, "str | None"], object]
"""How :meth:`Store.build_indexes` reports an index: its name, the outcome, the error."""


@dataclass(frozen=True, slots=True)
class Pruned:
    """What one :meth:`Writer.prune` deleted."""

    sessions: list[str]
    """The ended sessions deleted, each with its actions, violations and their alerts
    that were not pending."""
    orphans: int
    """Rows of no session deleted: actions and violations without a session id, and
    delivered or dead alerts whose violation was gone."""
    full: bool
    """A kind of row reached the pass's limit, or actions of a deleted session are left:
    more may be left for the next pass."""


def within_budget(
    found: list[tuple[str, int]], max_actions: int | None
) -> tuple[list[str], bool, str | None]:
    """The sessions of ``found`` (id and stored action count, oldest first) that one pass
    deletes: as many as hold ``max_actions`` actions together, and the first whatever its
    size; whether the budget left any of them out; and the first, if it alone holds more
    than the budget (its actions are then left to later passes). None is no budget."""
    taken: list[str] = []
    total = 0
    for session_id, actions in found:
        total += actions
        if taken and max_actions is not None and total > max_actions:
            return taken, True, _oversized(found, max_actions)
        taken.append(session_id)
    return taken, False, _oversized(found, max_actions)


def _oversized(found: list[tuple[str, int]], max_actions: int | None) -> str | None:
    if found and max_actions is not None and found[0][1] > max_actions:
        return found[0][0]
    return None


def forget_some(
    forgetting: list[tuple[str, int]],
    budget: int | None,
    delete_actions: Callable[[str, int, int | None], tuple[int, bool]],
    forgotten: Callable[[str, int], None],
) -> tuple[int, bool]:
    """Delete up to ``budget`` actions (None: all) of sessions being forgotten, each given
    as (session id, ``through_id``): ``delete_actions(session, through_id, most)`` deletes
    up to ``most`` of its actions up to that id and returns how many, and whether none are
    left; ``forgotten`` drops a session none are left of. Returns the actions deleted and
    whether any are left."""
    deleted = 0
    for session_id, through_id in forgetting:
        most = None if budget is None else budget - deleted
        if most is not None and most <= 0:
            return deleted, True
        count, done = delete_actions(session_id, through_id, most)
        deleted += count
        if not done:
            return deleted, True
        forgotten(session_id, through_id)
    return deleted, False


class Writer(Protocol):
    """One write transaction. Used by one thread at a time."""

    def add_action(self, row: ActionRow, received_at: float) -> bool:
        """Store ``row``; False when the same (trace, span, status) is already stored."""

    def is_stored(self, row: ActionRow) -> bool:
        """Whether :meth:`add_action` would find ``row`` stored already (a redelivery)."""

    def session_records(self, session_id: str, after_id: int = 0) -> Iterator[tuple[ActionRecord, Location]]:
        """The stored records of ``session_id`` in arrival order (this transaction's
        included), those stored after the record of id ``after_id`` only."""

    def keep_state(
        self, session_id: str, fed: int, state: bytes, if_stored: StoredSession | None = None
    ) -> None:
        """Keep ``state``, the engine's state of ``session_id`` after all of its stored
        records, which are ``fed``; it replaces the state kept before.

        ``if_stored``: for a session of a shared store that this transaction has not locked
        (:meth:`lock_sessions`), which another replica may be writing meanwhile: the state
        is kept only if the store holds that of the session still (its action count is
        ``fed``, its row the one the state was fed from), and it replaces no state kept of
        more records. A store of one writer keeps it regardless."""

    def kept_state(self, session_id: str) -> KeptState | None:
        """The state kept of ``session_id``, if it still holds the session's first records:
        None when none is kept, or when the store no longer holds exactly ``fed`` records
        of the session up to ``through_id`` (retention deleted the session and spans
        started it afresh; another replica wrote to it before the state was kept)."""

    def add_violation(self, violation: Violation, *, at_end: bool, now: float) -> bool:
        """Store ``violation``; True when it is new (its key was not stored), so it alerts.
        A stored one is left as it is: resolved or not (:meth:`resolve_end_violations`)."""

    def resolve_end_violations(self, session_id: str, keep: set[str], *, now: float) -> Settled:
        """At the session's end, ``keep`` being the keys of the end-of-session violations
        found (each stored already): mark its stored end-of-session violations not in
        ``keep`` resolved, and those in ``keep`` that were resolved unresolved again (they
        hold once more). Each change is written to the violation feed too, detected at
        ``now`` (``violation_changes``, read by :meth:`Store.violations_after`). Returns
        what changed, to alert on in the same transaction.

        Only violations of the rules the verdicts count (:attr:`Store.counted`) are
        touched: the others' rules did not run, so not finding them again says nothing,
        and they are left as they are."""

    def touch_session(self, session_id: str, now: float, added: int) -> None:
        """Record activity: ``added`` new actions at ``now``; the session is open again."""

    def end_session(self, session_id: str, now: float) -> None:
        """The session's end-of-session rules ran at ``now``."""

    def refresh_verdict(self, session_id: str) -> Verdict:
        """Recount the session's unresolved violations of the rules the verdicts count
        (:attr:`Store.counted`, as the writer was begun) and store its verdict and its
        counts of errors and warnings."""

    def read_meta(self, key: str) -> str | None:
        """The value of ``key`` in the ``meta`` table; None when it has none."""

    def write_meta(self, key: str, value: str | None) -> None:
        """Set ``key`` of the ``meta`` table to ``value``; None deletes it."""

    def lock_verdict_rules(self) -> None:
        """Before :data:`VERDICT_RULES` or :data:`RECOUNT` is read to be changed: on a
        store several replicas share, take a lock for the rest of the transaction, so that
        replicas starting together change them one after the other. Taken before any
        session's lock (:meth:`lock_sessions`), never after one."""

    def sessions_with_rules(
        self, rules: frozenset[str], after: str, window: int
    ) -> tuple[list[str], str | None]:
        """Of the ``window`` sessions whose ids follow ``after`` (in the store's order of
        ids), those with a violation of one of ``rules``; and the last id of the window,
        None when no session follows ``after``. Bounded by ``window`` sessions, however
        few have such violations: a step of a recount."""

    def enqueue_alert(self, channel: str, violation_key: str, payload: dict[str, Any], now: float) -> None:
        """Add an alert for ``channel`` to the outbox (once per channel and violation)."""

    def mark_delivered(self, alerts: Sequence[Alert], now: float) -> None:
        """The alerts were delivered. Only a pending row is marked, and on a shared store
        only while it still holds this replica's claim (:attr:`Alert.claim`): a replica
        whose claim ran out leaves the row to the one that claimed it next."""

    def mark_failed(self, alert: Alert, error: str, retry_at: float | None, failed: int = 1) -> None:
        """``failed`` delivery attempts failed (more than one when the store refused to
        record the earlier ones), the last with ``error``; retry at ``retry_at``, or
        dead-letter it when None. Only a pending row still held (as for
        :meth:`mark_delivered`) is marked, so an alert another replica delivered is never
        turned dead."""

    def redeliver_dead(self, channel: str | None, now: float) -> int:
        """Queue the dead-lettered alerts (of ``channel``, or all) for delivery again at
        ``now``, with their attempts counted from zero; return how many."""

    def idle_sessions(self, cutoff: float, limit: int) -> list[str]:
        """Open sessions with no activity since ``cutoff``, oldest first."""

    def prune(self, cutoff: float, limit: int, max_actions: int | None = None) -> Pruned:
        """Delete what the retention no longer keeps, up to ``limit`` of each kind below,
        and return what was deleted.

        - First, up to ``max_actions`` actions of sessions an earlier pass deleted but for
          their actions (below); a session none are left of is done.
        - Up to ``limit`` ended sessions (``open = 0``) last seen before ``cutoff``, oldest
          first, and no more than hold the rest of ``max_actions`` actions together: each
          with its actions, its violations, the outbox rows of those violations that are
          not pending, and the session row. A pending alert is kept: it is still
          delivered, and deleted by a later pass once delivered or dead. A first session
          that alone holds more actions than are left is deleted but for its actions:
          they are marked as no session's (up to the largest action id it has), skipped
          by every read of the session, and deleted by the next passes a budget at a time,
          so no pass deletes more than ``max_actions`` actions. Spans that arrive for its
          id meanwhile start it afresh.
        - Up to ``limit`` actions without a session received before ``cutoff``, and up to
          ``limit`` violations without a session created before it.
        - Up to ``limit`` delivered or dead outbox rows whose violation is gone and whose
          ``next_attempt_at`` is before ``cutoff`` (the time of the last retry, or on a
          shared store the end of the last claim; never before the row was created) —
          only when fewer than ``limit`` sessions were found: while old sessions are left
          over, so are old alerts of stored violations, and reading past them all on
          every pass would be slow.

        A store several replicas share deletes only sessions whose lock this transaction
        takes and that are still ended and last seen before ``cutoff`` under the lock, so
        that a session another replica is writing is never deleted under it. A store
        that gives a deleted largest id to the next row (SQLite) keeps the newest
        violation, and so its session: a violation-feed cursor is a violation id.

        Every statement goes through an index. Beyond the rows it deletes, a pass reads
        the rows of no session that are younger than ``cutoff``, and the delivered or
        dead alerts older than ``cutoff`` of violations still stored."""

    def lock_sessions(self, session_ids: list[str]) -> dict[str, StoredSession] | None:
        """Before the sessions are written: None when this process is the store's only
        writer; with a store several replicas share, lock the sessions for the rest of
        the transaction and return what the store holds of each (:class:`StoredSession`),
        so that the evaluator rebuilds a session another replica has added spans to, or
        deleted and started afresh."""


class Store(Protocol):
    """The durable store of sessions. Reads may come from any thread."""

    migrated_from: str | None
    """The schema version this store was migrated from when it was opened; None when
    it needed no migration."""

    shared: bool
    """Several sidecars may write it at once (PostgreSQL): another may leave alerts behind."""

    counted: frozenset[str] | None
    """The rules whose unresolved findings the verdicts of the writers begun from now on
    count, and which a session's detail shows as counted (None, as opened: every rule).
    Set by the sidecar at start-up from its selection of rules (see
    :mod:`~durable_sessions_collector.verdict_rules`)."""

    def writer(self) -> AbstractContextManager[Writer]:
        """A transaction: committed when the block ends, rolled back if it raises."""

    def list_sessions(
        self, verdict: Verdict | None = None, limit: int = 100, after: tuple[float, str] | None = None
    ) -> list[SessionSummary]:
        """Sessions, most recently active first (then by id, descending), optionally only
        those with ``verdict``; ``after`` = (last_seen, session_id) of the last session of
        the previous page."""

    def list_sessions_by_id(
        self, verdict: Verdict | None = None, limit: int = 100, after: str | None = None
    ) -> list[SessionSummary]:
        """Sessions in the order of their ids, optionally only those with ``verdict``;
        ``after`` = the id of the last session of the previous page. An id never changes,
        so a walk through the pages lists every session that exists throughout it once,
        however active it is meanwhile."""

    def get_session(self, session_id: str, pages: DetailPages = FIRST_PAGES) -> SessionDetail | None:
        """One session: its verdict, a page of its actions in order (start time, then
        arrival) and a page of its violations in the order they were found."""

    def verdict_counts(self) -> dict[str, int]:
        """How many sessions have each verdict."""

    def pending_alerts(self, channel: str, now: float, limit: int = 100) -> list[Alert]:
        """Alerts of ``channel`` due for delivery at ``now``.

        A store shared by several replicas (PostgreSQL) also *claims* the rows it
        returns for a lease, so that one replica delivers each; ``mark_delivered`` or
        ``mark_failed`` ends the claim. A row whose lease ran out may be claimed by
        another replica: call :meth:`hold_alert` right before each attempt."""

    def hold_alert(self, alert: Alert, now: float, attempt_s: float) -> Alert | None:
        """Before an attempt at ``alert`` (claimed by :meth:`pending_alerts`): the alert,
        its claim renewed to cover an attempt of up to ``attempt_s`` from ``now`` and the
        lease after it; None when it is no longer this replica's to send (its lease ran
        out and another replica claimed it, or it is no longer pending). A store of one
        writer returns ``alert`` as it is."""

    def release_alerts(self, alerts: Sequence[Alert], due_at: float) -> None:
        """Give back the claims of ``alerts`` (claimed, not attempted): they are due again
        at ``due_at``, for this replica or another, instead of at the end of the lease. A
        claim that is no longer this replica's is left alone; a store of one writer has
        nothing to give back."""

    def alert_counts(self) -> dict[tuple[str, str], int]:
        """Outbox rows by (channel, state)."""

    def dead_alerts(self, channel: str | None = None, limit: int = 100) -> list[DeadAlert]:
        """Dead-lettered alerts (of ``channel``, or all), oldest first."""

    def violation_cursor(self) -> str:
        """A cursor at the end of the violation feed: what commits from now on follows it."""

    def feed_start(self) -> str:
        """A cursor before the first violation and change the violation feed holds."""

    def store_id(self) -> str | None:
        """The store's id (:data:`STORE_ID`); None in a store no sidecar of this version
        has opened yet."""

    def violations_after(self, cursor: str, limit: int = 100) -> tuple[list[dict[str, Any]], str]:
        """The feed after ``cursor`` in commit order: committed new violations and changes
        of a violation's status (:meth:`Writer.resolve_end_violations`), at most ``limit``
        (see :func:`feed_item`; each with the ``cursor`` to resume after it), and the
        cursor after the last one; ValueError for a cursor of another store. A cursor
        of an earlier version of the store still resumes where it was."""

    def check(self) -> None:
        """Raise :class:`StoreError` when the store cannot be read."""

    def now(self) -> float:
        """The time (seconds since the epoch) on the store's own clock, which every
        sidecar writing the store shares (PostgreSQL: the server's), so that replicas
        compare activity times with one clock; SQLite, which one sidecar writes: this
        host's clock kept from going back (a step back of the host's clock must not delay
        ends and retries by its size). Every time a sidecar writes to the store or
        compares with what is stored (activity, due times, claims) is read here.
        :class:`StoreError` when it cannot be read."""

    def build_indexes(self, report: IndexReport) -> threading.Thread | None:
        """Build, in the background, the indexes a store made by an earlier sidecar lacks
        (the store works without them, only slower), calling ``report`` from that thread
        once per index with :data:`INDEX_BUILT`, :data:`INDEX_LEFT_TO_ANOTHER` (another
        replica is building it) or :data:`INDEX_FAILED` and the reason. Returns that
        thread (join it to wait for the builds), or None when there is nothing to build."""

    def close(self) -> None: ...


def cursor_position(cursor: str, kind: str, numbers: int | tuple[int, ...] = 1) -> tuple[int, ...]:
    """The integers of a ``KIND:N[:M…]`` violation-feed cursor of this store's ``kind``,
    ``numbers`` of them (or any of these counts: a store whose cursors grew reads its
    older ones too); ValueError, quoting it shortened, for anything else (each must fit
    64 signed bits)."""
    parts = cursor.split(":")
    digits = parts[1:]
    counts = (numbers,) if isinstance(numbers, int) else numbers
    if parts[0] != kind or len(digits) not in counts or not all(_is_position(text) for text in digits):
        raise ValueError(f"not a cursor of this store: {quoted(cursor)}")
    return tuple(int(text) for text in digits)


def _is_position(text: str) -> bool:
    return 0 < len(text) <= 19 and text.isascii() and text.isdigit() and int(text) < _INT64


VIOLATION_COLUMNS = "key, rule, severity, message, action_id, trace_id, span_id, at_end, resolved, created_at"
"""The columns :func:`violation_detail` reads, in its order."""


OUTBOX_CHANNELS = (
    "WITH RECURSIVE channels (name) AS ("
    " SELECT min(channel) FROM outbox"
    " UNION ALL SELECT (SELECT min(channel) FROM outbox WHERE channel > name) FROM channels"
    " WHERE name IS NOT NULL"
    ") SELECT name FROM channels WHERE name IS NOT NULL"
)
"""The alert channels of the outbox's rows, one index seek each (both stores index the
outbox by channel first): ``SELECT DISTINCT channel`` would read the whole index."""


def violation_of_outbox_key(outbox_key: str) -> str:
    """SQL for the key of the violation an outbox row is about, from the row's key
    (``outbox_key``, SQL), which is the violation's key, or for a change of status that
    and ``:`` and the change (:func:`~durable_sessions_collector.alerts.outbox_key`:
    ``:resolved:<µs>``, ``:firing:<µs>``). A violation's key ends with a span id or an
    occurrence, never with such a change, so it is never cut."""
    stem = f"rtrim({outbox_key}, '0123456789')"
    cut = " ".join(  # no LIKE: its '%' is a placeholder to psycopg
        f"WHEN substr({stem}, length({stem}) - {len(status) + 1}) = ':{status}:'"
        f" THEN substr({stem}, 1, length({stem}) - {len(status) + 2})"
        for status in (RESOLVED, FIRING)
    )
    return f"(CASE {cut} ELSE {outbox_key} END)"


IN_VIOLATION_ORDER = (
    f"({violation_of_outbox_key('o.violation_key')} = o.violation_key"
    " OR NOT EXISTS (SELECT 1 FROM outbox AS e WHERE e.channel = o.channel AND e.state = 'pending'"
    f" AND e.id < o.id AND {violation_of_outbox_key('e.violation_key')} = {violation_of_outbox_key('o.violation_key')}))"
)
"""SQL that holds an outbox row ``o`` back while an earlier row of the same violation is
pending on its channel, so that a violation's alerts (fired, resolved, fired again) reach
each channel in the order they happened, also when one of them is retried after a
failure. A violation's first alert has no earlier row: only a change of status, which is
rare, looks for one (among the channel's pending rows)."""


def violation_detail(row: tuple[Any, ...] | list[Any]) -> dict[str, Any]:
    """A stored violation as the APIs show it, from a row of :data:`VIOLATION_COLUMNS`."""
    key, rule, severity, message, action_id, trace_id, span_id, at_end, resolved, created_at = row
    return {
        "key": key,
        "rule": rule,
        "severity": severity,
        "message": message,
        "action_id": action_id,
        "trace_id": trace_id,
        "span_id": span_id,
        "at_session_end": bool(at_end),
        "resolved": bool(resolved),
        "created_at": created_at,
    }


def feed_item(
    row: tuple[Any, ...] | list[Any], status: str = FIRING, detected_at: float | None = None
) -> dict[str, Any]:
    """An item of the feed, from :data:`FEED_COLUMNS` (key, session_id, rule, severity,
    message, action_id, trace_id, span_id, at_end, resolved, created_at, the session's
    verdict now): the violation as stored now, its ``session_verdict`` now, and what the
    item reports — its ``status`` (``firing``: a new violation, or one that holds again;
    ``resolved``) and when that was found, ``detected_at`` (a new violation's
    ``created_at`` unless given)."""
    key, session_id, *columns, verdict = row
    found = violation_detail((key, *columns))
    return {
        **found,
        "session_id": session_id,
        "session_verdict": verdict,
        "status": status,
        "detected_at": found["created_at"] if detected_at is None else detected_at,
    }


# --- the violation feed (WatchAlerts): new violations and changes of their status ---------


def status_changes(
    resolved: list[dict[str, Any]], held_again: set[str], now: float
) -> list[tuple[str, float, str]]:
    """The rows of ``violation_changes`` one :meth:`Writer.resolve_end_violations` writes,
    as (status, detected_at, violation key): the violations ``resolved`` (in their order),
    then those that hold again (by key: a set has no order of its own)."""
    return [(RESOLVED, now, violation["key"]) for violation in resolved] + [
        (FIRING, now, key) for key in sorted(held_again)
    ]


FEED_COLUMNS = (
    "v.key, v.session_id, v.rule, v.severity, v.message, v.action_id, v.trace_id, v.span_id, "
    "v.at_end, v.resolved, v.created_at, s.verdict"
)
"""What :func:`feed_item` reads of a violation ``v`` and its session ``s``."""
FEED_VIOLATIONS = "FROM violations v LEFT JOIN sessions s ON s.session_id = v.session_id"
"""The feed's new violations, each with its session (none for a violation of no session)."""
FEED_CHANGES = (
    "FROM violation_changes c JOIN violations v ON v.id = c.violation_id "
    "LEFT JOIN sessions s ON s.session_id = v.session_id"
)
"""The feed's changes of status ``c``, each with its violation (a change whose violation
is gone is left out) and session."""

FEED_VIOLATION = 0
FEED_CHANGE = 1
"""The kinds of feed rows, in the order rows of one place in commit order are given
(a transaction's new violations before its changes)."""


class FeedRow(NamedTuple):
    """One row of the feed before its cursor is set."""

    order: tuple[int, int, int]
    """Its place in commit order, ``(position, kind, id)``: the position is the store's
    (SQLite: a violation id; PostgreSQL: a transaction id), then :data:`FEED_VIOLATION` or
    :data:`FEED_CHANGE`, then the row's id in its table."""
    item: dict[str, Any]
    """What :func:`feed_item` makes of it."""


def violation_feed_row(row: Sequence[Any]) -> FeedRow:
    """A new violation of the feed, from (position, id, *:data:`FEED_COLUMNS`)."""
    position, id_, *columns = row
    return FeedRow((int(position), FEED_VIOLATION, int(id_)), feed_item(columns))


def change_feed_row(row: Sequence[Any]) -> FeedRow:
    """A change of a violation's status, from (position, id, status, detected_at,
    *:data:`FEED_COLUMNS`)."""
    position, id_, status, detected_at, *columns = row
    return FeedRow((int(position), FEED_CHANGE, int(id_)), feed_item(columns, status, detected_at))


def first_of_feed(violations: list[FeedRow], changes: list[FeedRow], limit: int) -> list[FeedRow]:
    """The first ``limit`` rows of the feed, in commit order, from its first ``limit`` new
    violations and its first ``limit`` changes (fewer of either: all there are), each in
    its own order. Each list is taken from its start, so a cursor after the last row given
    passes every row of both before it, and none after it."""
    return list(itertools.islice(heapq.merge(violations, changes, key=lambda row: row.order), limit))


_ORJSON_EXACT = frozenset({str, int, bool, type(None)})
"""Value types orjson writes exactly as :mod:`json` does (it refuses integers beyond 64
bits and lone surrogates, which then take the json path)."""

_ORJSON_SMALLEST_FLOAT = 1e-4
"""Below this magnitude (zero aside) orjson writes a float in positional notation
(``0.00001``) where :mod:`json` writes ``1e-05``; from it up to infinity both write
Python's ``repr``. NaN and infinities orjson writes as ``null``, json as ``NaN``."""


def _orjson_writes_as_json(values: Iterable[Any]) -> bool:
    """orjson writes each of ``values`` (but for unencodable ones, which it refuses) as json does."""
    exact = _ORJSON_EXACT
    for value in values:
        kind = type(value)
        if kind is float:
            if not (_ORJSON_SMALLEST_FLOAT <= abs(value) < math.inf or value == 0.0):
                return False
        elif kind not in exact:
            return False
    return True


def encode_record(record: ActionRecord) -> str:
    """A record as JSON text that :func:`decode_record` turns back into an equal record.

    Values JSON lacks are tagged (bytes), so a re-fed record is the record the engine
    first saw; NaN and infinities are kept as Python's JSON writes them. A record of
    plain strings, integers, booleans and floats, nearly every record (``ts`` is a
    float), is written by orjson, in the text :mod:`json` would write.
    """
    if _orjson_writes_as_json(record.values()):
        try:
            return orjson.dumps(record).decode()
        except orjson.JSONEncodeError:
            pass
    return json.dumps(record, default=_tag, separators=(",", ":"), ensure_ascii=False)


def decode_record(text: str) -> ActionRecord:
    return json.loads(text, object_hook=_untag)  # type: ignore[no-any-return]


def _tag(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return {_BYTES_TAG: bytes(value).hex()}
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return repr(value)


def _untag(node: dict[str, Any]) -> Any:
    if len(node) == 1 and _BYTES_TAG in node and isinstance(node[_BYTES_TAG], str):
        return bytes.fromhex(node[_BYTES_TAG])
    return node


# Here, once everything the C rows are given (encode_record's float threshold) is defined.
_ROWS = _native_rows()
