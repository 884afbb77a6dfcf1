"""The PostgreSQL store (psycopg 3): several sidecar replicas sharing sessions.

``store: postgresql://user@host:5432/db?schema=durable_sessions`` — any libpq URL;
the extra ``schema`` parameter names the schema the tables live in (created when
missing; without it the connection's ``search_path`` decides, usually ``public``).

The same tables as the SQLite store, and the statements of :mod:`.statements` (:data:`SQL`),
plus what sharing needs:

- **Schema**: created idempotently (``CREATE … IF NOT EXISTS``) in one transaction
  under an advisory lock, so replicas starting together do not race; the version is in
  ``meta.schema_version``. A store of an earlier version is migrated (:func:`_migrate`),
  one of another version is refused.
- **Deduplication**: ``INSERT … ON CONFLICT DO NOTHING`` on the SQLite store's key of
  an action, ``(coalesce(session_id, ''), trace_id, span_id, status)`` (index
  :data:`ACTIONS_KEY`), and on the violation key. PostgreSQL makes a second inserter of
  the same key wait for the first transaction and then do nothing, so a span delivered to two
  replicas is stored once and a violation found by two replicas is new — and queued in
  the outbox — in exactly one of them.
- **One session, one writer at a time**: a write transaction first takes a
  transaction-scoped advisory lock on each session it touches (:meth:`PostgresWriter.
  lock_sessions`, in a fixed order, so two replicas cannot deadlock on them), and learns
  how many actions the store holds for each and when its row was made. The evaluator
  drops a session it holds in memory when that count is not the one it fed (another
  replica added spans) or the row is another (another replica's retention deleted it and
  spans started it afresh), and rebuilds it from the store. So spans of one session may
  arrive at any replica, in any interleaving, and are judged as one sidecar would judge
  them, in commit order.
- **Idle sweep**: :meth:`PostgresWriter.idle_sessions` only returns sessions whose lock
  it could take (``pg_try_advisory_xact_lock``), so one replica ends a session while the
  others skip it, and no replica ends a session another is writing.
- **One clock**: :meth:`PostgresStore.now` is the server's time (:class:`ServerClock`),
  which the pipeline writes session times with and takes the idle and retention cutoffs
  from, so replicas whose hosts' clocks disagree judge idleness alike.
- **Retention**: :meth:`PostgresWriter.prune` deletes only ended sessions whose lock it
  could take and that are still ended and old under it, so a session another replica
  is appending to is never deleted under it.
- **Alert outbox**: :meth:`PostgresStore.pending_alerts` *claims* the rows it returns
  (``FOR UPDATE SKIP LOCKED``, then ``next_attempt_at`` moved ``claim_lease_s`` ahead),
  so each alert is delivered by one replica; :meth:`PostgresStore.hold_alert` renews a
  claim right before each attempt (for the attempt and a lease after it) if the row
  still holds it, and ``mark_delivered`` / ``mark_failed`` end the claim, only while the
  row still holds it. A replica that dies holding a claim leaves it to another after the
  lease; a replica whose claim ran out before it got to the row leaves it to the one that
  claimed it next.
- **Violation feed** (``WatchAlerts``): each violation row, and each row of a change of
  a violation's status (``violation_changes``), carries the id of the transaction that
  wrote it (``xid8``). A reader only returns rows of transactions older than every
  transaction still running that holds a lock on a table of the store
  (:func:`_feed_horizon`: those are the ones that may write a violation or a change),
  ordered by ``(xid, kind, id)``, so a cursor never passes a row that commits later, and
  a transaction of another application or database does not hold the feed back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, LiteralString, TypeVar
from urllib.parse import unquote

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from durable_sessions.record import ActionRecord, Location
from durable_sessions.report import Verdict
from durable_sessions_collector.config import redact_store_url
from durable_sessions_collector.quote import quoted
from durable_sessions_collector.store.base import (
    FEED_CHANGE,
    FEED_CHANGES,
    FEED_COLUMNS,
    FEED_VIOLATION,
    FEED_VIOLATIONS,
    FIRST_PAGES,
    IN_VIOLATION_ORDER,
    INDEX_BUILT,
    INDEX_FAILED,
    INDEX_LEFT_TO_ANOTHER,
    NO_SESSION,
    OUTBOX_CHANNELS,
    STORE_ID,
    TEXT_COLUMNS,
    VIOLATION_COLUMNS,
    ActionRow,
    Alert,
    DeadAlert,
    DetailPages,
    FeedRow,
    IndexReport,
    Pruned,
    RecordRefused,
    SessionDetail,
    SessionSummary,
    Settled,
    StoredSession,
    StoreError,
    action_page,
    change_feed_row,
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

_T = TypeVar("_T")

SCHEMA_VERSION = 5
CLAIM_LEASE_S = 60.0
CLOCK_READ_EVERY_S = 10.0
"""Seconds between two readings of the server's clock (:class:`ServerClock`)."""
CONNECTION_DEFAULTS: dict[str, int] = {
    "connect_timeout": 10,
    # A server host that vanished (powered off, failed over to another host behind the same
    # address, cut off by a partition) sends no reset. Under the operating system's defaults
    # a connection waiting on it waited 2 h before its first keepalive probe, or some 15 min
    # of retransmissions: the writer committed nothing, long after the store was back.
    # These give a connection up after 30 s of silence and 3 probes 10 s apart, or 60 s of
    # data unacknowledged; it is replaced at its next use.
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}
"""libpq parameters every connection of the store gets, unless the URL sets them."""
SERVER_SIDE: dict[str, str] = {
    "keepalives_idle": "tcp_keepalives_idle",
    "keepalives_interval": "tcp_keepalives_interval",
    "keepalives_count": "tcp_keepalives_count",
    "tcp_user_timeout": "tcp_user_timeout",
}
"""The server's settings for its side of a connection's socket, each set as the libpq
parameter of the same meaning is (the URL's value, else :data:`CONNECTION_DEFAULTS`). A
replica's host that vanished in a transaction sends the server no reset either: under the
server's defaults (2 h of silence before the first probe) its backend kept the transaction,
and the advisory locks of its sessions, which every other replica writing one of them
waited for, committing nothing. A backend now gives up as the sidecar's side does."""
DDL_LOCK = 0x64757261  # advisory lock held while creating the schema ("dura")
_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")

