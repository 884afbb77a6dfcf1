"""``GET /metrics`` as Prometheus scrapes it: formats, names, labels, and what the values mean.

Every test runs a real sidecar and scrapes it over HTTP after real OTLP exports (the SDK's
gRPC and HTTP exporters):

- content negotiation as prometheus-client's own handler does it: OpenMetrics 1.0.0 (with
  ``# EOF``) for Prometheus's ``Accept``, text format 0.0.4 otherwise, gzip, HEAD,
  ``name[]``;
- conventions: counters end in ``_total``, durations in ``_seconds``, gauges never in
  ``_total``; HELP on every family; only bounded labels (no session, span or trace ids,
  no free text), each value from its known set;
- the README's metric list and the exposition agree, with their types;
- prometheus-client's ``process_*`` and ``python_*`` metrics are there;
- the Export histogram resolves the sub-millisecond answers most Exports get;
- counters never go down; the store-read gauges are right in a restarted process, and a
  slow count of the store does not slow every scrape.
"""

from __future__ import annotations

import gzip
import http.client
import re
import time
import uuid
from pathlib import Path
from typing import Any

from conftest import Sidecar, wait_for
from durable_sessions_collector.store.base import VERDICTS
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families
from sidecar_clients import Agent, grpc_exporter, http_exporter

from durable_sessions.rules import CATALOGUE
from durable_sessions.violation import Severity

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
# What Prometheus 2.x/3.x sends (scrape_protocols: OpenMetrics first).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
SESSION = "metrics-audit-" + uuid.uuid4().hex  # unique: found in the exposition, it is a label value
INSTANCE = "instance-" + uuid.uuid4().hex

# Every label of a durable_sessions_* metric, and the values it may take.
LABEL_VALUES = {
    "transport": {"grpc", "http"},
    "reason": {"invalid", "unstorable", "overload", "unavailable"},
    "outcome": {"ok", "partial", "invalid", "too_large", "unsupported", "unavailable"}
    | {"delivered", "retry", "dead_letter"}
    | {"loaded", "failed"},
    "credential": {"token", "tls"},
    "rule": {rule.id for rule in CATALOGUE},
    "severity": {severity.value for severity in Severity},
    "verdict": set(VERDICTS),
    "channel": {"log", "webhook", "otlp"},
    "state": {"pending", "delivered", "dead"},
}


TLS_ONLY = {"durable_sessions_tls_certificate_expiry_timestamp_seconds"}
"""Served only with TLS (checked in security/test_credential_rotation.py)."""


def scrape(
    sidecar: Sidecar, headers: dict[str, str] | None = None, method: str = "GET", path: str = "/metrics"
) -> tuple[int, Any, bytes]:
    """(status, headers, body) of one request on a fresh connection."""
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    try:
        connection.request(method, path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def traffic(sidecar: Sidecar) -> None:
    """Exports over gRPC and HTTP: actions with violations (one id used twice), a span of no action."""
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), INSTANCE)
    agent.action(SESSION, "pay-1", "payment")  # unkeyed-side-effect
    agent.action(SESSION, "pay-1", "payment")  # duplicate-action-id
    with agent.trace():
        agent.action(SESSION + "-b", "read-1", "tool_call")
    agent.shutdown()
    agent = Agent(http_exporter(sidecar.http_url), INSTANCE)
    agent.action(SESSION + "-c", "pay-2", "payment")
    agent.shutdown()
    wait_for(
        lambda: sidecar.metric("durable_sessions_alert_deliveries_total", channel="log", outcome="delivered")
    )


def documented() -> dict[str, set[str]]:
    section = README.split("Metrics (`GET /metrics`):", 1)[1].split("\n\n", 1)[0]
    return {
        name: set(labels.split(",")) if labels else set()
        for name, labels in re.findall(r"`(durable_sessions_[a-z_]+)(?:\{([a-z_,]+)\})?`", section)
    }


# --- content negotiation ------------------------------------------------------------------


def test_openmetrics_to_prometheus_text_0_0_4_otherwise(sidecar: Sidecar) -> None:
    traffic(sidecar)
    status, headers, body = scrape(sidecar, {"Accept": PROMETHEUS_ACCEPT})
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0"), headers
    text = body.decode()
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(text)}
    received = families["durable_sessions_spans_received"]
    assert received.type == "counter"
    assert {s.name for s in received.samples} == {
        "durable_sessions_spans_received_total",
        "durable_sessions_spans_received_created",
    }
    for accept in (None, "text/plain", "text/plain;version=0.0.4", "*/*"):
        status, headers, body = scrape(sidecar, {"Accept": accept} if accept else {})
        assert status == 200
        assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8", (accept, headers)
        assert "# EOF" not in body.decode()
        assert any(f.name == "durable_sessions_spans_received" for f in text_families(body.decode()))


