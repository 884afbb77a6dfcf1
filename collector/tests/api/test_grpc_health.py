"""``grpc.health.v1.Health`` on the sidecar's gRPC port, as probes and clients meet it.

Each test starts a real sidecar (:class:`Service` on free loopback ports, a SQLite store)
and calls it over real grpcio channels with grpcio-health-checking's own stubs: the
answer must be ``GET /healthz``'s, computed when asked (the store made unreadable while
the sidecar runs, and readable again), ``Check`` must stay open with a bearer token (a
kubelet probe sends none) while everything else still needs it, over TLS too, and health
watches must be bounded without starving Exports.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import wait_for
from durable_sessions_collector.api.health import HEALTH_CHECK_TIMEOUT_S, MAX_HEALTH_WATCHERS
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from durable_sessions_collector.otlp import grpc_receiver
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sidecar_clients import export_call, one_action_export
from stall_proxy import StallProxy
from tls_certs import make_cert

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
SESSION_SERVICE = "durable_sessions.v1.SessionService"
SERVICES = ("", TRACE_SERVICE, SESSION_SERVICE)
TOKEN = "health-" + uuid.uuid4().hex

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


# --- helpers ------------------------------------------------------------------------------


def check(stub: health_pb2_grpc.HealthStub, service: str = "", **options: Any) -> int:
    """The status ``Check`` answers for ``service``."""
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10, **options).status


def code_of(call: Any, *args: Any, **kwargs: Any) -> grpc.StatusCode:
    """The status code of a unary call, or of a stream read to its first message."""
    try:
        result = call(*args, **kwargs)
        if isinstance(result, grpc.Call) and hasattr(result, "__next__"):
            next(result)
            result.cancel()
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


# --- Check, List --------------------------------------------------------------------------


def test_check_and_list_answer_serving_for_the_server_and_both_services(sidecar) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in SERVICES:
            assert check(health, service) == SERVING, service
        listed = health.List(health_pb2.HealthListRequest(), timeout=10)
        assert {name: answer.status for name, answer in listed.statuses.items()} == dict.fromkeys(
            SERVICES, SERVING
        )
        # The protocol: a name the server does not know is NOT_FOUND, not a status.
        for unknown in ("nope", "durable_sessions.v1.sessionservice", "grpc.health.v1.Health"):
            with pytest.raises(grpc.RpcError) as caught:
                check(health, unknown)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND, unknown
            assert repr(unknown) in (caught.value.details() or "")
        # Bytes that are not a HealthCheckRequest are the client's error, as on the API.
        garbage = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert code_of(garbage, b"\xff\xff\xff\xff", timeout=10) == grpc.StatusCode.INVALID_ARGUMENT
    assert sidecar.get("/healthz") == (200, {"status": "ok"})


def test_a_writer_that_stopped_is_not_serving(sidecar) -> None:  # type: ignore[no-untyped-def]
    """The problems ``/healthz`` reports besides the store's (here: the writer thread is
    gone) make every service NOT_SERVING."""
    sidecar.service.pipeline.stop()
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert [check(health, service) for service in SERVICES] == [NOT_SERVING] * 3
    assert sidecar.get("/healthz")[0] == 503


# --- Check and Watch follow the store -----------------------------------------------------


def test_check_and_watch_follow_the_store_as_healthz_does(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The store file moved away while the sidecar runs (as if deleted: the sidecar then
    refuses to write, since writing on would lose the spans), then put back: Check says
    what /healthz says each time, and a Watch sends each change, without anyone setting a
    status."""
    db = tmp_path / "sessions.db"
    sidecar = start_sidecar(db)
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        overall = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
        sessions = health.Watch(health_pb2.HealthCheckRequest(service=SESSION_SERVICE), timeout=120)
        unknown = health.Watch(health_pb2.HealthCheckRequest(service="nope"), timeout=120)
        assert next(overall).status == SERVING
        assert next(sessions).status == SERVING
        # The protocol: an unknown name is SERVICE_UNKNOWN, and the stream stays open.
        assert next(unknown).status == SERVICE_UNKNOWN

        os.rename(db, tmp_path / "moved-away.db")
        assert next(overall).status == NOT_SERVING
        assert next(sessions).status == NOT_SERVING
        assert [check(health, service) for service in SERVICES] == [NOT_SERVING] * 3
        assert sidecar.get("/healthz")[0] == 503

        os.rename(tmp_path / "moved-away.db", db)
        assert next(overall).status == SERVING
        assert next(sessions).status == SERVING
        assert [check(health, service) for service in SERVICES] == [SERVING] * 3
        assert sidecar.get("/healthz") == (200, {"status": "ok"})

        assert unknown.is_active() and not unknown.done()
        for call in (overall, sessions, unknown):
            call.cancel()
    finally:
        channel.close()


