"""The SQLite store: one file, WAL journal, the embedded default.

Writes take ``BEGIN IMMEDIATE`` transactions and commit with ``synchronous=FULL``, so an
acknowledged Export survives a power cut as well as a killed process. Readers (the HTTP
API, metrics) use their own connections; WAL lets them read while the writer writes.
The statements it shares with the PostgreSQL store are in :mod:`.statements` (:data:`SQL`);
those here are its own.

Times (activity, due times, retention) are this host's clock kept from going back
(:class:`SteadyClock`): a clock stepped back neither delays idle sessions' ends and due
alerts by the size of the step nor dates new rows before the ones already stored.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from durable_sessions.record import ActionRecord, Location
from durable_sessions.report import Verdict
from durable_sessions_collector.store.base import (
    FEED_CHANGES,
    FEED_COLUMNS,
    FEED_VIOLATION,
    FEED_VIOLATIONS,
    FIRST_PAGES,
    IN_VIOLATION_ORDER,
    OUTBOX_CHANNELS,
    STORE_ID,
    VIOLATION_COLUMNS,
    ActionRow,
    Alert,
    DeadAlert,
    DetailPages,
    FeedRow,
    IndexReport,
    Pruned,
    SessionDetail,
    SessionSummary,
    Settled,
    StoredSession,
    StoreError,
    action_page,
    change_feed_row,
    counts_in_verdict,
    cursor_position,
    decode_record,
    first_of_feed,
    forget_some,
    new_store_id,
    status_changes,
    version_refused,
    violation_detail,
    violation_feed_row,
    violation_page,
    within_budget,
)
from durable_sessions_collector.store.pool import ReadPool
from durable_sessions_collector.store.statements import SqlWriter, Statements, session_summary

SCHEMA_VERSION = 5
META = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
)
"""
ACTIONS = """
CREATE TABLE IF NOT EXISTS actions (
    id INTEGER PRIMARY KEY,
    session_id TEXT,
    trace_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    status TEXT NOT NULL,
    action_id TEXT,
    kind TEXT,
    seq INTEGER,
    received_at REAL NOT NULL,
    record TEXT NOT NULL
)
"""
# One index serves both uses of the actions: it drops a redelivered span (the same
# trace, span and status; a span's session is derived from the span, so it is the same
# too) and finds a session's rows. Leading with the session keeps one batch's inserts on
# few pages; version 1's unique index led with the random trace id, so every insert
# dirtied another page of it, and inserts slowed as the store grew.
SESSION_KEY = "coalesce(session_id, '')"
"""How the index keys a row's session: queries by session say it the same way, to use it."""
ACTIONS_INDEX = f"CREATE UNIQUE INDEX IF NOT EXISTS actions_by_session_span ON actions ({SESSION_KEY}, trace_id, span_id, status)"
# Retention finds the old rows of no session through these (named in its statements: left
# to itself, SQLite reads violations by id instead, all of them): a row of no session has a
# NULL session id (see action_row), and only those rows are in the index. Without them a
# pass read every such row younger than the cutoff (a second for a million), each minute,
# in the writer thread. A store of an earlier sidecar gets them at start (one scan of each
# table).
SESSIONLESS_BY_AGE = """
CREATE INDEX IF NOT EXISTS actions_sessionless_by_age ON actions (received_at) WHERE session_id IS NULL;
CREATE INDEX IF NOT EXISTS violations_sessionless_by_age ON violations (created_at) WHERE session_id IS NULL
"""
# A session too large for one retention pass (see SqliteWriter.prune) is deleted but for
# its actions, which later passes delete a budget at a time: those up to ``through_id``
# belong to no session any more, and reads of the session skip them (SQL.not_forgotten).
# Version 3 added it; a version 2 store gets it at start.
FORGETTING = """
CREATE TABLE IF NOT EXISTS forgetting (
    session_id TEXT PRIMARY KEY,
    through_id INTEGER NOT NULL
)
"""
# The engine's state of a long session, kept so that a rebuild restores it and re-feeds
# only the records stored after ``through_id`` (see the evaluator). Version 4 added it; a
# version 2 or 3 store gets it at start.
SESSION_STATES = """
CREATE TABLE IF NOT EXISTS session_states (
    session_id TEXT PRIMARY KEY,
    fed INTEGER NOT NULL,
    through_id INTEGER NOT NULL,
    state BLOB NOT NULL
)
"""
# The violation feed's changes of status (resolved, firing again), written with the flip
# of violations.resolved (SqliteWriter.resolve_end_violations). ``after_violation`` is the
# largest violation id when it was written (retention keeps the newest violation, so it
# never goes back): it places the change among the new violations in commit order.
# AUTOINCREMENT: retention deletes a session's changes, and a deleted largest id given
# again would put a change behind a WatchAlerts cursor already past it. Version 5 added
# it; an older store gets it at start.
VIOLATION_CHANGES = """
CREATE TABLE IF NOT EXISTS violation_changes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    violation_id INTEGER NOT NULL,
    session_id TEXT,
    status TEXT NOT NULL,
    detected_at REAL NOT NULL,
    after_violation INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS violation_changes_by_session ON violation_changes (session_id)
"""
SQL = Statements(placeholder="?", session_key=SESSION_KEY, touched_last_seen="excluded.last_seen")
"""The statements this store shares with the PostgreSQL store."""
SCHEMA = f"""
{META};
{ACTIONS};
{ACTIONS_INDEX};
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    open INTEGER NOT NULL DEFAULT 1,
    ended_at REAL,
    actions INTEGER NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0,
    warnings INTEGER NOT NULL DEFAULT 0,
    verdict TEXT NOT NULL DEFAULT 'ok'
);
CREATE INDEX IF NOT EXISTS sessions_idle ON sessions (open, last_seen);
CREATE INDEX IF NOT EXISTS sessions_by_verdict ON sessions (verdict, last_seen);
CREATE INDEX IF NOT EXISTS sessions_by_activity ON sessions (last_seen);
CREATE TABLE IF NOT EXISTS violations (
    id INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    session_id TEXT,
    rule TEXT NOT NULL,
    severity TEXT NOT NULL,
    message TEXT NOT NULL,
    action_id TEXT,
    trace_id TEXT,
    span_id TEXT,
    at_end INTEGER NOT NULL DEFAULT 0,
    resolved INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS violations_by_session ON violations (session_id, id);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY,
    channel TEXT NOT NULL,
    violation_key TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    last_error TEXT,
    created_at REAL NOT NULL,
    delivered_at REAL,
    UNIQUE (channel, violation_key)
);
CREATE INDEX IF NOT EXISTS outbox_due ON outbox (channel, state, next_attempt_at);
{FORGETTING};
{SESSION_STATES};
{VIOLATION_CHANGES};
{SESSIONLESS_BY_AGE}"""