# A session too large for one retention pass: deleted but for its actions up to
# ``through_id``, which later passes delete a budget at a time and reads of the session
# skip (see the SQLite store). Version 2 added it; a version 1 store gets it at start.
FORGETTING = """
CREATE TABLE IF NOT EXISTS forgetting (
    session_id TEXT PRIMARY KEY,
    through_id BIGINT NOT NULL
)
"""
# The engine's state of a long session (see the SQLite store). Version 3 added it; a
# version 1 or 2 store gets it at start.
SESSION_STATES = """
CREATE TABLE IF NOT EXISTS session_states (
    session_id TEXT PRIMARY KEY,
    fed BIGINT NOT NULL,
    through_id BIGINT NOT NULL,
    state BYTEA NOT NULL
)
"""
# The violation feed's changes of status (resolved, firing again), written with the flip
# of violations.resolved (PostgresWriter.resolve_end_violations), each with the id of its
# transaction, as a violation has (see the feed). Version 4 added it; an older store gets
# it at start.
VIOLATION_CHANGES = """
CREATE TABLE IF NOT EXISTS violation_changes (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    violation_id BIGINT NOT NULL,
    session_id TEXT,
    status TEXT NOT NULL,
    detected_at DOUBLE PRECISION NOT NULL,
    xid XID8 NOT NULL DEFAULT pg_current_xact_id()
);
CREATE INDEX IF NOT EXISTS violation_changes_feed ON violation_changes (xid, id);
CREATE INDEX IF NOT EXISTS violation_changes_by_session ON violation_changes (session_id)
"""
# An outbox row this replica's claim still holds (see Alert.claim), joined as ``held``:
# pending, and its next_attempt_at still the one the claim set (a later claim by
# another replica, or a retry time, sets another).
STILL_HELD = "outbox.id = held.id AND outbox.state = 'pending' AND outbox.next_attempt_at = held.claim"
SQL = Statements(
    placeholder="%s",
    session_key="session_id",
    touched_last_seen="GREATEST(sessions.last_seen, excluded.last_seen)",
)
"""The statements this store shares with the SQLite store."""
SESSION_RECORDS_PAGE = 2_000
"""Rows one query of :meth:`PostgresWriter.session_records` reads: a rebuild's memory."""
SESSION_RECORDS = (
    "SELECT id, trace_id, span_id, record FROM actions "
    f"WHERE session_id = %s AND {SQL.not_forgotten} AND id > %s ORDER BY id LIMIT %s"
)
"""A page of :meth:`PostgresWriter.session_records` (the session id twice, the last id
read, :data:`SESSION_RECORDS_PAGE`), along ``actions_by_session``."""
SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS actions (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session_id TEXT,
    trace_id TEXT NOT NULL,
    span_id TEXT NOT NULL,
    status TEXT NOT NULL,
    action_id TEXT,
    kind TEXT,
    seq BIGINT,
    received_at DOUBLE PRECISION NOT NULL,
    record TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS actions_by_session ON actions (session_id, id);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    first_seen DOUBLE PRECISION NOT NULL,
    last_seen DOUBLE PRECISION NOT NULL,
    open SMALLINT NOT NULL DEFAULT 1,
    ended_at DOUBLE PRECISION,
    actions BIGINT NOT NULL DEFAULT 0,
    errors INTEGER NOT NULL DEFAULT 0,
    warnings INTEGER NOT NULL DEFAULT 0,
    verdict TEXT NOT NULL DEFAULT 'ok'
);
CREATE INDEX IF NOT EXISTS sessions_idle ON sessions (last_seen) WHERE open = 1;
CREATE INDEX IF NOT EXISTS sessions_by_verdict ON sessions (verdict, last_seen DESC, session_id DESC);
CREATE INDEX IF NOT EXISTS sessions_by_activity ON sessions (last_seen DESC, session_id DESC);
CREATE TABLE IF NOT EXISTS violations (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    session_id TEXT,
    rule TEXT NOT NULL,
    severity TEXT NOT NULL,
    message TEXT NOT NULL,
    action_id TEXT,
    trace_id TEXT,
    span_id TEXT,
    at_end SMALLINT NOT NULL DEFAULT 0,
    resolved SMALLINT NOT NULL DEFAULT 0,
    created_at DOUBLE PRECISION NOT NULL,
    xid XID8 NOT NULL DEFAULT pg_current_xact_id()
);
CREATE INDEX IF NOT EXISTS violations_by_session ON violations (session_id, id);
CREATE INDEX IF NOT EXISTS violations_feed ON violations (xid, id);
CREATE TABLE IF NOT EXISTS outbox (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    channel TEXT NOT NULL,
    violation_key TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at DOUBLE PRECISION NOT NULL,
    last_error TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    delivered_at DOUBLE PRECISION,
    UNIQUE (channel, violation_key)
);
CREATE INDEX IF NOT EXISTS outbox_due ON outbox (channel, state, next_attempt_at);
"""
    + f"{FORGETTING};{SESSION_STATES};{VIOLATION_CHANGES};"
)

# The key that drops a redelivered span: the SQLite store's (its ACTIONS_INDEX), so that
# both stores keep the same spans. Versions 1 to 4 had UNIQUE (trace_id, span_id, status)
# (OLD_ACTIONS_KEY), which also dropped a span whose ids and status equal those of a span
# of another session. A new store gets this index with its schema; a store of an earlier
# sidecar gets it built CONCURRENTLY at start (PostgresStore.build_indexes), and then the
# old constraint dropped: every key unique under the old one is unique under this one, so
# the build cannot fail on the rows, and until it is done the old key drops a superset.
ACTIONS_KEY = ("actions_by_session_span", "actions (coalesce(session_id, ''), trace_id, span_id, status)")
OLD_ACTIONS_KEY = "actions_trace_id_span_id_status_key"
"""The name PostgreSQL gave the version 1-4 schema's ``UNIQUE (trace_id, span_id, status)``."""
SESSION_KEY = "coalesce(session_id, '')"
"""How :data:`ACTIONS_KEY` keys a row's session: :data:`IS_STORED` says it so, to use it."""
IS_STORED = (
    f"SELECT 1 FROM actions WHERE {SESSION_KEY} = %s AND trace_id = %s AND span_id = %s AND status = %s"
)
"""Whether an action of the key (session id or '', trace, span, status) is stored."""

# Retention finds the old rows of no session through these (only such rows are in them).
# Without them its queries scanned the whole actions table each minute, in the writer's
# transaction. A new store gets them with its schema; a store of an earlier sidecar
# gets them at start, built CONCURRENTLY so that the other replicas write on meanwhile
# (see PostgresStore.build_indexes).
SESSIONLESS_BY_AGE = (
    ("actions_sessionless_by_age", "actions (received_at) WHERE session_id IS NULL"),
    ("violations_sessionless_by_age", "violations (created_at) WHERE session_id IS NULL"),
)


def _t(value: str | None) -> str | None:
    """Text PostgreSQL can hold: NUL is the one character a TEXT value cannot contain.

    Meant for free text (a message, a delivery error), where U+FFFD in its place is
    harmless. No stored id holds NUL: a span with one is refused by every store
    (:func:`~durable_sessions_collector.store.base.refuse_nul`), since replacing it would
    make two ids one."""
    if value is None or "\x00" not in value:
        return value
    return value.replace("\x00", "\ufffd")


KEEP_STORE_ID = "INSERT INTO meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING"
"""The store's id, given once: a store that has one keeps it (replicas starting together
take turns under the schema lock; the first one's id is every one's)."""


def _texts_held(row: ActionRow) -> ActionRow:
    """``row`` with :func:`_t` applied to its text columns (the same row when none holds NUL)."""
    held = {name: _t(text) for name in TEXT_COLUMNS if (text := getattr(row, name)) and "\x00" in text}
    return dataclasses.replace(row, **held) if held else row


