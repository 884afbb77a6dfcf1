"""The pipeline: a bounded write queue and the one thread that writes.

Receivers decode and map an Export request in their own threads, then :meth:`submit`
it. When the queue is full, :class:`Overloaded` is raised at once, and the receiver
answers ``UNAVAILABLE`` with ``RetryInfo`` / 503 with ``Retry-After``: nothing is
dropped silently. The writer thread takes every queued request (up to ``max_batch``),
stores and checks their records in one transaction, commits, and only then releases the
receivers waiting in :meth:`wait`, which acknowledge the Export: an acknowledged span is
a committed span. New violations are raised after the commit (see :mod:`..alerts`).

Between batches the writer ends the sessions that have been idle for ``idle_s`` —
counted from when this sidecar began accepting spans at the earliest (see
:meth:`Pipeline.accepting`) — and, with a retention (``retention_s`` > 0), deletes
ended sessions older than it (see :meth:`Pipeline.prune`). After the rules the verdicts
count changed, it recounts the verdicts a bounded step at a time (see
:meth:`Pipeline.recount`), and on a store replicas share looks now and then whether
another replica changed them (:meth:`Pipeline.check_rules`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from durable_sessions.violation import Violation
from durable_sessions_collector.alerts import FIRING, RESOLVED, alert_payload, change_payload, outbox_key
from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.evaluator import Arrival, Evaluator
from durable_sessions_collector.jsonlog import JsonLog, RepeatedFailure
from durable_sessions_collector.store import Pruned, RecordRefused, Store, StoreError, Writer
from durable_sessions_collector.verdict_rules import RECOUNT_WINDOW, recount_step, stored_rules

IDLE_BATCH = 500
SWEEP_REFEED = 20_000
"""Stored records one idle sweep re-feeds, at most, to rebuild the sessions it ends
(sessions not in memory: after a restart, all of them) before it commits and lets the
next write batch in; past it the sweep ends the sessions it has rebuilt and goes on after
that batch. One session is never split, so a sweep that rebuilds a session longer than
this takes as long as that session's rebuild (``docs/benchmarks.md``, "Rebuilding a
session")."""
MAX_LOCKED_SESSIONS = 1_000
"""Most sessions one write transaction locks on a store replicas share (PostgreSQL). Each
lock is an entry of the server's lock table, which every transaction on the server shares
(``max_locks_per_transaction`` × ``max_connections``: 6,400 entries by default): a batch of
many short sessions (a Collector's batches of 8,192 spans, a few queued) took tens of
thousands, failed with "out of shared memory", and failed again at each retry, while
other transactions on the server failed for the same reason. A larger batch is written
in parts of at most this many sessions, each a transaction of its own."""
PRUNE_BATCH = 500
"""Most sessions one retention pass deletes (and most rows of no session, of each kind)."""
PRUNE_ACTIONS = 20_000
"""Most actions one retention pass deletes: a pass is one transaction, and Exports wait for
it. A session holding more is deleted but for its actions, which later passes delete."""
PRUNE_EVERY_S = 60.0
"""Seconds between two retention passes, unless the last one deleted a full batch."""
RECOUNT_RETRY_S = 1.0
"""Seconds before a step of a recount of verdicts that failed is tried again."""
RULES_CHECK_EVERY_S = 60.0
"""Seconds between two looks, on a store replicas share, at the selection of rules its
verdicts count: another replica started with another selection is logged."""
WRITE_AT_STOP_S = 5.0
"""Longest the writer goes on after a stop is asked for (half of :meth:`Pipeline.stop`'s
timeout): writing the requests still queued, then keeping the state of the long sessions
held, so that the next start restores them rather than re-feeding all their records.
Requests still queued then are refused, and their clients retry; none was acknowledged."""