# --- retention: the statements of SqliteWriter.prune, each through an index ----------------

NEWEST_VIOLATION = "SELECT id, session_id FROM violations WHERE id = (SELECT max(id) FROM violations)"
PRUNE_SESSION_ALERTS = (
    "DELETE FROM outbox WHERE channel = ? AND state <> 'pending' "
    "AND violation_key IN (SELECT key FROM violations WHERE session_id = ?)"
)
PRUNE_SESSION_ROWS = (
    "DELETE FROM violation_changes WHERE session_id = ?",
    "DELETE FROM violations WHERE session_id = ?",
    "DELETE FROM sessions WHERE session_id = ?",
    "DELETE FROM session_states WHERE session_id = ?",
)
PRUNE_SESSION_ACTIONS = f"DELETE FROM actions WHERE {SESSION_KEY} = ?"
FORGETTING_SESSIONS = "SELECT session_id, through_id FROM forgetting ORDER BY session_id LIMIT ?"
FORGET_ACTIONS = (
    f"DELETE FROM actions WHERE id IN (SELECT id FROM actions WHERE {SESSION_KEY} = ? AND id < ? LIMIT ?)"
)
FORGET_LAST_ACTION = f"DELETE FROM actions WHERE id = ? AND {SESSION_KEY} = ?"
"""The action of id ``through_id`` goes last, with its ``forgetting`` row: SQLite gives the
largest id in the table plus one to a new row, so once it was gone a new action of the
session (started afresh) could be given an id up to ``through_id``, and be read as one
being forgotten — shown nowhere, never re-fed, then deleted."""
PRUNE_SESSIONLESS_ACTIONS = (
    "DELETE FROM actions WHERE id IN "
    "(SELECT id FROM actions INDEXED BY actions_sessionless_by_age "
    "WHERE session_id IS NULL AND received_at < ? LIMIT ?)"
)
PRUNE_SESSIONLESS_VIOLATIONS = (
    "DELETE FROM violations WHERE id IN "
    "(SELECT id FROM violations INDEXED BY violations_sessionless_by_age "
    "WHERE session_id IS NULL AND created_at < ? AND id < ? LIMIT ?)"
)
PRUNE_ORPHAN_ALERTS = (
    "DELETE FROM outbox WHERE id IN (SELECT o.id FROM outbox o WHERE o.channel = ? "
    "AND o.state IN ('delivered', 'dead') AND o.next_attempt_at < ? "
    "AND NOT EXISTS (SELECT 1 FROM violations v WHERE v.key = o.violation_key) LIMIT ?)"
)


