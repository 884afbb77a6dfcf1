"""Crash: the sidecar process is SIGKILLed while a client exports, then restarted.

Every span whose Export returned OK must be in the store afterwards, no alert may be
raised twice (and none lost), and the sessions that span the restart must get the
violations and verdicts an uninterrupted engine gives for the same stream.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from durable_sessions_collector.store.base import decode_record
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sidecar_clients import grpc_exporter

from durable_sessions.engine import Checker
from durable_sessions.record import Location
from durable_sessions.report import verdict_of
from durable_sessions.rules import select_rules

SESSIONS = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SidecarProcess:
    def __init__(self, db: Path, log: Path, grpc_port: int, http_port: int) -> None:
        self.log = log
        self.http_port = http_port
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "durable_sessions_collector", "serve",
                "--store", f"sqlite:///{db}",
                "--grpc-endpoint", f"127.0.0.1:{grpc_port}",
                "--http-endpoint", f"127.0.0.1:{http_port}",
                "--idle-s", "0.5",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log.open("wb"),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not any(line.get("event") == "started" for line in self.lines()):
            assert self.process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "sidecar did not start"
            time.sleep(0.05)

    def lines(self) -> list[dict]:  # type: ignore[type-arg]
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def terminate(self) -> None:
        self.process.terminate()
        assert self.process.wait(20) == 0


class Client(threading.Thread):
    """Exports batches continuously over OTLP/gRPC; remembers what was acknowledged."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.exporter = grpc_exporter(endpoint, timeout=1.5)
        self.memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.instance.id": "agent-1"}))
        provider.add_span_processor(SimpleSpanProcessor(self.memory))
        self.tracer = provider.get_tracer("crash")
        self.acknowledged: set[str] = set()
        self.failed = 0
        self.batches = 0
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            for _ in range(4):
                n += 1
                session = f"s{n % SESSIONS}"
                # Keyed payments under new action ids all sharing one key per session:
                # shared-key fires only if the session's history (from before the
                # restart too) is known.
                attributes = {
                    "session.id": session,
                    "agent.action.id": f"p{n}",
                    "agent.action.kind": "payment",
                    "agent.action.idempotency_key": f"{session}-key",
                }
                if n % 5 == 0:
                    del attributes["agent.action.idempotency_key"]  # unkeyed-side-effect
                self.tracer.start_span("pay", attributes=attributes).end()
            spans = list(self.memory.get_finished_spans())
            self.memory.clear()
            if self.exporter.export(spans) is SpanExportResult.SUCCESS:
                self.acknowledged.update(format(s.context.span_id, "016x") for s in spans)
            else:
                self.failed += 1
            self.batches += 1
            time.sleep(0.01)


def test_sigkill_loses_no_acknowledged_span_and_alerts_once(tmp_path: Path) -> None:
    db = tmp_path / "crash.db"
    grpc_port, http_port = free_port(), free_port()
    first = SidecarProcess(db, tmp_path / "first.log", grpc_port, http_port)
    client = Client(f"127.0.0.1:{grpc_port}")
    client.start()
    try:
        while len(client.acknowledged) < 200:
            time.sleep(0.02)
        first.kill()
        killed_at = client.batches
        second = SidecarProcess(db, tmp_path / "second.log", grpc_port, http_port)
        resumed_at = len(client.acknowledged)
        while len(client.acknowledged) < resumed_at + 200:
            time.sleep(0.02)
    finally:
        client.stop.set()
        client.join(10)
    assert client.batches > killed_at  # the client kept exporting across the crash
    print("failed exports during the outage:", client.failed)

    # Wait for every session to be idle-ended by the second sidecar.
    deadline = time.monotonic() + 15
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/api/sessions") as response:
            sessions = json.load(response)["sessions"]
        if len(sessions) == SESSIONS and all(s["state"] == "ended" for s in sessions):
            break
        assert time.monotonic() < deadline, sessions
        time.sleep(0.1)
    second.terminate()

    with sqlite3.connect(db) as store:
        stored = {span_id for (span_id,) in store.execute("SELECT span_id FROM actions")}
        rows = store.execute("SELECT trace_id, span_id, record FROM actions ORDER BY id").fetchall()
        violation_keys = {key for (key,) in store.execute("SELECT key FROM violations WHERE resolved = 0")}
        verdicts = dict(store.execute("SELECT session_id, verdict FROM sessions"))

    # 1. Acknowledged means committed.
    assert client.acknowledged <= stored

    # 2. Each violation alerted exactly once over both processes.
    alerted = [
        line["key"] for log in (first, second) for line in log.lines() if line.get("event") == "violation"
    ]
    assert len(alerted) == len(set(alerted))
    assert set(alerted) == violation_keys

    # 3. Same findings as one uninterrupted engine over the same stream.
    checker = Checker(select_rules())
    expected = []
    for trace_id, span_id, record in rows:
        expected.extend(checker.feed(decode_record(record), Location(None, None, trace_id, span_id)))
    expected.extend(checker.finish())
    assert {v.key for v in expected} == violation_keys
    assert {v.rule for v in expected} == {"shared-key", "unkeyed-side-effect"}
    for session in verdicts:
        assert verdicts[session] == verdict_of(v.severity for v in expected if v.session_id == session)
