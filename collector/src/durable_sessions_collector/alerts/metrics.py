"""Prometheus metrics, served on ``/metrics`` of the HTTP port.

Each sidecar has its own registry (several can run in one test process). Session
counts by verdict and outbox counts by state are read from the store (see
:class:`_StoreCollector`), so they are right across restarts; the rest are counters of
this process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from durable_sessions.rules import Rule
from durable_sessions_collector.alerts import LOG
from durable_sessions_collector.store import Alert, Store

DELIVERED, RETRY, DEAD_LETTER = "delivered", "retry", "dead_letter"
"""The ``outcome`` values of ``durable_sessions_alert_deliveries_total``."""

TRANSPORTS = ("grpc", "http")
"""The ``transport`` values: the OTLP receivers."""

REJECTED_REASONS = ("invalid", "unstorable", "overload", "unavailable")
"""The ``reason`` values of ``durable_sessions_spans_rejected_total``."""

OUTBOX_STATES = ("pending", "delivered", "dead")
"""The ``state`` values of ``durable_sessions_alert_outbox`` (an outbox row's state); the
log channel never dead-letters, so its rows are only ``pending`` or ``delivered``."""

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Most Export requests are answered in under a millisecond (a small batch on a local
# store: 85% of gRPC and 67% of HTTP ones in a 300-request run), so the export histogram
# starts at 100 µs; from 1 ms only, every quantile of a healthy sidecar read "under 1 ms".
EXPORT_BUCKETS = (0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS)

COUNT_SYNC_LIMIT_S = 0.05
"""While counting the store takes less than this, a scrape counts it and waits for the
answer. Once a count has taken longer (about 500,000 sessions on SQLite, fewer on
PostgreSQL: a GROUP BY over the whole table), a scrape starts the next count in a thread
and waits at most :data:`COUNT_WAIT_S` for it; if it is not done, the scrape serves the
count that finished last (on a large store, one scrape interval old) and the thread goes on."""

COUNT_WAIT_S = 0.01
"""How long such a scrape waits for its count: enough for a count that is quick again
(the slow one was a hiccup) to be served fresh."""


class _StoreCollector(Collector):
    """Sessions by verdict and outbox rows by (channel, state), counted in the store;
    every verdict, and each state of the enabled channels (:attr:`expected`), at 0 when
    none is counted.

    Not counted in memory: with PostgreSQL other replicas change the same rows, and a
    fresh process must start from the store. Counting on every scrape made a scrape slow
    as the store grew (1,000,000 sessions: ~80-130 ms on SQLite, ~140-200 ms on
    PostgreSQL, docs/benchmarks.md), hence :data:`COUNT_SYNC_LIMIT_S`; one count runs at a time.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._counts: tuple[dict[str, int], dict[tuple[str, str], int]] | None = None
        self._cost_s = 0.0  # how long the last count took; 0 at start: the first scrape counts
        self._counter: threading.Thread | None = None  # the count running in the background
        self.expected: tuple[tuple[str, str], ...] = ()
        """The outbox series served at 0 while the store has no such row: (channel, state)."""

    def _count(self) -> None:
        start = time.perf_counter()
        try:
            counts = (self.store.verdict_counts(), self.store.alert_counts())
        except Exception:  # a scrape must not fail because the store is busy: no samples
            counts = None
        self._counts, self._cost_s = counts, time.perf_counter() - start

    def _count_in_background(self) -> None:
        try:
            self._count()
        finally:
            with self._lock:
                self._counter = None

    def counts(self) -> tuple[dict[str, int], dict[tuple[str, str], int]] | None:
        with self._lock:
            if self._counter is None and self._cost_s < COUNT_SYNC_LIMIT_S:
                self._count()  # under the lock: concurrent scrapes count one at a time
                return self._counts
            if self._counter is None:
                self._counter = threading.Thread(target=self._count_in_background, name="metrics-count")
                self._counter.daemon = True
                self._counter.start()
            counter = self._counter
        counter.join(COUNT_WAIT_S)
        return self._counts

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Named, so that ?name[]=durable_sessions_sessions selects them.
        yield from self._families()

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        sessions = GaugeMetricFamily(
            "durable_sessions_sessions", "Stored sessions by verdict", labels=["verdict"]
        )
        outbox = GaugeMetricFamily(
            "durable_sessions_alert_outbox",
            "Alerts in the outbox by channel and state",
            labels=["channel", "state"],
        )
        return sessions, outbox

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sessions, outbox = self._families()
        counts = self.counts()
        if counts is not None:
            for verdict, count in sorted(counts[0].items()):
                sessions.add_metric([verdict], count)
            # At 0 rather than absent: the last dead letter redelivered must read 0, not
            # "no data" (a row of a channel no longer enabled is still counted).
            rows = dict.fromkeys(self.expected, 0) | counts[1]
            for (channel, state), count in sorted(rows.items()):
                outbox.add_metric([channel, state], count)
        yield sessions
        yield outbox


class Metrics:
    """Every metric the sidecar exports."""

    def __init__(self, store: Store) -> None:
        # auto_describe as prometheus-client's default registry: ?name[]= can then select
        # the process_* and python_* collectors, which name their metrics only when collected.
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.spans_received = Counter(
            "durable_sessions_spans_received",
            "Spans received in Export requests",
            ["transport"],
            registry=registry,
        )
        self.spans_rejected = Counter(
            "durable_sessions_spans_rejected",
            "Spans not accepted: invalid or unstorable (answered as rejected, never retried), or overload "
            "and unavailable (write queue full; store failure or stopping: retried by the client)",
            ["transport", "reason"],
            registry=registry,
        )
        for transport in TRANSPORTS:  # at 0 from the start, for increase() (see expect)
            self.spans_received.labels(transport)
            for reason in REJECTED_REASONS:
                self.spans_rejected.labels(transport, reason)
        self.spans_stored = Counter(
            "durable_sessions_actions_stored", "Action records committed to the store", registry=registry
        )
        self.spans_duplicate = Counter(
            "durable_sessions_spans_duplicate",
            "Spans dropped because they were already stored",
            registry=registry,
        )
        self.spans_not_action = Counter(
            "durable_sessions_spans_not_action", "Spans that describe no agent action", registry=registry
        )
        self.requests = Counter(
            "durable_sessions_export_requests",
            "Export requests by outcome (ok, partial, invalid, too_large, unsupported, unavailable)",
            ["transport", "outcome"],
            registry=registry,
        )
        self.export_latency = Histogram(
            "durable_sessions_export_duration_seconds",
            "Time from receiving an Export request to answering it (records committed)",
            ["transport"],
            buckets=EXPORT_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge(
            "durable_sessions_queue_depth", "Export requests waiting to be written", registry=registry
        )
        self.queue_capacity = Gauge(
            "durable_sessions_queue_capacity", "Export requests the write queue holds", registry=registry
        )
        self.violations = Counter(
            "durable_sessions_violations",
            "New violations found, by rule and severity",
            ["rule", "severity"],
            registry=registry,
        )
        self.sessions_held = Gauge(
            "durable_sessions_sessions_in_memory", "Sessions held in the engine", registry=registry
        )
        self.sessions_rebuilt = Counter(
            "durable_sessions_sessions_rebuilt", "Sessions rebuilt from the store", registry=registry
        )
        self.sessions_restored = Counter(
            "durable_sessions_sessions_restored",
            "Sessions rebuilt from the engine state kept in the store, re-fed only the records stored "
            "after it (also counted in durable_sessions_sessions_rebuilt_total)",
            registry=registry,
        )
        self.sessions_ended = Counter(
            "durable_sessions_sessions_ended", "End-of-session evaluations (idle sessions)", registry=registry
        )
        self.sessions_pruned = Counter(
            "durable_sessions_sessions_pruned",
            "Ended sessions deleted from the store by retention.sessions_s, with their violations and "
            "actions (those of a session over a pass's budget in later passes)",
            registry=registry,
        )
        self.alert_deliveries = Counter(
            "durable_sessions_alert_deliveries",
            "Alert delivery attempts by channel and outcome (delivered, retry, dead_letter)",
            ["channel", "outcome"],
            registry=registry,
        )
        self.alert_delivery_duration = Histogram(
            "durable_sessions_alert_delivery_duration_seconds",
            "Duration of one alert delivery attempt (a webhook POST, an OTLP Export), by channel",
            ["channel"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.alert_latency = Histogram(
            "durable_sessions_alert_latency_seconds",
            "Time from detecting a violation to delivering its alert, by channel",
            ["channel"],
            buckets=(*LATENCY_BUCKETS, 60.0, 300.0, 900.0, 3600.0),
            registry=registry,
        )
        self.http_connections = Gauge(
            "durable_sessions_http_connections", "Connections the HTTP port is serving", registry=registry
        )
        self.http_connections_limit = Gauge(
            "durable_sessions_http_connections_limit",
            "Connections the HTTP port serves at once (receivers.http.max_connections); more wait",
            registry=registry,
        )
        self.http_idle_closed = Counter(
            "durable_sessions_http_idle_connections_closed",
            "Idle keep-alive connections the HTTP port closed to make room for a waiting one",
            registry=registry,
        )
        self.decoding_bytes = Gauge(
            "durable_sessions_decoding_bytes",
            "Memory the Export requests being decoded are weighed at (receivers.max_decoding_bytes)",
            registry=registry,
        )
        self.decoding_bytes_limit = Gauge(
            "durable_sessions_decoding_bytes_limit",
            "Memory the Export requests decoded at once may be weighed at (receivers.max_decoding_bytes); "
            "one request alone may pass it",
            registry=registry,
        )
        self.decoding_refused = Counter(
            "durable_sessions_decoding_refused",
            "Export requests refused before decoding (503 / UNAVAILABLE, retried by the client): "
            "the decoding budget had no room for them",
            ["transport"],
            registry=registry,
        )
        for transport in TRANSPORTS:  # at 0 from the start, for increase()
            self.decoding_refused.labels(transport)
        self.credential_reloads = Counter(
            "durable_sessions_credential_reloads",
            "Changed credential files (credential: token, tls) loaded or refused (outcome: loaded, failed)",
            ["credential", "outcome"],
            registry=registry,
        )
        self.commit_failures = Counter(
            "durable_sessions_store_commit_failures",
            "Store transactions that failed: Export write batches, idle sweeps, retention passes, verdict recount steps",
            registry=registry,
        )
        self._store_counts = _StoreCollector(store)
        registry.register(self._store_counts)
        # process_* and python_* (python_gc_*, python_info), as prometheus-client's default
        # registry has them: a registry of our own starts without them.
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)

    def expect(self, channels: Iterable[str], rules: Iterable[Rule]) -> None:
        """Create, at 0, the series that alerting rules watch: each enabled channel's
        delivery outcomes and outbox states, and each selected rule's violations, of every
        severity its findings can have (:attr:`Rule.severities`). A series that appears at
        its first value is no increase to ``increase()`` or ``rate()``, so the first dead
        letter or violation after a start would otherwise go unseen (and a gauge absent
        while the store has no such alert reads "no data", not 0)."""
        channels = tuple(channels)
        for channel in channels:
            for outcome in (DELIVERED,) if channel == LOG else (DELIVERED, RETRY, DEAD_LETTER):
                self.alert_deliveries.labels(channel, outcome)
        self._store_counts.expected = tuple(
            (channel, state)
            for channel in channels
            for state in (OUTBOX_STATES[:2] if channel == LOG else OUTBOX_STATES)
        )
        for rule in rules:
            for severity in rule.severities:  # a rule's findings may differ in severity
                self.violations.labels(rule.id, severity.value)

    def delivered(self, channel: str, alerts: Sequence[Alert], now: float) -> None:
        """Count ``alerts`` delivered on ``channel`` at ``now``, each with its latency from
        detection (every channel: the log's deliveries had no latency series)."""
        self.alert_deliveries.labels(channel, DELIVERED).inc(len(alerts))
        latency = self.alert_latency.labels(channel)
        for alert in alerts:
            detected = alert.payload.get("detected_at")
            if isinstance(detected, int | float) and not isinstance(detected, bool):
                latency.observe(max(0.0, now - detected))

    def expect_reloads(self, credential: str) -> None:
        """Create, at 0, the reload series of a credential read from files (as :meth:`expect`):
        a failed reload means a certificate that will expire, or clients locked out soon."""
        for outcome in ("loaded", "failed"):
            self.credential_reloads.labels(credential, outcome)

    def watch_certificate(self, not_after: Callable[[], float]) -> None:
        """Serve when the certificate in use expires. Only with TLS: a gauge at 0 would
        say the certificate expired in 1970."""
        Gauge(
            "durable_sessions_tls_certificate_expiry_timestamp_seconds",
            "When the certificate the ports serve expires (seconds since the epoch)",
            registry=self.registry,
        ).set_function(not_after)

    def watch(self, queue_depth: Callable[[], int], held: Callable[[], int]) -> None:
        self.queue_depth.set_function(queue_depth)
        self.sessions_held.set_function(held)