def _connect(path: str, *, readonly: bool = False) -> sqlite3.Connection:
    connection = sqlite3.connect(path, isolation_level=None, timeout=30.0, check_same_thread=False)
    connection.execute("PRAGMA busy_timeout = 30000")
    connection.execute("PRAGMA synchronous = FULL")
    connection.execute("PRAGMA foreign_keys = OFF")
    if readonly:
        connection.execute("PRAGMA query_only = 1")
    return connection


def _prepare(connection: sqlite3.Connection, path: str) -> str | None:
    """Create the schema, or migrate an older one, in one transaction (all or nothing).
    Returns the version migrated from, if any."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        connection.execute(META)
        found = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        version = str(SCHEMA_VERSION) if found is None else found[0]
        if version == "1":
            _migrate_from_1(connection)
        elif version not in ("2", "3", "4", str(SCHEMA_VERSION)):
            # SCHEMA adds FORGETTING (3), SESSION_STATES (4), VIOLATION_CHANGES (5)
            raise version_refused(path, version, SCHEMA_VERSION)
        for statement in SCHEMA.split(";"):
            connection.execute(statement)
        connection.execute(SQL.write_meta, ("schema_version", str(SCHEMA_VERSION)))
        connection.execute(KEEP_STORE_ID, (STORE_ID, new_store_id()))
        connection.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            connection.execute("ROLLBACK")
        raise
    return None if version == str(SCHEMA_VERSION) else version


KEEP_STORE_ID = "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING"
"""The store's id, given once: a store that has one keeps it."""


def _require_current(connection: sqlite3.Connection, path: str) -> None:
    """For an administrative command beside a sidecar: the store must exist at this
    version; creating or migrating it is the sidecar's, at its start."""
    try:
        found = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except sqlite3.DatabaseError:
        found = None
    if found is None:
        raise StoreError(f"{path!r} is not a durable-sessions store")
    if found[0] != str(SCHEMA_VERSION):
        raise version_refused(path, found[0], SCHEMA_VERSION, "command")


def _migrate_from_1(connection: sqlite3.Connection) -> None:
    """Version 1 → 2: the actions table, rebuilt without its two indexes (rows, ids and
    their order kept); :data:`ACTIONS_INDEX` replaces both. Every key unique in version 1
    is unique in version 2."""
    connection.execute("ALTER TABLE actions RENAME TO actions_v1")
    connection.execute(ACTIONS)
    connection.execute("INSERT INTO actions SELECT * FROM actions_v1 ORDER BY id")
    connection.execute("DROP TABLE actions_v1")


