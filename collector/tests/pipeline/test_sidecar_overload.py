"""Overload: with a tiny write queue a burst is answered 503 / UNAVAILABLE with retry
hints (never dropped silently), in the request's own encoding (OTLP/protobuf or OTLP/JSON),
and the real SDK exporters' retries deliver everything."""

from __future__ import annotations

import functools
import http.client
import json
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from conftest import Sidecar, wait_for
from google.protobuf import json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sidecar_clients import export_call, grpc_exporter, http_exporter, otlp_json

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
CLIENTS = 12
SPANS_PER_BATCH = 300


def batches(tag: str, count: int = CLIENTS, size: int = SPANS_PER_BATCH) -> list[list]:  # type: ignore[type-arg]
    """``count`` batches of finished SDK spans, one session per batch."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.instance.id": f"inc-{tag}"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("overload")
    result = []
    for b in range(count):
        for n in range(size):
            attributes = {
                "session.id": f"{tag}-{b}",
                "agent.action.id": f"a{n}",
                "agent.action.kind": "tool_call",
            }
            tracer.start_span("step", attributes=attributes).end()
        result.append(list(memory.get_finished_spans()))
        memory.clear()
    provider.shutdown()
    return result


def burst(function, items) -> list:  # type: ignore[no-untyped-def,type-arg]
    barrier = threading.Barrier(len(items))

    def run(item):  # type: ignore[no-untyped-def]
        barrier.wait()
        return function(item)

    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(run, items))


def post_traces(
    sidecar: Sidecar, body: bytes, content_type: str = PROTOBUF, *, timeout: float
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One POST of ``body`` to ``/v1/traces`` on a connection of its own: status, headers, body."""
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=timeout)
    try:
        connection.request("POST", "/v1/traces", body=body, headers={"Content-Type": content_type})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def stored_actions(path) -> int:  # type: ignore[no-untyped-def]
    with sqlite3.connect(path) as db:
        return db.execute("SELECT COUNT(*) FROM actions").fetchone()[0]


