"""What a session remembers of its past actions, for the session rules.

The memory is deliberately small, because a log of a million actions in ten thousand
interleaved sessions keeps every session open until the end of the input. Each action
id costs one packed integer (kind, status, incarnation, position and three flags);
idempotency keys, attempt numbers (of an action attempted more than once) and outcome
fingerprints are kept beside it only for the actions that have them; results themselves
are never kept. Rules see the unpacked :class:`ActionMemory`, built only when an action
id comes back.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import orjson

from durable_sessions import kinds
from durable_sessions.digest import CANONICAL, Fingerprint, fingerprint, normal_digest
from durable_sessions.native import native_module
from durable_sessions.record import (
    NOWHERE,
    REDACTED,
    ActionRecord,
    Location,
    attempt_number,
    is_recorded,
    outcome_fingerprint,
    parse_ts,
)

_intern = sys.intern
DEFAULT_KEY_WINDOW_S = 86_400
DEFAULT_MAX_ACTIONS_PER_SESSION = 100_000
FORGET_BATCH = 1024
"""How many of a memory's oldest keys a session past its limit looks up at once."""

_RETRYABLE, _RECORDED, _EFFECT_DONE, _HAS_DETAILS, _HAS_OUTCOME = 1, 2, 4, 8, 16
_FLAG_BITS, _SYMBOL_BITS, _OUTCOME_BITS = 5, 24, 64
_SYMBOL_MASK = (1 << _SYMBOL_BITS) - 1
_MAX_SYMBOLS = _SYMBOL_MASK - 1
_KIND_SHIFT = _FLAG_BITS
_STATUS_SHIFT = _KIND_SHIFT + _SYMBOL_BITS
_INCARNATION_SHIFT = _STATUS_SHIFT + _SYMBOL_BITS
_FILE_SHIFT = _INCARNATION_SHIFT + _SYMBOL_BITS
_OUTCOME_SHIFT = _FILE_SHIFT + _SYMBOL_BITS
_OUTCOME_MASK = (1 << _OUTCOME_BITS) - 1
_POSITION_SHIFT = _OUTCOME_SHIFT + _OUTCOME_BITS
_PREFIX_CACHE_SIZE = 4096


class ActionMemory(NamedTuple):
    """What the session knows of one ``action_id`` from the records seen so far."""

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

    def is_other_incarnation(self, record: ActionRecord) -> bool:
        """``record`` comes from a different process run than the last one that executed
        the action (a replayed record executes nothing and leaves the run as it was)."""
        incarnation = record.get("incarnation")
        return incarnation is not None and self.incarnation is not None and incarnation != self.incarnation

    def attempts_seen(self) -> frozenset[int]:
        """The attempt numbers seen of the action: ``attempts`` kept empty stands for the
        first attempt only (:func:`_with_attempt`)."""
        return self.attempts or FIRST_ATTEMPT_ONLY

    def is_redelivery(self, record: ActionRecord, where: Location) -> bool:
        """``record`` is the span last seen for this action, delivered again."""
        return (
            where.span_id is not None
            and where.span_id == self.where.span_id
            and record.get("status") == self.status
        )


_NO_ATTEMPTS: frozenset[int] = frozenset()
FIRST_ATTEMPT_ONLY: frozenset[int] = frozenset({1})


def _with_attempt(attempts: frozenset[int], attempt: int, seen: bool) -> frozenset[int]:
    """``attempts`` with ``attempt`` added. An action seen at its first attempt only, the
    common case, keeps no numbers (so costs nothing beside its packed integer): its
    attempts are kept empty, and an empty set of an action seen before stands for
    ``{1}``, which a record without ``attempts`` is (:func:`attempt_number`)."""
    if seen and not attempts:
        attempts = FIRST_ATTEMPT_ONLY
    attempts = attempts | {attempt}
    return _NO_ATTEMPTS if attempts == FIRST_ATTEMPT_ONLY else attempts


_new_tuple = tuple.__new__


class ActionDetails(NamedTuple):
    """What only some actions have: an outcome fingerprint, a key, attempt numbers
    (packed by :func:`_pack_attempts`)."""

    outcome: Fingerprint | None
    key: str | None
    attempts: int | frozenset[int]


_MASKABLE_ATTEMPTS = range(1, 63)
_attempt_sets: dict[int, frozenset[int]] = {}