@pytest.mark.postgres
def test_a_store_that_does_not_answer_is_unhealthy_within_the_probe_timeout(
    start_sidecar, postgres_url
) -> None:  # type: ignore[no-untyped-def]
    """A PostgreSQL that stops answering (a network partition): its pooled read connection
    waits for ever. Each /healthz and Check waited on it, so a probe timed out with no
    answer and no reason, and every probe left a thread of the port (and a read
    connection) waiting, until Exports found no gRPC worker free. Now a probe is answered
    unhealthy within HEALTH_CHECK_TIMEOUT_S, saying why, by one check that goes on alone."""
    proxy, through_proxy = StallProxy.to_url(postgres_url)
    try:
        sidecar = start_sidecar(through_proxy)
        assert sidecar.get("/healthz") == (200, {"status": "ok"})  # its read connection stays pooled
        proxy.stall()
        status, document = sidecar.get("/healthz")
        assert status == 503, document
        assert f"did not answer within {HEALTH_CHECK_TIMEOUT_S:g} s" in document["reason"], document
        with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert [check(health, service) for service in SERVICES] == [NOT_SERVING] * 3
    finally:
        proxy.close()  # the store's connections fail now: the sidecar stops at once


def test_a_watch_ends_with_not_serving_when_the_sidecar_stops(sidecar) -> None:  # type: ignore[no-untyped-def]
    """A client watching learns that the sidecar is going away, and its stream ends
    cleanly (OK) when the sidecar stops, not cancelled after the port's grace period."""
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(watch).status == SERVING
        sidecar.stop()
        assert [answer.status for answer in watch] == [NOT_SERVING]
        assert watch.code() == grpc.StatusCode.OK


