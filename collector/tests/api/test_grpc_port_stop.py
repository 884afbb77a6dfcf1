"""The gRPC port while the sidecar stops: every call is answered ``UNAVAILABLE`` (retry,
here later or with another replica), none ``CANCELLED``, which clients read as their own
cancellation.

Real sidecars, real gRPC channels: Exports that honour the ``RetryInfo`` they are given,
as the OpenTelemetry exporters do, and API calls, while :meth:`Service.stop` runs.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections import Counter

import grpc
import pytest
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from durable_sessions_collector.credentials import CHECK_INTERVAL_S
from durable_sessions_collector.otlp.grpc_receiver import QUIET_S
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sidecar_clients import export_call, one_action_export, retry_delay

STOPPING = "the sidecar is stopping; retry later, or with another replica"


class Exporter(threading.Thread):
    """Exports one span at a time to the port until told to stop, waiting what a refusal's
    ``RetryInfo`` asks (else 50 ms), and notes each answer: its code and details."""

    def __init__(self, endpoint: str, number: int) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.number = endpoint, number
        self.answers: list[tuple[str, str, float | None]] = []
        self.done = threading.Event()

    def run(self) -> None:
        channel = grpc.insecure_channel(self.endpoint)
        export = export_call(channel)
        n = 0
        while not self.done.is_set():
            n += 1
            try:
                export(one_action_export(self.number * 4096 + n % 4096, f"s-{self.number}"), timeout=10)
                self.answers.append(("OK", "", None))
            except grpc.RpcError as error:
                delay = retry_delay(error)
                self.answers.append((error.code().name, error.details() or "", delay))
                self.done.wait(delay or 0.05)
        channel.close()


def test_calls_made_while_the_sidecar_stops_are_answered_unavailable_never_cancelled(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    answers: Counter[tuple[str, str]] = Counter()
    told_to_wait = 0
    for _ in range(3):  # a call caught by grpcio's own stop is a race: give it a few chances
        sidecar = start_sidecar()
        exporters = [Exporter(sidecar.grpc_endpoint, number) for number in range(8)]
        for exporter in exporters:
            exporter.start()
        time.sleep(0.5)  # under way
        sidecar.stop()
        time.sleep(0.3)  # and on, against the closed port
        for exporter in exporters:
            exporter.done.set()
        for exporter in exporters:
            exporter.join(15)
        for exporter in exporters:
            answers.update(
                (code, details if code != "UNAVAILABLE" else "") for code, details, _ in exporter.answers
            )
            # The first refusal is the sidecar's own, with the delay to wait.
            refusals = [(details, delay) for code, details, delay in exporter.answers if code != "OK"]
            assert refusals and refusals[0][0] == STOPPING and refusals[0][1] >= 1, exporter.answers[-5:]
            told_to_wait += 1
        # Each refused Export is counted unavailable, as the writer's refusals are.
        refused = sidecar.service.metrics.registry.get_sample_value(
            "durable_sessions_export_requests_total", {"transport": "grpc", "outcome": "unavailable"}
        )
        assert refused == sum(1 for e in exporters for _, details, _ in e.answers if details == STOPPING)
    assert set(answers) == {("OK", ""), ("UNAVAILABLE", "")}, answers
    assert told_to_wait == 24


def test_the_port_drains_while_an_export_is_in_progress(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An Export waits for its commit (another process holds the SQLite file's write lock)
    when the sidecar is told to stop: meanwhile the port answers a new API call
    ``UNAVAILABLE`` with ``RetryInfo``, and the health service NOT_SERVING; once the lock
    is released the Export is committed and answered OK, and the sidecar stops."""
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    api = pb_grpc.SessionServiceStub(channel)
    api.ListSessions(pb.ListSessionsRequest(), timeout=10)  # connected
    lock = sqlite3.connect(store, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    exported = export_call(channel).future(one_action_export(1, "held"), timeout=20)
    time.sleep(0.3)  # waiting for its commit
    stopping = threading.Thread(target=sidecar.stop)
    stopping.start()
    time.sleep(0.3)  # stopping: the drain lasts while the Export waits (up to the port's grace, 2 s)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            api.ListSessions(pb.ListSessionsRequest(), timeout=10)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert exported.result(timeout=10).partial_success.rejected_spans == 0
    stopping.join(15)
    channel.close()
    assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAVAILABLE, STOPPING)
    assert retry_delay(refused.value) >= 1  # type: ignore[operator]
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    check = sqlite3.connect(store)
    assert check.execute("SELECT count(*) FROM actions").fetchone() == (1,)
    check.close()


