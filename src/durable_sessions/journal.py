"""The record/replay journal: what lets a restarted agent resume instead of re-run.

A journal keeps, per session and action id, what became of each action the agent ran:
a write-ahead ``started`` entry before the action runs, then ``ok`` with the recorded
outcome or ``error``. :func:`durable_sessions.instrument.action` consults it when a
journal is given to :func:`~durable_sessions.instrument.session` (or to the action)::

    journal = SqliteJournal("state/journal.db")
    with session("trip-42", journal=journal):
        budget = ask_budget()   # an @action("a01", "user_prompt") function

After a crash, the same code in a new process replays instead of re-running:

- an action completed before (``ok``) is **replayed**: the decorated function is not
  called, its recorded outcome is returned, and the span says ``replayed: true``. One
  that completed without a recorded outcome (``record=False``, a value JSON cannot
  hold, or one longer than SQLite keeps) runs again, unless it is a side effect, which must not: it is replayed as
  ``None``;
- an action that failed (``error``), or whose process died while it ran, runs again as
  the next attempt: ``attempts`` counts across processes, and an action that already
  had its ``max_attempts`` raises :class:`AttemptsExhausted` (a crash loop is a retry
  loop too);
- a side effect that was started but never completed is **in doubt**: it may or may not
  have happened. Given the ``idempotency_key`` it was journaled with, it runs again under
  that key (the far side collapses the repeat); with ``replay="skip"`` it is stepped
  over; with neither (no key, or another key: one made afresh in each process),
  :class:`ActionInDoubt` is raised instead of repeating the effect, and
  :meth:`SqliteJournal.resolve` or :meth:`SqliteJournal.discard` settles it.

An action this process is running right now, entered again, runs (see :func:`plan`).

The journal holds results in full, since replay must return them: it is the agent's own
state, kept beside the agent, not the sidecar's (which keeps digests only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import sqlite3
import threading
import weakref
from collections.abc import Iterable, Iterator
from json.decoder import scanstring
from json.scanner import NUMBER_RE
from pathlib import Path
from typing import Any, Literal, Protocol

from durable_sessions import disk, session_lock
from durable_sessions import semconv as sc
from durable_sessions.digest import digest_bytes, outcome_json
from durable_sessions.mapping import exact
from durable_sessions.pickling import reduced
from durable_sessions.record import is_side_effecting
from durable_sessions.session_lock import SessionInUse

logger = logging.getLogger("durable_sessions")

Status = Literal["started", "ok", "error"]

SHAPE_FUTURE = "future"
"""An :attr:`Entry.shape`: the action's function returned an asyncio Task or Future (or,
a coroutine function, its await gave one)."""
SHAPE_ITERATOR = "iterator"
"""An :attr:`Entry.shape`: the action's function returned a generator (or its await gave one)."""
SHAPE_ASYNC_ITERATOR = "async_iterator"
"""An :attr:`Entry.shape`: the action's function returned an async generator (or its await
gave one)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """What the journal knows of one action of one session."""

    session_id: str
    action_id: str
    kind: str
    status: Status
    attempts: int = 1
    result: bytes | None = None
    """The outcome as JSON (keys in the order they had), when one was recorded. Given as
    text, a number or bytes-like (a row written by hand), it is kept as that JSON's bytes."""
    result_digest: str | None = None
    result_ref: str | None = None
    """Where the span pointed for the outcome, when it was too long to carry."""
    idempotency_key: str | None = None
    incarnation: str | None = None
    awaited: bool = False
    """Whether what the action returned was awaited (a sync function that returned a
    coroutine; noted before the await, so an entry still ``started`` has it too): its
    replay, or its skip, is handed back awaitable, as the first run was."""
    shape: str | None = None
    """What a sync function's first run returned (or a coroutine function's await gave),
    where a replay must hand back the same kind of object: ``"future"`` (an asyncio Task
    or Future; its replay is a done Future), ``"iterator"`` (a generator; its outcome is
    the list of its items, and its replay a generator of them) or ``"async_iterator"``
    (the same of an async generator). Noted, as ``awaited`` is, before the outcome is
    known. ``None`` otherwise, and in an entry written before 2026-12, which replays as it
    did then; an unknown value is read as ``None`` (a version before ``"async_iterator"``
    replays such an entry as its list)."""

    def __post_init__(self) -> None:
        # A row written by hand (an operator's UPDATE ... SET result = '{"charged": 2400}'
        # stores TEXT, and SET result = 2400 an INTEGER) or a journal of the user's own
        # (a database driver's memoryview) gives the outcome as another type than bytes:
        # read as its JSON text, it replays, and lists, as if the journal had written it.
        result = _as_json_bytes(self.result)
        if result is not self.result:
            object.__setattr__(self, "result", result)

    @property
    def is_recorded(self) -> bool:
        """Whether an outcome was recorded (by value or by reference) to replay."""
        return self.result is not None or self.result_ref is not None

    @property
    def outcome(self) -> Any:
        """The recorded outcome as a value (``None`` when none was recorded), at any depth
        of nesting the recording wrote."""
        if self.result is None:
            return None
        # The standard library, not orjson: an integer beyond 64 bits comes back exact.
        try:
            return json.loads(self.result)
        except RecursionError:  # nested deeper than the recursion limit leaves room for
            return loads_without_recursion(self.result.decode("utf-8", "surrogatepass"))