def _migrate(connection: psycopg.Connection[Any]) -> str | None:
    """Bring a store of an earlier version to this one, in the caller's transaction (under
    the schema lock); return the version migrated from. Another version is left for the
    caller to refuse. Version 2 added the ``forgetting`` table, version 3 the
    ``session_states`` table, version 4 the ``violation_changes`` table: no existing table
    is locked, so the other replicas write on. Version 5 keys the actions as the SQLite
    store does (:data:`ACTIONS_KEY`), which is built concurrently after the start
    (:meth:`PostgresStore.build_indexes`), not here: building it here would stop every
    replica's writes for as long as the build takes."""
    row = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None or row[0] not in ("1", "2", "3", "4"):
        return None
    connection.execute(FORGETTING)
    connection.execute(SESSION_STATES)
    connection.execute(VIOLATION_CHANGES)
    connection.execute("UPDATE meta SET value = %s WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
    return str(row[0])


def _session_settings(parameters: dict[str, Any]) -> sql.Composed:
    """The settings each connection makes on the server: its side of the socket as the
    libpq ``parameters`` in effect make the sidecar's (:data:`SERVER_SIDE`), and
    ``extra_float_digits``.

    psycopg reads a float8 as the text the server writes, which a server, role or database
    set to fewer digits (extra_float_digits 0: 15) rounds: a time read back then differed
    from the one written, and every comparison of the two failed (an alert's claim, a
    session's first_seen). Any value above 0 writes the shortest text that reads back exactly."""
    settings = [("extra_float_digits", 3)] + [
        (setting, int(parameters[name]))  # an integer: libpq connected with it
        for name, setting in SERVER_SIDE.items()
    ]
    return sql.SQL("; ").join(
        sql.SQL("SET {} = {}").format(sql.Identifier(setting), sql.Literal(value))
        for setting, value in settings
    )


def _schema_exists(connection: psycopg.Connection[Any], schema: str) -> bool:
    """Whether ``schema`` exists. Looked up before ``CREATE SCHEMA IF NOT EXISTS``, which
    PostgreSQL refuses without CREATE on the database even when the schema is there: a
    role that owns its schema and may not create others must still start."""
    return (
        connection.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)).fetchone() is not None
    )


def _create_index(
    name: str, definition: str, *, concurrently: bool = False, unique: bool = False
) -> sql.Composed:
    how = ("CREATE UNIQUE INDEX" if unique else "CREATE INDEX") + (" CONCURRENTLY" if concurrently else "")
    return sql.SQL(how + " IF NOT EXISTS {} ON " + definition).format(sql.Identifier(name))  # type: ignore[arg-type]


def _index_valid(connection: psycopg.Connection[Any], name: str) -> bool | None:
    """Whether index ``name`` is valid; None when there is no such index."""
    found = connection.execute(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", (name,)
    ).fetchone()
    return None if found is None else bool(found[0])


def _build_index(connection: psycopg.Connection[Any], name: str, definition: str) -> None:
    """Build index ``name`` unless it is there and valid (see ``PostgresStore.build_indexes``);
    for :data:`ACTIONS_KEY`, then drop the key it replaces (:func:`_drop_old_key`)."""
    is_key = name == ACTIONS_KEY[0]
    valid = _index_valid(connection, name)
    if not valid:
        if valid is not None:
            connection.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(sql.Identifier(name)))
        connection.execute(_create_index(name, definition, concurrently=True, unique=is_key))
    if is_key:  # once the new key holds: the old one may go
        _drop_old_key(connection)


def _has_old_key(connection: psycopg.Connection[Any]) -> bool:
    """Whether the actions table still has the version 1-4 key (:data:`OLD_ACTIONS_KEY`)."""
    found = connection.execute(
        "SELECT 1 FROM pg_constraint WHERE conrelid = to_regclass('actions') AND conname = %s",
        (OLD_ACTIONS_KEY,),
    ).fetchone()
    return found is not None


def _drop_old_key(connection: psycopg.Connection[Any]) -> None:
    """Drop :data:`OLD_ACTIONS_KEY`, once :data:`ACTIONS_KEY` is valid. Dropping a
    constraint locks the table exclusively: it waits for the transactions on it, and every
    read and write of it waits behind. Without a ``lock_timeout`` of the server's or the
    URL's it gives up after 10 s (a long transaction), and the next start tries again."""
    with connection.transaction():
        connection.execute(
            "SELECT set_config('lock_timeout', '10s', true) WHERE current_setting('lock_timeout') = '0'"
        )
        connection.execute(
            sql.SQL("ALTER TABLE actions DROP CONSTRAINT IF EXISTS {}").format(
                sql.Identifier(OLD_ACTIONS_KEY)
            )
        )