class Ownership:
    """This process is the one sidecar writing the store file, and the file is still there.

    SQLite lets several processes write one file, but two sidecars on it would each hold
    sessions in memory that the other changes under them, and judge them wrong. So a
    sidecar holds an exclusive lock on ``PATH.lock`` while it runs (the kernel releases
    it when the process ends, SIGKILL included) and refuses a store another one holds;
    several replicas share PostgreSQL instead. A store file deleted or replaced while the
    sidecar runs is noticed before each write: writing on into the unlinked file would
    acknowledge spans that are gone.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock_path = path + ".lock"
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise StoreError(
                f"store {path!r} is in use by another sidecar (pid {holder}, holding "
                f"{self.lock_path!r}): one sidecar per SQLite file; replicas share PostgreSQL"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        self._identity: tuple[int, int] | None = None

    def remember_file(self) -> None:
        """The store file is open: from now on it must stay the file at ``path``."""
        found = os.stat(self.path)
        self._identity = (found.st_dev, found.st_ino)

    def verify(self) -> None:
        """Raise :class:`StoreError` if the file at ``path`` is no longer the store's."""
        try:
            found = os.stat(self.path)
        except FileNotFoundError:
            raise StoreError(f"store {self.path!r} was deleted while the sidecar ran; restart it") from None
        if (found.st_dev, found.st_ino) != self._identity:
            raise StoreError(f"store {self.path!r} was replaced while the sidecar ran; restart it")

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class Visitor(Ownership):
    """An administrative command's access to a store a sidecar may be running on: no
    lock is taken, so the command works beside the sidecar (SQLite lets both write)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._identity = None

    def verify(self) -> None:
        pass

    def release(self) -> None:
        pass


class SteadyClock:
    """This host's clock (``wall``), never going back: once the wall clock is behind the
    time last given, the time goes on from it by the monotonic clock (which no step of the
    wall clock moves) until the wall clock catches up; a step forward is taken as it
    comes. It starts no earlier than ``floor`` (the latest time a store holds), so that a
    step back while the sidecar was down does not set the times written after a restart
    before those written before it either."""

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        floor: float = -math.inf,
    ) -> None:
        self.wall = wall
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._given = max(floor, wall())
        self._given_at = monotonic()

    def now(self) -> float:
        with self._lock:
            at = self.monotonic()
            carried = self._given + (at - self._given_at)
            wall = self.wall()
            if wall < carried:  # stepped back (or a hair slower than the monotonic clock)
                return carried
            self._given, self._given_at = wall, at
            return wall


def latest_time(connection: sqlite3.Connection) -> float:
    """The latest activity or alert time the store holds (-inf for none), by its indexes."""
    (seen,) = connection.execute("SELECT max(last_seen) FROM sessions").fetchone()
    alerted = connection.execute("SELECT created_at FROM outbox ORDER BY id DESC LIMIT 1").fetchone()
    return max((t for t in (seen, alerted and alerted[0]) if t is not None), default=-math.inf)


class SqliteStore:
    """The :class:`~durable_sessions_collector.store.base.Store` on one SQLite file."""

    shared = False

    def __init__(self, path: str, *, exclusive: bool = True, clock: Callable[[], float] = time.time) -> None:
        """``clock``: this host's clock, which :meth:`now` keeps from going back."""
        self.path = path
        self.counted: frozenset[str] | None = None
        if not exclusive and not os.path.isfile(path):  # a visitor creates nothing, not even a file
            raise StoreError(f"no SQLite store at {path}")
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, exist_ok=True)
            self.ownership = Ownership(path) if exclusive else Visitor(path)
        except OSError as error:
            raise StoreError(f"cannot open store {path!r}: {error}") from None
        try:
            connection = _connect(path)
            if not exclusive:  # before anything writes to a file that may be no store at all
                _require_current(connection, path)
            mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreError(f"store {path!r}: cannot switch the journal to WAL (got {mode!r})")
            self.migrated_from = _prepare(connection, path) if exclusive else None
            self.clock = SteadyClock(clock, floor=latest_time(connection))
            self.ownership.remember_file()
        except (sqlite3.Error, OSError) as error:
            self.ownership.release()
            raise StoreError(f"cannot open store {path!r}: {error}") from None
        except BaseException:
            self.ownership.release()
            raise
        self._write = connection
        self._write_lock = threading.Lock()
        self.readers: ReadPool[sqlite3.Connection] = ReadPool(
            lambda: _connect(path, readonly=True), _close_quietly
        )

    # --- writing ---------------------------------------------------------------------

    @contextmanager
    def writer(self) -> Iterator[SqliteWriter]:
        with self._write_lock:
            self.ownership.verify()
            connection = self._write
            try:
                connection.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as error:
                raise StoreError(f"store {self.path!r}: cannot begin a transaction: {error}") from None
            try:
                yield SqliteWriter(connection, self.counted)
            except BaseException as error:
                with contextlib.suppress(sqlite3.Error):
                    connection.execute("ROLLBACK")
                if isinstance(error, sqlite3.OperationalError):  # locked, full, I/O: the store's state
                    raise StoreError(f"store {self.path!r}: write failed: {error}") from error
                raise
            try:
                connection.execute("COMMIT")
            except sqlite3.Error as error:
                with contextlib.suppress(sqlite3.Error):
                    connection.execute("ROLLBACK")
                raise StoreError(f"store {self.path!r}: commit failed: {error}") from None

    # --- reading ---------------------------------------------------------------------

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A read connection for one read (everything fetched before it is given back)."""
        try:
            with self.readers.lend() as connection:
                yield connection
        except sqlite3.Error as error:
            raise StoreError(f"store {self.path!r} cannot be read: {error}") from None

    def list_sessions(
        self, verdict: Verdict | None = None, limit: int = 100, after: tuple[float, str] | None = None
    ) -> list[SessionSummary]:
        statement, params = SQL.session_page(verdict, limit, after)
        with self._read() as db:
            rows = db.execute(statement, params).fetchall()
        return [session_summary(row) for row in rows]

    def list_sessions_by_id(
        self, verdict: Verdict | None = None, limit: int = 100, after: str | None = None
    ) -> list[SessionSummary]:
        """See :meth:`Store.list_sessions_by_id
        <durable_sessions_collector.store.base.Store.list_sessions_by_id>`; read through the
        session id's own index (the primary key's)."""
        statement, params = SQL.session_id_page(verdict, limit, after)
        with self._read() as db:
            rows = db.execute(statement, params).fetchall()
        return [session_summary(row) for row in rows]

    def get_session(self, session_id: str, pages: DetailPages = FIRST_PAGES) -> SessionDetail | None:
        actions_after = pages.actions_after
        with self._read() as reader:
            reader.execute("BEGIN")
            try:
                row = reader.execute(SQL.session_row, (session_id,)).fetchone()
                if row is None:
                    return None
                action_rows = reader.execute(
                    SQL.session_actions if actions_after is None else SQL.session_actions_after,
                    (session_id, session_id, *(actions_after or ()), pages.actions_limit + 1),
                ).fetchall()
                violation_rows = reader.execute(
                    SQL.session_violations,
                    (session_id, pages.violations_after or 0, pages.violations_limit + 1),
                ).fetchall()
            finally:
                reader.execute("COMMIT")
        actions, next_actions = action_page(action_rows, pages.actions_limit)
        violations, next_violations = violation_page(
            violation_rows, pages.violations_limit, session_id, self.counted
        )
        return SessionDetail(session_summary(row), actions, violations, next_actions, next_violations)

    def verdict_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("ok", "at_risk", "unrecoverable"), 0)
        with self._read() as db:
            counts.update(db.execute(SQL.verdict_counts).fetchall())
        return counts

    def pending_alerts(self, channel: str, now: float, limit: int = 100) -> list[Alert]:
        with self._read() as db:
            rows = db.execute(
                "SELECT id, channel, violation_key, payload, attempts FROM outbox AS o "
                "WHERE channel = ? AND state = 'pending' AND next_attempt_at <= ? "
                f"AND {IN_VIOLATION_ORDER} ORDER BY id LIMIT ?",
                (channel, now, limit),
            ).fetchall()
        return [
            Alert(id_, ch, key, json.loads(payload), attempts) for id_, ch, key, payload, attempts in rows
        ]

    def hold_alert(self, alert: Alert, now: float, attempt_s: float) -> Alert | None:
        """This process is the store's one writer: the alert is its to send."""
        return alert

    def release_alerts(self, alerts: Sequence[Alert], due_at: float) -> None:
        """Nothing was claimed: a row is due as it was."""

    def alert_counts(self) -> dict[tuple[str, str], int]:
        with self._read() as db:
            rows = db.execute(SQL.alert_counts).fetchall()
        return {(channel, state): count for channel, state, count in rows}

    def dead_alerts(self, channel: str | None = None, limit: int = 100) -> list[DeadAlert]:
        with self._read() as db:
            rows = db.execute(SQL.dead_alerts, (channel, channel, limit)).fetchall()
        return [DeadAlert(id_, ch, key, json.loads(payload), *rest) for id_, ch, key, payload, *rest in rows]

    def count_actions(self) -> int:
        with self._read() as db:
            return int(db.execute(SQL.count_actions).fetchone()[0])

    # --- the violation feed (WatchAlerts) ------------------------------------------------
    # One writer commits at a time, so violation ids, and change ids, each grow in commit
    # order: the cursor is the last violation id and the last change id passed,
    # ``sqlite:V:C``. Version 4's ``sqlite:V`` is read as ``sqlite:V:0``: it was taken
    # before the store had any change.

    def violation_cursor(self) -> str:
        """A cursor after every violation and change committed so far."""
        with self._read() as db:
            violations, changes = _feed_end(db)
        return f"sqlite:{violations}:{changes}"

    def feed_start(self) -> str:
        """A cursor before every violation and change: ids count from 1."""
        return "sqlite:0:0"

    def store_id(self) -> str | None:
        with self._read() as db:
            found = db.execute("SELECT value FROM meta WHERE key = ?", (STORE_ID,)).fetchone()
        return None if found is None else str(found[0])

    def violations_after(self, cursor: str, limit: int = 100) -> tuple[list[dict[str, Any]], str]:
        """Committed violations and changes after ``cursor``, in commit order, and the
        cursor after them (see :meth:`Store.violations_after
        <durable_sessions_collector.store.base.Store.violations_after>`).

        A cursor past the end of the feed was not given by this store, whose ids only grow
        (retention keeps the newest violation): it is one of a store deleted since (a file
        lost with its pod, removed to judge everything anew). Every row of this store was
        committed after it was given, so the feed is read from its start (the position
        returned when that finds nothing); read from the cursor, the new store's first
        violations, numbered from 1 again, were never sent."""
        violations, changes = (*cursor_position(cursor, "sqlite", (1, 2)), 0)[:2]
        with self._read() as reader:
            reader.execute("BEGIN")  # both tables from one snapshot
            try:
                end_violations, end_changes = _feed_end(reader)
                if violations > end_violations or changes > end_changes:
                    # And the start is the position to go on from when the feed is empty:
                    # kept, the cursor was read as a position again once the feed had grown
                    # past it, and a first commit of that many violations lost its first ones.
                    violations, changes = 0, 0
                    cursor = self.feed_start()
                rows = first_of_feed(
                    [
                        violation_feed_row(row)
                        for row in reader.execute(
                            f"SELECT v.id, v.id, {FEED_COLUMNS} {FEED_VIOLATIONS} WHERE v.id > ? ORDER BY v.id LIMIT ?",
                            (violations, limit),
                        )
                    ],
                    [
                        change_feed_row(row)
                        for row in reader.execute(
                            f"SELECT c.after_violation, c.id, c.status, c.detected_at, {FEED_COLUMNS} {FEED_CHANGES} "
                            "WHERE c.id > ? ORDER BY c.id LIMIT ?",
                            (changes, limit),
                        )
                    ],
                    limit,
                )
            finally:
                reader.execute("COMMIT")
        found = list(_with_cursors(rows, violations, changes))
        return found, (found[-1]["cursor"] if found else cursor)

    def check(self) -> None:
        self.ownership.verify()
        with self._read() as db:
            db.execute(SQL.check).fetchone()

    def build_indexes(self, report: IndexReport) -> threading.Thread | None:
        """Nothing to build: a SQLite store gets its indexes with its schema, when opened."""
        return None

    def now(self) -> float:
        """This host's clock, which one sidecar writes the store by, kept from going back
        (:class:`SteadyClock`): never before a time given earlier or stored."""
        return self.clock.now()

    def close(self) -> None:
        self.readers.close()
        with self._write_lock:
            self._write.close()
        self.ownership.release()


