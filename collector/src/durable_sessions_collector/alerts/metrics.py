"""Prometheus metrics, served on ``/metrics`` of the HTTP port.

Each sidecar has its own registry (several can run in one test process). Session
counts by verdict and outbox counts by state are read from the store at scrape time,
so they are right across restarts; the rest are counters of this process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from durable_sessions_collector.store import Store

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _StoreCollector(Collector):
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        sessions = GaugeMetricFamily(
            "durable_sessions_sessions", "Stored sessions by verdict", labels=["verdict"]
        )
        outbox = GaugeMetricFamily(
            "durable_sessions_alert_outbox",
            "Alerts in the outbox by channel and state",
            labels=["channel", "state"],
        )
        try:
            for verdict, count in sorted(self.store.verdict_counts().items()):
                sessions.add_metric([verdict], count)
            for (channel, state), count in sorted(self.store.alert_counts().items()):
                outbox.add_metric([channel, state], count)
        except Exception:  # a scrape must not fail because the store is busy
            pass
        yield sessions
        yield outbox

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


class Metrics:
    """Every metric the sidecar exports."""

    def __init__(self, store: Store) -> None:
        self.registry = registry = CollectorRegistry()
        self.spans_received = Counter(
            "durable_sessions_spans_received",
            "Spans received in Export requests",
            ["transport"],
            registry=registry,
        )
        self.spans_rejected = Counter(
            "durable_sessions_spans_rejected",
            "Spans not accepted: invalid or unstorable (answered as rejected, never retried), or overload "
            "(retried by the client)",
            ["transport", "reason"],
            registry=registry,
        )
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
            buckets=LATENCY_BUCKETS,
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
        self.sessions_ended = Counter(
            "durable_sessions_sessions_ended", "End-of-session evaluations (idle sessions)", registry=registry
        )
        self.sessions_pruned = Counter(
            "durable_sessions_sessions_pruned",
            "Ended sessions deleted from the store by retention.sessions_s, with their actions and violations",
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
        self.commit_failures = Counter(
            "durable_sessions_store_commit_failures", "Store transactions that failed", registry=registry
        )
        registry.register(_StoreCollector(store))

    def watch(self, queue_depth: Callable[[], int], held: Callable[[], int]) -> None:
        self.queue_depth.set_function(queue_depth)
        self.sessions_held.set_function(held)
