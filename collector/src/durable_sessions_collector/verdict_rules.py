"""Which rules the verdicts count, as the store remembers it, and the recount after a change.

A session's verdict (and its counts of errors and warnings) counts the unresolved findings
of the rules the sidecar runs (``evaluation.strict`` adds the strict-only ones). The
store remembers that selection in its ``meta`` table (:data:`~.store.base.VERDICT_RULES`),
so that a sidecar started with another selection knows the stored verdicts counted
otherwise: :func:`adopt` records the new selection and queues a recount of the sessions
that have findings of the rules added or removed (:data:`~.store.base.RECOUNT`), which
the writer thread then runs a bounded step at a time (:func:`recount_step`) between write
batches. Each step moves the recount's place in the transaction that recounts, so a
crash leaves it to resume at the next start, where it stopped. Findings of rules not
counted stay stored, and a session's detail marks them ``not_counted``.

On a store several replicas share, the change is serialised by a lock
(:meth:`~.store.base.Writer.lock_verdict_rules`); replicas that run with different
selections still each count their own in the verdicts they write, so :func:`stored_rules`
lets each notice, and log, that the store's selection is not its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from durable_sessions.rules import CATALOGUE
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store.base import (
    RECOUNT,
    VERDICT_RULES,
    Store,
    Writer,
    decode_recount,
    decode_rules,
    encode_recount,
    encode_rules,
)

RECOUNT_WINDOW = 2_000
"""Sessions one step of a recount looks through (by id): one transaction, between two
write batches, so that Exports wait for no more than a step however large the store. Only
those with findings of the changed rules are recounted (an index lookup each). On a store
replicas share, a step locks each session it recounts: the pipeline then looks through no
more than it locks in a write (``pipeline.MAX_LOCKED_SESSIONS``)."""

EVERY_RULE = frozenset(rule.id for rule in CATALOGUE)
"""What a store whose selection was never recorded counted: every finding, of any rule."""


@dataclass(frozen=True, slots=True)
class Adopted:
    """What :func:`adopt` found and did."""

    previous: frozenset[str] | None
    """The selection the store held (None: none recorded)."""
    recount: frozenset[str] | None
    """The rules whose sessions are left to recount (None: no recount is pending)."""
    resumed: bool
    """The recount was left by an earlier run (and the selection did not change since)."""


def adopt(store: Store, rules: Iterable[str]) -> Adopted:
    """Make ``rules`` the selection the verdicts of ``store`` count, from now on.

    Sets :attr:`Store.counted <.store.base.Store.counted>` (for the writers begun after)
    and, under :meth:`~.store.base.Writer.lock_verdict_rules`, compares with the stored
    selection: when it differs, stores ``rules`` and queues a recount of the rules added
    or removed (joined to a recount an earlier run left unfinished, from the start). A
    store that has no session yet is only given the selection. Call before the writer
    thread starts; the recount itself is :func:`recount_step`'s."""
    selection = frozenset(rules)
    store.counted = selection
    with store.writer() as writer:
        writer.lock_verdict_rules()
        previous = decode_rules(writer.read_meta(VERDICT_RULES))
        pending = decode_recount(writer.read_meta(RECOUNT))
        if previous == selection:
            return Adopted(previous, pending and pending[0], pending is not None)
        writer.write_meta(VERDICT_RULES, encode_rules(selection))
        if previous is None and not store.list_sessions(limit=1):
            return Adopted(previous, None, False)  # a new store: nothing was counted yet
        changed = ((EVERY_RULE if previous is None else previous) ^ selection) | (
            pending[0] if pending else frozenset()
        )
        if changed:
            writer.write_meta(RECOUNT, encode_recount(changed, ""))
    return Adopted(previous, changed or None, False)


def log_adopted(log: JsonLog, adopted: Adopted, selection: frozenset[str], *, shared: bool) -> None:
    """Say what :func:`adopt` changed: ``verdict-rules-changed`` (a warning on a store
    replicas share, where one still running with the old selection counts otherwise), or
    ``verdict-recount-resumed``; nothing when nothing changed."""
    if adopted.resumed:
        log.info("verdict-recount-resumed", rules=sorted(adopted.recount or ()))
        return
    if adopted.previous == selection or (adopted.previous is None and adopted.recount is None):
        return
    before = EVERY_RULE if adopted.previous is None else adopted.previous
    fields = {
        "added": sorted(selection - before),
        "removed": sorted(before - selection),
        "previous": None if adopted.previous is None else sorted(adopted.previous),
        "recount": sorted(adopted.recount or ()),
    }
    if shared:
        log.warning(
            "verdict-rules-changed",
            **fields,
            note="replicas sharing this store with another selection of rules (evaluation.strict) "
            "count theirs in the verdicts they write: run every replica with the same settings",
        )
    else:
        log.info("verdict-rules-changed", **fields)


def recount_step(
    writer: Writer, lock: Callable[[Writer, list[str]], None], window: int = RECOUNT_WINDOW
) -> tuple[bool, int]:
    """One step of the recount the store has pending, in ``writer``'s transaction: the
    verdicts of the sessions, among the next ``window`` by id, that have findings of the
    changed rules, locked with ``lock`` first (the pipeline's, which a shared store needs);
    then the recount's place moves past them. Returns (whether the recount is over,
    sessions recounted). A recount another replica finished is over."""
    writer.lock_verdict_rules()
    pending = decode_recount(writer.read_meta(RECOUNT))
    if pending is None:
        return True, 0
    rules, after = pending
    sessions, last = writer.sessions_with_rules(rules, after, window)
    if last is None:
        writer.write_meta(RECOUNT, None)
        return True, 0
    lock(writer, sessions)
    for session_id in sessions:
        writer.refresh_verdict(session_id)
    writer.write_meta(RECOUNT, encode_recount(rules, last))
    return False, len(sessions)


def stored_rules(writer: Writer) -> frozenset[str] | None:
    """The selection the store's verdicts count as stored now (another replica may have
    changed it since this one started)."""
    return decode_rules(writer.read_meta(VERDICT_RULES))
