"""Edges of the OTLP/gRPC receiver, and of several replicas sharing one PostgreSQL schema.

gRPC: the real SDK exporter with gzip; a gzip request over ``max_request_bytes`` after
decompression; empty requests and resources/scopes without spans; a client deadline
shorter than the commit (the records are committed anyway; the retry is a duplicate);
the bearer token as gRPC metadata; a request whose every span is rejected.

Replicas: spans of several sessions alternating between two replicas, concurrently (one
verdict, each violation and end-of-session finding stored and alerted once, a WatchAlerts
stream on one replica sees every violation once in feed order); a replica that dies while
holding claimed outbox rows leaves them to the other after the lease.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections import Counter
from collections.abc import Sequence

import grpc
import pytest
from conftest import wait_for
from durable_sessions_collector.alerts import LOG, idempotency_key
from durable_sessions_collector.alerts.outbox import Attempt
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from opentelemetry.exporter.otlp.proto.grpc.exporter import Compression
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from sidecar_clients import Agent, any_value, export_call, grpc_exporter, request_of
from webhook_server import WebhookServer

MIB = 1024 * 1024
TOKEN = "edge-token-0123456789abcdef"
ANSWER = json.dumps({"budget_gbp": 2400})


# --- helpers ------------------------------------------------------------------------------


def span(n: int, session: str = "edge", *, trace_id: bytes | None = None, **attributes) -> Span:  # type: ignore[no-untyped-def]
    attributes.setdefault("session.id", session)
    attributes.setdefault("agent.action.id", f"a{n}")
    attributes.setdefault("agent.action.kind", "tool_call")
    return Span(
        trace_id=bytes([7] * 15 + [n]) if trace_id is None else trace_id,
        span_id=bytes([9] * 7 + [n]),
        name=f"action {n}",
        start_time_unix_nano=1_700_000_000_000_000_000 + n,
        end_time_unix_nano=1_700_000_000_000_000_000 + n + 1,
        attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()],
    )


def grpc_export(
    endpoint: str,
    body: bytes,
    *,
    timeout: float = 10,
    metadata: Sequence[tuple[str, str]] | None = None,
    compression: grpc.Compression | None = None,
) -> ExportTraceServiceResponse:
    """One raw ``TraceService/Export`` call over a fresh channel."""
    with grpc.insecure_channel(endpoint) as channel:
        call = export_call(channel)
        return call(body, timeout=timeout, metadata=metadata, compression=compression)  # type: ignore[no-any-return]


def actions_of(sidecar, session_id: str) -> list[str]:  # type: ignore[no-untyped-def]
    status, document = sidecar.get(f"/api/sessions/{session_id}")
    return [a["action_id"] for a in document["actions"]] if status == 200 else []


# --- OTLP/gRPC ----------------------------------------------------------------------------


def test_gzip_from_the_sdk_exporter_and_a_raw_channel_is_stored(sidecar) -> None:  # type: ignore[no-untyped-def]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint, compression=Compression.Gzip), "inc-gzip")
    agent.action("gz", "sdk", "tool_call")
    agent.shutdown()
    response = grpc_export(
        sidecar.grpc_endpoint,
        request_of(span(1, "gz")).SerializeToString(),
        compression=grpc.Compression.Gzip,
    )
    assert not response.HasField("partial_success")
    assert sorted(actions_of(sidecar, "gz")) == ["a1", "sdk"]  # listed in start-time order


def test_gzip_request_over_the_limit_after_decompression_is_resource_exhausted(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(receivers__max_request_bytes=MIB)
    big = request_of(span(1, "big", **{"agent.action.name": "x" * (2 * MIB)})).SerializeToString()
    assert len(gzip.compress(big)) < MIB // 100  # small on the wire: the limit is after decompression
    with pytest.raises(grpc.RpcError) as caught:
        grpc_export(sidecar.grpc_endpoint, big, compression=grpc.Compression.Gzip)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The port still works, and nothing of the refused request was stored.
    grpc_export(sidecar.grpc_endpoint, request_of(span(2, "small")).SerializeToString())
    assert actions_of(sidecar, "small") == ["a2"]
    assert sidecar.get("/api/sessions/big")[0] == 404


def test_empty_requests_and_resources_without_spans_are_ok_without_partial_success(sidecar) -> None:  # type: ignore[no-untyped-def]
    bodies = [
        b"",
        ExportTraceServiceRequest(resource_spans=[ResourceSpans()]).SerializeToString(),
        ExportTraceServiceRequest(
            resource_spans=[
                ResourceSpans(
                    resource=Resource(attributes=[KeyValue(key="service.name", value=any_value("x"))]),
                    scope_spans=[ScopeSpans(scope=InstrumentationScope(name="s"))],
                )
            ]
        ).SerializeToString(),
    ]
    for body in bodies:
        response = grpc_export(sidecar.grpc_endpoint, body)
        assert not response.HasField("partial_success")
    assert sidecar.metric("durable_sessions_export_requests_total", transport="grpc", outcome="ok") == 3


def test_a_request_whose_every_span_is_rejected_is_ok_with_partial_success(sidecar) -> None:  # type: ignore[no-untyped-def]
    # OTLP: rejected spans are a partial success (OK), not an error status.
    body = request_of(span(1, trace_id=b"\x01\x02"), span(2, trace_id=bytes(16))).SerializeToString()
    response = grpc_export(sidecar.grpc_endpoint, body)
    assert response.partial_success.rejected_spans == 2
    assert response.partial_success.error_message.startswith("rejected 2 of 2 span(s): ")


def test_a_deadline_shorter_than_the_commit_commits_and_the_retry_is_a_duplicate(sidecar) -> None:  # type: ignore[no-untyped-def]
    pipeline = sidecar.service.pipeline
    original = pipeline._transaction
    release = threading.Event()
    entered = threading.Event()

    def slow(batch, now):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(10)
        return original(batch, now)

    pipeline._transaction = slow
    body = request_of(span(1, "deadline")).SerializeToString()
    try:
        with pytest.raises(grpc.RpcError) as caught:
            grpc_export(sidecar.grpc_endpoint, body, timeout=0.3)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert entered.is_set()
    finally:
        release.set()
        pipeline._transaction = original
    # The request was accepted before the deadline: it is committed all the same.
    wait_for(lambda: actions_of(sidecar, "deadline") == ["a1"])
    # The client retries (DEADLINE_EXCEEDED is retryable): stored once, counted a duplicate.
    response = grpc_export(sidecar.grpc_endpoint, body)
    assert not response.HasField("partial_success")
    assert actions_of(sidecar, "deadline") == ["a1"]
    assert sidecar.metric("durable_sessions_spans_duplicate_total") == 1
    assert sidecar.metric("durable_sessions_actions_stored_total") == 1


def test_the_bearer_token_as_grpc_metadata(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(auth__token=TOKEN)
    endpoint = sidecar.grpc_endpoint
    # As the SDK exporter sends it with headers (and the Collector's bearertokenauth).
    agent = Agent(grpc_exporter(endpoint, headers={"authorization": f"Bearer {TOKEN}"}), "inc-auth")
    agent.action("auth", "sdk", "tool_call")
    agent.shutdown()
    body = request_of(span(1, "auth")).SerializeToString()
    grpc_export(endpoint, body, metadata=[("authorization", f"bearer {TOKEN}")])  # scheme: any case
    for metadata in (None, [("authorization", TOKEN)], [("authorization", f"Bearer {TOKEN}x")]):
        with pytest.raises(grpc.RpcError) as caught:
            grpc_export(endpoint, request_of(span(2, "auth")).SerializeToString(), metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(endpoint) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.SessionServiceStub(channel).GetSession(pb.GetSessionRequest(session_id="auth"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(endpoint) as channel:
        got = pb_grpc.SessionServiceStub(channel).GetSession(
            pb.GetSessionRequest(session_id="auth"),
            metadata=[("authorization", f"Bearer {TOKEN}")],
            timeout=5,
        )
    assert sorted(a.action_id for a in got.actions) == ["a1", "sdk"]


# --- PostgreSQL replicas ------------------------------------------------------------------


class RoundRobin(SpanExporter):
    """Each export goes to the next exporter in turn (a balancer without affinity)."""

    def __init__(self, exporters: Sequence[SpanExporter]) -> None:
        self.exporters = list(exporters)
        self._next = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        exporter = self.exporters[self._next]
        self._next = (self._next + 1) % len(self.exporters)
        return exporter.export(spans)

    def shutdown(self) -> None:
        for exporter in self.exporters:
            exporter.shutdown()


def scenario(agent: Agent, sid: str) -> None:
    """One session over two traces: findings that need earlier spans, one at its end."""
    with agent.trace("plan"):
        agent.action(sid, "a01", "user_prompt", result=ANSWER, prompt_digest="sha256:q1")
        agent.action(sid, "a02", "payment", idempotency_key=f"K-{sid}")
        agent.action(sid, "a03", "tool_call", retryable=True)  # unbounded-retry
        agent.action(sid, "a04", "llm_call", result=json.dumps({"text": "hi"}))
    with agent.trace("book"):
        agent.action(sid, "a05", "payment", idempotency_key=f"K-{sid}")  # shared-key (needs a02)
        agent.action(sid, "a06", "user_prompt", result=ANSWER, prompt_digest="sha256:q1")
        agent.action(sid, "a07", "email", status="started")  # unresolved at the session's end
        agent.action(sid, "a02", "payment", idempotency_key=f"K-{sid}", replayed=True)
        agent.action(sid, "a08", "llm_call")  # unrecorded-result


def findings(session: dict) -> list[tuple[str, str, bool]]:  # type: ignore[type-arg]
    return sorted((v["rule"], v["action_id"], v["resolved"]) for v in session["violations"])


def ended(sidecar, sid: str):  # type: ignore[no-untyped-def]
    session = sidecar.session(sid)
    return session if session["state"] == "ended" else None


def feed_position(cursor: str) -> tuple[int, int]:
    """The PostgreSQL feed position ``pg:XID:ID`` of a WatchAlerts cursor (``POSITION@STORE``)."""
    _, xid, row = cursor.rpartition("@")[0].split(":")
    return int(xid), int(row)


@pytest.mark.postgres
def test_concurrent_sessions_alternating_between_replicas_are_judged_and_alerted_once(
    start_sidecar, postgres_url, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    sessions = [f"trip-{n}" for n in range(4)]
    # idle_s: long enough that a busy machine cannot end a session between two of its
    # spans (then ended twice, and judged at each end).
    single = start_sidecar(tmp_path / "single.db", evaluation__idle_s=2.0)
    reference_agent = Agent(grpc_exporter(single.grpc_endpoint), "inc-ref")
    for sid in sessions:
        scenario(reference_agent, sid)
    reference_agent.shutdown()
    reference = {sid: wait_for(lambda sid=sid: ended(single, sid)) for sid in sessions}

    hook = WebhookServer()
    replicas = [
        start_sidecar(postgres_url, evaluation__idle_s=3.0, alerts__webhook__url=hook.url) for _ in range(2)
    ]
    # A watch on replica B, opened before any span: it must see what A and B commit.
    channel = grpc.insecure_channel(replicas[1].grpc_endpoint)
    watch = pb_grpc.SessionServiceStub(channel).WatchAlerts(pb.WatchAlertsRequest(), timeout=40)
    watch.initial_metadata()
    errors: list[BaseException] = []

    def run(n: int, sid: str) -> None:
        try:
            order = replicas if n % 2 == 0 else replicas[::-1]
            agent = Agent(RoundRobin([grpc_exporter(r.grpc_endpoint) for r in order]), f"inc-{n}")
            scenario(agent, sid)
            agent.shutdown()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(n, sid)) for n, sid in enumerate(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors

    stored_keys: set[str] = set()
    for sid in sessions:
        views = [wait_for(lambda r=r, sid=sid: ended(r, sid), timeout=15) for r in replicas]
        assert views[0]["verdict"] == views[1]["verdict"] == reference[sid]["verdict"], sid
        assert findings(views[0]) == findings(views[1]) == findings(reference[sid]), sid
        assert [a["action_id"] for a in views[0]["actions"]] == [
            a["action_id"] for a in reference[sid]["actions"]
        ]
        stored_keys |= {v["key"] for v in views[0]["violations"]}

    # Each session ended once, by one replica or the other (counted after the commit the
    # API shows).
    def ended_count() -> float:
        return sum(r.metric("durable_sessions_sessions_ended_total") for r in replicas)

    wait_for(lambda: ended_count() >= len(sessions))
    assert ended_count() == len(sessions)

    # Each violation logged once and posted once across the two replicas.
    def logged() -> Counter[str]:
        return Counter(line["key"] for r in replicas for line in r.alerts())

    wait_for(lambda: set(logged()) == stored_keys)
    assert set(logged().values()) == {1}
    wait_for(lambda: len(hook.accepted) >= len(stored_keys))
    assert Counter(r.body["violation_key"] for r in hook.accepted) == Counter(stored_keys)

    # The watch on B: every violation once, in feed order (cursors strictly increasing).
    seen = [next(watch) for _ in stored_keys]
    assert {a.violation.key for a in seen} == stored_keys
    positions = [feed_position(a.cursor) for a in seen]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    watch.cancel()
    channel.close()
    hook.stop()


@pytest.mark.postgres
def test_a_replica_that_dies_holding_claimed_webhook_alerts_leaves_them_to_the_other(
    start_sidecar, postgres_url
) -> None:  # type: ignore[no-untyped-def]
    hook = WebhookServer()
    dead = start_sidecar(
        postgres_url, alerts__webhook__url=hook.url, alerts__webhook__timeout_s=1, alerts__log__enabled=False
    )
    dead.service.store.claim_lease_s = 1.0  # held for an attempt (1 s) and the lease: 2 s
    claimed: list[str] = []
    gone = threading.Event()

    def hang(alert):  # type: ignore[no-untyped-def]
        # The replica took the row and then died: it never answers, never marks the row.
        claimed.append(alert.violation_key)
        gone.wait(30)
        return Attempt("retry", "the replica died")

    dead.service.webhook.send = hang
    agent = Agent(grpc_exporter(dead.grpc_endpoint), "inc-dead")
    agent.action("orphan", "t1", "tool_call", retryable=True)  # unbounded-retry
    agent.shutdown()
    wait_for(lambda: claimed)
    try:
        survivor = start_sidecar(postgres_url, alerts__webhook__url=hook.url, alerts__log__enabled=False)
        wait_for(lambda: hook.accepted, timeout=10)
        [posted] = hook.accepted
        assert posted.body["violation_key"] == claimed[0]
        assert posted.headers["idempotency-key"] == idempotency_key(posted.body)
        # The receiver has the POST before the survivor has its answer and counts it.
        wait_for(
            lambda: (
                survivor.metric(
                    "durable_sessions_alert_deliveries_total", channel="webhook", outcome="delivered"
                )
                == 1
            )
        )
    finally:
        gone.set()
        hook.stop()


@pytest.mark.postgres
def test_a_replica_that_dies_holding_claimed_log_alerts_leaves_them_to_the_other(
    start_sidecar, postgres_url
) -> None:  # type: ignore[no-untyped-def]
    # The README says of the outbox shared by replicas: "a replica that dies holding them
    # leaves them to another after the lease". The log channel has no delivery thread of
    # its own: a replica on a shared store looks for pending log rows after every idle
    # sweep, not only after committing a new violation of its own. The replica's death
    # between claiming its log rows and writing them is stood in for by replacing its
    # delivery (a SIGKILL cannot be timed to land there).
    dead = start_sidecar(postgres_url)
    survivor = start_sidecar(postgres_url)
    dead.service.store.claim_lease_s = 0.5
    store = dead.service.store

    def claim_then_die() -> int:
        # The replica claimed its pending log alerts, then died before writing them.
        return len(store.pending_alerts(LOG, time.time()))

    dead.service.log_alerts.deliver_pending = claim_then_die
    agent = Agent(grpc_exporter(dead.grpc_endpoint), "inc-dead")
    agent.action("orphan", "t1", "tool_call", retryable=True)  # unbounded-retry
    agent.shutdown()
    [violation] = survivor.session("orphan")["violations"]
    dead.stop()
    assert dead.alerts() == []

    # The survivor goes on working (commits without new violations) well past the lease.
    calm = Agent(grpc_exporter(survivor.grpc_endpoint), "inc-calm")
    deadline = time.monotonic() + 15  # the lease is 0.5 s: room for a loaded machine
    n = 0
    while time.monotonic() < deadline and not survivor.alerts():
        n += 1
        calm.action(f"calm-{n}", "u1", "user_prompt", result='{"x": 1}')
        assert survivor.session(f"calm-{n}")["violations"] == []  # acknowledged: committed
    calm.shutdown()
    assert [line["key"] for line in survivor.alerts()] == [violation["key"]]


@pytest.mark.postgres
def test_a_batch_that_outlives_its_claim_lease_is_sent_once_by_two_replicas(
    start_sidecar, postgres_url
) -> None:  # type: ignore[no-untyped-def]
    # A replica claims the alerts due a batch at a time and sends them one by one; with a
    # slow receiver the batch outlives the lease, and the other replica claims the rows
    # not sent yet. Each must still be POSTed once: by whichever replica holds it when
    # its turn comes. (A lease of 0.3 s and 0.15 s per POST stand in for 60 s and 100
    # alerts at 0.6 s each.)
    with WebhookServer(delay_s=0.15) as hook:
        replicas = [
            start_sidecar(
                postgres_url,
                alerts__webhook__url=hook.url,
                alerts__webhook__timeout_s=1,
                alerts__log__enabled=False,
            )
            for _ in range(2)
        ]
        for replica in replicas:
            replica.service.store.claim_lease_s = 0.3
        unkeyed = [span(n, "slow-batch", **{"agent.action.kind": "payment"}) for n in range(10)]
        grpc_export(replicas[0].grpc_endpoint, request_of(*unkeyed).SerializeToString())
        wait_for(lambda: len(hook.accepted) >= 10)
        time.sleep(1.5)  # a replica holding a stale claim would send its rows again by now
        sent = Counter(received.body["action_id"] for received in hook.accepted)
        assert sent == Counter({f"a{n}": 1 for n in range(10)})

        def delivered() -> float:
            return sum(
                replica.metric(
                    "durable_sessions_alert_deliveries_total", channel="webhook", outcome="delivered"
                )
                for replica in replicas
            )

        # Counted once the replica has the receiver's answer, after the receiver has the POST.
        wait_for(lambda: delivered() >= 10)
        assert delivered() == 10


def payments(sid: str, n: int) -> bytes:
    """Payment ``p{n}`` of session ``sid``, all payments of a session sharing one key."""
    attributes = {"agent.action.kind": "payment", "agent.action.idempotency_key": f"K-{sid}"}
    one = span(n, sid, **{"agent.action.id": f"p{n}", **attributes})
    one.trace_id = bytes([sum(sid.encode()) % 250 + 1] * 15 + [n])
    return request_of(one).SerializeToString()


@pytest.mark.postgres
def test_spans_of_one_session_committed_at_once_by_two_replicas_are_judged_once(
    start_sidecar, postgres_url, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    sessions = [f"pair-{n}" for n in range(6)]
    single = start_sidecar(tmp_path / "single.db")
    for sid in sessions:
        for n in range(4):
            grpc_export(single.grpc_endpoint, payments(sid, n))
    reference = {sid: single.session(sid) for sid in sessions}
    assert all(reference[sid]["violations"] for sid in sessions)

    replicas = [start_sidecar(postgres_url, evaluation__idle_s=30) for _ in range(2)]
    errors: list[BaseException] = []

    def send(endpoint: str, body: bytes) -> None:
        try:
            grpc_export(endpoint, body)
        except BaseException as error:
            errors.append(error)

    for pair in ((0, 1), (2, 3)):
        # Two spans of each session at the same moment, one to each replica.
        threads = [
            threading.Thread(target=send, args=(replicas[k].grpc_endpoint, payments(sid, n)))
            for sid in sessions
            for k, n in enumerate(pair)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
    assert not errors
    stored_keys: set[str] = set()
    for sid in sessions:
        views = [r.session(sid) for r in replicas]
        assert views[0] == views[1]
        assert views[0]["action_count"] == 4
        assert views[0]["verdict"] == reference[sid]["verdict"]
        assert Counter(v["rule"] for v in views[0]["violations"]) == Counter(
            v["rule"] for v in reference[sid]["violations"]
        ), sid
        stored_keys |= {v["key"] for v in views[0]["violations"]}
    wait_for(lambda: len([line for r in replicas for line in r.alerts()]) >= len(stored_keys))
    assert Counter(line["key"] for r in replicas for line in r.alerts()) == Counter(stored_keys)
