"""Two sidecar replicas sharing one PostgreSQL database, fed by real SDK gRPC exporters.

The spans of one session are exported round-robin — each span to the other replica
than the one before, the way a load balancer without session affinity would send them —
and the same scenario is run once more through a single SQLite sidecar. Both replicas
must report the verdict and the violations the single sidecar finds, the end-of-session
rules must run once, and every violation must be alerted exactly once across the two.
Then spans of many sessions are delivered to *both* replicas at once (OTLP's
at-least-once delivery, concurrently): each is stored once and alerted once.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Sequence

import grpc
import pytest
from conftest import wait_for
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from sidecar_clients import Agent, grpc_exporter

pytestmark = pytest.mark.postgres
ANSWER = json.dumps({"budget_gbp": 2400})


class RoundRobin(SpanExporter):
    """Each export goes to the next exporter in turn."""

    def __init__(self, exporters: Sequence[SpanExporter]) -> None:
        self.exporters = list(exporters)
        self.sent = [0] * len(self.exporters)
        self._next = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        index = self._next
        self._next = (self._next + 1) % len(self.exporters)
        self.sent[index] += len(spans)
        return self.exporters[index].export(spans)

    def shutdown(self) -> None:
        for exporter in self.exporters:
            exporter.shutdown()


class Both(SpanExporter):
    """Every export goes to every exporter at the same time (a redelivery race)."""

    def __init__(self, exporters: Sequence[SpanExporter]) -> None:
        self.exporters = list(exporters)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        results: list[SpanExportResult] = []
        threads = [
            threading.Thread(target=lambda e=exporter: results.append(e.export(spans)))
            for exporter in self.exporters
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        ok = all(result is SpanExportResult.SUCCESS for result in results)
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        for exporter in self.exporters:
            exporter.shutdown()


def scenario(agent: Agent) -> None:
    """One session over two traces; findings that need earlier spans, and one at its end."""
    with agent.trace("plan"):
        agent.action("trip", "a01", "user_prompt", result=ANSWER, prompt_digest="sha256:q1")
        agent.action("trip", "a02", "payment", idempotency_key="K-1")
        agent.action("trip", "a03", "tool_call", retryable=True)  # unbounded-retry
        agent.action("trip", "a04", "llm_call", result=json.dumps({"text": "hi"}))
    with agent.trace("book"):
        agent.action("trip", "a05", "payment", idempotency_key="K-1")  # shared-key (needs a02)
        agent.action("trip", "a06", "user_prompt", result=ANSWER, prompt_digest="sha256:q1")
        agent.action("trip", "a07", "email", status="started")  # unresolved at the session's end
        agent.action("trip", "a02", "payment", idempotency_key="K-1", replayed=True)
        agent.action("trip", "a08", "llm_call")  # unrecorded-result


def findings(session: dict) -> list[tuple[str, str, bool]]:  # type: ignore[type-arg]
    return sorted((v["rule"], v["action_id"], v["resolved"]) for v in session["violations"])


def alert_keys(*sidecars) -> Counter[str]:  # type: ignore[no-untyped-def]
    return Counter(line["key"] for sidecar in sidecars for line in sidecar.alerts())


def test_two_replicas_agree_on_one_verdict_and_alert_once(start_sidecar, postgres_url, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The reference: the same scenario through one sidecar on SQLite.
    # idle_s: long enough that a busy machine cannot end the session between two of its
    # spans (then ended twice, and judged at each end).
    single = start_sidecar(tmp_path / "single.db", evaluation__idle_s=2.0)
    reference_agent = Agent(grpc_exporter(single.grpc_endpoint), "inc-ref")
    scenario(reference_agent)
    reference = wait_for(lambda: (s := single.session("trip"))["state"] == "ended" and s)
    reference_agent.shutdown()
    assert reference["verdict"] == "unrecoverable"
    assert {rule for rule, _, _ in findings(reference)} >= {
        "unbounded-retry",
        "shared-key",
        "unresolved-side-effect",
    }

    replicas = [start_sidecar(postgres_url, evaluation__idle_s=2.0) for _ in range(2)]
    # A watch on one replica sees what either replica commits (the shared violation feed).
    channel = grpc.insecure_channel(replicas[0].grpc_endpoint)
    watch = pb_grpc.SessionServiceStub(channel).WatchAlerts(pb.WatchAlertsRequest(), timeout=30)
    watch.initial_metadata()
    spread = RoundRobin([grpc_exporter(r.grpc_endpoint) for r in replicas])
    agent = Agent(spread, "inc-1")
    scenario(agent)
    assert min(spread.sent) >= 5  # both replicas received spans of the session

    # Both replicas read the shared store: one session, one verdict, the reference's findings.
    ended = [wait_for(lambda r=r: (s := r.session("trip"))["state"] == "ended" and s) for r in replicas]
    assert ended[0]["verdict"] == ended[1]["verdict"] == reference["verdict"]
    assert findings(ended[0]) == findings(ended[1]) == findings(reference)
    assert [a["action_id"] for a in ended[0]["actions"]] == [a["action_id"] for a in reference["actions"]]
    # Counted by the replica that ended it after the commit the API shows.
    wait_for(lambda: sum(r.metric("durable_sessions_sessions_ended_total") for r in replicas) >= 1)
    assert sum(r.metric("durable_sessions_sessions_ended_total") for r in replicas) == 1
    # Each violation alerted once, by one replica or the other.
    stored_keys = {v["key"] for v in ended[0]["violations"]}
    wait_for(lambda: set(alert_keys(*replicas)) == stored_keys)
    assert alert_keys(*replicas) == Counter(stored_keys)
    assert replicas[0].metric("durable_sessions_sessions", verdict="unrecoverable") == 1
    assert sorted(next(watch).violation.key for _ in stored_keys) == sorted(stored_keys)
    watch.cancel()
    channel.close()
    agent.shutdown()

    # Redelivery races: every span of 12 sessions reaches both replicas at the same time.
    twice = Agent(Both([grpc_exporter(r.grpc_endpoint) for r in replicas]), "inc-2")
    for n in range(12):
        with twice.trace("race"):
            twice.action(f"race-{n}", "p1", "payment", idempotency_key=f"R-{n}")
            twice.action(f"race-{n}", "p2", "payment", idempotency_key=f"R-{n}")  # shared-key
            twice.action(f"race-{n}", "t1", "tool_call", retryable=True)  # unbounded-retry
    twice.shutdown()
    stored = sum(r.metric("durable_sessions_actions_stored_total") for r in replicas)
    duplicates = sum(r.metric("durable_sessions_spans_duplicate_total") for r in replicas)
    assert stored == 9 + 12 * 3  # the first scenario's 9 actions, then each race span once
    assert duplicates == 12 * 3
    for n in range(12):
        session = replicas[n % 2].session(f"race-{n}")
        assert len(session["actions"]) == 3
        assert sorted(v["rule"] for v in session["violations"]) == ["shared-key", "unbounded-retry"]
    wait_for(lambda: sum(alert_keys(*replicas).values()) == len(stored_keys) + 24)
    assert set(alert_keys(*replicas).values()) == {1}