def _pack_attempts(attempts: frozenset[int]) -> int | frozenset[int]:
    """Attempt numbers as a bit mask when they are all small (a retried call's 1, 2, 3):
    a small int costs nothing to keep, where a frozenset costs some 200 bytes an action."""
    mask = 0
    for attempt in attempts:
        if attempt not in _MASKABLE_ATTEMPTS:
            return attempts
        mask |= 1 << attempt
    return mask


def _unpack_attempts(packed: int | frozenset[int]) -> frozenset[int]:
    if type(packed) is not int:
        return packed  # type: ignore[return-value]
    attempts = _attempt_sets.get(packed)
    if attempts is None:
        attempts = frozenset(n for n in _MASKABLE_ATTEMPTS if packed >> n & 1)
        if len(_attempt_sets) < 4096:
            _attempt_sets[packed] = attempts
    return attempts


class Symbols:
    """Strings (kinds, statuses, files) numbered for packing.

    One table serves every session of a checker, so the common strings are looked up in
    a small, warm dictionary. It holds at most ``_MAX_SYMBOLS`` strings; past that
    :meth:`number` returns None and sessions keep such actions unpacked. Strings are
    never dropped, so only those of a small vocabulary belong here: incarnations, one per
    process run, are numbered by each session (:meth:`SessionState.incarnation_index`),
    and go with it.
    """

    __slots__ = ("index", "prefixes", "texts")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.index: dict[str, int] = {}
        self.prefixes: dict[tuple[str, str, str | None], int | None] = {}

    def number(self, text: str) -> int | None:
        found = self.index.get(text)
        if found is None:
            if len(self.texts) >= _MAX_SYMBOLS:
                return None
            found = self.index[text] = len(self.texts)
            self.texts.append(text)
        return found

    def prefix(self, kind: str, status: str, file: str | None) -> int | None:
        """Kind, status and file packed together, or None when the table is full."""
        combination = (kind, status, file)
        prefix = self.prefixes.get(combination)
        if prefix is None:
            numbers = (self.number(kind), self.number(status), self.number(file) if file else -1)
            if None in numbers:
                return None
            prefix = numbers[0] << _KIND_SHIFT | numbers[1] << _STATUS_SHIFT | (numbers[2] + 1) << _FILE_SHIFT
            if len(self.prefixes) < _PREFIX_CACHE_SIZE:
                self.prefixes[combination] = prefix
        return prefix


