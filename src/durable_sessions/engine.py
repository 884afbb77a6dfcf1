"""The incremental checking engine: the only place rules run.

A :class:`Checker` is fed records one at a time (from a file, a live process or the
sidecar), groups them by session, keeps bounded memory per session, and returns each
violation exactly once, when the record that causes it arrives. It is told when a
session ends (end of input, process shutdown, an idle timeout), and only then runs the
rules that need the whole session.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from durable_sessions.json_text import may_hold_long_integer
from durable_sessions.native import native_module
from durable_sessions.record import NOWHERE, ActionRecord, Location, line_location, missing_fields
from durable_sessions.rules import CATALOGUE, Rule, select_rules
from durable_sessions.rules import snapshot as snapshot_format
from durable_sessions.rules.base import Facts, Finding
from durable_sessions.rules.record_rules import describe
from durable_sessions.rules.state import (
    DEFAULT_KEY_WINDOW_S,
    DEFAULT_MAX_ACTIONS_PER_SESSION,
    SessionState,
    Symbols,
    remembering,
)
from durable_sessions.violation import Violation

UNREADABLE_LINE = CATALOGUE.get("unreadable-line")
MISSING_FIELD = CATALOGUE.get("missing-field")
DISPATCH_CACHE_SIZE = 4096
Dispatch = tuple[
    tuple[tuple[Rule, Callable[..., Finding]], ...], tuple[tuple[Rule, Callable[..., Finding]], ...]
]
"""The (rule, check) pairs that apply: record rules, then session rules."""
_new_facts = tuple.__new__
Line = tuple[int, "bytes | None", bool]
"""A line of a JSONL action log: (line number, raw bytes or None, whether it is this checker's)."""


class Checker:
    """Checks a stream of action records against a selection of rules.

    ``max_sessions`` bounds how many sessions are held at once: past it the least
    recently active session is ended (its end-of-session rules run) and forgotten.
    ``None`` holds every session until :meth:`finish`, which is right for a file.

    A record of an action whose last span it repeats (same span id and status) is taken
    for that span delivered again and skipped, unless ``dropped_redeliveries``: the caller
    drops every span delivered again itself, by session, trace id, span id and status
    (the sidecar's stores, the offline checker's readers), and the engine, which remembers an
    action's last span id but not its trace, would also skip a span of the same id in
    another trace, which is another span.
    """

    def __init__(
        self,
        rules: Iterable[Rule] | None = None,
        *,
        key_window_s: float = DEFAULT_KEY_WINDOW_S,
        max_sessions: int | None = None,
        max_actions_per_session: int = DEFAULT_MAX_ACTIONS_PER_SESSION,
        dropped_redeliveries: bool = False,
    ) -> None:
        self.dropped_redeliveries = dropped_redeliveries
        self.rules: tuple[Rule, ...] = tuple(rules) if rules is not None else select_rules()
        self.key_window_s = key_window_s
        self.max_sessions = max_sessions
        self.max_actions_per_session = max_actions_per_session
        enabled = {rule.id for rule in self.rules}
        self._reports_lines = UNREADABLE_LINE.id in enabled
        self._reports_missing = MISSING_FIELD.id in enabled
        self._record_rules = tuple(r for r in self.rules if r.scope == "record")
        self._session_rules = tuple(r for r in self.rules if r.scope == "session")
        self._end_rules = tuple(r for r in self._session_rules if r.at_end is not None)
        self._relevant_fields = frozenset().union(*(r.fields for r in self.rules))
        self._dispatch: dict[Facts, Dispatch] = {}
        self._by_shape: dict[tuple, Dispatch] = {}
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()
        self._symbols = Symbols()
        self._remember = remembering()
        self.actions = 0
        self.sessions = 0
        native = self._native_feed()
        if native is not None:
            self.feed, self.feed_lines = native.feed, native.feed_lines

    def _native_feed(self) -> Any:
        """:meth:`feed` and :meth:`feed_lines` in C (``durable_sessions._engine``), which
        hands :meth:`feed` every record it does not handle itself; None where it was not
        built, ``DURABLE_SESSIONS_NATIVE`` turns it off, or a subclass overrides either
        method (its override is kept)."""
        module = native_module("_engine")
        cls = type(self)
        if module is None or cls.feed is not Checker.feed or cls.feed_lines is not Checker.feed_lines:
            return None
        return module.Feed(
            self,
            python_feed=self.feed,
            sessions=self._sessions,
            by_shape=self._by_shape,
            remember=self._remember,
            nowhere=NOWHERE,
            loads=orjson.loads,
            decode_error=orjson.JSONDecodeError,
            location_type=Location,
            check_redeliveries=not self.dropped_redeliveries,
        )

    def feed(self, record: ActionRecord, where: Location = NOWHERE) -> list[Violation]:
        """Check one record found at ``where``; return the violations it causes, in rule order.

        Where the native extension was built, ``checker.feed`` is its C version of this
        method (see :meth:`_native_feed`); the two give the same results.
        """
        self.actions += 1
        get = record.get
        session_id, action_id, kind, status = get("session_id"), get("action_id"), get("kind"), get("status")
        if not (
            type(session_id) is str
            and type(action_id) is str
            and type(kind) is str
            and type(status) is str
            and session_id
            and action_id
            and kind
            and status
        ):
            return self._missing_fields(record, where, missing_fields(record))
        violations: list[Violation] = []
        session = self._sessions.get(session_id) if self.max_sessions is None else None
        if session is None:
            session = self._session(session_id, violations)
        prior = session.recall(action_id)
        if prior is not None and not self.dropped_redeliveries and prior.is_redelivery(record, where):
            self.actions -= 1
            return violations
        shape = (kind, status, tuple(record), prior is not None, bool(session.failure_runs))
        rules = self._by_shape.get(shape)
        if rules is None:
            rules = self._rules_for_shape(shape, record)
        for rule, check in rules[0]:
            if finding := check(record):
                violations.append(rule.on(record, where, finding))
        for rule, check in rules[1]:
            if finding := check(session, record, where, prior):
                violations.append(rule.on(record, where, finding))
        self._remember(session, record, where, prior)
        return violations

    def feed_lines(
        self, lines: list[Line], file: str, other: Callable[[int, bytes | None, bool], list[Violation]]
    ) -> list[Violation]:
        """Check a block of lines of ``file``; return the violations they cause, in order.

        A line known to be this checker's that holds a JSON object is fed at its line;
        every other line (someone else's perhaps, or unreadable, or one that may hold an
        integer beyond 64 bits, which orjson rounds) is given to ``other``,
        which returns its violations. Where the native extension was built,
        ``checker.feed_lines`` is its C version of this method.
        """
        found: list[Violation] = []
        for number, raw, owned in lines:
            record = None
            # A line that may hold an integer beyond 64 bits is read exactly by ``other``.
            if owned is True and type(raw) is bytes and not may_hold_long_integer(raw):
                with contextlib.suppress(orjson.JSONDecodeError):
                    record = orjson.loads(raw)
            if type(record) is dict:
                found.extend(self.feed(record, line_location(file, number)))
            else:
                found.extend(other(number, raw, owned))
        return found

    def unreadable(self, location: Location, reason: str) -> list[Violation]:
        """Count an input line that holds no record, and report why."""
        self.actions += 1
        if not self._reports_lines:
            return []
        return [
            UNREADABLE_LINE.violation(
                f"{reason} — the action on this line cannot be replayed",
                session_id=None,
                action_id=None,
                location=location,
            )
        ]

    def end_session(self, session_id: str) -> list[Violation]:
        """Run the end-of-session rules for ``session_id`` and forget it."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return []
        return self._end(session)

    def finish(self) -> list[Violation]:
        """End every open session (the input is over)."""
        violations: list[Violation] = []
        while self._sessions:
            _, session = self._sessions.popitem(last=False)
            violations.extend(self._end(session))
        return violations

    def forget(self, session_id: str) -> None:
        """Drop ``session_id`` without judging its end (it will be rebuilt or is gone)."""
        self._sessions.pop(session_id, None)

    def snapshot(self, session_id: str) -> bytes | None:
        """The whole state of the held session ``session_id`` as bytes that
        :meth:`restore` reads (the format: :mod:`durable_sessions.rules.snapshot`), or
        None when the session is not held — or holds a record value that is not JSON
        (only records given by Python code do), which no snapshot carries exactly. The
        session is left as it was."""
        session = self._sessions.get(session_id)
        if session is None:
            return None
        return snapshot_format.encode(session, self._snapshot_settings())

    def restore(self, session_id: str, data: bytes) -> bool:
        """Hold ``session_id`` again with exactly the state ``data`` is a snapshot of
        (:meth:`snapshot`, by this checker or another): fed the same records afterwards,
        it finds what the snapshot's checker would have found, and :meth:`end_session`
        the same. The session counts as seen (``sessions``); ``actions`` counts records
        checked, and none is.

        Returns False, holding nothing new, for data this checker does not restore: of
        another format version; taken under another ``max_actions_per_session`` or
        another selection of rules (``key_window_s`` may differ: the restored session
        judges by this checker's); of another session; or anything else than a snapshot
        (truncated, altered, garbage). Bad data never raises: a store can hold anything.
        Raises ValueError for a caller's error: ``session_id`` is not a non-empty string,
        the session is held already, or ``max_sessions`` are held (restoring one more
        would end the least recently active, whose findings would have nowhere to go).
        """
        if type(session_id) is not str or not session_id:
            raise ValueError(f"restore: session_id must be a non-empty string, not {session_id!r}")
        if session_id in self._sessions:
            raise ValueError(f"restore: session {session_id!r} is held already (end or forget it first)")
        if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
            raise ValueError(f"restore: {self.max_sessions} sessions are held already (max_sessions)")
        try:
            session = snapshot_format.decode(
                data,
                session_id=session_id,
                settings=self._snapshot_settings(),
                symbols=self._symbols,
                key_window_s=self.key_window_s,
            )
        except snapshot_format.Refused:
            return False
        self._sessions[session_id] = session
        self.sessions += 1
        return True

    def _snapshot_settings(self) -> snapshot_format.Settings:
        return snapshot_format.Settings.of(self.max_actions_per_session, self.rules)

    def __contains__(self, session_id: object) -> bool:
        """Whether ``session_id`` is held in memory right now."""
        return session_id in self._sessions

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    def _end(self, session: SessionState) -> list[Violation]:
        violations = []
        for rule in self._end_rules:
            for pending, message in rule.at_end(session):  # type: ignore[misc]
                violations.append(
                    rule.violation(
                        message,
                        session_id=session.session_id,
                        action_id=pending.action_id,
                        location=pending.where,
                        kind=pending.kind,
                    )
                )
        return violations

    def _session(self, session_id: str, violations: list[Violation]) -> SessionState:
        session = self._sessions.get(session_id)
        if session is not None:
            if self.max_sessions is not None:
                self._sessions.move_to_end(session_id)
            return session
        session = SessionState(
            session_id,
            key_window_s=self.key_window_s,
            max_actions=self.max_actions_per_session,
            symbols=self._symbols,
        )
        self._sessions[session_id] = session
        self.sessions += 1
        if self.max_sessions is not None and len(self._sessions) > self.max_sessions:
            _, evicted = self._sessions.popitem(last=False)
            violations.extend(self._end(evicted))
        return session

    def _rules_for_shape(self, shape: tuple, record: ActionRecord) -> Dispatch:
        """The rules for a record shape (kind, status, field names, prior, watching).

        Logs repeat a handful of shapes, so this is cached; the facts behind a shape
        are cached again, so a log whose shapes all differ is only slower, not wrong.
        """
        kind, status, _, has_prior, watching = shape
        fields = frozenset(self._relevant_fields.intersection(record))
        rules = self._rules_for(_new_facts(Facts, (kind, status, fields, has_prior, watching)))
        if len(self._by_shape) < DISPATCH_CACHE_SIZE:
            self._by_shape[shape] = rules
        return rules

    def _rules_for(self, facts: Facts) -> Dispatch:
        """The record and session rules that can fire on a record with these facts."""
        rules = self._dispatch.get(facts)
        if rules is None:
            rules = (
                tuple((r, r.check_for(facts)) for r in self._record_rules if r.when(facts)),
                tuple((r, r.check_for(facts)) for r in self._session_rules if r.when(facts)),
            )
            if len(self._dispatch) < DISPATCH_CACHE_SIZE:
                self._dispatch[facts] = rules
        return rules

    def _missing_fields(
        self, record: ActionRecord, where: Location, missing: tuple[str, ...]
    ) -> list[Violation]:
        violations: list[Violation] = []
        session_id = record.get("session_id")
        if type(session_id) is str and session_id:
            # The record names its session, which its violations are reported under:
            # the session counts as seen, as it does for a complete record.
            self._session(session_id, violations)
        if not self._reports_missing:
            return violations
        for occurrence, name in enumerate(missing):
            value = record.get(name)
            if value is None:
                message = f"required field '{name}' missing"
            else:
                message = f"required field '{name}' is {describe(value)}, expected a non-empty string"
            action_id = record.get("action_id")
            violations.append(
                MISSING_FIELD.violation(
                    f"{message} — the action cannot be matched on replay",
                    session_id=session_id if type(session_id) is str else None,
                    action_id=action_id if type(action_id) is str else None,
                    location=where,
                    kind=record.get("kind") if type(record.get("kind")) is str else None,
                    occurrence=occurrence,
                )
            )
        return violations