class Overloaded(Exception):
    """The write queue is full: the client should retry after ``retry_after_s`` or more
    (the receivers spread the delay they give)."""

    def __init__(self, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(Exception):
    """The records could not be committed (store failure, timeout, shutdown): retryable."""

    def __init__(self, retry_after_s: int, message: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Job:
    """One Export request's mapped spans, waiting to be committed."""

    items: list[Arrival]
    transport: str
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    stored: int = 0
    duplicates: int = 0
    unstorable: list[str] = field(default_factory=list)
    """Spans that could not be stored, each named with the reason (rejected, not retried)."""


class Pipeline:
    """The write queue and its writer thread; owns the evaluator."""

    def __init__(
        self,
        store: Store,
        evaluator: Evaluator,
        metrics: Metrics,
        log: JsonLog,
        *,
        queue_size: int = 64,
        max_batch: int = 64,
        idle_s: float = 30.0,
        retention_s: float = 0.0,
        ack_timeout_s: float = 5.0,
        retry_after_s: int = 1,
        channels: tuple[str, ...] = (),
        after_commit: Callable[[], None] | None = None,
        recounting: bool = False,
    ) -> None:
        """``recounting``: the store has a recount of verdicts pending (see
        :func:`~durable_sessions_collector.verdict_rules.adopt`)."""
        self.store = store
        self.evaluator = evaluator
        self.metrics = metrics
        self.log = log
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.queue_size = queue_size
        self.max_batch = max_batch
        self.idle_s = idle_s
        self.retention_s = retention_s  # 0: keep everything
        self.ack_timeout_s = ack_timeout_s
        self.retry_after_s = retry_after_s
        self.channels = channels
        self.after_commit = after_commit
        self.sweep_every = min(1.0, max(0.05, idle_s / 4))
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_sweep = -float("inf")  # time.monotonic() of the last sweep: a clock step cannot stall it
        self.last_prune = -float("inf")  # time.monotonic() of the last retention pass
        self.accepting_since = time.monotonic()
        """time.monotonic() when the receivers began accepting spans (:meth:`accepting`)."""
        self._rebuilt_reported = 0
        self._restored_reported = 0
        self._more_idle = False  # the last sweep left idle sessions for the next one
        self._backlog = True  # alerts left pending by an earlier run are delivered first
        self.recounting = recounting
        self.recounted = 0
        """Sessions whose verdicts the recount has recounted so far."""
        self._recount_after = -float("inf")  # time.monotonic() before which no step is tried
        self.last_rules_check = time.monotonic()  # the start compared them already
        self._conflict_logged: frozenset[str] | None = None
        self.write_failures = RepeatedFailure(log, "store-write-failed", "store-write-recovered")
        """While the store fails every write (its clients retry each second or so), a line
        a minute says so, with the count, rather than a line per failed batch."""
        # Also tried again each second or sooner while the store fails: the delivery after
        # a commit (the log channel's), the idle sweep, a step of the recount.
        self.delivery_failures = RepeatedFailure(log, "alert-delivery-failed", "alert-delivery-recovered")
        self.sweep_failures = RepeatedFailure(log, "idle-sweep-failed", "idle-sweep-recovered")
        self.recount_failures = RepeatedFailure(log, "verdict-recount-failed", "verdict-recount-recovered")
        metrics.queue_capacity.set(queue_size)
        metrics.watch(self.queue.qsize, lambda: evaluator.held)

    # --- receivers' side ---------------------------------------------------------------

    def submit(self, items: list[Arrival], transport: str) -> Job:
        """Queue a request's records; raise :class:`Overloaded` when the queue is full."""
        if self._stopping.is_set() or not self.alive:
            raise Unavailable(self.retry_after_s, "the sidecar is shutting down; retry later")
        job = Job(items, transport)
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise Overloaded(
                self.retry_after_s,
                f"write queue full ({self.queue_size} Export requests waiting); retry after the "
                "delay given (RetryInfo, Retry-After)",
            ) from None
        return job

    def wait(self, job: Job) -> Job:
        """Block until ``job`` is committed; raise :class:`Unavailable` if it could not be."""
        if not job.done.wait(self.ack_timeout_s):
            raise Unavailable(
                self.retry_after_s,
                f"records not committed within {self.ack_timeout_s:g} s; retry later (duplicates are dropped)",
            )
        if job.error is not None:
            raise Unavailable(self.retry_after_s, f"records could not be stored: {job.error}; retry later")
        return job

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- the writer --------------------------------------------------------------------

    def accepting(self) -> None:
        """The receivers accept spans from now on.

        Idleness is counted from now at the earliest: a session last seen before a restart
        (or before this sidecar's first start) is not idle until ``idle_s`` after it, since
        the spans its clients queued during the outage (an OpenTelemetry Collector's
        sending queue) arrive only now. Without this grace a restart longer than
        ``idle_s`` would end every active session before its queued spans are in, and
        alert on end-of-session findings those spans resolve.
        """
        self.accepting_since = time.monotonic()

    def start(self) -> None:
        self.accepting_since = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="durable-sessions-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            job.error = RuntimeError("the sidecar stopped before the records were stored")
            job.done.set()

    def _run(self) -> None:
        get = self.queue.get
        while not self._stopping.is_set():
            try:
                first = get(timeout=min(self.sweep_every, 0.1))
            except queue.Empty:
                first = None
            if first is not None:
                batch = [first]
                while len(batch) < self.max_batch:
                    try:
                        batch.append(self.queue.get_nowait())
                    except queue.Empty:
                        break
                self._write(batch)
            ticked = time.monotonic()
            if ticked - self.last_sweep >= self.sweep_every:
                try:
                    # Within idle_s of accepting spans no session has been idle that long.
                    if ticked - self.accepting_since >= self.idle_s:
                        self.sweep(self.now())
                        self.sweep_failures.ok()
                except Exception as error:  # keep writing; the sweep is retried next time
                    self.metrics.commit_failures.inc()
                    self.sweep_failures.failed(error=f"{type(error).__name__}: {error}")
                # A sweep cut short (a full batch, or its re-feeding budget spent) leaves more
                # idle sessions: sweep again right after the next write batch, rather than
                # making Exports wait for a whole wave to end.
                if not self._more_idle:
                    self.last_sweep = ticked
                if self.store.shared:
                    # Alerts a replica left when it died (committed, or claimed and not
                    # delivered) are this one's once their lease is over, new violation or not.
                    self._backlog = True
                # And a delivery that failed (the store refused it) is tried again, though
                # no span nor idle session comes to try it.
                self._deliver()
            if self.retention_s > 0 and ticked - self.last_prune >= PRUNE_EVERY_S:
                self._prune_pass(ticked)
            if self.recounting and ticked >= self._recount_after:
                self._recount_pass(ticked)
            if self.store.shared and ticked - self.last_rules_check >= RULES_CHECK_EVERY_S:
                self.last_rules_check = ticked
                self.check_rules()
        until = time.monotonic() + WRITE_AT_STOP_S
        self._drain(until)
        self.keep_states(until)

    def _drain(self, until: float) -> None:
        """Write the requests queued before the stop was asked for, one at a time, until
        ``time.monotonic()`` passes ``until``. Without the bound a deep queue of large
        requests kept the writer on past :meth:`stop`'s wait, which then refused the same
        queue from its side while the store was being written."""
        while time.monotonic() < until:
            try:
                self._write([self.queue.get_nowait()])
            except queue.Empty:
                return

    def _write(self, batch: list[Job]) -> None:
        """Commit ``batch`` in one transaction, then release its receivers.

        A failure the store reports as such (:class:`StoreError`: unreachable, locked,
        full) fails the batch, and its clients retry. Any other failure comes from
        something in the records, so it must not fail the requests batched with it
        forever: the requests are written one at a time, and a failing request span by
        span, so that only the spans that cannot be stored are rejected. A request one of
        whose spans the store fails meanwhile (a StoreError) is retryable as a whole.
        """
        for job in batch:
            job.stored = job.duplicates = 0
        if self.store.shared and len(_sessions(batch)) > MAX_LOCKED_SESSIONS:
            self._write_in_parts(batch)
            return
        try:
            fresh = self._transaction(batch, self.now())
        except StoreError as error:
            self._fail(batch, error)
            return
        except Exception as error:
            self._fail_over(batch, error)
            return
        self.write_failures.ok()
        # Counted before the receivers answer, so that a scrape after an Export's answer
        # counts its spans; the alerts' delivery, which may wait on a log, comes after.
        stored = sum(job.stored for job in batch)
        duplicates = sum(job.duplicates for job in batch)
        if stored:
            self.metrics.spans_stored.inc(stored)
        if duplicates:
            self.metrics.spans_duplicate.inc(duplicates)
        self._raised(fresh)
        for job in batch:
            job.done.set()
        self._deliver()

    def _transaction(self, batch: list[Job], now: float) -> list[Violation]:
        """Store and check the batch's records in one transaction; return the new violations."""
        touched: dict[str, int] = {}
        fresh: list[Violation] = []
        verdicts: dict[str, str] = {}
        evaluator = self.evaluator
        sessions = _sessions(batch)
        try:
            with self.store.writer() as writer:
                self._lock(writer, sessions)
                for job in batch:
                    for arrived in job.items:
                        stored, violations = evaluator.ingest(writer, arrived, now)
                        session_id = arrived.row.session_id
                        if stored:
                            job.stored += 1
                            if session_id is not None:
                                touched[session_id] = touched.get(session_id, 0) + 1
                        else:
                            job.duplicates += 1
                        for violation in violations:
                            if writer.add_violation(violation, at_end=False, now=now):
                                fresh.append(violation)
                for session_id, added in touched.items():
                    writer.touch_session(session_id, now, added)
                for violation in fresh:
                    if violation.session_id is not None and violation.session_id not in verdicts:
                        verdicts[violation.session_id] = ""
                for session_id in touched.keys() | verdicts.keys():
                    verdicts[session_id] = writer.refresh_verdict(session_id)
                self._enqueue(writer, fresh, verdicts, now)
        except BaseException:
            # Any session of the batch may hold state the rollback took from the store
            # (a record fed before the failure): forget them all; they are rebuilt.
            evaluator.discard(sessions)
            raise
        return fresh

    def _write_in_parts(self, batch: list[Job]) -> None:
        """Write ``batch``, which holds more than :data:`MAX_LOCKED_SESSIONS` sessions, in
        parts that hold at most that many: its requests in groups, and a request that holds
        more alone in parts of its spans (in their order). A part that fails makes its
        request retryable as a whole; the parts committed are dropped as duplicates then."""
        if len(batch) > 1:
            group: list[Job] = []
            held: set[str] = set()
            for job in batch:
                sessions = _sessions([job])
                if group and len(held | sessions) > MAX_LOCKED_SESSIONS:
                    self._write(group)
                    group, held = [], set()
                group.append(job)
                held |= sessions
            self._write(group)
            return
        job = batch[0]
        unstorable: list[str] = []
        for items in _session_parts(job.items, MAX_LOCKED_SESSIONS):
            part = Job(items, job.transport)
            self._write([part])
            if part.error is not None:
                job.stored = job.duplicates = 0
                job.error = part.error
                break
            job.stored += part.stored
            job.duplicates += part.duplicates
            unstorable += part.unstorable
        else:
            job.unstorable = unstorable
        job.done.set()

    def _fail(self, batch: list[Job], error: BaseException) -> None:
        self.metrics.commit_failures.inc()
        self.write_failures.failed(error=f"{type(error).__name__}: {error}", requests=len(batch))
        for job in batch:
            job.stored = job.duplicates = 0  # counted before the write failed: nothing is committed
            job.error = error
            job.done.set()

    def _fail_over(self, batch: list[Job], error: Exception) -> None:
        """``batch`` failed for something in its records: write it in smaller parts."""
        if len(batch) > 1:
            for job in batch:
                self._write([job])
            return
        job = batch[0]
        if len(job.items) == 1:
            if isinstance(error, RecordRefused):  # no retry will store it: reject it
                self.log.error("span-refused", error=str(error), span_id=job.items[0].row.span_id)
                job.stored = job.duplicates = 0  # counted before the write failed
                job.unstorable = [_unstorable(job.items[0], error)]
                job.done.set()
            else:
                self._fail(batch, error)
            return
        self.log.error(
            "request-write-failed",
            error=f"{type(error).__name__}: {error}",
            spans=len(job.items),
            note="writing its spans one at a time",
        )
        job.stored = job.duplicates = 0  # counted before the write failed; the parts count again
        unstorable: list[str] = []
        retryable: list[BaseException] = []
        for arrived in job.items:
            part = Job([arrived], job.transport)
            self._write([part])
            unstorable += part.unstorable
            if part.error is not None:
                retryable.append(part.error)
                unstorable.append(_unstorable(arrived, part.error))
            elif not part.unstorable:
                job.stored += part.stored
                job.duplicates += part.duplicates
        failed = [error for error in retryable if isinstance(error, StoreError)]
        if failed:
            # The store failed a span (unreachable, locked, full): the request is retried
            # whole, its committed spans dropped as duplicates then. Listed with the
            # rejected ones, that span was never sent again: lost, though acknowledged.
            job.error = failed[-1]
        elif len(unstorable) == len(job.items) and retryable:
            job.error = retryable[-1]  # nothing could be stored: retryable, as a store failure is
        else:
            job.unstorable = unstorable
        job.done.set()

    def sweep(self, now: float) -> int:
        """End up to ``IDLE_BATCH`` sessions idle for ``idle_s`` (their end-of-session rules
        run), in one transaction, stopping early once rebuilding them has re-fed
        ``SWEEP_REFEED`` stored records; return how many were ended.

        An end-of-session violation that the session's later spans settled is resolved,
        and one that was resolved and is found again holds again: each such change is
        alerted (:func:`~durable_sessions_collector.alerts.change_payload`) from the
        outbox rows written in the same transaction."""
        fresh: list[Violation] = []
        changes: list[dict[str, Any]] = []
        verdicts: dict[str, str] = {}
        self._more_idle = False
        with self.store.writer() as writer:
            idle = writer.idle_sessions(now - self.idle_s, IDLE_BATCH)
            if not idle:
                return 0
            refed_before = self.evaluator.refed
            try:
                self._lock(writer, idle)
                for position, session_id in enumerate(idle):
                    if self.evaluator.refed - refed_before >= SWEEP_REFEED:
                        idle, self._more_idle = idle[:position], True
                        break
                    violations = self.evaluator.end(writer, session_id)
                    for violation in violations:
                        if writer.add_violation(violation, at_end=True, now=now):
                            fresh.append(violation)
                    settled = writer.resolve_end_violations(session_id, {v.key for v in violations}, now=now)
                    writer.end_session(session_id, now)
                    verdict = verdicts[session_id] = writer.refresh_verdict(session_id)
                    changes += [
                        change_payload({**v, "session_id": session_id}, RESOLVED, verdict, now)
                        for v in settled.resolved
                    ]
                    changes += [
                        change_payload(alert_payload(v, verdict, now), FIRING, verdict, now)
                        for v in violations
                        if v.key in settled.held_again
                    ]
                self._enqueue(writer, fresh, verdicts, now)
                self._enqueue_alerts(writer, changes)
            except BaseException:
                self.evaluator.discard(idle)
                raise
        self._more_idle = self._more_idle or len(idle) == IDLE_BATCH
        self.metrics.sessions_ended.inc(len(idle))
        if changes:
            self._backlog = True
        self._raised(fresh)
        self._deliver()
        return len(idle)

    def keep_states(self, until: float) -> int:
        """Keep, in one transaction (on a shared store, one per
        :data:`MAX_LOCKED_SESSIONS` sessions), the state of the held sessions fed many
        records since it was last kept (see the evaluator), longest first, until
        ``time.monotonic()`` passes ``until``; return how many were kept. A failure is
        logged: the next start re-feeds what it would have restored."""
        sessions = self.evaluator.unkept()
        if not sessions:
            return 0
        step = MAX_LOCKED_SESSIONS if self.store.shared else len(sessions)
        kept = 0
        try:
            for start in range(0, len(sessions), step):
                if time.monotonic() >= until:
                    break
                part = sessions[start : start + step]
                with self.store.writer() as writer:
                    self._lock(writer, part)
                    kept += self.evaluator.keep_states(writer, part, until)
        except Exception as error:
            self.log.error("keep-states-failed", error=f"{type(error).__name__}: {error}", kept=kept)
            return kept
        self.log.info("session-states-kept", sessions=kept)
        return kept

    def _prune_pass(self, ticked: float) -> None:
        """One retention pass, from the writer loop: a failure is logged and retried at the
        next pass, and never stops the writer."""
        try:
            full = self.prune(self.now()).full
        except Exception as error:
            self.metrics.commit_failures.inc()
            self.log.error("prune-failed", error=f"{type(error).__name__}: {error}")
            full = False
        # A full batch leaves more to delete: prune again right after the next write
        # batch, as the sweep does, rather than making Exports wait for the whole backlog.
        if not full:
            self.last_prune = ticked

    def _recount_pass(self, ticked: float) -> None:
        """One step of the recount, from the writer loop: a failure is logged and the step
        tried again after :data:`RECOUNT_RETRY_S` (its place is in the store)."""
        try:
            self.recount()
        except Exception as error:
            self.metrics.commit_failures.inc()
            self.recount_failures.failed(error=f"{type(error).__name__}: {error}")
            self._recount_after = ticked + RECOUNT_RETRY_S

    def recount(self) -> bool:
        """Recount, in one transaction, the verdicts of the sessions with findings of the
        changed rules among the next sessions of the recount the store has pending (see
        :func:`~durable_sessions_collector.verdict_rules.recount_step`); log
        ``verdict-recount-done`` when it is over. Returns whether it is over.

        On a shared store a step looks through at most :data:`MAX_LOCKED_SESSIONS`
        sessions, since it may lock every one of them, as a write batch does."""
        window = min(RECOUNT_WINDOW, MAX_LOCKED_SESSIONS) if self.store.shared else RECOUNT_WINDOW
        with self.store.writer() as writer:
            done, recounted = recount_step(writer, self._lock, window)
        self.recount_failures.ok()
        self.recounted += recounted
        if done:
            self.recounting = False
            self.log.info("verdict-recount-done", sessions=self.recounted)
        return done

    def check_rules(self) -> None:
        """Log ``verdict-rules-conflict`` (an error, once per selection found) when the
        store's verdicts count another selection of rules than this sidecar's: another
        replica started with other settings, and the two now write verdicts that count
        differently. A failure to read it is left to the next look."""
        try:
            with self.store.writer() as writer:
                stored = stored_rules(writer)
        except Exception:  # the writes report the store's failures
            return
        ours = self.store.counted
        if stored is None or ours is None or stored == ours or stored == self._conflict_logged:
            return
        self._conflict_logged = stored
        self.log.error(
            "verdict-rules-conflict",
            stored=sorted(stored),
            ours=sorted(ours),
            note="another replica sharing the store runs another selection of rules (evaluation.strict); "
            "each counts its own in the verdicts it writes, so verdicts change with the replica that "
            "wrote last: run every replica with the same settings, then restart them",
        )

    def prune(self, now: float) -> Pruned:
        """Delete, in one transaction, up to ``PRUNE_BATCH`` ended sessions last seen
        before ``now - retention_s`` with their rows, and rows of no session as old (see
        :meth:`Writer.prune <durable_sessions_collector.store.base.Writer.prune>`); the
        evaluator forgets the deleted sessions. Returns what was deleted."""
        pruned = Pruned([], 0, False)
        try:
            with self.store.writer() as writer:
                pruned = writer.prune(now - self.retention_s, PRUNE_BATCH, PRUNE_ACTIONS)
        finally:
            # Spans that arrive for a deleted session start it afresh: whatever the engine
            # holds of it must go (also if the commit failed: a rebuild is all that costs).
            self.evaluator.discard(pruned.sessions)
        if pruned.sessions:
            self.metrics.sessions_pruned.inc(len(pruned.sessions))
        if pruned.sessions or pruned.orphans:
            self.log.info("sessions-pruned", sessions=len(pruned.sessions), orphan_rows=pruned.orphans)
        return pruned

    def now(self) -> float:
        """The time of the writes (activity, findings) and of the idle and retention
        cutoffs: the store's clock (:meth:`Store.now
        <durable_sessions_collector.store.base.Store.now>`; PostgreSQL: the server's,
        which every replica shares, so that one whose host clock is off neither ends
        another's live sessions nor keeps idle ones)."""
        return self.store.now()

    def _lock(self, writer: Writer, session_ids: Iterable[str | None]) -> None:
        """With a store shared by replicas: lock the sessions for this transaction and
        forget the held ones another replica has written to since (they are rebuilt)."""
        stored = writer.lock_sessions(sorted(s for s in session_ids if s is not None))
        if stored:
            self.evaluator.forget_stale(stored)

    def _enqueue(self, writer: Writer, fresh: list[Violation], verdicts: dict[str, str], now: float) -> None:
        payloads = [alert_payload(v, verdicts.get(v.session_id or ""), now) for v in fresh]
        self._enqueue_alerts(writer, payloads)

    def _enqueue_alerts(self, writer: Writer, payloads: list[dict[str, Any]]) -> None:
        """Queue each alert on every channel, under its outbox key
        (:func:`~durable_sessions_collector.alerts.outbox_key`: a new violation's key, or
        that and the change of status), due now on the clock every replica delivering it
        compares due times with (:meth:`now`)."""
        due = self.now()
        for payload in payloads:
            key = outbox_key(payload)
            for channel in self.channels:
                writer.enqueue_alert(channel, key, payload, due)

    def _raised(self, fresh: list[Violation]) -> None:
        """Count what the last commit raised and rebuilt; its alerts wait for :meth:`_deliver`."""
        for violation in fresh:
            self.metrics.violations.labels(violation.rule, violation.severity.value).inc()
        if self.evaluator.rebuilt > self._rebuilt_reported:
            self.metrics.sessions_rebuilt.inc(self.evaluator.rebuilt - self._rebuilt_reported)
            self._rebuilt_reported = self.evaluator.rebuilt
        if self.evaluator.restored > self._restored_reported:
            self.metrics.sessions_restored.inc(self.evaluator.restored - self._restored_reported)
            self._restored_reported = self.evaluator.restored
        if fresh:
            self._backlog = True

    def _deliver(self) -> None:
        """Deliver the alerts committed and not yet delivered, if there may be any."""
        if self.after_commit is not None and self._backlog:
            self._backlog = False
            try:
                self.after_commit()
            except Exception as error:
                self._backlog = True
                self.delivery_failures.failed(error=f"{type(error).__name__}: {error}")
            else:
                self.delivery_failures.ok()


def _sessions(batch: list[Job]) -> set[str]:
    """The sessions the spans of ``batch`` belong to."""
    return {arrived.row.session_id for job in batch for arrived in job.items} - {None}  # type: ignore[misc]


def _session_parts(items: list[Arrival], most: int) -> list[list[Arrival]]:
    """``items`` cut, in their order, into parts of spans of at most ``most`` sessions each."""
    parts: list[list[Arrival]] = [[]]
    held: set[str] = set()
    for arrived in items:
        session_id = arrived.row.session_id
        if session_id is not None and session_id not in held:
            if len(held) == most:
                parts.append([])
                held = set()
            held.add(session_id)
        parts[-1].append(arrived)
    return parts


def _unstorable(arrived: Arrival, error: BaseException) -> str:
    row = arrived.row
    return f"span {row.span_id} (trace {row.trace_id}): cannot be stored ({type(error).__name__}: {error})"