@dataclass(slots=True)
class KeyUse:
    """The first use of an idempotency key in a session: by which action, where, and the
    first time known of it (the ``ts`` of the first record with the key that has one)."""

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

    The engine calls :meth:`recall` before the rules judge a record and
    :meth:`remember` after; the maps below ``details`` belong to the rules that name
    them. At most ``max_actions`` action ids (and as many keys and answered prompts) are
    remembered: past that the oldest are forgotten, so a runaway session cannot exhaust
    memory.
    """

    __slots__ = (
        "actions",
        "answered_prompts",
        "details",
        "exhausted_retries",
        "failure_runs",
        "incarnation",
        "incarnation_numbers",
        "incarnations",
        "key_window_s",
        "keys",
        "max_actions",
        "oldest",
        "session_id",
        "symbols",
        "unfinished_effects",
    )

    def __init__(
        self,
        session_id: str,
        *,
        key_window_s: float = DEFAULT_KEY_WINDOW_S,
        max_actions: int = DEFAULT_MAX_ACTIONS_PER_SESSION,
        symbols: Symbols | None = None,
    ) -> None:
        self.session_id = session_id
        self.actions: dict[str, int | ActionMemory] = {}
        self.details: dict[str, ActionDetails | Fingerprint] = {}
        self.keys: dict[str, KeyUse] = {}
        self.answered_prompts: dict[str, tuple[str, str | None]] = {}  # by normal_digest
        self.exhausted_retries: dict[str, Pending] = {}
        self.unfinished_effects: dict[str, Pending] = {}
        self.failure_runs: dict[tuple[str | None, str | None], FailureRun] = {}
        self.symbols = symbols if symbols is not None else Symbols()
        self.incarnation: tuple[str | None, int] = (None, 0)
        # The session's own incarnation numbers: a checker that outlives many process
        # runs (the sidecar) forgets each run's string with the sessions that saw it.
        self.incarnations: list[str] = []
        self.incarnation_numbers: dict[str, int] = {}
        self.key_window_s = key_window_s
        self.max_actions = max_actions
        self.oldest: dict[str, deque[Any]] | None = None
        """Per memory past ``max_actions``, its next oldest keys (:meth:`_forget_oldest`)."""

    def recall(self, action_id: str) -> ActionMemory | None:
        """What the session remembers of ``action_id``, or None if it is new."""
        packed = self.actions.get(action_id)
        if packed is None or type(packed) is ActionMemory:
            return packed  # type: ignore[return-value]
        texts = self.symbols.texts
        file = (packed >> _FILE_SHIFT) & _SYMBOL_MASK
        position = packed >> _POSITION_SHIFT
        if file:
            where = Location(texts[file - 1], position)
        else:
            where = Location(span_id=f"{position:016x}") if position else NOWHERE
        details = self.details.get(action_id) if packed & _HAS_DETAILS else None
        if details is not None and type(details) is not ActionDetails:
            details = ActionDetails(details, None, _NO_ATTEMPTS)
        if packed & _HAS_OUTCOME:
            outcome = (packed >> _OUTCOME_SHIFT) & _OUTCOME_MASK
        else:
            outcome = details.outcome if details else None
        return ActionMemory(
            kind=texts[(packed >> _KIND_SHIFT) & _SYMBOL_MASK],
            where=where,
            status=texts[(packed >> _STATUS_SHIFT) & _SYMBOL_MASK],
            incarnation=self._incarnation_of(packed),
            attempts=_unpack_attempts(details.attempts) if details else _NO_ATTEMPTS,
            retryable=bool(packed & _RETRYABLE),
            key=details.key if details else None,
            recorded=bool(packed & _RECORDED),
            outcome=outcome,
            effect_done=bool(packed & _EFFECT_DONE),
        )

    def status_of(self, action_id: str) -> str | None:
        """The latest status recorded for ``action_id``."""
        memory = self.recall(action_id)
        return None if memory is None else memory.status

    def remember(self, record: ActionRecord, where: Location, prior: ActionMemory | None) -> None:
        """Fold ``record`` into the session's memory (after the rules have judged it)."""
        get = record.get
        action_id = record["action_id"]
        status = record["status"]
        here = where  # the record's own location, where a key it carries is first used
        if prior is None:
            # Many logs reuse per-session counters ("a01", "step-3") as action ids: one copy each.
            action_id = _intern(action_id)
            kind, flags, outcome, key, attempts = record["kind"], 0, None, None, _NO_ATTEMPTS
            incarnation = get("incarnation")
        else:
            kind, flags = prior.kind, prior.retryable | prior.recorded << 1 | prior.effect_done << 2
            outcome, key, attempts = prior.outcome, prior.key, prior.attempts
            incarnation = get("incarnation")
            if incarnation is None or get("replayed") is True:
                # absent or null: the run that last wrote it goes on; a replay executes
                # nothing, so the action stays the run's that executed it
                incarnation = prior.incarnation
            if where.span_id is None:
                where = prior.where  # a logged action is cited where it first appeared
        if get("retryable") is True:
            flags |= _RETRYABLE
        if status == "ok":
            # A replay serves the outcome recorded when the action executed: where the
            # session never saw that execution (a log that begins after it, a resumed
            # process's spans), the replay is its record, and the effect was done.
            if not flags & _RECORDED and is_recorded(record):
                flags |= _RECORDED
                outcome = outcome_fingerprint(record)
            if kind in kinds.SIDE_EFFECTING or get("side_effects") is True:
                flags |= _EFFECT_DONE
        # An action with numbered attempts adds this record's attempt also when it is not
        # written: a record without attempts is attempt 1.
        if attempts or "attempts" in record or "idempotency_key" in record or "prompt_digest" in record:
            key, attempts = self._remember_key_and_attempts(
                record, here, action_id, key, attempts, prior is not None
            )
        if type(incarnation) is not str:
            incarnation = None
        packed_outcome = 0
        if type(outcome) is int:
            flags |= _HAS_OUTCOME
            packed_outcome, outcome_detail = outcome << _OUTCOME_SHIFT, None
        else:
            outcome_detail = outcome  # a given digest that is not SHA-256: kept as it is
        if key is not None or attempts:
            flags |= _HAS_DETAILS
            self.details[action_id] = _new_tuple(
                ActionDetails, (outcome_detail, key, _pack_attempts(attempts))
            )
        elif outcome_detail is not None:
            flags |= _HAS_DETAILS
            self.details[action_id] = outcome_detail
        packed = self._pack(kind, status, incarnation, where, flags)
        if packed:
            packed |= packed_outcome
        self.actions[action_id] = packed if packed else ActionMemory(
            kind, where, status, incarnation, attempts, bool(flags & _RETRYABLE), key,
            bool(flags & _RECORDED), outcome, bool(flags & _EFFECT_DONE),
        )  # fmt: skip
        if prior is None and len(self.actions) > self.max_actions:
            self.forget_oldest_action()

    def forget_oldest_action(self) -> None:
        """Past ``max_actions``: forget the oldest action id remembered, with its details."""
        forgotten = self._forget_oldest("actions", self.actions)
        self.details.pop(forgotten, None)

    def _forget_oldest(self, name: str, memory: dict[Any, Any]) -> Any:
        """Delete and return ``memory``'s oldest key: its first, since each memory adds a
        key once and only this method removes one. Finding a dict's first key scans every
        entry deleted before it (until the dict is next resized): done for each action
        past the limit, that made it cost up to 15 times as much. The next
        :data:`FORGET_BATCH` oldest keys are looked up at once instead."""
        if self.oldest is None:
            self.oldest = {}
        batch = self.oldest.get(name)
        if not batch:
            batch = self.oldest[name] = deque(itertools.islice(memory, FORGET_BATCH))
        forgotten = batch.popleft()
        del memory[forgotten]
        return forgotten

    def _pack(self, kind: str, status: str, incarnation: str | None, where: Location, flags: int) -> int:
        """The action as one integer, or 0 when the symbol table is full."""
        span_id = where.span_id
        file = (where.file or ("-" if where.line is not None else None)) if span_id is None else None
        symbols = self.symbols
        prefix = symbols.prefixes.get((kind, status, file))
        if prefix is None:
            prefix = symbols.prefix(kind, status, file)
            if prefix is None:
                return 0
        if incarnation is not None:
            last, number = self.incarnation
            if incarnation != last:
                found = self.incarnation_index(incarnation)
                if found is None:
                    return 0
                number = (found + 1) << _INCARNATION_SHIFT
                self.incarnation = (incarnation, number)
            prefix |= number
        if span_id is None:
            return flags | prefix | (where.line or 0) << _POSITION_SHIFT
        try:
            return flags | prefix | int(span_id, 16) << _POSITION_SHIFT
        except ValueError:
            return 0

    def incarnation_index(self, incarnation: str) -> int | None:
        """``incarnation``'s index in this session's table (packed as index + 1), or None
        when the table is full: at most as many incarnations as remembered actions (or
        ``_MAX_SYMBOLS``), so a session of ever new runs keeps the newest actions unpacked
        rather than a string per run beyond its action limit."""
        found = self.incarnation_numbers.get(incarnation)
        if found is None:
            if len(self.incarnations) >= min(self.max_actions, _MAX_SYMBOLS):
                return None
            found = self.incarnation_numbers[incarnation] = len(self.incarnations)
            self.incarnations.append(incarnation)
        return found

    def _runs_in_new_incarnation(self, record: ActionRecord, action_id: str) -> bool:
        """``record`` executes ``action_id`` in another process run than the one that last
        did (read from the memory not yet folded: :meth:`ActionMemory.is_other_incarnation`)."""
        incarnation = record.get("incarnation")
        if type(incarnation) is not str or record.get("replayed") is True:
            return False
        packed = self.actions.get(action_id)
        if packed is None:
            return False
        last = packed.incarnation if type(packed) is ActionMemory else self._incarnation_of(packed)
        return last is not None and last != incarnation

    def _incarnation_of(self, packed: int) -> str | None:
        """The incarnation a packed action memory names (index + 1 in the table), if any."""
        number = (packed >> _INCARNATION_SHIFT) & _SYMBOL_MASK
        return self.incarnations[number - 1] if number else None

    def _remember_key_and_attempts(
        self,
        record: ActionRecord,
        where: Location,
        action_id: str,
        key: str | None,
        attempts: frozenset[int],
        seen: bool,
    ) -> tuple[str | None, frozenset[int]]:
        """Fold the record's key, attempt and answered prompt into the session;
        ``attempts`` are the action's, ``seen`` whether it was seen before."""
        get = record.get
        attempt = attempt_number(record)
        if seen and self._runs_in_new_incarnation(record, action_id):
            # A resumed process counts its attempts afresh: the dead run's attempt numbers
            # are not this run's, so its attempt 2 is no duplicate of theirs (and its
            # attempt after one completed here is a re-execution, whatever they reached).
            attempts, seen = _NO_ATTEMPTS, False
        if attempt is not None and attempt not in attempts:
            attempts = _with_attempt(attempts, attempt, seen)
        given = get("idempotency_key")
        if given and type(given) is str:
            key = key or given
            use = self.keys.get(given)
            if use is None:
                self.keys[given] = KeyUse(action_id, where, parse_ts(get("ts")))
                if len(self.keys) > self.max_actions:
                    self._forget_oldest("keys", self.keys)
            elif use.ts is None:  # the first use had no time: the first record that has one
                use.ts = parse_ts(get("ts"))
        digest = get("prompt_digest")
        if (
            digest
            and type(digest) is str
            and record["kind"] == kinds.USER_PROMPT
            and record["status"] == "ok"
            and (digest := normal_digest(digest)) not in self.answered_prompts
            and is_recorded(record)
        ):
            self.answered_prompts[digest] = (action_id, get("incarnation"))
            if len(self.answered_prompts) > self.max_actions:
                self._forget_oldest("answered_prompts", self.answered_prompts)
        return key, attempts