def _as_json_bytes(result: Any) -> Any:
    """``result`` as the JSON text's bytes an :class:`Entry` holds, where it is text, a
    number or bytes-like; anything else as it is (it does not read, which is logged)."""
    if result is None or type(result) is bytes:
        return result
    if isinstance(result, (bytearray, memoryview)):
        return bytes(result)
    if isinstance(result, str):
        return result.encode("utf-8", "surrogatepass")
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return json.dumps(result).encode()
    return result


_SPACE = re.compile(r"[ \t\n\r]*")
_CONSTANTS = {"true": True, "false": False, "null": None, "NaN": math.nan, "Infinity": math.inf}


def loads_without_recursion(text: str) -> Any:
    """``json.loads(text)`` for JSON of any depth: what it gives, without recursion.

    An outcome is recorded at any depth (:func:`~durable_sessions.digest.outcome_json`
    writes deep JSON without recursion), but ``json.loads`` recurses once per level and
    raises ``RecursionError`` some way short of 1,000 levels, the nearer the deeper the
    caller's own stack: such an outcome was replayed as ``None``. Values, numbers and key
    order are read as ``json.loads`` reads them. Raises ``ValueError`` for text that is
    not JSON.
    """
    open_: list[list[Any] | dict[str, Any]] = []  # the containers being read, innermost last
    keys: list[str] = []  # the key being read in each open dictionary
    position = _SPACE.match(text).end()  # type: ignore[union-attr]
    while True:
        value, position = _read_value(text, position, open_, keys)
        if value is _OPENED:
            continue
        while True:  # put the value in its container; close the containers it ends
            if not open_:
                if _SPACE.match(text, position).end() != len(text):  # type: ignore[union-attr]
                    raise ValueError(f"extra data at {position}")
                return value
            container = open_[-1]
            if type(container) is list:
                container.append(value)
            else:
                container[keys.pop()] = value  # type: ignore[call-overload]
            position = _SPACE.match(text, position).end()  # type: ignore[union-attr]
            mark = text[position : position + 1]
            if mark == ",":
                position = _after_separator(text, position + 1, container, keys)
                break
            if mark != ("]" if type(container) is list else "}"):
                raise ValueError(f"expected ',' or a closing bracket at {position}")
            value, position = open_.pop(), position + 1


_OPENED = object()