def test_gzip_head_and_name_filter_as_prometheus_client_serves_them(sidecar: Sidecar) -> None:
    traffic(sidecar)
    status, headers, body = scrape(sidecar, {"Accept-Encoding": "gzip", "Accept": PROMETHEUS_ACCEPT})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body).decode().endswith("# EOF\n")
    assert int(headers["Content-Length"]) == len(body)
    status, headers, body = scrape(sidecar, {"Accept-Encoding": "identity"})
    assert status == 200 and "Content-Encoding" not in headers and body.startswith(b"# HELP")

    status, headers, body = scrape(sidecar, method="HEAD")
    assert status == 200 and body == b""
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert int(headers["Content-Length"]) > 0

    query = "?name[]=durable_sessions_sessions&name[]=process_open_fds&name[]=durable_sessions_queue_depth"
    status, _, body = scrape(sidecar, path="/metrics" + query)
    assert status == 200
    assert {f.name for f in text_families(body.decode())} == {
        "durable_sessions_sessions",
        "process_open_fds",
        "durable_sessions_queue_depth",
    }


def test_accept_headers_over_several_lines_are_read_as_one_list(sidecar: Sidecar) -> None:
    """RFC 9110 section 5.3: field lines of one name are one comma-separated list, as a
    WSGI server hands prometheus-client's handler them. Only the first line was read: a
    scraper (or a proxy adding a line) asking OpenMetrics and gzip on lines after the first
    got uncompressed text format."""
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=30)
    try:
        connection.putrequest("GET", "/metrics")
        for name, value in (
            ("Accept", "text/plain;version=0.0.4;q=0.5"),
            ("Accept", "application/openmetrics-text;version=1.0.0"),
            ("Accept-Encoding", "identity"),
            ("Accept-Encoding", "gzip"),
        ):
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    assert response.status == 200 and response.headers["Content-Encoding"] == "gzip"
    assert response.headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert gzip.decompress(body).decode().endswith("# EOF\n")


# --- names, types, labels -------------------------------------------------------------------


def test_names_types_help_and_bounded_labels(sidecar: Sidecar) -> None:
    traffic(sidecar)
    text = scrape(sidecar, {"Accept": PROMETHEUS_ACCEPT})[2].decode()
    assert SESSION not in text and INSTANCE not in text  # no session (or resource) ids in labels
    families = [f for f in openmetrics_families(text) if f.name.startswith("durable_sessions_")]
    assert len(families) == len(set(documented()) - TLS_ONLY)
    for family in families:
        assert family.documentation.strip(), f"{family.name} has no HELP"
        assert not re.search(r"_(ms|milliseconds|microseconds|kb|mb)(_|$)", family.name), family.name
        if family.type == "counter":
            assert not family.name.endswith("_total")  # OpenMetrics: the family; samples add _total
        elif family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name  # every histogram is a duration
        else:
            assert family.type == "gauge" and not family.name.endswith("_total"), family
        for sample in family.samples:
            for label, value in sample.labels.items():
                if label == "le":
                    continue
                assert label in LABEL_VALUES, (family.name, label)
                assert value in LABEL_VALUES[label], (family.name, label, value)
    # The text format (0.0.4) spells counters with _total and never a gauge so.
    for family in text_families(scrape(sidecar)[2].decode()):
        if family.type == "gauge":
            assert not family.name.endswith("_total"), family.name
        if family.type == "counter" and family.name.startswith("durable_sessions_"):
            assert all(s.name.endswith("_total") for s in family.samples), family.name


def test_readme_list_and_exposition_agree_with_types(sidecar: Sidecar) -> None:
    traffic(sidecar)
    text = scrape(sidecar, {"Accept": PROMETHEUS_ACCEPT})[2].decode()
    exposed: dict[str, tuple[str, set[str]]] = {}
    for family in openmetrics_families(text):
        if not family.name.startswith("durable_sessions_"):
            continue
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {label for s in family.samples for label in s.labels} - {"le"}
        exposed[name] = (family.type, labels)
    listed = documented()
    assert set(exposed) == set(listed) - TLS_ONLY, set(exposed) ^ (set(listed) - TLS_ONLY)
    for name, labels in listed.items():
        if name in TLS_ONLY:
            continue
        kind, seen = exposed[name]
        assert seen <= labels, (name, seen, labels)  # a family without samples yet has none
        if name.endswith("_total"):
            assert kind == "counter", name
        elif name.endswith("_seconds"):
            assert kind == "histogram", name
        else:
            assert kind == "gauge", name


def test_process_and_python_metrics_are_served(sidecar: Sidecar) -> None:
    names = {f.name for f in text_families(scrape(sidecar)[2].decode())}
    for name in (
        "process_cpu_seconds",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_open_fds",
        "python_gc_objects_collected",
        "python_info",
    ):
        assert name in names, name