# -- the packed layout taken apart, for a snapshot of a session (rules/snapshot_memory.py)

_FLAGS_MASK = (1 << _FLAG_BITS) - 1
_SHAPE_MASK = (1 << _OUTCOME_SHIFT) - 1


def split_packed(packed: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Packed actions taken apart: their *shapes* (the bits below the outcome: flags,
    kind, status, incarnation and file), their outcomes (64 bits) and their positions (a
    line, or a span id read as hex: any int). :func:`join_packed` is the inverse."""
    return (
        [p & _SHAPE_MASK for p in packed],
        [p >> _OUTCOME_SHIFT & _OUTCOME_MASK for p in packed],
        [p >> _POSITION_SHIFT for p in packed],
    )


def join_packed(shapes: list[int], outcomes: list[int], positions: list[int]) -> list[int]:
    """The packed actions of these shapes, outcomes and positions (:func:`split_packed`)."""
    return [
        shape | outcome << _OUTCOME_SHIFT | position << _POSITION_SHIFT
        for shape, outcome, position in zip(shapes, outcomes, positions, strict=True)
    ]


def shape_parts(shape: int) -> tuple[int, int, int, int, int]:
    """A shape as (flags, kind, status, incarnation, file): the kind's and status's symbol
    numbers, the incarnation's index in its session + 1 and the file's number + 1 (each 0
    for none)."""
    return (
        shape & _FLAGS_MASK,
        shape >> _KIND_SHIFT & _SYMBOL_MASK,
        shape >> _STATUS_SHIFT & _SYMBOL_MASK,
        shape >> _INCARNATION_SHIFT & _SYMBOL_MASK,
        shape >> _FILE_SHIFT & _SYMBOL_MASK,
    )


def join_shape(flags: int, prefix: int, incarnation: int) -> int:
    """A shape from its flags, :meth:`Symbols.prefix` of its kind, status and file, and its
    incarnation's index + 1 (0 for none); ``flags`` must be below ``FLAG_LIMIT``."""
    return flags | prefix | incarnation << _INCARNATION_SHIFT


FLAG_LIMIT = 1 << _FLAG_BITS


Remember = Callable[[SessionState, ActionRecord, Location, "ActionMemory | None"], None]


def remembering() -> Remember:
    """How the engine folds a checked record into its session: ``SessionState.remember``,
    or the same fold in C (``durable_sessions._memory``) where it was built and
    ``DURABLE_SESSIONS_NATIVE`` does not turn it off. Called as
    ``remember(session, record, where, prior)``."""
    module = native_module("_memory")
    return SessionState.remember if module is None else _native_fold(module).remember


@functools.cache
def _native_fold(module: ModuleType) -> Any:
    return module.Fold(
        ActionMemory,
        ActionDetails,
        python_remember=SessionState.remember,
        side_effecting=kinds.SIDE_EFFECTING,
        redacted=REDACTED,
        no_attempts=_NO_ATTEMPTS,
        dumps=orjson.dumps,
        dumps_option=CANONICAL,
        fingerprint=fingerprint,
        flag_bits=(_RETRYABLE, _RECORDED, _EFFECT_DONE, _HAS_DETAILS, _HAS_OUTCOME),
        incarnation_shift=_INCARNATION_SHIFT,
        outcome_shift=_OUTCOME_SHIFT,
        position_shift=_POSITION_SHIFT,
    )