def _pending_indexes(connection: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    """The indexes :meth:`PostgresStore.build_indexes` has to build (or, for
    :data:`ACTIONS_KEY`, to finish by dropping the old key)."""
    pending = (
        [ACTIONS_KEY] if not _index_valid(connection, ACTIONS_KEY[0]) or _has_old_key(connection) else []
    )
    return pending + [
        (name, definition) for name, definition in SESSIONLESS_BY_AGE if not _index_valid(connection, name)
    ]


def split_url(url: str) -> tuple[str, str | None]:
    """``postgresql://…?schema=x&…`` → (the libpq URL without ``schema``, ``x``).

    Only the ``schema=`` pairs are cut out of the query; the rest of the URL is passed on
    byte for byte, as libpq reads it: an empty host part (``postgresql:///db?host=…``, a
    Unix socket) keeps its ``//``, and a ``+`` or ``%20`` in a value stays what it was
    (libpq reads ``+`` as itself, not as a space). Rebuilding the URL from decoded parts
    changed both."""
    base, _, query = url.partition("?")
    kept: list[str] = []
    schemas: list[str] = []
    for pair in query.split("&") if query else []:
        key, _, value = pair.partition("=")
        if unquote(key) == "schema":
            schemas.append(unquote(value))
        else:
            kept.append(pair)
    schema = schemas[-1] if schemas else None
    if schema is not None and not _SCHEMA_NAME.match(schema):
        raise StoreError(
            f"schema must be a plain identifier (letters, digits, _; at most 63), got {schema!r}"
        )
    return (f"{base}?{'&'.join(kept)}" if kept else base), schema


class PostgresStore:
    """The :class:`~durable_sessions_collector.store.base.Store` on a PostgreSQL database."""

    shared = True

    def __init__(self, url: str, *, claim_lease_s: float = CLAIM_LEASE_S, existing: bool = False) -> None:
        self.url = url
        self.name = redact_store_url(url)
        self.migrated_from: str | None = None
        self.counted: frozenset[str] | None = None
        self.dsn, self.schema = split_url(url)
        self.claim_lease_s = claim_lease_s
        self._write_lock = threading.Lock()
        self.readers: ReadPool[psycopg.Connection[Any]] = ReadPool(
            self._connect_reader,
            _close_quietly,
            lambda connection: not (connection.closed or connection.broken),
        )
        self.clock = ServerClock(self._server_time)
        self._closing = False
        self._index_builder: threading.Thread | None = None
        self._index_connection: psycopg.Connection[Any] | None = None
        try:
            connection = self._connect(create_schema=not existing)
        except psycopg.Error as error:
            raise StoreError(f"cannot open store {self.name!r}: {_reason(error)}") from None
        try:
            self._open(connection, existing)
        except BaseException:
            connection.close()  # a store that cannot be opened keeps no connection to its server
            raise
        self._write = connection

    def _open(self, connection: psycopg.Connection[Any], existing: bool) -> None:
        """Create, migrate or check the store's schema on its write connection."""
        try:
            with connection.transaction():
                connection.execute("SELECT pg_advisory_xact_lock(%s)", (DDL_LOCK,))
                # A store that exists is left alone here: CREATE ... IF NOT EXISTS still locks
                # each table, and would wait on (and deadlock with) an index being built.
                missing = connection.execute("SELECT to_regclass('meta')").fetchone() == (None,)
                if existing:  # an administrative command: neither create nor migrate
                    if missing:
                        raise StoreError(f"no store in {self.name!r} (schema {self.schema or 'public'})")
                elif missing:
                    connection.execute(SCHEMA)
                    connection.execute(_create_index(*ACTIONS_KEY, unique=True))
                    for name, definition in SESSIONLESS_BY_AGE:
                        connection.execute(_create_index(name, definition))
                    connection.execute(
                        "INSERT INTO meta (key, value) VALUES ('schema_version', %s)", (str(SCHEMA_VERSION),)
                    )
                else:
                    self.migrated_from = _migrate(connection)
                if not existing:
                    connection.execute(KEEP_STORE_ID, (STORE_ID, new_store_id()))
            row = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            scope = connection.execute("SELECT current_schema()").fetchone()
        except psycopg.Error as error:
            raise StoreError(f"cannot open store {self.name!r}: {_reason(error)}") from None
        if row is None or int(row[0]) != SCHEMA_VERSION:
            raise version_refused(
                self.name, row and row[0], SCHEMA_VERSION, "command" if existing else "sidecar"
            )
        # Advisory locks are database-wide: scope the session locks to this schema.
        self._lock_class = int(
            connection.execute("SELECT hashtext(%s)", (scope[0] if scope else "",)).fetchone()[0]  # type: ignore[index]
        )
        self._scope = scope[0] if scope else ""

    def build_indexes(self, report: IndexReport) -> threading.Thread | None:
        """See :meth:`Store.build_indexes <durable_sessions_collector.store.base.Store.build_indexes>`.

        The indexes a store of an earlier sidecar lacks are built ``CONCURRENTLY`` by a
        thread of their own, on a connection of its own: the other replicas write on, and
        this one serves meanwhile (its retention queries are the same without them, only
        slower; until :data:`ACTIONS_KEY` replaces the old key, a span whose ids and status
        equal a span's of another session is dropped, as before version 5). One replica
        builds at a time; another that finds a build in progress leaves it to that one. An index left invalid by an interrupted build is dropped
        and built again. :meth:`close` cancels a build in progress, which the next start
        takes up again."""
        pending = self._reading(_pending_indexes)
        if not pending:
            return None
        self._index_builder = threading.Thread(
            target=self._build_indexes,
            args=(pending, report),
            name="durable-sessions-index-build",
            daemon=True,
        )
        self._index_builder.start()
        return self._index_builder

    def _build_indexes(self, pending: list[tuple[str, str]], report: IndexReport) -> None:
        try:
            connection = self._connect()
        except psycopg.Error as error:
            for name, _ in pending:
                report(name, INDEX_FAILED, _reason(error))
            return
        self._index_connection = connection
        try:
            if not self._closing:  # else closed while this connected: close() may not have seen it
                self._build_on(connection, pending, report)
        finally:
            _close_quietly(connection)  # the session's advisory lock goes with it

    def _build_on(
        self, connection: psycopg.Connection[Any], pending: list[tuple[str, str]], report: IndexReport
    ) -> None:
        key = f"durable-sessions index build {self._scope}"
        try:
            got = connection.execute(
                "SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (key,)
            ).fetchone()
        except psycopg.Error as error:
            for name, _ in pending:
                report(name, INDEX_FAILED, _reason(error))
            return
        if not (got and got[0]):  # another replica is building them
            for name, _ in pending:
                report(name, INDEX_LEFT_TO_ANOTHER, None)
            return
        for name, definition in pending:
            try:
                _build_index(connection, name, definition)
            except psycopg.Error as error:
                if self._closing:  # cancelled by close(): the next start builds it
                    return
                report(name, INDEX_FAILED, _reason(error))
            else:
                report(name, INDEX_BUILT, None)

    def _connect(self, *, create_schema: bool = False) -> psycopg.Connection[Any]:
        options: dict[str, Any] = {"autocommit": True}
        given = conninfo_to_dict(self.dsn)
        options.update((name, value) for name, value in CONNECTION_DEFAULTS.items() if name not in given)
        connection = psycopg.connect(self.dsn, **options)
        try:
            connection.execute(_session_settings({**options, **given}))
            if self.schema is not None:
                if create_schema and not _schema_exists(connection, self.schema):
                    with connection.transaction():
                        connection.execute("SELECT pg_advisory_xact_lock(%s)", (DDL_LOCK,))
                        connection.execute(
                            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema))
                        )
                connection.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
        except BaseException:
            connection.close()
            raise
        return connection

    # --- writing ---------------------------------------------------------------------

    @contextmanager
    def writer(self) -> Iterator[PostgresWriter]:
        with self._write_lock:
            try:
                connection, transaction = self._begin()
            except psycopg.Error as error:
                raise StoreError(
                    f"store {self.name!r}: cannot begin a transaction: {_reason(error)}"
                ) from None
            try:
                yield PostgresWriter(connection, self._lock_class, self._scope, self.counted)
            except BaseException as error:
                with contextlib.suppress(psycopg.Error):
                    transaction.__exit__(type(error), error, error.__traceback__)
                if _about_the_store(error):
                    raise StoreError(f"store {self.name!r}: write failed: {_reason(error)}") from error
                if _sqlstate_class(error) in REFUSED_VALUE_CLASSES:
                    raise RecordRefused(f"PostgreSQL refuses the record: {_reason(error)}") from error
                raise
            try:
                transaction.__exit__(None, None, None)
            except psycopg.Error as error:
                raise StoreError(f"store {self.name!r}: commit failed: {_reason(error)}") from None

    def _begin(self) -> tuple[psycopg.Connection[Any], psycopg.Transaction]:
        """A transaction begun on the write connection. A connection the server dropped
        while it was idle (a restart, a failover, a proxy's idle timeout) fails at
        ``BEGIN``, before anything of the transaction ran: it is replaced and ``BEGIN``
        runs once more, so that the first write after the loss is not failed for it."""
        try:
            return self._begin_once()
        except psycopg.OperationalError:
            if not self._write.broken:
                raise
        return self._begin_once()

    def _begin_once(self) -> tuple[psycopg.Connection[Any], psycopg.Transaction]:
        if self._write.closed or self._write.broken:
            self._write = self._connect()
        transaction = self._write.transaction()
        transaction.__enter__()
        return self._write, transaction

    # --- reading ---------------------------------------------------------------------

    def _connect_reader(self) -> psycopg.Connection[Any]:
        try:
            return self._connect()
        except psycopg.Error as error:
            raise StoreError(f"store {self.name!r} cannot be reached: {_reason(error)}") from None

    @contextmanager
    def _read(self) -> Iterator[psycopg.Connection[Any]]:
        """A read connection for one read (everything fetched before it is given back),
        used through :meth:`_reading`. When the server had dropped the connection, the
        other idle ones are dropped too (it has most likely dropped them all), and the
        error is a :class:`ReadConnectionLost`."""
        try:
            with self.readers.lend() as connection:
                try:
                    yield connection
                except psycopg.Error as error:
                    if connection.broken or connection.closed:
                        self.readers.drop_idle()
                        raise ReadConnectionLost(
                            f"store {self.name!r} cannot be read: {_reason(error)}"
                        ) from None
                    raise
        except psycopg.Error as error:
            raise StoreError(f"store {self.name!r} cannot be read: {_reason(error)}") from None

    def _reading(self, read: Callable[[psycopg.Connection[Any]], _T]) -> _T:
        """``read`` on a read connection (it must fetch everything it returns); run once
        more on a new connection when the server had dropped the first (a restart, a
        failover, a proxy's idle timeout), so that a store that is back answers at once."""
        try:
            with self._read() as db:
                return read(db)
        except ReadConnectionLost:
            with self._read() as db:
                return read(db)

    def list_sessions(
        self, verdict: Verdict | None = None, limit: int = 100, after: tuple[float, str] | None = None
    ) -> list[SessionSummary]:
        keyset = None if after is None else (after[0], _t(after[1]))
        statement, params = SQL.session_page(verdict, limit, keyset)
        rows = self._reading(lambda db: db.execute(statement, params).fetchall())
        return [session_summary(row) for row in rows]

    def list_sessions_by_id(
        self, verdict: Verdict | None = None, limit: int = 100, after: str | None = None
    ) -> list[SessionSummary]:
        """See :meth:`Store.list_sessions_by_id
        <durable_sessions_collector.store.base.Store.list_sessions_by_id>`; read through the
        primary key's index."""
        statement, params = SQL.session_id_page(verdict, limit, _t(after))
        rows = self._reading(lambda db: db.execute(statement, params).fetchall())
        return [session_summary(row) for row in rows]

    def get_session(self, session_id: str, pages: DetailPages = FIRST_PAGES) -> SessionDetail | None:
        if "\x00" in session_id:  # no stored id holds one (refuse_nul); "a\ufffdb" is another session
            return None
        rows = self._reading(lambda db: self._session_rows(db, session_id, pages))
        if rows is None:
            return None
        row, action_rows, violation_rows = rows
        actions, next_actions = action_page(action_rows, pages.actions_limit)
        violations, next_violations = violation_page(
            violation_rows, pages.violations_limit, session_id, self.counted
        )
        return SessionDetail(session_summary(row), actions, violations, next_actions, next_violations)

    def _session_rows(
        self, db: psycopg.Connection[Any], session_id: str, pages: DetailPages
    ) -> tuple[Any, list[Any], list[Any]] | None:
        """A session's row and the rows of its pages, from one snapshot; None: no such session."""
        actions_after = pages.actions_after
        with db.transaction():
            db.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            row = db.execute(SQL.session_row, (_t(session_id),)).fetchone()
            if row is None:
                return None
            action_rows = db.execute(
                SQL.session_actions if actions_after is None else SQL.session_actions_after,
                (_t(session_id), _t(session_id), *(actions_after or ()), pages.actions_limit + 1),
            ).fetchall()
            violation_rows = db.execute(
                SQL.session_violations,
                (_t(session_id), pages.violations_after or 0, pages.violations_limit + 1),
            ).fetchall()
        return row, action_rows, violation_rows

    def verdict_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(("ok", "at_risk", "unrecoverable"), 0)
        rows = self._reading(lambda db: db.execute(SQL.verdict_counts).fetchall())
        for verdict, count in rows:
            counts[verdict] = int(count)
        return counts

    def pending_alerts(self, channel: str, now: float, limit: int = 100) -> list[Alert]:
        """Claim and return the alerts of ``channel`` due at ``now`` (see the module docs).

        A claimed row is not returned again — by this replica or another — before
        ``now + claim_lease_s`` unless ``mark_failed`` sets an earlier retry time. Each
        alert carries its claim (:attr:`Alert.claim`), which :meth:`hold_alert` renews.

        Run again on a new connection when the server had dropped the first, like a
        read (:meth:`_reading`): if the lost claim had committed, its rows are sent after
        its lease, by this replica or another; none is sent twice or lost.
        """
        rows = self._reading(
            lambda db: db.execute(
                "UPDATE outbox SET next_attempt_at = %s WHERE id IN ("
                " SELECT id FROM outbox AS o WHERE channel = %s AND state = 'pending' AND next_attempt_at <= %s"
                f" AND {IN_VIOLATION_ORDER} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
                ") RETURNING id, channel, violation_key, payload, attempts, next_attempt_at",
                (now + self.claim_lease_s, channel, now, limit),
            ).fetchall()
        )
        return sorted(
            (
                Alert(int(id_), ch, key, json.loads(payload), attempts, float(claim))
                for id_, ch, key, payload, attempts, claim in rows
            ),
            key=lambda alert: alert.id,
        )

    def hold_alert(self, alert: Alert, now: float, attempt_s: float) -> Alert | None:
        """See :meth:`Store.hold_alert <durable_sessions_collector.store.base.Store.hold_alert>`.

        Rows are claimed a batch at a time and sent one by one: the lease of the last
        may run out while the first are sent (a slow receiver, a few timeouts), and
        another replica claim it. The renewal applies only while the row still holds
        this replica's claim, so exactly one of the two sends it. Run again after a dropped
        connection (:meth:`pending_alerts`): a lost renewal that had committed makes the
        second find the claim changed, and the row is sent after the lease."""
        row = self._reading(
            lambda db: db.execute(
                "UPDATE outbox SET next_attempt_at = %s "
                "WHERE id = %s AND state = 'pending' AND next_attempt_at = %s RETURNING next_attempt_at",
                (now + attempt_s + self.claim_lease_s, alert.id, alert.claim),
            ).fetchone()
        )
        return None if row is None else dataclasses.replace(alert, claim=float(row[0]))

    def release_alerts(self, alerts: Sequence[Alert], due_at: float) -> None:
        """See :meth:`Store.release_alerts <durable_sessions_collector.store.base.Store.release_alerts>`.

        Without it the rows a paused or stopping channel did not get to would wait out
        the rest of the lease (60 s), although the receiver is back long before."""
        if alerts:
            self._reading(
                lambda db: db.execute(
                    "UPDATE outbox SET next_attempt_at = %s "
                    f"FROM unnest(%s::bigint[], %s::float8[]) AS held (id, claim) WHERE {STILL_HELD}",
                    (due_at, [alert.id for alert in alerts], [alert.claim for alert in alerts]),
                )
            )

    def alert_counts(self) -> dict[tuple[str, str], int]:
        rows = self._reading(lambda db: db.execute(SQL.alert_counts).fetchall())
        return {(channel, state): int(count) for channel, state, count in rows}

    def dead_alerts(self, channel: str | None = None, limit: int = 100) -> list[DeadAlert]:
        rows = self._reading(lambda db: db.execute(SQL.dead_alerts, (channel, channel, limit)).fetchall())
        return [
            DeadAlert(int(id_), ch, key, json.loads(payload), int(attempts), error, float(created))
            for id_, ch, key, payload, attempts, error, created in rows
        ]

    def count_actions(self) -> int:
        return self._reading(lambda db: int(db.execute(SQL.count_actions).fetchone()[0]))  # type: ignore[index]

    # --- the violation feed (WatchAlerts) ------------------------------------------------

    def violation_cursor(self) -> str:
        """A cursor before every violation and change not yet committed (some just
        committed may follow)."""
        return f"pg:{self._reading(_feed_horizon)}:0"

    def feed_start(self) -> str:
        """A cursor before every violation and change: transaction and row ids are positive."""
        return "pg:0:0"

    def store_id(self) -> str | None:
        found = self._reading(
            lambda db: db.execute("SELECT value FROM meta WHERE key = %s", (STORE_ID,)).fetchone()
        )
        return None if found is None else str(found[0])

    def violations_after(self, cursor: str, limit: int = 100) -> tuple[list[dict[str, Any]], str]:
        """Committed violations and changes after ``cursor``, in feed order, and the cursor
        after them (see :meth:`Store.violations_after
        <durable_sessions_collector.store.base.Store.violations_after>`).

        The feed's order is ``(xid, kind, id)`` (:class:`FeedRow`): a transaction's new
        violations, then its changes. A cursor names the place of the row it follows:
        ``pg:XID:ID`` a violation's (version 3's cursors, all of them), ``pg:XID:ID:1`` a
        change's."""
        after = _feed_place(cursor)

        def read(db: psycopg.Connection[Any]) -> list[FeedRow]:
            nonlocal after, cursor
            # The rows are read in statements after the one that read the horizon, so
            # their snapshots see every transaction below it ended: both tables are read
            # up to the same horizon, and the two reads agree on what lies below it.
            horizon, next_xid = _feed_bounds(db)
            if after[0] > next_xid:
                # A transaction this server has not begun: the cursor was given by another
                # server, the one this store was dumped from (a restore keeps the store's id,
                # not its transaction ids). Read as a position, everything committed until
                # this server's ids passed it was skipped; like a SQLite cursor past the end
                # of its feed, it is read from the start.
                cursor = self.feed_start()
                after = _feed_place(cursor)
            violations = db.execute(
                f"SELECT v.xid::text, v.id, {FEED_COLUMNS} {FEED_VIOLATIONS} "
                "WHERE v.xid >= %s::xid8 AND (v.xid, %s, v.id) > (%s::xid8, %s, %s) AND v.xid < %s::xid8 "
                "ORDER BY v.xid, v.id LIMIT %s",
                (str(after[0]), FEED_VIOLATION, str(after[0]), *after[1:], horizon, limit),
            ).fetchall()
            changes = db.execute(
                f"SELECT c.xid::text, c.id, c.status, c.detected_at, {FEED_COLUMNS} {FEED_CHANGES} "
                "WHERE c.xid >= %s::xid8 AND (c.xid, %s, c.id) > (%s::xid8, %s, %s) AND c.xid < %s::xid8 "
                "ORDER BY c.xid, c.id LIMIT %s",
                (str(after[0]), FEED_CHANGE, str(after[0]), *after[1:], horizon, limit),
            ).fetchall()
            return first_of_feed(
                [violation_feed_row(row) for row in violations],
                [change_feed_row(row) for row in changes],
                limit,
            )

        found = [{**row.item, "cursor": _feed_cursor(row)} for row in self._reading(read)]
        return found, (found[-1]["cursor"] if found else cursor)

    def check(self) -> None:
        self._reading(lambda db: db.execute(SQL.check).fetchone())

    def now(self) -> float:
        """The server's clock (see :class:`ServerClock`): every replica's times are the
        server's, whatever their hosts' clocks say."""
        return self.clock.now()

    def _server_time(self) -> float:
        return self._reading(
            lambda db: float(db.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()[0])  # type: ignore[index]
        )

    def close(self) -> None:
        self._closing = True
        builder, connection = self._index_builder, self._index_connection
        if builder is not None:
            if connection is not None:
                with contextlib.suppress(psycopg.Error):
                    connection.cancel_safe()
            builder.join(10)
        self.readers.close()
        with self._write_lock, contextlib.suppress(psycopg.Error):
            self._write.close()