# --- the bearer token, TLS --------------------------------------------------------------------


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_with_a_token_check_alone_is_open_and_tells_only_the_status(start_sidecar, tmp_path, tls) -> None:  # type: ignore[no-untyped-def]
    """Like GET /healthz: Check answers without the token, or with a wrong one (a kubelet
    `grpc:` probe sends none), and tells the status alone; Watch, List and every other
    method still need the token."""
    settings: dict[str, Any] = {"auth__token": TOKEN}
    if tls:
        ca, cert, key = make_cert(tmp_path)
        settings.update(tls__cert_file=str(cert), tls__key_file=str(key))
    sidecar = start_sidecar(**settings)
    if tls:
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes())
        channel = grpc.secure_channel(sidecar.grpc_endpoint, credentials)
    else:
        channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    good = (("authorization", f"Bearer {TOKEN}"),)
    wrong = (("authorization", f"Bearer {TOKEN}x"),)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        api = pb_grpc.SessionServiceStub(channel)
        for metadata in ((), wrong, good):
            assert check(health, "", metadata=metadata) == SERVING, metadata
            assert check(health, TRACE_SERVICE, metadata=metadata) == SERVING, metadata
            assert code_of(
                health.Check, health_pb2.HealthCheckRequest(service="nope"), metadata=metadata
            ) == (grpc.StatusCode.NOT_FOUND)

        watch_request, list_request = health_pb2.HealthCheckRequest(), health_pb2.HealthListRequest()
        for metadata in ((), wrong):
            for call, request in (
                (health.Watch, watch_request),
                (health.List, list_request),
                (api.ListSessions, pb.ListSessionsRequest()),
                (export_call(channel), one_action_export(1, "denied")),
            ):
                assert (
                    code_of(call, request, metadata=metadata, timeout=10) == grpc.StatusCode.UNAUTHENTICATED
                )
        watch = health.Watch(watch_request, metadata=good, timeout=30)
        assert next(watch).status == SERVING
        watch.cancel()
        assert health.List(list_request, metadata=good, timeout=10).statuses[""].status == SERVING
        assert api.ListSessions(pb.ListSessionsRequest(), metadata=good, timeout=10).sessions == []

        # Unhealthy: the open answer is the status alone, no reason (it names the store).
        sidecar.service.pipeline.stop()
        answer, call = health.Check.with_call(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer == health_pb2.HealthCheckResponse(status=NOT_SERVING)
        assert not call.details()
        assert not [key for key, _ in call.trailing_metadata() or () if not key.startswith("grpc-")]
    finally:
        channel.close()


# --- watch slots, threads ------------------------------------------------------------------


def test_a_cancelled_watch_gives_its_slot_back_at_once(sidecar) -> None:  # type: ignore[no-untyped-def]
    """Beyond the cap a watch is RESOURCE_EXHAUSTED; a cancelled one frees its slot (and
    its thread) at once, not at its next look at the health (made a minute away here)."""
    sidecar.service.health.poll_s = 60.0
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watches = [
            health.Watch(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(MAX_HEALTH_WATCHERS)
        ]
        assert [next(watch).status for watch in watches] == [SERVING] * MAX_HEALTH_WATCHERS
        assert code_of(health.Watch, health_pb2.HealthCheckRequest(), timeout=10) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        watches[0].cancel()
        started = time.monotonic()

        def a_slot() -> Any:
            call = health.Watch(health_pb2.HealthCheckRequest(), timeout=120)
            try:
                return next(call), call
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                return None

        answer, again = wait_for(a_slot, timeout=20, interval=0.2)
        assert answer.status == SERVING
        assert time.monotonic() - started < 20
        for watch in [*watches[1:], again]:
            watch.cancel()


def test_health_watches_are_bounded_and_do_not_starve_exports(start_sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every health watch holds a worker thread of the port, so the port has one for each
    of them besides those of Exports and WatchAlerts streams. Here the port has a single
    spare thread, a write pipeline of 3 (queue 2, batch 1), and every watch slot is taken:
    one more health watch is refused, Exports are still stored, and while the store is
    locked the Exports the queue cannot take are answered UNAVAILABLE at once, and Check
    and the API still answer. Without the health watches counted, the watches alone took
    every thread."""
    monkeypatch.setattr(grpc_receiver, "SPARE_WORKERS", 1)
    sidecar = start_sidecar(pipeline__queue_size=2, pipeline__max_batch=1)
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    health = health_pb2_grpc.HealthStub(channel)
    api = pb_grpc.SessionServiceStub(channel)
    export = export_call(channel)
    alert_watches = [api.WatchAlerts(pb.WatchAlertsRequest(), timeout=120) for _ in range(8)]
    health_watches = [
        health.Watch(health_pb2.HealthCheckRequest(), timeout=120) for _ in range(MAX_HEALTH_WATCHERS)
    ]
    try:
        for watch in alert_watches:
            watch.initial_metadata()
        assert [next(watch).status for watch in health_watches] == [SERVING] * MAX_HEALTH_WATCHERS
        assert code_of(health.Watch, health_pb2.HealthCheckRequest(), timeout=20) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert not export(one_action_export(0, "while-watched"), timeout=20).HasField("partial_success")

        lock = sqlite3.connect(sidecar.service.store.path, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        try:
            calls = [export.future(one_action_export(n, f"locked-{n}"), timeout=90) for n in range(1, 21)]
            refused = wait_for(lambda: [c for c in calls if c.done()], timeout=20)
            assert check(health) == SERVING  # the store is still readable
            assert len(api.ListSessions(pb.ListSessionsRequest(), timeout=10).sessions) == 1
            for call in refused:
                assert call.code() == grpc.StatusCode.UNAVAILABLE, call.details()
                assert "write queue full" in call.details()
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        codes = Counter(call.code() for call in calls)
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
        assert codes[grpc.StatusCode.OK] >= 1, codes
        stored = len(sidecar.get("/api/sessions?limit=1000")[1]["sessions"])
        assert stored == 1 + codes[grpc.StatusCode.OK]
    finally:
        for watch in [*alert_watches, *health_watches]:
            watch.cancel()
        channel.close()
