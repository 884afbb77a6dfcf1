"""Delivering one alert channel from the store's outbox: retries, backoff, dead letter.

The ``webhook`` and ``otlp`` channels share this loop; each only says how to send one
alert (:meth:`OutboxDelivery.send`) and what one attempt came to (:class:`Attempt`).

Rows come from the store's outbox (written in the same transaction as the violation),
so an alert survives a crash or a restart and is delivered once it can be, oldest
first, by a thread of the channel's own. On a store several replicas share, the rows are
claimed a batch at a time and each claim is renewed right before its attempt
(:meth:`Store.hold_alert`): a row another replica claimed meanwhile is left to it.

A delivered alert is marked delivered (if the store refuses the mark, the next pass
marks it without sending it again: :class:`Unrecorded`); a retryable failure is retried after
``backoff_s · 2^(attempt-1)`` (capped by ``max_backoff_s``, ±50% jitter so that many
sidecars do not retry in step; a delay the receiver asks for is honoured up to the cap);
a rejection, or the ``max_attempts``-th failure, moves the alert to the dead letter: it
stays in the outbox with state ``dead`` and its last error, and is never sent again. The
error is stored as the log shows it, with the log's redactor applied (:func:`log_redactor`).
A failure the store refuses to record (a full disk, a lost connection) is counted in
memory until it takes it (:class:`Unrecorded`): the backoff and the dead letter hold
while the store fails, rather than the alert being sent again each second, forever.

A failure of the receiver as a whole (unreachable, a timeout, overloaded or rate-limited:
:attr:`Attempt.receiver_unavailable`) pauses the channel until that alert's retry: the
other alerts due are not sent meanwhile, so they keep their attempts, and a receiver that
asks for a delay (``Retry-After``, ``RetryInfo``) gets it for every alert, not one. The
rows of the batch not tried are given back (:meth:`Store.release_alerts`), due when the
pause ends, rather than held for the rest of their claim's lease. A failure of one alert
(a 500 for its body, say) leaves the others to go on at once.

Metrics (labelled with the channel): ``durable_sessions_alert_deliveries_total{channel,outcome}``
(``delivered``, ``retry``, ``dead_letter``), ``durable_sessions_alert_outbox{channel,state}``
(from the store), ``durable_sessions_alert_delivery_duration_seconds{channel}`` (one attempt)
and ``durable_sessions_alert_latency_seconds{channel}`` (detection to delivery).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from durable_sessions_collector.alerts import idempotency_key
from durable_sessions_collector.alerts.metrics import DEAD_LETTER, RETRY, Metrics
from durable_sessions_collector.jsonlog import JsonLog, RepeatedFailure
from durable_sessions_collector.store import Alert, Store

BATCH = 100
MAX_ERROR_CHARS = 500
UNRECORDED_LIMIT = 10_000
"""Most alerts of a channel whose outcome the store refused to record are remembered
(:class:`Unrecorded`)."""


@runtime_checkable
class Redacting(Protocol):
    """A stream that replaces secrets in what it writes (the service's log stream)."""

    def scrub(self, text: str) -> str: ...


def log_redactor(log: JsonLog) -> Callable[[str], str]:
    """What ``log`` does to secrets in a line, for text kept elsewhere: the redactor its
    stream applies (the service logs through one), else nothing."""
    stream = log.stream
    return stream.scrub if isinstance(stream, Redacting) else str


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one delivery attempt came to."""

    outcome: str  # "delivered", "retry" or "rejected"
    error: str | None = None
    retry_after_s: float | None = None
    receiver_unavailable: bool = False
    """The receiver cannot take any alert now, not this one alone: the channel pauses."""


def backoff_delay(attempts: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """Wait after the ``attempts``-th failure: exponential, capped, ±50% jitter. Any
    count of attempts has a delay: past about 1,024 the doubling is beyond a float, and
    the cap is the delay (``max_attempts`` has no upper bound)."""
    try:
        delay = min(max_s, math.ldexp(base_s, max(0, attempts - 1)))
    except OverflowError:
        delay = max_s
    return min(max_s, delay * rng.uniform(0.5, 1.5))


@dataclass(frozen=True)
class DeliveryPolicy:
    """How hard a channel tries: attempts before the dead letter, per-attempt timeout, and
    the exponential backoff (with jitter) between attempts."""

    max_attempts: int = 8
    timeout_s: float = 5.0
    backoff_s: float = 1.0
    max_backoff_s: float = 300.0


DEFAULT_POLICY = DeliveryPolicy()


@dataclass(slots=True)
class Refused:
    """What the store refused to record of one alert's attempts: that it was delivered
    (only its mark is missing), or ``failed`` failed attempts, the last one's ``error``
    and the time it is due again (None: it is dead-lettered)."""

    delivered: bool = False
    failed: int = 0
    error: str = ""
    retry_at: float | None = None
    stored: int = 0
    """The row's count of attempts in the store when it refused: a row whose count changed
    since was written after all (a commit that failed only to answer) or redelivered."""


class Unrecorded:
    """The outcomes of attempts the store refused to record (a full disk, a lost
    connection), by outbox row, until it records them: a delivered alert is marked, not
    sent again, and a failing one keeps its backoff and its count of attempts (so its
    dead letter) although the store still has it due with its earlier count. What a
    restart loses is only what a crash loses anyway: an alert is sent again after it, with
    its ``Idempotency-Key``.

    At most ``limit`` alerts, those the store returned least recently forgotten first: a
    row that leaves the pending ones meanwhile (a mark the store committed though it
    reported a failure, another replica's mark, then retention) is never returned again,
    and must not be kept forever. A row is known by its id and its key: SQLite gives a new
    row the id of a deleted one, and a new alert must not be taken for one sent before.
    What was refused of a row whose count of attempts changed since is forgotten: the
    store has it after all (a commit that failed only to answer), or the alert was
    redelivered (``alerts redeliver``) from a count other than 0."""

    def __init__(self, limit: int = UNRECORDED_LIMIT) -> None:
        self.limit = limit
        self._refused: OrderedDict[tuple[int, str], Refused] = OrderedDict()

    def __len__(self) -> int:
        return len(self._refused)

    def keys(self) -> list[str]:
        """The keys of the alerts remembered, least recently returned by the store first."""
        return [key for _, key in self._refused]

    def get(self, alert: Alert) -> Refused | None:
        """What is unrecorded of ``alert``, which the store just returned, if anything."""
        row = (alert.id, alert.violation_key)
        refused = self._refused.get(row)
        if refused is not None and refused.stored != alert.attempts:
            del self._refused[row]
            return None
        if refused is not None:
            self._refused.move_to_end(row)
        return refused

    def keep(self, alert: Alert, refused: Refused) -> None:
        row = (alert.id, alert.violation_key)
        refused.stored = alert.attempts
        self._refused[row] = refused
        self._refused.move_to_end(row)
        while len(self._refused) > self.limit:
            self._refused.popitem(last=False)

    def forget(self, alert: Alert) -> None:
        """The store recorded the outcome of ``alert``."""
        self._refused.pop((alert.id, alert.violation_key), None)


class OutboxDelivery:
    """Delivers the outbox rows of :attr:`channel` from a thread of its own."""

    channel = ""
    thread_name = "alerts"

    def __init__(
        self,
        store: Store,
        log: JsonLog,
        metrics: Metrics,
        policy: DeliveryPolicy,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.log = log
        self.metrics = metrics
        self.max_attempts = policy.max_attempts
        self.timeout_s = policy.timeout_s
        self.backoff_s = policy.backoff_s
        self.max_backoff_s = policy.max_backoff_s
        self._rng = rng or random.Random()
        # An error may quote a secret (a receiver echoing a credential, http.client the
        # URL's path): it is stored, and printed by `alerts dead`, as the log shows it.
        self._redact = log_redactor(log)
        self._failures = RepeatedFailure(
            log, "alert-delivery-failed", "alert-delivery-recovered", context={"channel": self.channel}
        )
        """A pass the store fails (it is busy or gone) is tried again each second: logged a
        line a minute, with the count."""
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_due: float | None = None
        self._paused_until = 0.0
        self.unrecorded = Unrecorded()
        """What the store refused to record of this channel's attempts, until it records it."""

    # --- what a channel provides --------------------------------------------------------

    def send(self, alert: Alert) -> Attempt:
        """One delivery attempt of ``alert``."""
        raise NotImplementedError

    def target(self) -> dict[str, Any]:
        """Where alerts go, for log lines (never a secret)."""
        return {}

    def close(self) -> None:
        """Release what :meth:`send` holds open (called after the thread stopped)."""

    def now(self) -> float:
        """The time due times, claims and deliveries are read and written on: the store's
        clock (PostgreSQL: the server's), so that a replica whose host clock is off
        neither takes another's claim before its lease ends nor leaves due alerts waiting."""
        return self.store.now()

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start delivering, beginning with what an earlier run left pending."""
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def notify(self) -> None:
        """New alerts were committed: deliver them now."""
        self._wake.set()

    def request_stop(self) -> None:
        """Stop at the end of the attempt in flight, without waiting (see :meth:`stop`)."""
        self._stopping.set()
        self._wake.set()

    def stop(self) -> None:
        """Stop and wait for the thread: at most ``timeout_s`` (one attempt) and 2 s. Call
        :meth:`request_stop` of every channel first, so that their attempts end together."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 2)
        self.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.deliver_due()
            except Exception as error:  # the store is busy or gone: try again shortly
                self._failures.failed(error=f"{type(error).__name__}: {error}")
                self._next_due = None  # try again in a second
            else:
                self._failures.ok()
            wait = 1.0 if self._next_due is None else min(1.0, max(0.01, self._next_due - self.now()))
            self._wake.wait(wait)
            self._wake.clear()

    # --- delivery ----------------------------------------------------------------------

    def deliver_due(self) -> int:
        """Send every alert that is due now; return how many were delivered."""
        delivered = 0
        self._next_due = None
        while not self._stopping.is_set() and not self._paused():
            due = self.store.pending_alerts(self.channel, self.now(), limit=BATCH)
            if not due:
                break
            sent, waiting = delivered, 0
            for index, alert in enumerate(due):
                if self._stopping.is_set() or self._paused():
                    # Due again when the pause ends (at once when stopping), not at the
                    # end of the claim's lease: for this replica or another.
                    self.store.release_alerts(due[index:], max(self.now(), self._paused_until))
                    return delivered
                held = self.store.hold_alert(alert, self.now(), self.timeout_s)
                if held is None:  # another replica claimed it when our lease ran out
                    continue
                if self._waiting(held):
                    waiting += 1
                else:
                    delivered += self._deliver(held)
            # A batch the store still has due only by the failures it refused is all there
            # is until they are due: fetching it again would spin.
            if waiting == len(due) or (len(due) < BATCH and delivered == sent):
                break  # else more rows, or a change held back behind one sent, are due
        return delivered

    def _waiting(self, alert: Alert) -> bool:
        """Whether ``alert``, due by the store, is not due by the failures the store
        refused to record (:class:`Unrecorded`): its retry is later, or it is
        dead-lettered (then its mark is written now; it is never sent again)."""
        refused = self.unrecorded.get(alert)
        if refused is None or refused.delivered:
            return False
        if refused.retry_at is None:
            self._record_failure(alert, refused, None)
            return True
        if self.now() < refused.retry_at:
            self._due_at(refused.retry_at)
            return True
        return False

    def _due_at(self, when: float) -> None:
        self._next_due = when if self._next_due is None else min(self._next_due, when)

    def _record_failure(self, alert: Alert, refused: Refused, retry_at: float | None) -> None:
        """Write ``refused``'s failed attempts, the last to be retried at ``retry_at`` (or
        dead-lettered); if the store refuses them, keep them (:class:`Unrecorded`) and raise."""
        try:
            with self.store.writer() as writer:
                writer.mark_failed(alert, refused.error, retry_at, refused.failed)
        except BaseException:
            refused.retry_at = retry_at
            self.unrecorded.keep(alert, refused)
            raise
        self.unrecorded.forget(alert)

    def _delivered(self, alert: Alert, attempts: int) -> int:
        """Mark ``alert``, delivered at its ``attempts``-th attempt. If the store refuses
        the mark (a full disk, a lost connection), the next pass marks it without sending
        it again: the receiver has it (another replica may send it after its claim's
        lease, as after a crash)."""
        now = self.now()
        try:
            with self.store.writer() as writer:
                writer.mark_delivered([alert], now)
        except BaseException:
            self.unrecorded.keep(alert, Refused(delivered=True))
            raise
        self.unrecorded.forget(alert)
        self.metrics.delivered(self.channel, [alert], now)
        key = idempotency_key(alert.payload)
        self.log.debug("alert-delivered", channel=self.channel, idempotency_key=key, attempts=attempts)
        return 1

    def _paused(self) -> bool:
        if self.now() < self._paused_until:
            self._next_due = self._paused_until
            return True
        return False

    def _deliver(self, alert: Alert) -> int:
        channel = self.channel
        refused = self.unrecorded.get(alert) or Refused()
        if refused.delivered:  # delivered already: only its mark is missing
            return self._delivered(alert, alert.attempts + 1)
        start = time.perf_counter()
        try:
            attempt = self.send(alert)
        except Exception as error:  # a bug in a channel still counts as an attempt: capped, not endless
            attempt = Attempt("retry", f"{type(error).__name__}: {error}")
        self.metrics.alert_delivery_duration.labels(channel).observe(time.perf_counter() - start)
        now = self.now()
        attempts = alert.attempts + refused.failed + 1
        key = idempotency_key(alert.payload)
        if attempt.outcome == "delivered":
            return self._delivered(alert, attempts)
        error = self._redact(attempt.error or "failed")[:MAX_ERROR_CHARS]  # cut after: no half secret
        delay = backoff_delay(attempts, self.backoff_s, self.max_backoff_s, self._rng)
        if attempt.retry_after_s is not None:
            delay = min(self.max_backoff_s, max(delay, attempt.retry_after_s))
        if attempt.receiver_unavailable:  # also when this alert's attempts are exhausted
            self._paused_until = now + delay
        failed = Refused(failed=refused.failed + 1, error=error)
        if attempt.outcome == "retry" and attempts < self.max_attempts:
            retry_at = now + delay
            self._due_at(retry_at)
            # Counted and logged before the store records it: the attempt was made.
            self.metrics.alert_deliveries.labels(channel, RETRY).inc()
            self.log.warning(
                "alert-delivery-retry",
                channel=channel,
                **self.target(),
                idempotency_key=key,
                attempt=attempts,
                max_attempts=self.max_attempts,
                retry_in_s=round(delay, 3),
                error=error,
                channel_paused=attempt.receiver_unavailable,
            )
            self._record_failure(alert, failed, retry_at)
            return 0
        self.metrics.alert_deliveries.labels(channel, DEAD_LETTER).inc()
        self.log.error(
            "alert-dead-letter",
            channel=channel,
            **self.target(),
            idempotency_key=key,
            violation_key=alert.violation_key,
            attempts=attempts,
            error=error,
            reason="rejected by the receiver" if attempt.outcome == "rejected" else "attempts exhausted",
        )
        self._record_failure(alert, failed, None)
        return 0
