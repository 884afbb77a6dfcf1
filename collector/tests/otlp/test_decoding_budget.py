"""The decoding budget (``receivers.max_decoding_bytes``, ``otlp/budget.py``), on real
ports with real clients: a request heavier than the budget is decoded alone; requests
past it are refused with the write queue's retryable answers (503 + ``Retry-After``,
``UNAVAILABLE`` + ``RetryInfo``) and counted, while those that fit are stored; the
budget is given back after every error; the SDK exporters' retries deliver everything.

Where a test needs a request "being decoded" for as long as it looks, it holds the
sidecar's own budget (``Service.budget``) as a decoding request holds it: decoding takes
milliseconds, too short to race against."""

from __future__ import annotations

import gzip
import http.client
import json
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Sidecar, wait_for
from durable_sessions_collector.config import ConfigError, load
from durable_sessions_collector.otlp import decode
from durable_sessions_collector.otlp.budget import (
    JSON_FACTOR,
    REFERENCE_FACTOR,
    TURN_RETRY_AFTERS,
    WIRE_FACTOR,
    DecodingBudget,
    DecodingRefused,
)
from google.protobuf import json_format
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sidecar_clients import export_call, grpc_exporter, http_exporter, otlp_json

from tests.support.senders import require_native

JSON = "application/json"
PROTOBUF = "application/x-protobuf"
REFUSAL = "decoding memory budget in use"


def action_spans(tag: str, count: int, foreign: int = 0) -> list[ReadableSpan]:
    """``count`` finished SDK action spans of session ``tag``, each with ``foreign``
    short attributes the mapping does not read (they make a body heavy to decode)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.instance.id": f"inc-{tag}"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("budget")
    for n in range(count):
        attributes: dict[str, Any] = {
            "session.id": tag,
            "agent.action.id": f"a{n}",
            "agent.action.kind": "tool_call",
        }
        attributes.update({f"app.k{i}": i for i in range(foreign)})
        tracer.start_span("step", attributes=attributes).end()
    provider.shutdown()
    return list(memory.get_finished_spans())


def protobuf(spans: list[ReadableSpan]) -> bytes:
    return encode_spans(spans).SerializeToString()  # type: ignore[no-any-return]


def post(
    sidecar: Sidecar, body: bytes, content_type: str = PROTOBUF, **headers: str
) -> tuple[int, Any, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=60)
    try:
        connection.request("POST", "/v1/traces", body=body, headers={"Content-Type": content_type, **headers})
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def grpc_export(sidecar: Sidecar, body: bytes) -> grpc.RpcError | None:
    """Export ``body`` over gRPC: None when it is answered OK, else the error."""
    with grpc.insecure_channel(sidecar.grpc_endpoint) as channel:
        try:
            export_call(channel)(body, timeout=30)
        except grpc.RpcError as error:
            return error
    return None


def stored_actions(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT COUNT(*) FROM actions").fetchone()[0]  # type: ignore[no-any-return]


def refused(sidecar: Sidecar, transport: str) -> float:
    return sidecar.metric("durable_sessions_decoding_refused_total", transport=transport)


@contextmanager
def decoding(sidecar: Sidecar, weight: int) -> Iterator[None]:
    """A request of ``weight`` bytes being decoded, for as long as the block lasts."""
    with sidecar.service.budget.reserved(weight // JSON_FACTOR, json=True):
        yield


def assert_http_refusal(answer: tuple[int, Any, bytes], content_type: str, retry_after_s: int) -> None:
    """A 503 as a full write queue answers it: ``Retry-After`` whole seconds spread from
    ``retry_after_s`` to twice that, and the same delay in the Status's ``RetryInfo``, in
    the request's encoding."""
    status, headers, body = answer
    assert status == 503, (status, body)
    assert headers["Content-Type"] == content_type
    delay = int(headers["Retry-After"])
    assert retry_after_s <= delay <= 2 * retry_after_s
    message = (
        json_format.Parse(body, status_pb2.Status())
        if content_type == JSON
        else status_pb2.Status.FromString(body)
    )
    assert message.code == code_pb2.UNAVAILABLE and REFUSAL in message.message, message
    retry_info = error_details_pb2.RetryInfo()
    assert message.details[0].Unpack(retry_info) and retry_info.retry_delay.ToSeconds() == delay


def assert_grpc_refusal(error: grpc.RpcError | None, retry_after_s: int) -> None:
    """``UNAVAILABLE`` with ``RetryInfo`` where Go clients and the Python SDK read it."""
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert REFUSAL in error.details()
    trailers = dict(error.trailing_metadata())
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    retry_info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(retry_info)
    assert retry_after_s <= retry_info.retry_delay.ToTimedelta().total_seconds() <= 2 * retry_after_s
    assert error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"]) == retry_info