def _feed_end(db: sqlite3.Connection) -> tuple[int, int]:
    """The last violation id and the last change id given (0: none yet)."""
    return db.execute(  # type: ignore[no-any-return]
        "SELECT (SELECT coalesce(max(id), 0) FROM violations), "
        # The largest change id ever given (retention may have deleted its row).
        "coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'violation_changes'), 0)"
    ).fetchone()


def _with_cursors(rows: list[FeedRow], violations: int, changes: int) -> Iterator[dict[str, Any]]:
    """The feed's items, each with the cursor after it: the last violation id and the last
    change id passed, from ``violations`` and ``changes`` before the first."""
    for row in rows:
        _, kind, id_ = row.order
        if kind == FEED_VIOLATION:
            violations = id_
        else:
            changes = id_
        yield {**row.item, "cursor": f"sqlite:{violations}:{changes}"}


def _close_quietly(connection: sqlite3.Connection) -> None:
    with contextlib.suppress(sqlite3.Error):
        connection.close()


class SqliteWriter(SqlWriter):
    """One write transaction on the store's write connection."""

    __slots__ = ()
    _sql = SQL

    def lock_sessions(self, session_ids: list[str]) -> None:
        """Nothing to do: this process is the store's only writer, so what the evaluator
        holds in memory is what the store holds (see the PostgreSQL store)."""
        return None

    def keep_state(
        self, session_id: str, fed: int, state: bytes, if_stored: StoredSession | None = None
    ) -> None:
        """Kept whatever ``if_stored`` says: this process is the store's only writer, so
        the store holds what the engine was fed (and the evaluator's ``first_seen`` of a
        session it rebuilt is not its row's)."""
        super().keep_state(session_id, fed, state)

    def is_stored(self, row: ActionRow) -> bool:
        found = self._db.execute(
            f"SELECT 1 FROM actions WHERE {SESSION_KEY} = ? AND trace_id = ? AND span_id = ? AND status = ?",
            (row.session_id or "", row.trace_id, row.span_id, row.status),
        ).fetchone()
        return found is not None

    def session_records(self, session_id: str, after_id: int = 0) -> Iterator[tuple[ActionRecord, Location]]:
        # Row by row from the cursor, not fetchall(): a session of a million actions is
        # rebuilt in the memory of one record (and SQLite's sorter, which spills to disk).
        rows = self._db.execute(
            f"SELECT trace_id, span_id, record FROM actions WHERE {SESSION_KEY} = ? AND {SQL.not_forgotten} "
            "AND id > ? ORDER BY id",
            (session_id, session_id, after_id),
        )
        for trace_id, span_id, record in rows:
            yield decode_record(record), Location(None, None, trace_id, span_id)

    def resolve_end_violations(self, session_id: str, keep: set[str], *, now: float) -> Settled:
        rows = self._db.execute(
            f"SELECT {VIOLATION_COLUMNS} FROM violations WHERE session_id = ? AND at_end = 1 ORDER BY id",
            (session_id,),
        ).fetchall()
        counted = self._counted
        found = [v for v in map(violation_detail, rows) if counts_in_verdict(v["rule"], counted)]
        resolved = [v for v in found if not v["resolved"] and v["key"] not in keep]
        held_again = {v["key"] for v in found if v["resolved"] and v["key"] in keep}
        self._db.executemany(
            "UPDATE violations SET resolved = 1 WHERE key = ?", [(v["key"],) for v in resolved]
        )
        self._db.executemany(
            "UPDATE violations SET resolved = 0 WHERE key = ?", [(key,) for key in held_again]
        )
        self._db.executemany(
            "INSERT INTO violation_changes (violation_id, session_id, status, detected_at, after_violation) "
            "SELECT id, session_id, ?, ?, (SELECT max(id) FROM violations) FROM violations WHERE key = ?",
            status_changes(resolved, held_again, now),
        )
        return Settled([{**v, "resolved": True} for v in resolved], held_again)

    def lock_verdict_rules(self) -> None:
        """Nothing to do: the transaction is ``BEGIN IMMEDIATE``, which one writer holds at a time."""

    def sessions_with_rules(
        self, rules: frozenset[str], after: str, window: int
    ) -> tuple[list[str], str | None]:
        (last,) = self._db.execute(SQL.sessions_window_end, (after, window)).fetchone()
        if last is None or not rules:
            return [], last
        marks = ", ".join("?" * len(rules))
        found = self._db.execute(
            "SELECT DISTINCT session_id FROM violations WHERE session_id > ? AND session_id <= ? "
            f"AND rule IN ({marks}) ORDER BY session_id",
            (after, last, *sorted(rules)),
        ).fetchall()
        return [session_id for (session_id,) in found], last

    def mark_delivered(self, alerts: Sequence[Alert], now: float) -> None:
        self._db.executemany(
            "UPDATE outbox SET state = 'delivered', delivered_at = ?, attempts = attempts + 1 "
            "WHERE id = ? AND state = 'pending'",
            [(now, alert.id) for alert in alerts],
        )

    def mark_failed(self, alert: Alert, error: str, retry_at: float | None, failed: int = 1) -> None:
        if retry_at is None:
            self._db.execute(
                "UPDATE outbox SET state = 'dead', attempts = attempts + ?, last_error = ? "
                "WHERE id = ? AND state = 'pending'",
                (failed, error, alert.id),
            )
        else:
            self._db.execute(
                "UPDATE outbox SET attempts = attempts + ?, last_error = ?, next_attempt_at = ? "
                "WHERE id = ? AND state = 'pending'",
                (failed, error, retry_at, alert.id),
            )

    def prune(self, cutoff: float, limit: int, max_actions: int | None = None) -> Pruned:
        """See :meth:`Writer.prune <durable_sessions_collector.store.base.Writer.prune>`.

        The newest violation is kept, and the session it belongs to: SQLite gives the
        largest id in a table plus one to the next row, so deleting the newest violation
        would give its id again, and a WatchAlerts cursor at that id would skip the next
        violation."""
        db = self._db
        forgetting = db.execute(FORGETTING_SESSIONS, (limit,)).fetchall()
        forgot, forgetting_left = forget_some(forgetting, max_actions, self._forget_actions, self._forgotten)
        budget = None if max_actions is None else max(max_actions - forgot, 0)
        newest_id, newest_session = db.execute(NEWEST_VIOLATION).fetchone() or (0, None)
        found = db.execute(SQL.prunable_sessions, (cutoff, limit)).fetchall() if budget != 0 else []
        taken, cut, oversized = within_budget(found, budget)
        cut = cut or budget == 0
        sessions = [session_id for session_id in taken if session_id != newest_session]
        channels = [name for (name,) in db.execute(OUTBOX_CHANNELS)]
        if sessions:
            db.executemany(PRUNE_SESSION_ALERTS, [(c, s) for s in sessions for c in channels])
            for statement in PRUNE_SESSION_ROWS:
                db.executemany(statement, [(session_id,) for session_id in sessions])
            db.executemany(PRUNE_SESSION_ACTIONS, [(s,) for s in sessions if s != oversized])
            if oversized in sessions:  # its actions: a budget at a time, by the next passes
                db.execute(SQL.forget_session, (oversized, oversized))
        counts = [
            forgot,
            db.execute(PRUNE_SESSIONLESS_ACTIONS, (cutoff, limit)).rowcount,
            db.execute(PRUNE_SESSIONLESS_VIOLATIONS, (cutoff, newest_id, limit)).rowcount,
        ]
        more_sessions = cut or len(found) == limit
        if not more_sessions:
            counts.append(self._prune_orphan_alerts(channels, cutoff, limit))
        more_forgetting = forgetting_left or len(forgetting) == limit or oversized in sessions
        return Pruned(sessions, sum(counts), more_sessions or more_forgetting or limit in counts[1:])

    def _forget_actions(self, session_id: str, through_id: int, most: int | None) -> tuple[int, bool]:
        """Up to ``most`` of the session's actions up to ``through_id``, that one last
        (:data:`FORGET_LAST_ACTION`); how many, and whether none are left."""
        below = self._db.execute(
            FORGET_ACTIONS, (session_id, through_id, -1 if most is None else most)
        ).rowcount
        if most is not None and below >= most:
            return below, False
        return below + self._db.execute(FORGET_LAST_ACTION, (through_id, session_id)).rowcount, True

    def _prune_orphan_alerts(self, channels: list[str], cutoff: float, limit: int) -> int:
        """Delete up to ``limit`` delivered or dead alerts of deleted violations, over all channels."""
        left = limit
        for channel in channels:
            left -= self._db.execute(PRUNE_ORPHAN_ALERTS, (channel, cutoff, left)).rowcount
            if left <= 0:
                break
        return limit - left