def _read_value(
    text: str, position: int, open_: list[list[Any] | dict[str, Any]], keys: list[str]
) -> tuple[Any, int]:
    """The value at ``position`` and where it ends; for a container with members,
    ``_OPENED`` and where its first member starts (it is pushed on ``open_``)."""
    position = _SPACE.match(text, position).end()  # type: ignore[union-attr]
    mark = text[position : position + 1]
    if mark in ("[", "{"):
        empty = _SPACE.match(text, position + 1).end()  # type: ignore[union-attr]
        if text[empty : empty + 1] == ("]" if mark == "[" else "}"):
            return ([] if mark == "[" else {}), empty + 1
        container: list[Any] | dict[str, Any] = [] if mark == "[" else {}
        open_.append(container)
        return _OPENED, _after_separator(text, position + 1, container, keys)
    if mark == '"':
        return scanstring(text, position + 1)
    number = NUMBER_RE.match(text, position)
    if number is not None:
        integer, fraction, exponent = number.groups()
        if fraction or exponent:
            return float(integer + (fraction or "") + (exponent or "")), number.end()
        return int(integer), number.end()
    for word, constant in (*_CONSTANTS.items(), ("-Infinity", -math.inf)):
        if text.startswith(word, position):
            return constant, position + len(word)
    raise ValueError(f"expected a JSON value at {position}")


def _after_separator(text: str, position: int, container: list[Any] | dict[str, Any], keys: list[str]) -> int:
    """Where the next member's value starts: past its key and ``:`` in a dictionary."""
    if type(container) is list:
        return position
    position = _SPACE.match(text, position).end()  # type: ignore[union-attr]
    if text[position : position + 1] != '"':
        raise ValueError(f"expected a key at {position}")
    key, position = scanstring(text, position + 1)
    position = _SPACE.match(text, position).end()  # type: ignore[union-attr]
    if text[position : position + 1] != ":":
        raise ValueError(f"expected ':' at {position}")
    keys.append(key)
    return position + 1


class Journal(Protocol):
    """Where entries are kept. ``put`` returns only once the entry is durable, and keeps
    the idempotency key of an entry that is still ``started``: it is the key the far side
    may have seen, which :func:`plan` checks a resumed run's key against. A recorded
    outcome (``ok``) stands: a later put of the same action leaves it as it is.

    A journal may also have ``hold(session_id)``, a context manager that holds the session
    for this process (as :meth:`SqliteJournal.hold`); a ``session`` block without it holds
    nothing, and a second live process running the session is not stopped."""

    def get(self, session_id: str, action_id: str) -> Entry | None: ...

    def put(self, entry: Entry) -> None: ...


