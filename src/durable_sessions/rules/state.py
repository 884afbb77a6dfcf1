"""What a session remembers of its past actions, for the session rules.

The memory is deliberately small: a few fields per action id, never the results
themselves (only their digests), so a week-long session with many thousands of actions
stays cheap to hold and cheap to rebuild from a store.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import NamedTuple

from durable_sessions import kinds
from durable_sessions.digest import Fingerprint
from durable_sessions.record import (
    ActionRecord,
    Location,
    is_int,
    is_recorded,
    is_side_effecting,
    outcome_fingerprint,
    parse_ts,
)

DEFAULT_KEY_WINDOW_S = 86_400
DEFAULT_MAX_ACTIONS_PER_SESSION = 100_000
_intern = sys.intern


class ActionMemory(NamedTuple):
    """What the session knows of one ``action_id`` from the records seen so far.

    A tuple of plain values, so that holding a million of them is cheap and the garbage
    collector can stop tracking them.
    """

    kind: str
    where: Location
    status: str
    incarnation: str | None
    attempts: frozenset[int]
    retryable: bool
    key: str | None
    recorded: bool
    outcome: Fingerprint | None
    effect_done: bool

    @classmethod
    def first(cls, record: ActionRecord, where: Location, incarnation: str | None) -> ActionMemory:
        get = record.get
        kind = _intern(record["kind"])
        status = _intern(record["status"])
        attempts = get("attempts")
        key = get("idempotency_key")
        recorded, outcome, effect_done = _outcome(record, kind, status, False, None, False)
        return _new_tuple(
            cls,
            (
                kind,
                where,
                status,
                incarnation,
                frozenset((attempts,)) if is_int(attempts) else _NO_ATTEMPTS,
                get("retryable") is True,
                key if key and type(key) is str else None,
                recorded,
                outcome,
                effect_done,
            ),
        )

    def updated(self, record: ActionRecord, where: Location, incarnation: str | None) -> ActionMemory:
        get = record.get
        status = _intern(record["status"])
        attempts = self.attempts
        new_attempt = get("attempts")
        if is_int(new_attempt) and new_attempt not in attempts:
            attempts = attempts | {new_attempt}
        key = self.key
        if key is None:
            given = get("idempotency_key")
            key = given if given and type(given) is str else None
        recorded, outcome, effect_done = _outcome(
            record, self.kind, status, self.recorded, self.outcome, self.effect_done
        )
        return _new_tuple(
            ActionMemory,
            (
                self.kind,
                where if where.span_id is not None else self.where,
                status,
                incarnation if incarnation is not None else self.incarnation,
                attempts,
                self.retryable or get("retryable") is True,
                key,
                recorded,
                outcome,
                effect_done,
            ),
        )

    def is_other_incarnation(self, record: ActionRecord) -> bool:
        """``record`` comes from a different process run than the last one seen."""
        incarnation = record.get("incarnation")
        return incarnation is not None and self.incarnation is not None and incarnation != self.incarnation

    def is_redelivery(self, record: ActionRecord, where: Location) -> bool:
        """``record`` is the span last seen for this action, delivered again."""
        return (
            where.span_id is not None
            and where.span_id == self.where.span_id
            and record.get("status") == self.status
        )


_new_tuple = tuple.__new__
_NO_ATTEMPTS: frozenset[int] = frozenset()


def _outcome(
    record: ActionRecord,
    kind: str,
    status: str,
    recorded: bool,
    outcome: Fingerprint | None,
    effect_done: bool,
) -> tuple[bool, Fingerprint | None, bool]:
    """(recorded, outcome, effect_done) after ``record``: what executed ok and was kept."""
    if status != "ok" or record.get("replayed") is True:
        return recorded, outcome, effect_done
    if not recorded and kind in kinds.NON_DETERMINISTIC and is_recorded(record):
        recorded, outcome = True, outcome_fingerprint(record)
    if not effect_done and is_side_effecting(record):
        effect_done = True
    return recorded, outcome, effect_done


@dataclass(slots=True)
class KeyUse:
    """The first use of an idempotency key in a session."""

    action_id: str
    where: Location
    ts: float | None


@dataclass(slots=True)
class Pending:
    """An action some rule is watching until the session ends."""

    action_id: str
    kind: str
    where: Location
    detail: str = ""


@dataclass(slots=True)
class FailureRun:
    """Consecutive failures of one kind and name under different action ids."""

    action_ids: set[str] = field(default_factory=set)
    reported: bool = False


class SessionState:
    """The bounded memory of one session, shared by the session rules.

    ``actions`` is updated by the engine after every record; the other maps belong to
    the rule that names them. At most ``max_actions`` action ids (and as many keys and
    answered prompts) are remembered: past that the oldest are forgotten, so a runaway
    session cannot exhaust memory.
    """

    __slots__ = (
        "actions",
        "answered_prompts",
        "exhausted_retries",
        "failure_runs",
        "incarnations",
        "key_window_s",
        "keys",
        "max_actions",
        "session_id",
        "unfinished_effects",
    )  # fmt: skip

    def __init__(
        self,
        session_id: str,
        *,
        key_window_s: float = DEFAULT_KEY_WINDOW_S,
        max_actions: int = DEFAULT_MAX_ACTIONS_PER_SESSION,
    ) -> None:
        self.session_id = session_id
        self.actions: dict[str, ActionMemory] = {}
        self.keys: dict[str, KeyUse] = {}
        self.answered_prompts: dict[str, tuple[str, str | None]] = {}
        self.exhausted_retries: dict[str, Pending] = {}
        self.unfinished_effects: dict[str, Pending] = {}
        self.failure_runs: dict[tuple[str | None, str | None], FailureRun] = {}
        self.incarnations: dict[str, str] = {}
        self.key_window_s = key_window_s
        self.max_actions = max_actions

    def remember(self, record: ActionRecord, where: Location, prior: ActionMemory | None) -> None:
        """Fold ``record`` into the session's memory (after the rules have judged it)."""
        incarnation = record.get("incarnation")
        if incarnation is not None and type(incarnation) is str:
            incarnation = self.incarnations.setdefault(incarnation, incarnation)
        else:
            incarnation = None
        if prior is None:
            self.actions[record["action_id"]] = ActionMemory.first(record, where, incarnation)
            _trim(self.actions, self.max_actions)
        else:
            self.actions[record["action_id"]] = prior.updated(record, where, incarnation)
        key = record.get("idempotency_key")
        if key and type(key) is str and key not in self.keys:
            self.keys[key] = KeyUse(record["action_id"], where, parse_ts(record.get("ts")))
            _trim(self.keys, self.max_actions)
        digest = record.get("prompt_digest")
        if (
            digest
            and record["kind"] == kinds.USER_PROMPT
            and record["status"] == "ok"
            and digest not in self.answered_prompts
            and is_recorded(record)
        ):
            self.answered_prompts[digest] = (record["action_id"], incarnation)
            _trim(self.answered_prompts, self.max_actions)


def _trim(memory: dict, limit: int) -> None:
    if len(memory) > limit:
        del memory[next(iter(memory))]