def test_burst_gets_retry_hints_on_both_transports(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(pipeline__queue_size=1, pipeline__max_batch=1, pipeline__retry_after_s=2)
    bodies = [encode_spans(batch).SerializeToString() for batch in batches("raw")]
    post = functools.partial(post_traces, sidecar, timeout=30)

    answers = burst(post, bodies)
    refused = [a for a in answers if a[0] == 503]
    accepted = [a for a in answers if a[0] == 200]
    assert refused and accepted and len(refused) + len(accepted) == CLIENTS
    for _, headers, body in refused:
        # Spread between retry_after_s and twice that, in whole seconds (see the spread test).
        assert headers["Content-Type"] == PROTOBUF and headers["Retry-After"] in ("2", "3", "4")
        status = status_pb2.Status.FromString(body)
        assert "write queue full" in status.message
        retry_info = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(retry_info)
        assert retry_info.retry_delay.ToSeconds() == int(headers["Retry-After"])
    for _, _, body in accepted:
        assert not ExportTraceServiceResponse.FromString(body).HasField("partial_success")
    # Nothing refused was kept, nothing accepted was lost.
    assert stored_actions(tmp_path / "sessions.db") == len(accepted) * SPANS_PER_BATCH

    # OTLP/JSON in an overload that lasts: while another connection holds the database's
    # write lock the writer cannot commit, so it holds one request and the queue one more;
    # of three concurrent JSON requests at least one finds the queue full. Its 503 is in the
    # request's encoding (the Collector's otlphttp exporter decodes an answer by its exact
    # Content-Type), a JSON google.rpc.Status with RetryInfo, and a Retry-After of whole
    # seconds (the exporter reads it with strconv.Atoi).
    json_bodies = [otlp_json(batch) for batch in batches("raw-json", count=3)]
    blocker = sqlite3.connect(tmp_path / "sessions.db", isolation_level=None, timeout=30)
    blocker.execute("BEGIN IMMEDIATE")
    with ThreadPoolExecutor(len(json_bodies)) as pool:
        try:
            pending = [pool.submit(post, body, JSON) for body in json_bodies]
            # Nothing can be committed yet, so the first answer is a refusal.
            wait_for(lambda: any(future.done() for future in pending), timeout=30)
        finally:
            blocker.close()  # ends the transaction: the writer commits what it holds
        json_answers = [future.result() for future in pending]
    json_refused = [a for a in json_answers if a[0] == 503]
    json_accepted = [a for a in json_answers if a[0] == 200]
    assert json_refused and len(json_refused) + len(json_accepted) == len(json_bodies)
    for _, headers, body in json_refused:
        assert headers["Content-Type"] == JSON
        assert headers["Retry-After"] in ("2", "3", "4")
        status = json_format.Parse(body, status_pb2.Status())  # strictly a Status, no other keys
        assert status.code == code_pb2.UNAVAILABLE and "write queue full" in status.message
        [detail] = status.details
        retry_info = error_details_pb2.RetryInfo()
        assert detail.Unpack(retry_info) and retry_info.retry_delay.ToSeconds() == int(headers["Retry-After"])
    for _, headers, body in json_accepted:
        assert headers["Content-Type"] == JSON and json.loads(body) == {}
    assert stored_actions(tmp_path / "sessions.db") == (len(accepted) + len(json_accepted)) * SPANS_PER_BATCH
    assert sidecar.metric("durable_sessions_spans_rejected_total", transport="http", reason="overload") == (
        (len(refused) + len(json_refused)) * SPANS_PER_BATCH
    )

    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    call = export_call(channel)
    grpc_bodies = [encode_spans(batch).SerializeToString() for batch in batches("raw-grpc")]

    def export(body: bytes):  # type: ignore[no-untyped-def]
        try:
            call(body, timeout=30)
            return None
        except grpc.RpcError as error:
            return error

    errors = [e for e in burst(export, grpc_bodies) if e is not None]
    channel.close()
    assert errors and len(errors) < CLIENTS
    for error in errors:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        trailers = dict(error.trailing_metadata())
        status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
        retry_info = error_details_pb2.RetryInfo()
        assert (
            status.details[0].Unpack(retry_info)
            and 2 <= retry_info.retry_delay.ToTimedelta().total_seconds() <= 4
        )
        # The same delay where the Python SDK reads it.
        assert error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"]) == retry_info
    assert sidecar.metric("durable_sessions_spans_rejected_total", transport="grpc", reason="overload") == (
        len(errors) * SPANS_PER_BATCH
    )
    assert sidecar.get("/healthz")[0] == 200


def test_sdk_exporters_retry_until_everything_is_delivered(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(pipeline__queue_size=1, pipeline__max_batch=1, pipeline__retry_after_s=1)
    work = batches("sdk")
    exporters = [
        grpc_exporter(sidecar.grpc_endpoint, timeout=30)
        if n % 2
        else http_exporter(sidecar.http_url, timeout=30)
        for n in range(CLIENTS)
    ]
    results = burst(lambda pair: pair[0].export(pair[1]), list(zip(exporters, work, strict=True)))
    assert results == [SpanExportResult.SUCCESS] * CLIENTS
    refused = sum(
        sidecar.metric("durable_sessions_export_requests_total", transport=t, outcome="unavailable")
        for t in ("grpc", "http")
    )
    assert refused > 0  # the queue really overflowed, and the retries made up for it
    assert stored_actions(tmp_path / "sessions.db") == CLIENTS * SPANS_PER_BATCH
    for exporter in exporters:
        exporter.shutdown()


def test_clients_refused_together_are_told_different_delays(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Clients honour RetryInfo and Retry-After exactly: told one delay, a burst of them
    # would come back at one instant, find the queue full again, and use up their attempts
    # together (the SDK exporters give up after 6). Each refusal gets its own delay.
    sidecar = start_sidecar(pipeline__queue_size=1, pipeline__max_batch=1, pipeline__retry_after_s=1)
    body = encode_spans(batches("spread", count=1)[0]).SerializeToString()
    blocker = sqlite3.connect(tmp_path / "sessions.db", isolation_level=None, timeout=30)
    blocker.execute("BEGIN IMMEDIATE")  # nothing commits: the queue stays full
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    call = export_call(channel)
    try:
        held = []  # the request the writer is stuck on, and those the queue holds
        while len(held) < 10:
            future = call.future(body, timeout=30)
            try:
                future.exception(timeout=2)  # answered while nothing commits: refused
            except grpc.FutureTimeoutError:
                held.append(future)
                continue
            assert future.code() == grpc.StatusCode.UNAVAILABLE  # the queue is full from here on
            break
        assert 1 <= len(held) < 10
        grpc_delays, http_delays = [], []
        for _ in range(20):
            try:
                call(body, timeout=10)
                raise AssertionError("accepted while the queue was full")
            except grpc.RpcError as refused:
                assert refused.code() == grpc.StatusCode.UNAVAILABLE
                trailers = dict(refused.trailing_metadata())
                retry = error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
                grpc_delays.append(retry.retry_delay.ToTimedelta().total_seconds())
            connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=10)
            connection.request("POST", "/v1/traces", body=body, headers={"Content-Type": PROTOBUF})
            response = connection.getresponse()
            response.read()
            connection.close()
            assert response.status == 503
            http_delays.append(response.headers["Retry-After"])
    finally:
        blocker.close()
    assert all(1 <= delay <= 2 for delay in grpc_delays) and len(set(grpc_delays)) > 10
    assert set(http_delays) == {"1", "2"}
    for future in held:
        future.result()
    channel.close()


def test_a_locked_store_is_answered_unavailable_before_an_sdk_exporter_gives_up(
    start_sidecar, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    # The OpenTelemetry SDK exporters give up on an Export after 10 s. While another process
    # held the store's write lock, the sidecar answered only when pipeline.ack_timeout_s,
    # then 30 s, ran out: every client had gone by then, none was told to retry. With the
    # default of 5 s it is answered UNAVAILABLE / 503 with a retry delay in time, and an
    # Export whose records commit once the lock is gone is stored once when retried.
    sidecar = start_sidecar()  # pipeline.ack_timeout_s at its default
    raw_http, raw_grpc, sdk_http, sdk_grpc = batches("locked", count=4, size=3)
    http_body, grpc_body = (encode_spans(batch).SerializeToString() for batch in (raw_http, raw_grpc))
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    call = export_call(channel)
    post = functools.partial(post_traces, sidecar, timeout=60)

    def timed(function, *args):  # type: ignore[no-untyped-def]
        started = time.monotonic()
        try:
            return function(*args), time.monotonic() - started
        except grpc.RpcError as error:
            return error, time.monotonic() - started

    exporters = [
        http_exporter(sidecar.http_url, timeout=10),
        grpc_exporter(sidecar.grpc_endpoint, timeout=10),
    ]
    blocker = sqlite3.connect(tmp_path / "sessions.db", isolation_level=None, timeout=30)
    blocker.execute("BEGIN EXCLUSIVE")
    with ThreadPoolExecutor(4) as pool:
        try:
            http_answer = pool.submit(timed, post, http_body)
            grpc_answer = pool.submit(timed, call, grpc_body, 60)
            sdk_results = [
                pool.submit(e.export, b) for e, b in zip(exporters, (sdk_http, sdk_grpc), strict=True)
            ]
            (status, headers, body), http_took = http_answer.result(timeout=60)
            error, grpc_took = grpc_answer.result(timeout=60)
        finally:
            blocker.close()  # ends the transaction: the writer commits what it holds
        assert [result.result(timeout=30) for result in sdk_results] == [SpanExportResult.SUCCESS] * 2
    # Answered when the ack timeout ran out, not at once (the queue was not full).
    assert 4.5 <= http_took < 10 and 4.5 <= grpc_took < 10, (http_took, grpc_took)
    assert status == 503 and headers["Retry-After"] in ("1", "2")
    message = "records not committed within 5 s; retry later (duplicates are dropped)"
    answer = status_pb2.Status.FromString(body)
    assert (answer.code, answer.message) == (code_pb2.UNAVAILABLE, message)
    assert answer.details[0].Unpack(error_details_pb2.RetryInfo())
    assert isinstance(error, grpc.RpcError) and (error.code(), error.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        message,
    )
    assert "google.rpc.retryinfo-bin" in dict(error.trailing_metadata())
    # The refused Exports were committed after all once the lock was gone; sent again, as
    # a client told to retry does, they are answered OK and stored once.
    wait_for(lambda: stored_actions(tmp_path / "sessions.db") == 4 * 3, timeout=30)
    duplicates = sidecar.metric("durable_sessions_spans_duplicate_total")
    assert post(http_body)[0] == 200
    call(grpc_body, timeout=30)
    channel.close()
    assert stored_actions(tmp_path / "sessions.db") == 4 * 3
    assert sidecar.metric("durable_sessions_spans_duplicate_total") == duplicates + 2 * 3
    for exporter in exporters:
        exporter.shutdown()