class ActionInDoubt(Exception):
    """A side effect was started by an earlier process and never completed.

    Running it again might repeat it (a second charge, a second email); not running it
    might lose it. Nothing makes a repeat safe: the action has no idempotency key, or not
    the key the interrupted attempt used (``key_now``: a key made afresh in each process
    cannot collapse the repeat), and is not ``replay="skip"``. Find out at the far side
    whether it happened, then call ``journal.resolve(session_id, action_id, outcome)``
    (it happened) or ``journal.discard(session_id, action_id)`` (it did not; it will run
    again).
    """

    def __init__(self, entry: Entry, key_now: str | None = None) -> None:
        self.entry = entry
        self.key_now = key_now
        super().__init__(
            f"{entry.kind} {entry.action_id!r} of session {entry.session_id!r} was started by an "
            f"earlier process and never completed, and {_why_a_repeat_is_unsafe(entry.idempotency_key, key_now)}: "
            "it may already have happened. Resolve it with journal.resolve(session_id, action_id, outcome) or "
            "journal.discard(session_id, action_id), or from a shell with 'durable-sessions journal resolve "
            "JOURNAL_FILE SESSION ACTION OUTCOME_JSON' or 'durable-sessions journal discard JOURNAL_FILE SESSION ACTION'"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as what it was made from (:func:`~durable_sessions.pickling.reduced`)."""
        return reduced(self, self.entry, self.key_now)


def _why_a_repeat_is_unsafe(journaled: str | None, key_now: str | None) -> str:
    """Why running the action again may do it twice, for :class:`ActionInDoubt`."""
    if journaled is None and key_now is None:
        return "it has no idempotency key"
    if journaled is None:
        return f"it was started without an idempotency key (the key given now, {key_now!r}, cannot collapse a repeat)"
    if key_now is None:
        return f"it was started under idempotency key {journaled!r}, which is not given now"
    return (
        f"the key given now, {key_now!r}, is not the one it was started under, {journaled!r}: under another "
        "key a repeat is a second effect (a key must be the same in every process)"
    )


class AttemptsExhausted(Exception):
    """An action has failed (or its process died) ``max_attempts`` times, across processes.

    A crash loop (an action that kills its process, every time it is resumed) is a retry
    loop too; the journal counts its attempts and stops it at the cap, where the next
    move is a question to a person, not another attempt. ``journal.discard`` resets it.
    """

    def __init__(self, entry: Entry, max_attempts: int) -> None:
        self.entry = entry
        self.max_attempts = max_attempts
        super().__init__(
            f"{entry.kind} {entry.action_id!r} of session {entry.session_id!r} has used its "
            f"{max_attempts} attempts (the last {'failed' if entry.status == sc.STATUS_ERROR else 'never finished'}); "
            "escalate instead of trying again, or journal.discard(session_id, action_id) to start over"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as what it was made from (:func:`~durable_sessions.pickling.reduced`)."""
        return reduced(self, self.entry, self.max_attempts)


class SessionLive(SessionInUse):
    """:meth:`SqliteJournal.resolve` or :meth:`SqliteJournal.discard` of an action of a
    session that another live process has open (its ``session`` block holds the session's
    lock): an action ``started`` there is running, not in doubt, and an outcome recorded
    for it now would stand over the one it is about to return. Nothing is changed.
    Settle it once that process has ended. A :class:`SessionInUse`, with its
    ``session_id`` and ``lock_path``."""

    advice = "its started actions are running, not in doubt: settle them once that process has ended"


class AlreadyCompleted(ValueError):
    """:meth:`SqliteJournal.resolve` of an action whose outcome is recorded already."""


# -- deciding what to do with an action --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the journal says to do with an action in this process."""

    decision: Literal["run", "replay", "skip"]
    attempts: int = 1
    entry: Entry | None = None


RUN_FIRST = Plan("run")


def is_side_effect(kind: str, fields: dict[str, Any]) -> bool:
    """Whether the action of ``kind`` with record ``fields`` touches the world
    (:func:`~durable_sessions.record.is_side_effecting` of its record)."""
    return is_side_effecting({**fields, "kind": kind})


def journaled_key(fields: dict[str, Any]) -> str | None:
    """The idempotency key of record ``fields`` as the journal keeps it (a key is text).

    A ``str`` subclass (a ``StrEnum`` member, a key type of the agent's own) is read as its
    text (:func:`~durable_sessions.mapping.exact`), which is what the span carries and the
    far side sees: read as no key, a keyed side effect cut short was in doubt instead of
    run again under its key.
    """
    key = exact(fields.get("idempotency_key"))
    return key if type(key) is str else None


def plan(entry: Entry | None, kind: str, fields: dict[str, Any], *, in_flight: bool = False) -> Plan:
    """Decide from the journal's entry (``None``: never seen) what to do with an action.

    ``in_flight``: this process is running the action right now (the instrumentation
    knows which it is running), so a ``started`` entry is its own run entered again (a
    retry from inside itself, another thread), which runs as the next attempt, never in
    doubt. Any other entry is recovered, whichever process wrote it: a completed action
    is replayed even in the process that ran it (a server running a session's loop again
    after it failed must not ask or charge again), and one cut short is in doubt.

    Raises :class:`ActionInDoubt` for an unskippable side effect that was started and
    never completed (a process that died, a run cancelled by a timeout) and is not given
    the idempotency key that attempt was journaled with, and
    :class:`AttemptsExhausted` for an action that already had its ``max_attempts``.
    """
    if entry is None:
        return RUN_FIRST
    if entry.status == sc.STATUS_OK and (entry.is_recorded or is_side_effect(kind, fields)):
        return Plan("replay", entry.attempts, entry)
    if entry.status == sc.STATUS_STARTED and not in_flight and is_side_effect(kind, fields):
        if fields.get("replay") == sc.REPLAY_SKIP:
            return Plan("skip", entry.attempts, entry)
        # Only the key the interrupted attempt used makes the far side collapse a repeat.
        key_now = journaled_key(fields)
        if key_now is None or key_now != entry.idempotency_key:
            raise ActionInDoubt(entry, key_now)
    cap = fields.get("max_attempts")
    if entry.status != sc.STATUS_OK and type(cap) is int and entry.attempts >= cap:
        raise AttemptsExhausted(entry, cap)
    # A completed action without an outcome to replay runs afresh: it is no retry.
    return Plan("run", 1 if entry.status == sc.STATUS_OK else entry.attempts + 1, entry)


# -- the SQLite journal -------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE IF NOT EXISTS journal (
    session_id TEXT NOT NULL,
    action_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    result BLOB,
    result_digest TEXT,
    result_ref TEXT,
    idempotency_key TEXT,
    incarnation TEXT,
    awaited INTEGER NOT NULL DEFAULT 0,
    shape TEXT,
    PRIMARY KEY (session_id, action_id)
)
"""
_ADDED_COLUMNS = {"awaited": ("INTEGER NOT NULL DEFAULT 0", "0"), "shape": ("TEXT", "NULL")}
"""Columns a journal written by an earlier version lacks (each column's definition, and the
value it reads as where it is missing), added when it is opened for writing."""
_COLUMNS = [field.name for field in dataclasses.fields(Entry)]
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM journal"


def _select_from(present: frozenset[str]) -> str:
    """``_SELECT`` from a journal of an earlier version opened read-only, which keeps its
    columns (``present``): the ones it lacks read as their defaults."""
    return "SELECT {} FROM journal".format(
        ", ".join(
            column if column in present else f"{_ADDED_COLUMNS[column][1]} AS {column}" for column in _COLUMNS
        )
    )


# The key of an attempt in doubt (a `started` row) is the one the far side may have seen:
# it is kept, never replaced by another attempt's, so that a resumed run is checked
# against it and an operator settling the action looks it up by it.
_KEPT_WHILE_IN_DOUBT = {
    "idempotency_key": "CASE WHEN journal.status = 'started' "
    "THEN coalesce(journal.idempotency_key, excluded.idempotency_key) ELSE excluded.idempotency_key END"
}
# An upsert, not INSERT OR REPLACE (a delete and an insert): the row keeps its place, so
# entries() lists actions in the order they were first journaled. A recorded outcome
# stands (the WHERE): two processes running one session at once both run the action, and
# the first outcome recorded is the one later runs replay, not whichever came last.
_UPSERT = (
    f"INSERT INTO journal ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))}) "
    "ON CONFLICT (session_id, action_id) DO UPDATE SET "
    + ", ".join(
        f"{column} = {_KEPT_WHILE_IN_DOUBT.get(column, f'excluded.{column}')}" for column in _COLUMNS[2:]
    )
    + " WHERE journal.status <> 'ok' OR (journal.result IS NULL AND journal.result_ref IS NULL)"
)


# -- fork ----------------------------------------------------------------------------------
#
# A thread inside SQLite when another thread forks leaves SQLite's own mutexes held for
# ever in the child, whose first connection then hangs. So each journal's lock is taken
# before a fork and let go after it, in parent and child: no thread of this process is
# inside one of its journals' calls at the fork (a fork waits for the call under way).
# The child drops the connection it inherited without closing it: closing it would
# release locks the parent's process holds on the file (SQLite's advice is to leave a
# connection opened before a fork alone in the child), so it is kept, unused.

_JOURNALS: weakref.WeakSet[SqliteJournal] = weakref.WeakSet()
_held_at_fork: list[SqliteJournal] = []
_inherited: list[sqlite3.Connection] = []
"""Connections a forked child inherited: kept, never closed, never used."""


def _before_fork() -> None:
    global _held_at_fork
    held = []
    for journal in list(_JOURNALS):
        journal._lock.acquire()
        held.append(journal)
    _held_at_fork = held


def _after_fork_in_parent() -> None:
    held = _held_at_fork
    for journal in held:
        journal._lock.release()


def _after_fork_in_child() -> None:
    """A forked child takes a new lock and opens its own connection on first use."""
    for journal in _held_at_fork:
        if journal._connection is not None:
            _inherited.append(journal._connection)
        journal._connection = None
        journal._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
    )


class SqliteJournal:
    """A journal in one SQLite file, which several processes and threads may share.

    Every ``put`` is its own transaction, committed with ``synchronous = FULL`` before
    it returns: a write-ahead ``started`` entry is on disk before the side effect runs.
    A fork waits for a call under way in another thread; the forked child opens its own
    connection on first use, to the same file whatever its working directory.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, timeout_s: float = 30.0, readonly: bool = False
    ) -> None:
        # Made absolute now: a relative path resolved at each connection named another file
        # once the working directory changed (a daemon's chdir, a forked child's own).
        self.path = Path(os.path.abspath(path))
        """The journal's file, as an absolute path (a relative one is of the working
        directory the journal was made in)."""
        self.timeout_s = timeout_s
        self.readonly = readonly
        """Opened to be read only (``mode=ro``): nothing is created, set or written."""
        self._columns: frozenset[str] | None = None  # of a file opened read-only, once read
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None
        _JOURNALS.add(self)

    def get(self, session_id: str, action_id: str) -> Entry | None:
        rows = self._query(f"{_SELECT} WHERE session_id = ? AND action_id = ?", (session_id, action_id))
        return rows[0] if rows else None

    def put(self, entry: Entry) -> None:
        """Write ``entry``; the idempotency key of an entry still ``started`` (in doubt) is
        kept: another attempt's key does not replace it. An ``ok`` entry with a recorded
        outcome stands: a put over it (another process that ran the same session at the
        same time) changes nothing and is logged; only :meth:`discard` removes it."""
        if self._execute(_UPSERT, dataclasses.astuple(entry)) == 0 and self._kept_differs(entry):
            logger.warning(
                "durable_sessions: action %r of session %r was completed by another run first; the journal %s "
                "keeps that outcome, not this run's %s entry (run one session in one process at a time)",
                entry.action_id,
                entry.session_id,
                self.path,
                entry.status,
            )

    def _kept_differs(self, entry: Entry) -> bool:
        """Whether the outcome the journal kept over ``entry`` is another: a retry by
        recursion completes the inner call first, with the outcome the outer one returns."""
        kept = self.get(entry.session_id, entry.action_id)
        return kept is None or (kept.result, kept.result_ref) != (entry.result, entry.result_ref)

    def entries(
        self, session_id: str | None = None, *, status: Status | None = None, outcomes: bool = True
    ) -> list[Entry]:
        """The entries of a session (or of every session), optionally only those with
        ``status``, in the order the actions were first journaled. ``outcomes=False``
        leaves each entry's ``result`` out (``None``; its digest stays): a listing of a
        journal that keeps large results in full need not read them all into memory."""
        return self._query(
            f"{_SELECT} WHERE (?1 IS NULL OR session_id = ?1) AND (?2 IS NULL OR status = ?2) ORDER BY rowid",
            (session_id, status),
            outcomes=outcomes,
        )

    @classmethod
    def existing(cls, path: str | os.PathLike[str], *, readonly: bool = False) -> SqliteJournal:
        """The journal at ``path``, which must be one: for tools that inspect a journal,
        where a new empty file would hide a wrong path. Raises ``FileNotFoundError`` or
        ``ValueError`` (not a journal, or not readable)."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no journal at {os.fspath(path)}")
        journal = cls(path, readonly=True)
        try:
            found = journal._connected().execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'journal'"
            )
            table = found.fetchone()
        except sqlite3.DatabaseError as error:
            raise ValueError(f"cannot read {os.fspath(path)} as a journal: {error}") from None
        finally:
            journal.close()
        if table is None:
            raise ValueError(f"{os.fspath(path)} is not a journal (it has no journal table)")
        return cls(path, readonly=readonly)

    def resolve(self, session_id: str, action_id: str, outcome: Any) -> Entry:
        """Record that an in-doubt action did happen, with ``outcome``: it is replayed from now on.

        An action completed without a recorded outcome (``record=False``, a value JSON
        cannot hold: a side effect replayed as ``None``) takes one too.

        Raises ``KeyError`` for an action the journal does not have, ``ValueError`` for one
        completed with a recorded outcome (it stands; :meth:`discard` forgets it, to run again),
        ``TypeError`` for an outcome holding a value of no JSON type (a set, bytes), as
        :func:`~durable_sessions.digest.canonical_json` raises, and ``ValueError`` for one
        that JSON would give back as another value (NaN and ±Infinity; two keys of one
        text: :func:`~durable_sessions.digest.outcome_json`). Nothing is recorded then.

        Raises :class:`SessionLive`, changing nothing, while another live process has the
        session open: what runs there is not in doubt."""
        with self._settling(session_id):
            entry = self._existing(session_id, action_id)
            if entry.status == sc.STATUS_OK and entry.is_recorded:
                raise AlreadyCompleted(
                    f"action {action_id!r} of session {session_id!r} completed already; its recorded outcome "
                    "stands (a discard forgets it: the next run runs the action again)"
                )
            digest = digest_bytes(outcome_json(outcome))
            data = outcome_json(outcome, in_order=True)  # replayed as given, keys in their order
            resolved = dataclasses.replace(
                entry, status=sc.STATUS_OK, result=data, result_digest=digest, result_ref=None
            )
            self.put(resolved)
        return resolved

    def discard(self, session_id: str, action_id: str) -> None:
        """Forget an action: the next process runs it as if for the first time. Raises
        ``KeyError`` for an action the journal does not have, and :class:`SessionLive`,
        changing nothing, while another live process has the session open."""
        with self._settling(session_id):
            self._existing(session_id, action_id)
            self._execute(
                "DELETE FROM journal WHERE session_id = ? AND action_id = ?", (session_id, action_id)
            )

    @contextlib.contextmanager
    def _settling(self, session_id: str) -> Iterator[None]:
        """Hold the session while one of its actions is settled: an action ``started`` in
        a live process is running, not in doubt, and an outcome recorded for it now would
        stand over the one it is about to return. Raises :class:`SessionLive`. A process
        that has the session open itself (an agent that met :class:`ActionInDoubt` in its
        block) shares its own hold, and settles.

        A journal without a lock file has never had a session held: nothing to check, and
        no lock file is made (an operator's would be theirs, and the agent's user might not
        open it)."""
        with contextlib.ExitStack() as held:
            if self._lock_path().exists():
                try:
                    held.enter_context(self.hold(session_id))
                except SessionInUse as error:
                    raise SessionLive(error.session_id, error.lock_path) from None
            yield

    def hold(self, session_id: str) -> contextlib.AbstractContextManager[None]:
        """Hold ``session_id`` for this process while the ``with`` block runs: another
        process's hold raises :class:`~durable_sessions.session_lock.SessionInUse`. The lock
        file is beside the journal (:mod:`durable_sessions.session_lock`); a journal opened
        read-only holds nothing."""
        if self.readonly:
            return contextlib.nullcontext()
        with contextlib.suppress(OSError):  # else the lock file cannot be opened: logged there
            disk.make_directories(self.path.parent)
        return session_lock.held(self._lock_path(), session_id)

    def live_sessions(self, session_ids: Iterable[str]) -> set[str]:
        """The sessions among ``session_ids`` that a live process has open (its ``session``
        block holds the session; this process's included): their ``started`` actions are
        running, not in doubt. Takes no lock (on Linux) and makes no lock file: without
        one, no session is open. Raises ``OSError`` when the lock file cannot be read."""
        return session_lock.live(self._lock_path(), session_ids)

    def _lock_path(self) -> Path:
        # Resolved: two spellings of one file are one lock file, held once by this process.
        return session_lock.lock_path_of(self.path.resolve())

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
            self._connection = None

    def __repr__(self) -> str:
        return f"SqliteJournal({str(self.path)!r})"

    # internals ---------------------------------------------------------------------------

    def _existing(self, session_id: str, action_id: str) -> Entry:
        entry = self.get(session_id, action_id)
        if entry is None:
            raise KeyError(f"the journal {self.path} has no action {action_id!r} of session {session_id!r}")
        return entry

    def _query(self, sql: str, parameters: tuple[Any, ...], *, outcomes: bool = True) -> list[Entry]:
        with self._lock:
            connection = self._connected()
            present = self._readonly_columns()
            if present is not None and not present >= _ADDED_COLUMNS.keys():
                sql = sql.replace(_SELECT, _select_from(present), 1)
            if not outcomes:
                sql = sql.replace(", result, ", ", NULL AS result, ", 1)
            rows = connection.execute(sql, parameters).fetchall()
        return [_entry(row) for row in rows]

    def _execute(self, sql: str, parameters: tuple[Any, ...]) -> int:
        """Run one statement; the number of rows it changed."""
        with self._lock:
            return self._connected().execute(sql, parameters).rowcount

    def _connected(self) -> sqlite3.Connection:
        if self._connection is None and self.readonly:
            self._connection = sqlite3.connect(
                self.path.resolve().as_uri() + "?mode=ro",
                uri=True,
                timeout=self.timeout_s,
                check_same_thread=False,
            )
        if self._connection is None:
            # SQLite syncs the directory its files are in; the ones made above it, this does.
            disk.make_directories(self.path.parent)
            # Autocommit (isolation_level None): each statement is a durable transaction.
            connection = sqlite3.connect(
                self.path, timeout=self.timeout_s, isolation_level=None, check_same_thread=False
            )
            connection.execute("PRAGMA journal_mode = WAL")
            connection.execute("PRAGMA synchronous = FULL")
            connection.execute(_SCHEMA)
            _add_missing_columns(connection)
            self._connection = connection
        return self._connection

    def _readonly_columns(self) -> frozenset[str] | None:
        """The columns of a file opened read-only, which may be a journal of an earlier
        version; ``None`` for one opened for writing, which gets the columns it lacks when
        it is opened."""
        if not self.readonly:
            return None
        if self._columns is None:
            rows = self._connected().execute("PRAGMA table_info(journal)").fetchall()
            self._columns = frozenset(row[1] for row in rows)
        return self._columns


def _add_missing_columns(connection: sqlite3.Connection) -> None:
    """Bring a journal written by an earlier version up to this one's columns."""
    present = {row[1] for row in connection.execute("PRAGMA table_info(journal)").fetchall()}
    for column, (definition, _) in _ADDED_COLUMNS.items():
        if column not in present:
            with contextlib.suppress(sqlite3.OperationalError):  # another process added it first
                connection.execute(f"ALTER TABLE journal ADD COLUMN {column} {definition}")


def _entry(row: tuple[Any, ...]) -> Entry:
    """The entry of a row of ``_COLUMNS``: SQLite keeps ``awaited`` as an integer."""
    values = dict(zip(_COLUMNS, row, strict=True))
    values["awaited"] = bool(values["awaited"])
    return Entry(**values)


__all__ = [
    "ActionInDoubt",
    "AttemptsExhausted",
    "Entry",
    "Journal",
    "Plan",
    "SessionLive",
    "SqliteJournal",
    "is_side_effect",
    "journaled_key",
    "plan",
]