class ServerClock:
    """The database server's clock, read from the server at most every ``read_every_s``
    and carried forward in between by this host's monotonic clock (which no step of the
    host's wall clock moves), so that taking the time costs no round trip. Replicas
    whose hosts' clocks disagree then still agree on how long a session has been idle.

    The reading is placed halfway through the round trip that took it. A reading that
    fails keeps the last one (tried again after ``read_every_s``); with none yet,
    :meth:`now` raises its :class:`StoreError`."""

    def __init__(self, read: Callable[[], float], read_every_s: float = CLOCK_READ_EVERY_S) -> None:
        self._read = read
        self.read_every_s = read_every_s
        self._lock = threading.Lock()
        self._offset: float | None = None  # server time minus monotonic time
        self._read_at = -math.inf

    def now(self) -> float:
        with self._lock:
            offset = self._offset
            if offset is None or time.monotonic() - self._read_at >= self.read_every_s:
                offset = self._read_server(offset)
            return time.monotonic() + offset

    def _read_server(self, last: float | None) -> float:
        """The server's time minus the monotonic time, newly read; ``last`` when the server
        cannot be read (its error when there is no ``last``)."""
        before = time.monotonic()
        self._read_at = before
        try:
            server = self._read()
        except StoreError:
            if last is None:
                raise
            return last
        self._offset = server - (before + time.monotonic()) / 2
        return self._offset


