"""The evaluator: the shared rule engine over stored sessions.

Record rules and session rules run as each action arrives, through one
:class:`~durable_sessions.engine.Checker` — no rule is re-implemented here. The
end-of-session rules run when a session has been idle for ``idle_s`` (like the
Collector's ``tail_sampling`` ``decision_wait``), and again after later spans reopen it.

Memory stays flat: at most ``max_sessions`` sessions are held in the engine. A session
that is not held — evicted, ended, or from before a restart — is rebuilt by re-feeding
its stored records in arrival order, which is the order the engine first saw them in,
so the rebuilt state is the state it had. A long session's state is kept in the store
as well (when it is evicted or ended, when the sidecar stops, and as it grows), so that
its rebuild restores that state and re-feeds only the records stored after it: the
time of a rebuild is then that of the records since, not of the whole session. What
the rules find while rebuilding is not reported: with the rules of the run that stored
the records it was found, and stored, when they arrived; a rule enabled since (``evaluation.strict``) judges the spans that
arrive after it, not records stored before, so that a change of settings raises no
alert for old actions.

Used by the pipeline's writer thread only: the engine is not thread-safe.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from durable_sessions.engine import Checker
from durable_sessions.mapping import Mapped, with_problems
from durable_sessions.rules import select_rules
from durable_sessions.violation import Violation
from durable_sessions_collector.store import ActionRow, Writer, action_row
from durable_sessions_collector.store.base import NO_SESSION, StoredSession, refuse_nul

KEEP_STATE_AFTER = 1_000
"""Records a session is fed beyond the state kept of it before that state is kept again.
Below it, re-feeding the records costs less than keeping and restoring the state."""


@dataclass(slots=True)
class Held:
    """A session the engine holds."""

    fed: int
    """How many of its stored records the engine has been fed."""
    first_seen: float | None
    """Its stored row's ``first_seen`` (:class:`StoredSession`): None when it has no row yet,
    or the store is this process's alone (whose :meth:`Writer.lock_sessions` tells nothing)."""
    kept: int = 0
    """How many of its records it had been fed when its state was last kept in the store
    (0: never), or found to be one no snapshot carries (see :meth:`Evaluator._keep`)."""

    def unkept(self) -> int:
        """Records fed since the state was last kept."""
        return self.fed - self.kept

    def grown(self, keep_after: int) -> bool:
        """Whether the session has grown enough since its state was kept to keep it again
        while it is held: by ``keep_after`` records and by half, so that keeping costs a
        constant per record however long the session, and a crash leaves at most a third
        of it to re-feed."""
        return self.unkept() >= max(keep_after, self.kept // 2)


class Arrival(NamedTuple):
    """A mapped span and the row it is stored as."""

    mapped: Mapped
    row: ActionRow


def arrival(mapped: Mapped) -> Arrival:
    """What the evaluator ingests for ``mapped``. Needs no state: receivers build it in
    their own threads, leaving the one writer thread less to do per span."""
    where = mapped.where
    return Arrival(mapped, action_row(mapped.record, where.trace_id or "", where.span_id or ""))


class Evaluator:
    """Feeds stored actions to the engine, rebuilding sessions from the store as needed."""

    def __init__(
        self,
        *,
        strict: bool = False,
        key_window_s: float = 86_400,
        max_sessions: int = 10_000,
        max_actions_per_session: int = 100_000,
        keep_state_after: int = KEEP_STATE_AFTER,
    ) -> None:
        """``keep_state_after``: records a session is fed beyond the state kept of it before
        that state is kept again in the store (:data:`KEEP_STATE_AFTER`; a session shorter
        than that is always rebuilt by re-feeding its records)."""
        self.rules = select_rules(strict=strict)
        # Eviction is done here, not by the engine: an evicted session is not over, so
        # its end-of-session rules must not fire; it is rebuilt when needed. Every record
        # fed is one the store had not stored (unique on trace, span and status): a span of
        # an action's last span id in another trace is another span, checked as one.
        self.checker = Checker(
            self.rules,
            key_window_s=key_window_s,
            max_actions_per_session=max_actions_per_session,
            dropped_redeliveries=True,
        )
        self.max_sessions = max_sessions
        self.keep_state_after = keep_state_after
        self._held: OrderedDict[str, Held] = OrderedDict()
        # What a shared store held of the sessions of this transaction when it locked them
        # (see forget_stale): a session rebuilt meanwhile is held as that row's.
        self._locked: Mapping[str, StoredSession] = {}
        self.rebuilt = 0
        """Sessions rebuilt from the store so far."""
        self.refed = 0
        """Stored records re-fed to rebuild them so far: the work rebuilding has cost."""
        self.restored = 0
        """Sessions rebuilt from a kept state so far (``keep_state_after``)."""

    @property
    def held(self) -> int:
        """Sessions currently held in memory."""
        return len(self._held)

    def ingest(self, writer: Writer, arrived: Arrival, now: float) -> tuple[bool, list[Violation]]:
        """Store one mapped span and check it: (stored, violations found).

        ``stored`` is False for a span already stored (OTLP redelivery): it is not
        checked again. The violations are not yet stored; the caller stores them.
        Raises :class:`~durable_sessions_collector.store.RecordRefused` for a span no
        store keeps (:func:`~durable_sessions_collector.store.base.refuse_nul`), before
        anything is read or written.
        """
        mapped, row = arrived
        refuse_nul(row)
        session_id = row.session_id
        held = None
        if session_id is not None:
            held = self._held.get(session_id)
            if held is not None:
                self._held.move_to_end(session_id)
            elif writer.is_stored(row):
                # A redelivered span of a session not in memory (ended, say): rebuilding it
                # would cost a replay of its records and hold it for nothing.
                return False, []
            else:
                held = self._hold(writer, session_id)
        if not writer.add_action(row, now):
            return False, []
        if held is not None:
            held.fed += 1
            if held.first_seen is None:  # no row yet: the caller's touch_session makes it at ``now``
                held.first_seen = now
        # The engine checks the row's record: identifiers and digests as stored, so that a
        # session rebuilt from the store holds the state it had (a long key is compared
        # digest to digest). The row is encoded already: the problems are checked, not
        # stored (a rebuilt session's records come without them, and its violations are
        # stored already).
        violations = self.checker.feed(with_problems(row.record, mapped.problems), mapped.where)
        # The first test is half of grown()'s, and fails for most records: it spares them the call.
        keep_after = self.keep_state_after
        if held is not None and held.unkept() >= keep_after and held.grown(keep_after):
            self._keep(writer, session_id, held)  # type: ignore[arg-type]
        return True, violations

    def end(self, writer: Writer, session_id: str) -> list[Violation]:
        """Run the end-of-session rules of ``session_id`` and forget it (rebuilt if needed,
        its state kept if it is long); return what they find."""
        self._hold(writer, session_id)
        self._release(writer, session_id)
        return self.checker.end_session(session_id)

    def unkept(self) -> list[str]:
        """The long held sessions (of ``keep_state_after`` records or more) fed records
        since their state was last kept, most such records first: what a stop keeps
        (:meth:`keep_states`)."""
        unkept = [
            (held.unkept(), session_id)
            for session_id, held in self._held.items()
            if held.fed >= self.keep_state_after and held.unkept()
        ]
        return [session_id for _, session_id in sorted(unkept, reverse=True)]

    def keep_states(self, writer: Writer, session_ids: Iterable[str], until: float) -> int:
        """Keep the state of those of ``session_ids`` still held (after
        :meth:`forget_stale`), in the store, until ``time.monotonic()`` passes ``until``;
        return how many were kept. For a stop: the next start restores them."""
        kept = 0
        for session_id in session_ids:
            if time.monotonic() >= until:
                break
            if session_id in self._held:
                self._keep(writer, session_id)
                kept += 1
        return kept

    def forget_stale(self, stored: Mapping[str, StoredSession]) -> int:
        """Forget the held sessions the store holds otherwise than the engine was fed —
        more (or fewer) records: another replica sharing the store wrote them; another
        row: another replica's retention deleted the session and spans started it afresh
        — so that they are rebuilt from the store before their next record. ``stored``
        is read under the sessions' locks, for the transaction that follows. Returns how
        many were forgotten."""
        self._locked = stored
        stale = [
            session_id
            for session_id, kept in stored.items()
            if (held := self._held.get(session_id)) is not None and (held.fed, held.first_seen) != kept
        ]
        self.discard(stale)
        return len(stale)

    def discard(self, session_ids: Iterable[str]) -> None:
        """Forget sessions whose in-memory state may be ahead of the store (a failed commit)."""
        for session_id in session_ids:
            if self._held.pop(session_id, "absent") != "absent":
                self.checker.end_session(session_id)

    def _hold(self, writer: Writer, session_id: str) -> Held:
        """``session_id`` as the engine holds it, rebuilt from the store if it was not held
        (what the rules find meanwhile is dropped: see the module's docstring)."""
        held = self._held
        if session_id in held:
            held.move_to_end(session_id)
            return held[session_id]
        held[session_id] = holding = self._rebuild(writer, session_id)
        while len(held) > self.max_sessions:
            evicted = next(iter(held))
            # Most often a session of no span of this transaction, whose lock it does not
            # hold: on a shared store another replica may be writing it meanwhile.
            self._release(writer, evicted, locked=evicted in self._locked)
            self.checker.end_session(evicted)  # not over: its end-of-session findings wait for idleness
        return holding

    def _rebuild(self, writer: Writer, session_id: str) -> Held:
        """The session as the store holds it: its kept state restored, if there is one
        this engine can take, and the records stored after it re-fed."""
        kept = writer.kept_state(session_id)
        restored = kept is not None and self.checker.restore(session_id, kept.state)
        start, after = (kept.fed, kept.through_id) if restored else (0, 0)  # type: ignore[union-attr]
        feed = self.checker.feed
        count = 0
        for record, where in writer.session_records(session_id, after):
            feed(record, where)
            count += 1
        self.refed += count
        if start or count:
            self.rebuilt += 1
            self.restored += restored
        return Held(start + count, self._locked.get(session_id, NO_SESSION).first_seen, kept=start)

    def _release(self, writer: Writer, session_id: str, *, locked: bool = True) -> None:
        """Stop holding ``session_id``, keeping its state in the store first if it has been
        fed enough records since it was last kept. ``locked``: the session is locked by
        this transaction (see :meth:`_keep`)."""
        held = self._held.pop(session_id, None)
        if held is not None and held.unkept() >= self.keep_state_after:
            self._keep(writer, session_id, held, locked=locked)

    def _keep(
        self, writer: Writer, session_id: str, held: Held | None = None, *, locked: bool = True
    ) -> None:
        """Keep the state of ``session_id`` in the store. Unless ``locked``, a shared store
        keeps it only while it holds what the engine was fed: another replica may have
        added records meanwhile and kept a newer state, or deleted the session and started
        it afresh with as many records, whose rebuild would then restore this one's state."""
        held = held or self._held[session_id]
        state = self.checker.snapshot(session_id)
        if state is not None:
            fed_from = None if locked else StoredSession(held.fed, held.first_seen)
            writer.keep_state(session_id, held.fed, state, fed_from)
        # Also when no snapshot carries the state (a record value that is not JSON): it is
        # tried again once the session has grown as much again, not at its next record.
        held.kept = held.fed