def test_a_client_answered_during_the_drain_is_told_to_wait_on_its_next_call(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The drain closed the port as soon as the last call in progress was answered, when
    that call had arrived more than QUIET_S before: its client, answered OK, sent its next
    Export into grpcio's stop (CANCELLED, or a closing port, without RetryInfo). The quiet
    now starts at the answer too, so that next Export is refused with the delay to wait."""
    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    export = export_call(channel)
    export(one_action_export(1, "warm"), timeout=10)  # connected
    lock = sqlite3.connect(store, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    held = export.future(one_action_export(2, "held"), timeout=20)
    time.sleep(0.3)  # waiting for its commit
    stopping = threading.Thread(target=sidecar.stop)
    stopping.start()
    time.sleep(0.3)  # draining, for longer than QUIET_S since the held Export arrived
    lock.execute("ROLLBACK")
    lock.close()
    assert held.result(timeout=10).partial_success.rejected_spans == 0
    time.sleep(QUIET_S / 2)  # the exporter's next batch, soon after
    with pytest.raises(grpc.RpcError) as refused:
        export(one_action_export(3, "next"), timeout=10)
    stopping.join(15)
    channel.close()
    assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.UNAVAILABLE, STOPPING)
    assert retry_delay(refused.value) >= 1  # type: ignore[operator]


def test_calls_the_sidecar_reads_late_are_refused_not_cancelled(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """grpcio's one serving thread reads calls one at a time. Here it is held in the first
    call, reading a token file that changed into a FIFO (a slow file system would do the
    same), while twenty more calls reach the port and the sidecar is told to stop: the
    drain saw 50 ms of quiet and closed the port, and grpcio answered the calls it had not
    read yet ``CANCELLED`` (some of the twenty in 4 runs of 4; of five, in about half the
    runs). Once quiet, the drain now sends the port a call of its own and waits for it, so
    every call that came before is read, and refused with the delay to wait."""
    token, token_file = "drain-probe-token-0123456789", tmp_path / "token"
    token_file.write_text(token)
    sidecar = start_sidecar(auth__token_file=str(token_file))
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    export = export_call(channel)
    metadata = (("authorization", f"Bearer {token}"),)
    export(one_action_export(1, "warm"), timeout=10, metadata=metadata)  # connected
    fifo, writer = tmp_path / "fifo", tmp_path / "fifo-writer"
    os.mkfifo(fifo)
    os.link(fifo, writer)  # the FIFO is written by this name once the token file is a file again
    os.replace(fifo, token_file)
    time.sleep(CHECK_INTERVAL_S + 0.1)  # the next call looks at the file, and reads the FIFO
    stopping = threading.Thread(target=sidecar.stop)
    try:
        calls = [export.future(one_action_export(2, "read-first"), timeout=10, metadata=metadata)]
        time.sleep(0.2)  # the serving thread waits in it
        calls += [
            export.future(one_action_export(n, f"late-{n}"), timeout=10, metadata=metadata)
            for n in range(3, 23)
        ]
        time.sleep(0.2)  # at the port, not read
        stopping.start()
        time.sleep(0.5)  # the drain's quiet is long over
    finally:
        # A file again first: a later look at the FIFO (changed, by the write) would wait in it for ever.
        (tmp_path / "token-again").write_text(token)
        os.replace(tmp_path / "token-again", token_file)
        # The serving thread reads on. Without a reader, as when it never looked, this fails
        # (ENXIO) rather than waiting for one.
        descriptor = os.open(writer, os.O_WRONLY | os.O_NONBLOCK)
        os.write(descriptor, token.encode())
        os.close(descriptor)
    answers = []
    for call in calls:
        with pytest.raises(grpc.RpcError) as refused:
            call.result(timeout=10)
        answers.append((refused.value.code(), refused.value.details(), retry_delay(refused.value)))
    stopping.join(15)
    channel.close()
    assert [(code, details) for code, details, _ in answers] == [(grpc.StatusCode.UNAVAILABLE, STOPPING)] * 21
    assert all(delay is not None and delay >= 1 for _, _, delay in answers)