# The tables of a store. Every transaction that writes a violation holds a lock on one
# of them from before it has a transaction id until it ends: its first write is to one
# of them (the sidecar writes nothing else, and uses no savepoint, whose rollback would
# release a lock early), and a statement locks its table before it writes.
STORE_TABLES = (
    "meta",
    "actions",
    "sessions",
    "violations",
    "outbox",
    "forgetting",
    "session_states",
    "violation_changes",
)

# The oldest transaction still running that holds a lock on a table of the store (see
# STORE_TABLES), as the current snapshot knows it; else the snapshot's xmax, the first
# transaction id not yet given. pg_locks names a transaction by its 32-bit xid: it is
# matched with the 64-bit ids of the snapshot's running transactions. pg_locks is read
# once (each read takes every lock-table partition's lock).
FEED_HORIZON = """
WITH locks AS MATERIALIZED (SELECT locktype, database, relation, transactionid, mode, granted, pid FROM pg_locks)
SELECT coalesce(
    (SELECT min(running) FROM pg_snapshot_xip(snapshot) AS running
     WHERE running::xid IN (
        SELECT tx.transactionid FROM locks AS tx JOIN locks AS store_table ON store_table.pid = tx.pid
        WHERE tx.locktype = 'transactionid' AND tx.mode = 'ExclusiveLock' AND tx.granted
          AND store_table.locktype = 'relation'
          AND store_table.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND store_table.relation = ANY(
            SELECT to_regclass(name)::oid FROM unnest(%s::text[]) AS name))),
    pg_snapshot_xmax(snapshot))::text,
    pg_snapshot_xmax(snapshot)::text
FROM pg_current_snapshot() AS snapshot
"""