def test_export_histogram_resolves_sub_millisecond_answers(sidecar: Sidecar) -> None:
    traffic(sidecar)
    bounds = {
        float(labels["le"])
        for (name, label_items), _ in sidecar.metrics().items()
        if name == "durable_sessions_export_duration_seconds_bucket"
        for labels in [dict(label_items)]
        if labels["transport"] == "grpc"
    }
    assert {0.0001, 0.00025, 0.0005} <= bounds  # most small Exports are answered under 1 ms
    assert max(bounds - {float("inf")}) >= 10.0  # ... and a slow commit still has buckets


# --- what the values mean -------------------------------------------------------------------


def counter_samples(sidecar: Sidecar) -> dict[Any, float]:
    return {
        key: value
        for key, value in sidecar.metrics().items()
        if key[0].startswith("durable_sessions_") and key[0].endswith(("_total", "_count", "_sum", "_bucket"))
    }


def test_counters_only_grow_and_store_gauges_survive_a_restart(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = tmp_path / "restart.db"
    first = start_sidecar(store)
    traffic(first)
    before = counter_samples(first)
    traffic(first)  # the same actions again (new spans): every counter grows or stays
    after = counter_samples(first)
    assert set(before) <= set(after)
    assert all(after[key] >= value for key, value in before.items()), [
        key for key, value in before.items() if after[key] < value
    ]
    received = ("durable_sessions_spans_received_total", (("transport", "grpc"),))
    assert after[received] == 2 * before[received]
    gauges = {
        key: value
        for key, value in first.metrics().items()
        if key[0] in ("durable_sessions_sessions", "durable_sessions_alert_outbox")
    }
    assert gauges[("durable_sessions_sessions", (("verdict", "unrecoverable"),))] >= 2
    first.stop()

    second = start_sidecar(store)  # no traffic: the gauges come from the store
    assert {key: v for key, v in second.metrics().items() if key in gauges} == gauges
    assert second.metric("durable_sessions_spans_received_total", transport="grpc") == 0  # a new process


def test_a_slow_store_count_does_not_slow_every_scrape(sidecar: Sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = sidecar.service.store
    count = store.verdict_counts
    delay = {"s": 0.0}

    def slow_count() -> dict[str, int]:  # a store of millions of sessions (docs/benchmarks.md)
        time.sleep(delay["s"])
        return count()

    monkeypatch.setattr(store, "verdict_counts", slow_count)
    unrecoverable = lambda: sidecar.metric("durable_sessions_sessions", verdict="unrecoverable")  # noqa: E731
    assert unrecoverable() == 0
    delay["s"] = 1.5  # far from the times asserted below: a loaded machine must not matter
    started = time.perf_counter()
    assert unrecoverable() == 0  # counted while the scrape waits: it was quick so far
    assert time.perf_counter() - started >= 1.5

    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), INSTANCE)
    agent.action(SESSION, "pay-1", "payment")
    agent.shutdown()
    assert sidecar.session(SESSION)["verdict"] == "unrecoverable"
    started = time.perf_counter()
    assert unrecoverable() == 0  # the last count, served at once; the next one runs meanwhile
    assert time.perf_counter() - started < 1.0
    wait_for(lambda: unrecoverable() == 1, 10)  # the background count arrives by a later scrape

    delay["s"] = 0.0  # quick again: scrapes serve fresh counts again
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), INSTANCE)
    agent.action(SESSION + "-2", "pay-1", "payment")
    agent.shutdown()
    assert sidecar.session(SESSION + "-2")["verdict"] == "unrecoverable"
    wait_for(lambda: unrecoverable() == 2, 10)


def test_alerting_series_exist_at_zero_from_the_start(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    # increase()/rate() see a series that appears at its first value as no change: the
    # first dead letter or violation after a start must be an increase from 0.
    sidecar = start_sidecar(alerts__webhook__url="http://127.0.0.1:9/hook")
    samples = sidecar.metrics()
    for outcome in ("delivered", "retry", "dead_letter"):
        key = ("durable_sessions_alert_deliveries_total", (("channel", "webhook"), ("outcome", outcome)))
        assert samples[key] == 0.0, outcome
    assert (
        samples[("durable_sessions_alert_deliveries_total", (("channel", "log"), ("outcome", "delivered")))]
        == 0
    )
    assert not [key for key in samples if ("channel", "otlp") in key[1]]  # not enabled: no series
    rules = sidecar.service.evaluator.rules
    for rule in rules:
        key = ("durable_sessions_violations_total", (("rule", rule.id), ("severity", rule.severity.value)))
        assert samples[key] == 0.0, rule.id