def test_a_request_heavier_than_the_budget_is_decoded_alone(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(receivers__max_decoding_bytes=1024)
    assert sidecar.metric("durable_sessions_decoding_bytes_limit") == 1024
    json_body = otlp_json(action_spans("alone-json", 100))
    protobuf_body = protobuf(action_spans("alone-protobuf", 100))
    assert len(json_body) * JSON_FACTOR > 1024 and len(protobuf_body) > 1024
    # While another request is being decoded, none of them fits beside it...
    with decoding(sidecar, 100):
        assert post(sidecar, json_body, JSON)[0] == 503
        assert post(sidecar, protobuf_body)[0] == 503
        assert_grpc_refusal(grpc_export(sidecar, protobuf_body), 1)
        assert sidecar.metric("durable_sessions_decoding_bytes") > 0
    assert refused(sidecar, "http") == 2 and refused(sidecar, "grpc") == 1
    # ...and alone, each is decoded and stored, however much heavier than the budget.
    assert post(sidecar, json_body, JSON)[0] == 200
    assert post(sidecar, protobuf_body)[0] == 200
    assert grpc_export(sidecar, protobuf(action_spans("alone-grpc", 100))) is None
    assert stored_actions(tmp_path / "sessions.db") == 300
    assert sidecar.metric("durable_sessions_decoding_bytes") == 0


def test_requests_past_the_budget_get_the_queue_full_answers_and_those_that_fit_are_stored(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    budget = 8 * 1024 * 1024
    sidecar = start_sidecar(receivers__max_decoding_bytes=budget, pipeline__retry_after_s=2)
    json_body = otlp_json(action_spans("past-json", 300))
    protobuf_body = protobuf(action_spans("past-protobuf", 3000))
    grpc_body = protobuf(action_spans("past-grpc", 3000))
    small = protobuf(action_spans("small", 3))
    # 6 MiB of the budget is held: the ~6 MiB each of these weighs does not fit beside it,
    # a gzipped JSON body either (weighed decompressed), while a small request does.
    held = 6 * 1024 * 1024
    assert all(
        held + sidecar.service.budget.weight(len(b), json=False) > budget for b in (protobuf_body, grpc_body)
    )
    assert (
        held + len(json_body) * JSON_FACTOR > budget
        and len(gzip.compress(json_body)) * JSON_FACTOR < budget - held
    )
    with decoding(sidecar, held):
        assert sidecar.metric("durable_sessions_decoding_bytes") == held // JSON_FACTOR * JSON_FACTOR
        assert_http_refusal(post(sidecar, json_body, JSON), JSON, 2)
        assert_http_refusal(
            post(sidecar, gzip.compress(json_body), JSON, **{"Content-Encoding": "gzip"}), JSON, 2
        )
        assert_http_refusal(post(sidecar, protobuf_body), PROTOBUF, 2)
        assert_grpc_refusal(grpc_export(sidecar, grpc_body), 2)
        assert post(sidecar, small)[0] == 200
        assert grpc_export(sidecar, small) is None  # a duplicate of it, stored once
    assert (refused(sidecar, "http"), refused(sidecar, "grpc")) == (3, 1)
    requests = "durable_sessions_export_requests_total"
    assert sidecar.metric(requests, transport="http", outcome="unavailable") == 3
    assert sidecar.metric(requests, transport="grpc", outcome="unavailable") == 1
    # Nothing of a refused request was received (its spans were never decoded).
    assert sidecar.metric("durable_sessions_spans_received_total", transport="http") == 3
    assert stored_actions(tmp_path / "sessions.db") == 3
    # Sent again once the budget has room, as their clients would, they are stored.
    assert post(sidecar, json_body, JSON)[0] == 200
    assert post(sidecar, protobuf_body)[0] == 200
    assert grpc_export(sidecar, grpc_body) is None
    assert stored_actions(tmp_path / "sessions.db") == 3 + 300 + 3000 + 3000


def test_concurrent_json_exports_past_the_budget_are_refused_while_the_others_are_stored(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    clients = 6
    bodies = [otlp_json(action_spans(f"burst-{n}", 2000, foreign=10)) for n in range(clients)]
    # Room for one of these at a time (~3 MiB of JSON each, weighed at 22 times that).
    largest = max(len(body) for body in bodies) * JSON_FACTOR
    sidecar = start_sidecar(receivers__max_decoding_bytes=largest + largest // 2)
    barrier = threading.Barrier(clients)

    def send(body: bytes) -> tuple[int, Any, bytes]:
        barrier.wait()
        return post(sidecar, body, JSON)

    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(send, bodies))
    accepted = [n for n, answer in enumerate(answers) if answer[0] == 200]
    refusals = [answer for answer in answers if answer[0] != 200]
    assert accepted and refusals, [answer[0] for answer in answers]
    for answer in refusals:
        assert_http_refusal(answer, JSON, 1)
    assert refused(sidecar, "http") == len(refusals)
    assert stored_actions(tmp_path / "sessions.db") == len(accepted) * 2000
    assert sidecar.metric("durable_sessions_decoding_bytes") == 0
    for n, answer in enumerate(answers):  # the clients' retries
        if answer[0] != 200:
            assert post(sidecar, bodies[n], JSON)[0] == 200
    assert stored_actions(tmp_path / "sessions.db") == clients * 2000


def test_the_budget_is_given_back_after_every_error(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    good = otlp_json(action_spans("after-errors", 200))
    # Room for exactly the good request: any weight not given back refuses it.
    sidecar = start_sidecar(
        receivers__max_decoding_bytes=len(good) * JSON_FACTOR, receivers__max_request_bytes=2 * len(good)
    )
    legacy = json.dumps({"resourceSpans": [{"instrumentationLibrarySpans": []}]}).encode()
    bad_id = json.loads(good)
    bad_id["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = "zz"
    for body, content_type, status in (
        (b'{"resourceSpans": [', JSON, 400),  # not JSON
        (b"[]", JSON, 400),  # not an object
        (legacy, JSON, 400),
        (b"\xff" * 64, PROTOBUF, 400),  # not protobuf
        (b"x" * (3 * len(good)), JSON, 413),  # over max_request_bytes
        (json.dumps(bad_id).encode(), JSON, 200),  # a partial success
    ):
        assert post(sidecar, body, content_type)[0] == status, body[:40]
        assert sidecar.metric("durable_sessions_decoding_bytes") == 0
    error = grpc_export(sidecar, b"\xff" * 64)
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = grpc_export(sidecar, b"\x0a" * (3 * len(good)))  # over the receive limit
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sidecar.metric("durable_sessions_decoding_bytes") == 0
    assert post(sidecar, good, JSON)[0] == 200
    assert refused(sidecar, "http") == refused(sidecar, "grpc") == 0


def test_sdk_exporters_retries_deliver_everything_refused_for_memory(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(receivers__max_decoding_bytes=64 * 1024, pipeline__retry_after_s=1)
    work = [action_spans(f"sdk-{n}", 300) for n in range(4)]
    exporters = [
        grpc_exporter(sidecar.grpc_endpoint, timeout=30)
        if n % 2
        else http_exporter(sidecar.http_url, timeout=30)
        for n in range(4)
    ]
    with ThreadPoolExecutor(4) as pool:
        with decoding(sidecar, 64 * 1024):  # a long decode: every Export is refused meanwhile
            results = [pool.submit(e.export, spans) for e, spans in zip(exporters, work, strict=True)]
            wait_for(lambda: refused(sidecar, "http") >= 2 and refused(sidecar, "grpc") >= 2, timeout=30)
        assert [result.result(timeout=60) for result in results] == [SpanExportResult.SUCCESS] * 4
    assert stored_actions(tmp_path / "sessions.db") == 4 * 300
    for exporter in exporters:
        exporter.shutdown()


@pytest.mark.parametrize(
    ("value", "shown"), [("0", "0"), ("-1", "'-1'"), ("1.5", "'1.5'"), ("lots", "'lots'")]
)
def test_the_budget_is_a_positive_number_of_bytes(value: str, shown: str) -> None:
    with pytest.raises(ConfigError) as error:
        load(None, env={"DURABLE_SESSIONS_MAX_DECODING_BYTES": value})
    assert str(error.value) == (
        f"receivers.max_decoding_bytes: expected a positive integer, got {shown} "
        "(from DURABLE_SESSIONS_MAX_DECODING_BYTES)"
    )
    config = load(None, env={}, overrides={"receivers_max_decoding_bytes": "2048"})
    assert config.receivers_max_decoding_bytes == 2048
    assert config.sources["receivers.max_decoding_bytes"] == "--max-decoding-bytes"


def test_a_request_wire_declines_is_weighed_again_for_the_reference_path(
    start_sidecar, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """``_wire`` leaves anything unusual (here an unknown field) to protobuf's parser and a
    Python walk, which take up to 9 times the body where ``_wire`` takes 5: weighed as
    ``_wire`` would, a request it declines could pass the budget by 80%."""
    require_native("_wire", package="durable_sessions_collector.otlp")
    plain = protobuf(action_spans("plain-a", 200))
    declined = protobuf(action_spans("unkno-a", 200)) + b"\xf8\x01\x07"  # field 31, unknown
    assert decode.wire_span_parts(declined) is None and decode.wire_span_parts(plain) is not None
    assert len(plain) + 3 == len(declined)
    held = 22 * 1000
    # Room beside what is held for either at _wire's weight, not at the reference path's.
    budget = held + WIRE_FACTOR * len(declined) + len(declined)
    assert held + REFERENCE_FACTOR * len(declined) > budget
    sidecar = start_sidecar(receivers__max_decoding_bytes=budget, pipeline__retry_after_s=1)
    with decoding(sidecar, held):
        assert post(sidecar, plain)[0] == 200
        assert_http_refusal(post(sidecar, declined), PROTOBUF, 1)
        assert sidecar.metric("durable_sessions_decoding_bytes") == held
    assert refused(sidecar, "http") == 1
    assert post(sidecar, declined)[0] == 200  # alone, it is decoded whatever it weighs
    assert stored_actions(tmp_path / "sessions.db") == 400
    assert sidecar.metric("durable_sessions_decoding_bytes") == 0


def test_a_heavy_request_refused_gets_its_turn_before_lighter_ones(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Under steady traffic a request that fits only alone was refused until its client
    gave up: the budget was never empty when it came back. Refused, it now gets a turn:
    lighter requests are refused while they would not leave it room, and it goes in when
    it comes back."""
    heavy = otlp_json(action_spans("heavy", 100))
    light = protobuf(action_spans("light", 2))
    budget = 64 * 1024
    sidecar = start_sidecar(receivers__max_decoding_bytes=budget, pipeline__retry_after_s=1)
    assert len(heavy) * JSON_FACTOR > budget
    with decoding(sidecar, 1000):  # the steady traffic
        assert_http_refusal(post(sidecar, heavy, JSON), JSON, 1)
        refusal = post(sidecar, light)
        assert_http_refusal(refusal, PROTOBUF, 1)
        assert b"waits its turn" in refusal[2]
    assert post(sidecar, light)[0] == 503  # alone, but the heavy one needs all of it
    assert post(sidecar, heavy, JSON)[0] == 200  # its client's retry
    assert post(sidecar, light)[0] == 200
    assert stored_actions(tmp_path / "sessions.db") == 102


def test_a_turn_ends_after_its_window_when_its_client_gave_up() -> None:
    now = [0.0]
    budget = DecodingBudget(1000, retry_after_s=2, clock=lambda: now[0])

    def admitted(size: int, *, json: bool) -> bool:
        try:
            with budget.reserved(size, json=json):
                return True
        except DecodingRefused:
            return False

    with budget.reserved(10, json=True):  # 220 bytes being decoded
        assert not admitted(600, json=False)  # 3,000 or more: heavier than the whole budget
    assert not admitted(10, json=True)  # alone, yet its turn holds the budget
    now[0] += TURN_RETRY_AFTERS * 2 - 0.1
    assert not admitted(10, json=True)
    now[0] += 0.2  # its client never came back
    assert admitted(10, json=True) and budget.in_use == 0


def test_a_heavy_request_the_reference_path_reads_keeps_its_turn_until_it_holds_its_room() -> None:
    """A request ``_wire`` declines takes its room in two steps: ``_wire``'s weight, then
    the reference path's (see ``TraceReceiver.decode``). Its turn ended at the first step,
    so a lighter request could take the room while ``_wire`` read it, and the second step
    was refused: under steady traffic it was refused each time its client came back."""
    now = [0.0]
    budget = DecodingBudget(1000, retry_after_s=1, clock=lambda: now[0])
    budget.protobuf_factor = WIRE_FACTOR  # as where _wire is built, whatever this build has
    size, light = 110, 20
    first, room = budget.weight(size, json=False), budget.reference_weight(size)
    assert budget.limit // 2 < first < room <= budget.limit
    lighter: list[bool] = []

    def heavy(while_wire_reads: Callable[[], None] = lambda: None) -> bool:
        try:
            with budget.reserved(size, json=False) as reservation:
                while_wire_reads()
                reservation.grow(room)  # _wire declined it
        except DecodingRefused:
            return False
        return True

    with ExitStack() as traffic:

        def light_request_arrives() -> None:
            try:
                traffic.enter_context(budget.reserved(light, json=False))
            except DecodingRefused:
                lighter.append(False)
            else:
                lighter.append(True)

        light_request_arrives()
        assert not heavy()  # its first step fits beside the traffic, its second does not
        traffic.close()
        assert heavy(light_request_arrives)  # its client's retry, as a lighter one arrives
    assert lighter == [True, False]
    assert budget.in_use == 0
    with budget.reserved(light, json=False):  # its turn is over
        pass
