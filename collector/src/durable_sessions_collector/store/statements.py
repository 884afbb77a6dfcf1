"""The SQL the SQLite and the PostgreSQL stores both run, written once, and the writer
methods that run it alike.

The statements are written with SQLite's placeholder (``?``); a :class:`Statements`
holds them in one store's dialect. Besides its placeholder, a dialect supplies:

- ``session_key``: how a statement names an action's session so that it reads through
  the store's index of the actions (SQLite's is keyed on ``coalesce(session_id, '')``,
  PostgreSQL's on ``session_id``);
- ``touched_last_seen``: what a touch of a session makes of its ``last_seen`` (SQLite:
  the time given, by its one writer's clock; PostgreSQL: never earlier than it was).

What is truly one store's own stays in its module: the schema and its migrations,
transactions, PostgreSQL's advisory locks, claims and server clock, the violation feed,
retention, and the statements whose SQL differs (arrays against lists of placeholders,
``RETURNING``, ``FOR UPDATE SKIP LOCKED``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, ClassVar

from durable_sessions.report import Verdict
from durable_sessions.violation import Violation
from durable_sessions_collector.store.base import (
    ACTION_ORDER,
    VIOLATION_COLUMNS,
    ActionRow,
    KeptState,
    SessionSummary,
    StoredSession,
    tally,
)

SUMMARY_COLUMNS = "session_id, verdict, open, actions, errors, warnings, first_seen, last_seen, ended_at"
"""The columns :func:`session_summary` reads, in its order."""


def session_summary(row: Any) -> SessionSummary:
    """A session as the APIs list it, from a row of :data:`SUMMARY_COLUMNS`."""
    session_id, verdict, open_, actions, errors, warnings, first_seen, last_seen, ended_at = row
    return SessionSummary(
        session_id=session_id,
        verdict=verdict,
        state="active" if open_ else "ended",
        actions=int(actions),
        errors=int(errors),
        warnings=int(warnings),
        first_seen=first_seen,
        last_seen=last_seen,
        ended_at=ended_at,
    )


class Statements:
    """The shared statements in one dialect (see the module's docs)."""

    def __init__(self, *, placeholder: str, session_key: str, touched_last_seen: str) -> None:
        self.placeholder = placeholder
        key = session_key
        sql = self.dialect
        # Of a session's actions, those not left over from an earlier session of its id
        # being deleted by retention (the session id is its parameter).
        not_forgotten = "id > coalesce((SELECT through_id FROM forgetting WHERE session_id = ?), 0)"
        self.not_forgotten = sql(not_forgotten)

        # --- writing ---------------------------------------------------------------------
        self.add_action = sql(
            "INSERT INTO actions (session_id, trace_id, span_id, status, action_id, kind, seq, received_at, record) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        )
        self.keep_state = sql(
            "INSERT INTO session_states (session_id, fed, through_id, state) "
            f"SELECT ?, ?, max(id), ? FROM actions WHERE {key} = ? AND {not_forgotten} "
            "HAVING max(id) IS NOT NULL ON CONFLICT (session_id) DO UPDATE "
            "SET fed = excluded.fed, through_id = excluded.through_id, state = excluded.state"
        )
        # The same, for a session this transaction has not locked (another replica may be
        # writing it): only while the store holds what the state was fed, its row's action
        # count and first_seen, read in the statement's one snapshot with the records'
        # largest id; and never over a state of more records (kept by that replica).
        self.keep_state_if_stored = sql(
            "INSERT INTO session_states (session_id, fed, through_id, state) "
            f"SELECT ?, ?, max(id), ? FROM actions WHERE {key} = ? AND {not_forgotten} "
            "AND EXISTS (SELECT 1 FROM sessions WHERE session_id = ? AND actions = ? AND first_seen = ?) "
            "HAVING max(id) IS NOT NULL ON CONFLICT (session_id) DO UPDATE "
            "SET fed = excluded.fed, through_id = excluded.through_id, state = excluded.state "
            "WHERE session_states.fed < excluded.fed"
        )
        self.kept_state = sql("SELECT fed, through_id, state FROM session_states WHERE session_id = ?")
        self.count_kept = sql(f"SELECT count(*) FROM actions WHERE {key} = ? AND {not_forgotten} AND id <= ?")
        self.add_violation = sql(
            "INSERT INTO violations (key, session_id, rule, severity, message, action_id, trace_id, span_id, "
            "at_end, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        )
        self.touch_session = sql(
            "INSERT INTO sessions (session_id, first_seen, last_seen, open, actions) VALUES (?, ?, ?, 1, ?) "
            f"ON CONFLICT (session_id) DO UPDATE SET last_seen = {touched_last_seen}, "
            "open = 1, ended_at = NULL, actions = sessions.actions + excluded.actions"
        )
        self.end_session = sql("UPDATE sessions SET open = 0, ended_at = ? WHERE session_id = ?")
        # A session's unresolved violations counted by rule and severity, for tally().
        self.unresolved_by_rule = sql(
            "SELECT rule, severity, COUNT(*) FROM violations WHERE session_id = ? AND resolved = 0 "
            "GROUP BY rule, severity"
        )
        self.set_verdict = sql(
            "UPDATE sessions SET errors = ?, warnings = ?, verdict = ? WHERE session_id = ?"
        )
        self.read_meta = sql("SELECT value FROM meta WHERE key = ?")
        self.delete_meta = sql("DELETE FROM meta WHERE key = ?")
        self.write_meta = sql(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value"
        )
        self.sessions_window_end = sql(
            "SELECT max(session_id) FROM (SELECT session_id FROM sessions WHERE session_id > ? "
            "ORDER BY session_id LIMIT ?) AS w"
        )
        """The last of the next ``window`` session ids after one (NULL: none is left)."""
        self.enqueue_alert = sql(
            "INSERT INTO outbox (channel, violation_key, payload, next_attempt_at, created_at) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
        )
        # CAST: PostgreSQL must know the type of a parameter it is only asked whether NULL.
        self.redeliver_dead = sql(
            "UPDATE outbox SET state = 'pending', attempts = 0, next_attempt_at = ? "
            "WHERE state = 'dead' AND (CAST(? AS TEXT) IS NULL OR channel = ?)"
        )
        self.idle_sessions = sql(
            "SELECT session_id FROM sessions WHERE open = 1 AND last_seen <= ? ORDER BY last_seen LIMIT ?"
        )
        # Retention (each store's prune).
        self.prunable_sessions = sql(
            "SELECT session_id, actions FROM sessions WHERE open = 0 AND last_seen < ? ORDER BY last_seen LIMIT ?"
        )
        self.forget_session = sql(
            f"INSERT INTO forgetting (session_id, through_id) SELECT ?, max(id) FROM actions WHERE {key} = ? "
            "HAVING max(id) IS NOT NULL ON CONFLICT (session_id) DO UPDATE SET through_id = excluded.through_id"
        )
        self.forgotten = sql("DELETE FROM forgetting WHERE session_id = ? AND through_id = ?")

        # --- reading ---------------------------------------------------------------------
        self.session_row = sql(f"SELECT {SUMMARY_COLUMNS} FROM sessions WHERE session_id = ?")
        actions = (
            f"SELECT {ACTION_ORDER}, id, trace_id, span_id, received_at, record FROM actions "
            f"WHERE {key} = ? AND {not_forgotten} "
        )
        self.session_actions = sql(actions + f"ORDER BY {ACTION_ORDER}, id LIMIT ?")
        self.session_actions_after = sql(
            actions + f"AND ({ACTION_ORDER}, id) > (?, ?) ORDER BY {ACTION_ORDER}, id LIMIT ?"
        )
        """A page of a session's actions, from its start or after a place in their order
        (parameters: the session id twice, the place if any, how many)."""
        self.session_violations = sql(
            f"SELECT id, {VIOLATION_COLUMNS} FROM violations WHERE session_id = ? AND id > ? ORDER BY id LIMIT ?"
        )
        self.verdict_counts = "SELECT verdict, COUNT(*) FROM sessions GROUP BY verdict"
        self.alert_counts = "SELECT channel, state, COUNT(*) FROM outbox GROUP BY channel, state"
        self.dead_alerts = sql(
            "SELECT id, channel, violation_key, payload, attempts, last_error, created_at FROM outbox "
            "WHERE state = 'dead' AND (CAST(? AS TEXT) IS NULL OR channel = ?) ORDER BY id LIMIT ?"
        )
        self.count_actions = "SELECT COUNT(*) FROM actions"
        self.check = "SELECT 1 FROM meta LIMIT 1"

    def dialect(self, statement: str) -> str:
        """``statement``, written with ``?`` placeholders, with this dialect's."""
        if self.placeholder == "?":
            return statement
        if "%" in statement:  # psycopg would read it as the start of a placeholder
            raise ValueError(f"a shared statement holds '%': {statement!r}")
        return statement.replace("?", self.placeholder)

    def session_page(
        self, verdict: Verdict | None, limit: int, after: tuple[float, str | None] | None
    ) -> tuple[str, tuple[Any, ...]]:
        """The statement that lists sessions (``Store.list_sessions``) and its parameters:
        newest activity first, of one verdict if given, after the (last_seen, session_id)
        of the previous page if given (keyset paging)."""
        where: list[str] = []
        params: list[Any] = []
        if verdict is not None:
            where.append("verdict = ?")
            params.append(verdict)
        if after is not None:
            # A row value, which SQLite reads as a range of the last_seen indexes; the same
            # comparison spelled with OR was a scan and a sort of every older session.
            where.append("(last_seen, session_id) < (?, ?)")
            params.extend(after)
        clause = ("WHERE " + " AND ".join(where)) if where else ""
        statement = f"SELECT {SUMMARY_COLUMNS} FROM sessions {clause} ORDER BY last_seen DESC, session_id DESC LIMIT ?"
        return self.dialect(statement), (*params, limit)

    def session_id_page(
        self, verdict: Verdict | None, limit: int, after: str | None
    ) -> tuple[str, tuple[Any, ...]]:
        """The statement that lists sessions in session id order (``Store.list_sessions_by_id``)
        and its parameters: of one verdict if given, after the session id ``after`` if given."""
        # Each condition only when given: "? IS NULL OR session_id > ?" is no range of the
        # primary key's index, and every page would be read from the first session on.
        where = [("verdict = ?", verdict), ("session_id > ?", after)]
        given = [(condition, value) for condition, value in where if value is not None]
        clause = ("WHERE " + " AND ".join(condition for condition, _ in given)) if given else ""
        statement = f"SELECT {SUMMARY_COLUMNS} FROM sessions {clause} ORDER BY session_id LIMIT ?"
        return self.dialect(statement), (*(value for _, value in given), limit)


def action_params(row: ActionRow, received_at: float) -> tuple[Any, ...]:
    """The parameters of :attr:`Statements.add_action` for ``row``, as they are."""
    return (
        row.session_id,
        row.trace_id,
        row.span_id,
        row.status,
        row.action_id,
        row.kind,
        row.seq,
        received_at,
        row.text,
    )


def as_is(value: str | None) -> str | None:
    """A text as SQLite writes it: as it is."""
    return value


class SqlWriter:
    """The :class:`~durable_sessions_collector.store.base.Writer` methods both stores
    run alike, on a connection whose ``execute`` takes the statements of ``_sql``. A
    store's writer class names its :class:`Statements` and what a free text or id
    becomes before it is written (``_text``: PostgreSQL's TEXT cannot hold NUL)."""

    __slots__ = ("_counted", "_db")

    _sql: ClassVar[Statements]
    _text: ClassVar[Callable[[str | None], str | None]] = staticmethod(as_is)

    def __init__(self, connection: Any, counted: frozenset[str] | None = None) -> None:
        self._db = connection
        self._counted = counted

    def add_action(self, row: ActionRow, received_at: float) -> bool:
        # No _text here: this runs for every span ingested, and a call for each of six
        # texts made it 7% slower on SQLite (PostgresWriter.add_action holds the texts).
        cursor = self._db.execute(self._sql.add_action, action_params(row, received_at))
        return cursor.rowcount == 1  # type: ignore[no-any-return]

    def keep_state(
        self, session_id: str, fed: int, state: bytes, if_stored: StoredSession | None = None
    ) -> None:
        if if_stored is None:
            self._db.execute(self._sql.keep_state, (session_id, fed, state, session_id, session_id))
            return
        self._db.execute(
            self._sql.keep_state_if_stored,
            (session_id, fed, state, session_id, session_id, session_id, *if_stored),
        )

    def kept_state(self, session_id: str) -> KeptState | None:
        kept = self._db.execute(self._sql.kept_state, (session_id,)).fetchone()
        if kept is None:
            return None
        fed, through_id, state = kept
        (held,) = self._db.execute(self._sql.count_kept, (session_id, session_id, through_id)).fetchone()
        return KeptState(fed, through_id, bytes(state)) if held == fed else None

    def add_violation(self, violation: Violation, *, at_end: bool, now: float) -> bool:
        t = self._text
        cursor = self._db.execute(
            self._sql.add_violation,
            (
                t(violation.key),
                t(violation.session_id or None),  # "" is no session, as for its action (action_row)
                t(violation.rule),
                violation.severity.value,
                t(violation.message),
                t(violation.action_id),
                t(violation.trace_id),
                t(violation.span_id),
                int(at_end),
                now,
            ),
        )
        return cursor.rowcount == 1  # type: ignore[no-any-return]

    def touch_session(self, session_id: str, now: float, added: int) -> None:
        # A session re-opened by a later span is active again: its old end is no more
        # (the API's ended_at is "unset while the session is active").
        self._db.execute(self._sql.touch_session, (self._text(session_id), now, now, added))

    def end_session(self, session_id: str, now: float) -> None:
        self._db.execute(self._sql.end_session, (now, self._text(session_id)))

    def refresh_verdict(self, session_id: str) -> Verdict:
        session = self._text(session_id)
        rows = self._db.execute(self._sql.unresolved_by_rule, (session,)).fetchall()
        errors, warnings, verdict = tally(rows, self._counted)
        self._db.execute(self._sql.set_verdict, (errors, warnings, verdict, session))
        return verdict

    def read_meta(self, key: str) -> str | None:
        found = self._db.execute(self._sql.read_meta, (key,)).fetchone()
        return None if found is None else str(found[0])

    def write_meta(self, key: str, value: str | None) -> None:
        if value is None:
            self._db.execute(self._sql.delete_meta, (key,))
        else:
            self._db.execute(self._sql.write_meta, (key, value))

    def enqueue_alert(self, channel: str, violation_key: str, payload: dict[str, Any], now: float) -> None:
        self._db.execute(
            self._sql.enqueue_alert,
            (channel, self._text(violation_key), json.dumps(payload, separators=(",", ":")), now, now),
        )

    def redeliver_dead(self, channel: str | None, now: float) -> int:
        return self._db.execute(self._sql.redeliver_dead, (now, channel, channel)).rowcount  # type: ignore[no-any-return]

    def idle_sessions(self, cutoff: float, limit: int) -> list[str]:
        return [session_id for (session_id,) in self._db.execute(self._sql.idle_sessions, (cutoff, limit))]

    def _forgotten(self, session_id: str, through_id: int) -> None:
        self._db.execute(self._sql.forgotten, (session_id, through_id))