def _feed_place(cursor: str) -> tuple[int, int, int]:
    """The ``(xid, kind, id)`` a feed cursor names (see :meth:`PostgresStore.violations_after`)."""
    xid, id_, *kind = cursor_position(cursor, "pg", (2, 3))
    if kind and kind[0] != FEED_CHANGE:
        raise ValueError(f"not a cursor of this store: {quoted(cursor)}")
    return xid, (kind[0] if kind else FEED_VIOLATION), id_


def _feed_cursor(row: FeedRow) -> str:
    """The cursor after ``row``: a violation's as version 3 wrote it, a change's with its kind."""
    xid, kind, id_ = row.order
    return f"pg:{xid}:{id_}" if kind == FEED_VIOLATION else f"pg:{xid}:{id_}:{kind}"


def _feed_horizon(db: psycopg.Connection[Any]) -> str:
    """The violation feed's horizon: every violation of a transaction id below it has
    committed (or never will), so a cursor may pass it; none above it is returned yet.

    Only transactions that may write a violation hold it back — those holding a lock on
    a table of the store — not every transaction of the cluster (``pg_snapshot_xmin``
    was held back by any open transaction, of any application, in any database, and the
    feed stalled meanwhile). Read in a statement of its own, before the rows: a writer
    running when the horizon was read either still held it back then, or had ended, and
    the later snapshot of the rows sees what it committed."""
    return _feed_bounds(db)[0]


def _feed_bounds(db: psycopg.Connection[Any]) -> tuple[str, int]:
    """The feed's horizon (:func:`_feed_horizon`) and the server's next transaction id: a
    cursor of this server names a transaction before it."""
    horizon, next_xid = db.execute(FEED_HORIZON, (list(STORE_TABLES),)).fetchone()  # type: ignore[misc]
    return str(horizon), int(next_xid)


class ReadConnectionLost(StoreError):
    """A read failed because the server had dropped its connection (retried once)."""


def _close_quietly(connection: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(psycopg.Error):
        connection.close()


# SQLSTATE classes of errors caused by the values written: data exception (22) and
# integrity constraint violation (23). Every other class is about the store itself.
RECORD_ERROR_CLASSES = frozenset({"22", "23", "54"})
"""SQLSTATE classes of errors from the values written: data exception, integrity
constraint violation, program limit exceeded (an index entry over PostgreSQL's 2,704 bytes)."""
REFUSED_VALUE_CLASSES = frozenset({"22", "54"})
"""Those that no state of the store can cure (:class:`RecordRefused`)."""


def _sqlstate_class(error: BaseException) -> str | None:
    sqlstate = error.sqlstate if isinstance(error, psycopg.Error) else None
    return sqlstate[:2] if sqlstate else None


def _about_the_store(error: BaseException) -> bool:
    """Whether ``error`` comes from the store's state (connection, locks, resources, a
    schema that is gone or a permission taken away), which retrying later may cure, rather
    than from the values written, which no retry of the same records will."""
    sqlstate_class = _sqlstate_class(error)
    if sqlstate_class is not None:  # before the class: program limits are OperationalErrors
        return sqlstate_class not in RECORD_ERROR_CLASSES
    return isinstance(error, psycopg.OperationalError)


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


class PostgresWriter(SqlWriter):
    """One write transaction on the store's write connection."""

    __slots__ = ("_lock_class", "_scope")
    _sql = SQL
    _text = staticmethod(_t)

    def __init__(
        self,
        connection: psycopg.Connection[Any],
        lock_class: int,
        scope: str = "",
        counted: frozenset[str] | None = None,
    ) -> None:
        super().__init__(connection, counted)
        self._lock_class = lock_class
        self._scope = scope

    def lock_sessions(self, session_ids: Sequence[str]) -> dict[str, StoredSession]:
        """Lock the sessions for this transaction; return what the store holds of each.

        Locks are taken in one statement, in the order of their lock keys, so two
        replicas locking overlapping sets cannot deadlock. A session with no row yet
        is :data:`NO_SESSION`.
        """
        if not session_ids:
            return {}
        ids = [_t(session_id) for session_id in session_ids]
        self._db.execute(
            "SELECT pg_advisory_xact_lock(%s, h) FROM "
            "(SELECT DISTINCT hashtext(s) AS h FROM unnest(%s::text[]) AS s ORDER BY h) AS keys",
            (self._lock_class, ids),
        ).fetchall()
        stored = {
            session_id: StoredSession(int(actions), first_seen)
            for session_id, actions, first_seen in self._db.execute(
                "SELECT session_id, actions, first_seen FROM sessions WHERE session_id = ANY(%s)", (ids,)
            )
        }
        return {session_id: stored.get(_t(session_id), NO_SESSION) for session_id in session_ids}

    def add_action(self, row: ActionRow, received_at: float) -> bool:
        return super().add_action(_texts_held(row), received_at)

    def is_stored(self, row: ActionRow) -> bool:
        found = self._db.execute(
            IS_STORED, (_t(row.session_id) or "", _t(row.trace_id), _t(row.span_id), _t(row.status))
        ).fetchone()
        return found is not None

    def session_records(self, session_id: str, after_id: int = 0) -> Iterator[tuple[ActionRecord, Location]]:
        # A page of SESSION_RECORDS_PAGE rows at a time, by id along actions_by_session,
        # not the whole session at once: a session of a million actions is rebuilt in the
        # memory of one page. Each page is a query of its own, so a rebuild given up
        # halfway (a failed transaction) leaves no server-side cursor behind.
        after = after_id
        while True:
            rows = self._db.execute(
                SESSION_RECORDS, (_t(session_id), _t(session_id), after, SESSION_RECORDS_PAGE)
            ).fetchall()
            for _, trace_id, span_id, record in rows:
                yield decode_record(record), Location(None, None, trace_id, span_id)
            if len(rows) < SESSION_RECORDS_PAGE:
                return
            after = rows[-1][0]  # the next page starts after the last id read

    def resolve_end_violations(self, session_id: str, keep: set[str], *, now: float) -> Settled:
        keys = [_t(key) for key in keep]
        # NULL (every rule counted) makes the condition true for every row.
        counted = None if self._counted is None else [_t(rule) for rule in self._counted]
        resolved = self._db.execute(
            "UPDATE violations SET resolved = 1 WHERE session_id = %s AND at_end = 1 AND resolved = 0 "
            f"AND NOT (key = ANY(%s)) AND (%s::text[] IS NULL OR rule = ANY(%s)) RETURNING {VIOLATION_COLUMNS}",
            (_t(session_id), keys, counted, counted),
        ).fetchall()
        held_again = self._db.execute(
            "UPDATE violations SET resolved = 0 WHERE session_id = %s AND at_end = 1 AND resolved = 1 "
            "AND key = ANY(%s) AND (%s::text[] IS NULL OR rule = ANY(%s)) RETURNING key",
            (_t(session_id), keys, counted, counted),
        ).fetchall()
        found = sorted((violation_detail(row) for row in resolved), key=lambda v: (v["created_at"], v["key"]))
        settled = Settled(found, {key for (key,) in held_again})
        changes = status_changes(*settled, now)
        if changes:
            self._db.cursor().executemany(
                "INSERT INTO violation_changes (violation_id, session_id, status, detected_at) "
                "SELECT id, session_id, %s, %s FROM violations WHERE key = %s",
                [(status, at, _t(key)) for status, at, key in changes],
            )
        return settled

    def lock_verdict_rules(self) -> None:
        """A transaction-scoped advisory lock of this schema's selection of rules: one key
        (the one-number form, which the sessions' two-number locks never take)."""
        self._db.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            (f"durable-sessions verdict rules {self._scope}",),
        )

    def sessions_with_rules(
        self, rules: frozenset[str], after: str, window: int
    ) -> tuple[list[str], str | None]:
        (last,) = self._db.execute(SQL.sessions_window_end, (_t(after), window)).fetchone()
        if last is None or not rules:
            return [], last
        found = self._db.execute(
            "SELECT DISTINCT session_id FROM violations WHERE session_id > %s AND session_id <= %s "
            "AND rule = ANY(%s) ORDER BY session_id",
            (_t(after), last, [_t(rule) for rule in rules]),
        ).fetchall()
        return [session_id for (session_id,) in found], last

    def mark_delivered(self, alerts: Sequence[Alert], now: float) -> None:
        if alerts:
            self._db.execute(
                "UPDATE outbox SET state = 'delivered', delivered_at = %s, attempts = attempts + 1 "
                f"FROM unnest(%s::bigint[], %s::float8[]) AS held (id, claim) WHERE {STILL_HELD}",
                (now, [alert.id for alert in alerts], [alert.claim for alert in alerts]),
            )

    def mark_failed(self, alert: Alert, error: str, retry_at: float | None, failed: int = 1) -> None:
        held = (alert.id, alert.claim)
        if retry_at is None:
            self._db.execute(
                "UPDATE outbox SET state = 'dead', attempts = attempts + %s, last_error = %s "
                f"FROM (VALUES (%s::bigint, %s::float8)) AS held (id, claim) WHERE {STILL_HELD}",
                (failed, _t(error), *held),
            )
        else:
            self._db.execute(
                "UPDATE outbox SET attempts = attempts + %s, last_error = %s, next_attempt_at = %s "
                f"FROM (VALUES (%s::bigint, %s::float8)) AS held (id, claim) WHERE {STILL_HELD}",
                (failed, _t(error), retry_at, *held),
            )

    def idle_sessions(self, cutoff: float, limit: int) -> list[str]:
        """Open sessions idle since ``cutoff`` whose lock this transaction could take.

        A session another replica is writing or ending is skipped; it is found again at
        a later sweep if it is still idle then.
        """
        candidates = super().idle_sessions(cutoff, limit)
        # Under the locks, with a new snapshot: still open and idle (not ended or resumed meanwhile)?
        return self._try_lock(
            candidates,
            "SELECT session_id FROM sessions WHERE session_id = ANY(%s) AND open = 1 AND last_seen <= %s",
            cutoff,
        )

    def prune(self, cutoff: float, limit: int, max_actions: int | None = None) -> Pruned:
        """See :meth:`Writer.prune <durable_sessions_collector.store.base.Writer.prune>`.

        Rows of no session, and alerts, are taken ``FOR UPDATE SKIP LOCKED``: two replicas
        pruning at once each delete other rows, and neither waits for the other."""
        db = self._db
        forgetting = db.execute(
            "SELECT session_id, through_id FROM forgetting ORDER BY session_id LIMIT %s FOR UPDATE SKIP LOCKED",
            (limit,),
        ).fetchall()
        forgot, forgetting_left = forget_some(forgetting, max_actions, self._forget_actions, self._forgotten)
        budget = None if max_actions is None else max(max_actions - forgot, 0)
        found = db.execute(SQL.prunable_sessions, (cutoff, limit)).fetchall() if budget != 0 else []
        taken, cut, oversized = within_budget(found, budget)
        cut = cut or budget == 0
        # Under the locks, with a new snapshot: still ended and old (no replica resumed it meanwhile)?
        sessions = self._try_lock(
            taken,
            "SELECT session_id FROM sessions WHERE session_id = ANY(%s) AND open = 0 AND last_seen < %s",
            cutoff,
        )
        channels = [name for (name,) in db.execute(OUTBOX_CHANNELS)]
        if sessions:
            db.execute(
                "DELETE FROM outbox WHERE channel = ANY(%s) AND state <> 'pending' "
                "AND violation_key IN (SELECT key FROM violations WHERE session_id = ANY(%s))",
                (channels, sessions),
            )
            for table in ("violation_changes", "violations", "sessions", "session_states"):
                db.execute(
                    sql.SQL("DELETE FROM {} WHERE session_id = ANY(%s)").format(sql.Identifier(table)),
                    (sessions,),
                )
            whole = [session_id for session_id in sessions if session_id != oversized]
            db.execute("DELETE FROM actions WHERE session_id = ANY(%s)", (whole,))
            if oversized in sessions:  # its actions: a budget at a time, by the next passes
                db.execute(SQL.forget_session, (oversized, oversized))
        counts = [
            forgot,
            db.execute(
                "DELETE FROM actions WHERE id IN (SELECT id FROM actions WHERE session_id IS NULL "
                "AND received_at < %s LIMIT %s FOR UPDATE SKIP LOCKED)",
                (cutoff, limit),
            ).rowcount,
            db.execute(
                "DELETE FROM violations WHERE id IN (SELECT id FROM violations WHERE session_id IS NULL "
                "AND created_at < %s LIMIT %s FOR UPDATE SKIP LOCKED)",
                (cutoff, limit),
            ).rowcount,
        ]
        more_sessions = cut or len(found) == limit
        if not more_sessions:
            counts.append(
                db.execute(
                    "DELETE FROM outbox WHERE id IN (SELECT o.id FROM outbox o WHERE o.channel = ANY(%s) "
                    "AND o.state IN ('delivered', 'dead') AND o.next_attempt_at < %s "
                    "AND NOT EXISTS (SELECT 1 FROM violations v WHERE v.key = o.violation_key) "
                    "LIMIT %s FOR UPDATE OF o SKIP LOCKED)",
                    (channels, cutoff, limit),
                ).rowcount
            )
        more_forgetting = forgetting_left or len(forgetting) == limit or oversized in sessions
        return Pruned(sessions, sum(counts), more_sessions or more_forgetting or limit in counts[1:])

    def _forget_actions(self, session_id: str, through_id: int, most: int | None) -> tuple[int, bool]:
        count = self._db.execute(
            "DELETE FROM actions WHERE id IN (SELECT id FROM actions WHERE session_id = %s AND id <= %s LIMIT %s)",
            (session_id, through_id, most),
        ).rowcount
        return count, most is None or count < most  # an identity never gives an id twice

    def _try_lock(self, candidates: list[str], still: LiteralString, cutoff: float) -> list[str]:
        """The ``candidates`` whose session lock this transaction could take and that the
        query ``still`` (over ``ANY(ids)`` and ``cutoff``) still returns under the lock,
        in the candidates' order. A session another replica holds is skipped."""
        if not candidates:
            return []
        locked = [
            session_id
            for session_id, got in self._db.execute(
                "SELECT s, pg_try_advisory_xact_lock(%s, hashtext(s)) FROM unnest(%s::text[]) AS s",
                (self._lock_class, candidates),
            )
            if got
        ]
        if not locked:
            return []
        found = {session_id for (session_id,) in self._db.execute(still, (locked, cutoff))}
        return [session_id for session_id in locked if session_id in found]
