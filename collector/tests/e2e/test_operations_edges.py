"""Operating the sidecar: what an SRE running ``durable-sessions-collector serve`` meets.

- the store's disk fills up while it runs: Exports are answered retryable (503 +
  Retry-After / UNAVAILABLE + RetryInfo), nothing is acknowledged that was not
  committed, and it recovers without a restart;
- the SQLite file is deleted while the sidecar runs;
- a second ``serve`` on the same SQLite file;
- SIGTERM while clients export: every Export answered OK is committed, the others are
  answered not-OK, and the process exits within a bound;
- a port already in use at start-up: exit code 2 and one line naming the key;
- a webhook that hangs or trickles its answer: ``alerts.webhook.timeout_s`` and shutdown;
- standard error closed, or a pipe nobody reads;
- the wall clock stepping backwards: idle sessions must still be ended.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import wait_for
from durable_sessions_collector import pipeline as pipeline_module
from google.rpc import error_details_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from sidecar_clients import export_call, request_of, retry_delay
from stall_proxy import StallProxy
from webhook_server import free_port

# --- helpers ----------------------------------------------------------------------------------


def span_id_of(session: str, action_id: str) -> str:
    return hashlib.sha256(f"{session}/{action_id}".encode()).hexdigest()[:16]


def export_request(session: str, *action_ids: str, kind: str = "tool_call", key: str | None = None) -> bytes:
    """An ExportTraceServiceRequest with one action span per ``action_ids``."""
    spans = []
    for n, action_id in enumerate(action_ids):
        attributes = [
            KeyValue(key="session.id", value=AnyValue(string_value=session)),
            KeyValue(key="agent.action.id", value=AnyValue(string_value=action_id)),
            KeyValue(key="agent.action.kind", value=AnyValue(string_value=kind)),
        ]
        if key is not None:
            attributes.append(KeyValue(key="agent.action.idempotency_key", value=AnyValue(string_value=key)))
        spans.append(
            Span(
                trace_id=hashlib.sha256(session.encode()).digest()[:16],
                span_id=bytes.fromhex(span_id_of(session, action_id)),
                name=action_id,
                start_time_unix_nano=1_700_000_000_000_000_000 + n,
                end_time_unix_nano=1_700_000_000_000_000_001 + n,
                attributes=attributes,
            )
        )
    return request_of(*spans).SerializeToString()


def post_traces(http_url: str, body: bytes, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` to ``/v1/traces`` as protobuf: (status, headers, body)."""
    request = urllib.request.Request(
        http_url + "/v1/traces", data=body, headers={"Content-Type": "application/x-protobuf"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def grpc_export(endpoint: str, body: bytes, timeout: float = 30) -> tuple[grpc.StatusCode, dict[str, Any]]:
    """One raw Export over gRPC: (code, trailing metadata)."""
    with grpc.insecure_channel(endpoint) as channel:
        export = export_call(channel)
        try:
            export(body, timeout=timeout)
        except grpc.RpcError as error:
            return error.code(), dict(error.trailing_metadata() or ())
    return grpc.StatusCode.OK, {}


def stored_span_ids(db: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(db)) as store:
        return {span_id for (span_id,) in store.execute("SELECT span_id FROM actions")}


def clean_env() -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("DURABLE_SESSIONS_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def serve_argv(db: Path | str, grpc_port: int, http_port: int, *extra: str) -> list[str]:
    """``serve`` on ``db``: a SQLite file, or a store URL (``postgresql://…``)."""
    store = db if isinstance(db, str) and "://" in db else f"sqlite:///{db}"
    return [
        sys.executable,
        "-m",
        "durable_sessions_collector",
        "serve",
        f"--store={store}",
        f"--grpc-endpoint=127.0.0.1:{grpc_port}",
        f"--http-endpoint=127.0.0.1:{http_port}",
        *extra,
    ]


class Serve:
    """``serve`` in a subprocess, its standard error in a file."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=clean_env()
        )

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def started(self, timeout: float = 30) -> dict[str, Any] | None:
        """The ``started`` line, or None if the process exited first."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines():
                if line.get("event") == "started":
                    return line
            if self.process.poll() is not None:
                return None
            assert time.monotonic() < deadline, "serve neither started nor exited: " + self.log.read_text()
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def served() -> Iterator[list[Serve]]:
    """Processes to kill at the end of the test, whatever happened."""
    processes: list[Serve] = []
    yield processes
    for process in processes:
        process.kill()


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


# --- the store's disk: full, read-only --------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (needs root, or CAP_SYS_ADMIN): a disk that can really fill up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
            check=True,
            capture_output=True,
        )
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {error}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 65536):
                pass
    finally:
        os.close(fd)
    return filler


def assert_retryable_http(status: int, headers: dict[str, str]) -> None:
    assert status == 503, status
    assert headers.get("Retry-After", "").isdigit(), headers


def assert_retryable_grpc(code: grpc.StatusCode, trailers: dict[str, Any]) -> None:
    assert code == grpc.StatusCode.UNAVAILABLE, code
    retry = error_details_pb2.RetryInfo.FromString(trailers["google.rpc.retryinfo-bin"])
    assert retry.retry_delay.seconds >= 1


def test_a_full_disk_is_answered_retryable_and_recovers_without_restart(start_sidecar, small_disk) -> None:  # type: ignore[no-untyped-def]
    db = small_disk / "sessions.db"
    sidecar = start_sidecar(db)
    assert post_traces(sidecar.http_url, export_request("before", "b1"))[0] == 200
    filler = fill(small_disk)

    # Big enough that the WAL must grow: pad the batch with many spans.
    during_http = export_request("full-http", *(f"h{n}" for n in range(300)))
    during_grpc = export_request("full-grpc", *(f"g{n}" for n in range(300)))
    status, headers, body = post_traces(sidecar.http_url, during_http)
    assert_retryable_http(status, headers)
    assert b"full" in body  # the reason is passed on: "database or disk is full"
    assert_retryable_grpc(*grpc_export(sidecar.grpc_endpoint, during_grpc))
    assert sidecar.metric("durable_sessions_store_commit_failures_total") >= 2

    # Space comes back: the same requests (the clients' retries) are stored, no restart.
    filler.unlink()
    assert post_traces(sidecar.http_url, during_http)[0] == 200
    assert grpc_export(sidecar.grpc_endpoint, during_grpc)[0] == grpc.StatusCode.OK
    assert sidecar.get("/healthz")[0] == 200
    sidecar.stop()
    ids = stored_span_ids(db)
    assert {span_id_of("full-http", f"h{n}") for n in range(300)} <= ids
    assert {span_id_of("full-grpc", f"g{n}") for n in range(300)} <= ids


# --- the SQLite file deleted while the sidecar runs -------------------------------------------


def test_an_export_after_the_store_file_was_deleted_is_not_acknowledged(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A write connection would go on writing into the deleted inode: Exports answered OK,
    # /healthz ok, and every one of those spans gone at the next stop. The sidecar checks,
    # before each write, that the file at its path is still its store: retryable until
    # restarted, and /healthz unhealthy.
    db = tmp_path / "sessions.db"
    sidecar = start_sidecar(db)
    assert post_traces(sidecar.http_url, export_request("kept", "k1"))[0] == 200
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{db}{suffix}")
    status, _, _ = post_traces(sidecar.http_url, export_request("after-delete", "d1"))
    sidecar.stop()
    if status == 200:
        assert db.exists() and span_id_of("after-delete", "d1") in stored_span_ids(db), (
            "the Export was answered OK, but its span is not in the store at the configured path"
        )
    else:
        assert status == 503


# --- two sidecars on one SQLite file ------------------------------------------------------------


def test_a_second_serve_on_the_same_sqlite_file_refuses_to_start(start_sidecar, tmp_path, served) -> None:  # type: ignore[no-untyped-def]
    # Two sidecars on one SQLite file would each judge a session from its own memory,
    # which the other changes under it (a key shared by actions that reached different
    # processes would never be reported). The second `serve` refuses to start: exit
    # code 2, naming the store and the pid that holds it.
    db = tmp_path / "sessions.db"
    first = start_sidecar(db, evaluation__idle_s=60)
    grpc_port, http_port = free_port(), free_port()
    second = Serve(serve_argv(db, grpc_port, http_port, "--idle-s", "60"), tmp_path / "second.log")
    served.append(second)
    assert second.started() is None, "a second serve started on a store another sidecar writes"
    assert second.process.returncode == 2, second.log.read_text()
    assert f"in use by another sidecar (pid {os.getpid()}" in second.log.read_text()
    assert first.get("/healthz")[0] == 200  # the first one is untouched


# --- ports in use -----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["grpc", "http"])
def test_a_port_in_use_at_start_up_is_exit_code_2_naming_the_key(tmp_path, served, which) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        busy = occupant.getsockname()[1]
        ports = {"grpc": free_port(), "http": free_port(), which: busy}
        process = Serve(serve_argv(tmp_path / "s.db", ports["grpc"], ports["http"]), tmp_path / "serve.log")
        served.append(process)
        assert process.process.wait(30) == 2
    stderr = process.log.read_text()
    assert "Traceback" not in stderr
    assert f"receivers.{which}.endpoint" in stderr and str(busy) in stderr, stderr
    # Why, as the OS says it (grpcio's own error only said to set GRPC_VERBOSITY=debug,
    # which serve turns off).
    assert "Address already in use" in stderr and "GRPC_VERBOSITY" not in stderr, stderr
    # Nothing was left listening on the other port.
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", ports["http" if which == "grpc" else "grpc"]))


# --- SIGTERM under load -----------------------------------------------------------------------


class LoadClient(threading.Thread):
    """Exports distinct spans in a loop over one transport; records every answer. Over
    gRPC it waits the delay of an ``UNAVAILABLE`` answer's ``RetryInfo`` before its next
    Export, as the OTLP exporters do."""

    def __init__(self, name: str, transport: str, grpc_endpoint: str, http_url: str) -> None:
        super().__init__(daemon=True)
        self.name_ = name
        self.transport = transport
        self.grpc_endpoint = grpc_endpoint
        self.http_url = http_url
        self.acknowledged: set[str] = set()
        self.outcomes: list[tuple[str, float]] = []
        """Each answer, and the seconds it took."""
        self.after: list[str] = []
        """For each answer, the one before it (``none`` for the first)."""
        self.waits = 0  # answers whose RetryInfo delay it waited
        self.stop = threading.Event()

    def run(self) -> None:
        n = 0
        channel = grpc.insecure_channel(self.grpc_endpoint)
        export = export_call(channel)
        while not self.stop.is_set():
            n += 1
            session = f"{self.name_}-{n % 7}"
            actions = [f"{self.name_}-{n}-{i}" for i in range(20)]
            body = export_request(session, *actions)
            start = time.monotonic()
            retry_after_s = 0.0
            if self.transport == "grpc":
                try:
                    export(body, timeout=15)
                    outcome = "ok"
                except grpc.RpcError as error:
                    outcome = error.code().name
                    retry_after_s = retry_delay(error) or 0.0
            else:
                try:
                    status = post_traces(self.http_url, body, timeout=15)[0]
                    outcome = "ok" if status == 200 else str(status)
                except (OSError, urllib.error.URLError, http.client.HTTPException) as error:
                    outcome = type(error).__name__
            self.after.append(self.outcomes[-1][0] if self.outcomes else "none")
            self.outcomes.append((outcome, time.monotonic() - start))
            if outcome == "ok":
                self.acknowledged.update(span_id_of(session, a) for a in actions)
            elif retry_after_s:
                self.waits += 1
                self.stop.wait(retry_after_s)
            elif outcome not in ("503", "UNAVAILABLE"):
                time.sleep(0.02)  # refused or reset: the process is going away
        channel.close()


def test_sigterm_under_load_commits_every_acknowledged_export_and_exits(tmp_path, served) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / "sessions.db"
    grpc_port, http_port = free_port(), free_port()
    process = Serve(serve_argv(db, grpc_port, http_port, "--idle-s", "0.2"), tmp_path / "serve.log")
    served.append(process)
    assert process.started() is not None, process.log.read_text()
    clients = [
        LoadClient(
            f"c{i}", "grpc" if i % 2 else "http", f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}"
        )
        for i in range(6)
    ]
    for client in clients:
        client.start()
    try:
        wait_for(lambda: sum(len(c.acknowledged) for c in clients) >= 2000, timeout=30)
        process.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = process.process.wait(30)
        took = time.monotonic() - signalled
    finally:
        for client in clients:
            client.stop.set()
        for client in clients:
            client.join(20)
    assert code == 0, process.log.read_text()
    assert took < 15, f"SIGTERM took {took:.1f} s"
    assert [line["event"] for line in process.lines()][-2:] == ["signal", "stopped"]
    acknowledged = set().union(*(c.acknowledged for c in clients))
    missing = acknowledged - stored_span_ids(db)
    assert not missing, f"{len(missing)} acknowledged spans are not in the store"
    outcomes = [outcome for c in clients for outcome in c.outcomes]
    assert all(seconds < 14 for _, seconds in outcomes), "an Export hung until the client's deadline"
    # Every other answer is one a client retries. No CANCELLED, grpcio's answer to a call
    # that reaches the port as its close begins: the port drains first, answering new calls
    # UNAVAILABLE with RetryInfo until none has arrived or been answered for 50 ms, and
    # these clients call again at once after an OK, so each is waiting its delay when the
    # port closes. (A client whose next call came over 50 ms after an OK could still be
    # caught: it was never told to wait.) The rest are refused or reset connections once
    # the process is gone.
    cancelled = [
        (c.name_, before)
        for c in clients
        for (name, _), before in zip(c.outcomes, c.after, strict=True)
        if name == "CANCELLED"
    ]
    assert not cancelled, f"CANCELLED (client, the answer before): {cancelled}"
    assert sum(c.waits for c in clients if c.transport == "grpc") > 0, "no gRPC call was told to wait"
    assert {name for name, _ in outcomes} - {"ok", "503", "UNAVAILABLE"} <= {
        "URLError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "RemoteDisconnected",
        "BrokenPipeError",
        "IncompleteRead",
    }


@contextlib.contextmanager
def writer_stuck_on_postgresql(tmp_path: Path, served: list[Serve], postgres_url: str) -> Iterator[Serve]:
    """``serve`` on PostgreSQL through a :class:`StallProxy`, stalled once an Export went
    through: its writer is in a write the store never answers (a network partition, a
    server hung on its disk), and the next Export was not acknowledged."""
    proxy, through_proxy = StallProxy.to_url(postgres_url)
    grpc_port, http_port = free_port(), free_port()
    process = Serve(
        serve_argv(through_proxy, grpc_port, http_port, "--ack-timeout-s", "1", "--alert-log", "false"),
        tmp_path / "serve.log",
    )
    served.append(process)
    try:
        assert process.started() is not None, process.log.read_text()
        endpoint = f"127.0.0.1:{grpc_port}"
        assert grpc_export(endpoint, export_request("answered", "a1"))[0] == grpc.StatusCode.OK
        proxy.stall()
        assert_retryable_grpc(*grpc_export(endpoint, export_request("unanswered", "u1")))
        yield process
    finally:
        proxy.close()


@pytest.mark.postgres
def test_sigterm_stops_serve_while_postgresql_does_not_answer(tmp_path, served, postgres_url) -> None:  # type: ignore[no-untyped-def]
    # The stop waited for the stuck write to close the store: serve never exited after
    # SIGTERM. Nothing that write holds was acknowledged.
    with writer_stuck_on_postgresql(tmp_path, served, postgres_url) as process:
        process.process.send_signal(signal.SIGTERM)
        code = process.process.wait(60)
    assert code == 0, process.log.read_text()
    events = [line["event"] for line in process.lines()]
    assert "store-write-stuck" in events and events[-1] == "stopped", events


@pytest.mark.postgres
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_during_the_stop_ends_serve_at_once(tmp_path, served, postgres_url, signum) -> None:  # type: ignore[no-untyped-def]
    # A second signal ended the process at once only while it was starting; during the
    # stop (here waiting on the stuck write) it was ignored: Ctrl-C twice, or an operator's
    # second SIGTERM, left it to finish the stop. Everything acknowledged is committed.
    with writer_stuck_on_postgresql(tmp_path, served, postgres_url) as process:
        process.process.send_signal(signum)
        wait_for(lambda: "signal" in [line["event"] for line in process.lines()], timeout=10)
        process.process.send_signal(signum)
        code = process.process.wait(60)
    assert code == 128 + signum, process.log.read_text()
    assert "stopped" not in [line["event"] for line in process.lines()]


# --- the webhook hangs ------------------------------------------------------------------------


class SlowReceiver:
    """A webhook receiver that never finishes its answer: it accepts, then either says
    nothing (``trickle=False``) or trickles a never-ending header one byte at a time."""

    def __init__(self, trickle: bool) -> None:
        self.trickle = trickle
        self.connections = 0
        self.stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                connection, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            connection.recv(65536)
            if self.trickle:
                with contextlib.suppress(OSError):
                    connection.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                    while not self.stop.wait(0.2):
                        connection.sendall(b"a")
            else:
                self.stop.wait()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def unkeyed_payment(sidecar, session: str = "pay") -> None:  # type: ignore[no-untyped-def]
    """One span that raises one violation (unkeyed-side-effect)."""
    assert (
        grpc_export(sidecar.grpc_endpoint, export_request(session, "p1", kind="payment"))[0]
        == grpc.StatusCode.OK
    )


def test_a_webhook_that_trickles_its_answer_is_cut_off_after_timeout_s(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    # alerts.webhook.timeout_s bounds a whole POST, not each read: a receiver (or a proxy)
    # that sends a byte now and then would otherwise hold the delivery thread forever, and
    # that alert and every one after it would never be retried, dead-lettered or delivered.
    receiver = SlowReceiver(trickle=True)
    try:
        sidecar = start_sidecar(
            alerts__webhook__url=receiver.url,
            alerts__webhook__timeout_s=1,
            alerts__webhook__backoff_s=0.1,
            alerts__webhook__max_backoff_s=0.2,
        )
        unkeyed_payment(sidecar)
        wait_for(lambda: receiver.connections >= 1, timeout=10)
        # Expected: the attempt counts as failed about 1 s after it began.
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not any(
            line.get("event") == "alert-delivery-retry" for line in sidecar.log.lines()
        ):
            time.sleep(0.1)
        retried = sidecar.metric(
            "durable_sessions_alert_deliveries_total", channel="webhook", outcome="retry"
        )
        assert retried >= 1, "a POST that never finished was not cut off after alerts.webhook.timeout_s = 1 s"
        # Shutdown stays bounded however the receiver behaves.
        begun = time.monotonic()
        sidecar.stop()
        assert time.monotonic() - begun < 1 + 2 + 3
    finally:
        receiver.close()


def test_shutdown_is_bounded_while_a_webhook_post_hangs(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    receiver = SlowReceiver(trickle=False)
    try:
        sidecar = start_sidecar(alerts__webhook__url=receiver.url, alerts__webhook__timeout_s=3)
        unkeyed_payment(sidecar)
        wait_for(lambda: receiver.connections >= 1, timeout=10)
        begun = time.monotonic()
        sidecar.stop()
        took = time.monotonic() - begun
        # The delivery thread is given timeout_s + 2 s, then shutdown goes on.
        assert took < 3 + 2 + 2, f"stop() took {took:.1f} s while the webhook hung"
        # The alert was not lost: it is still pending for the next run.
        with contextlib.closing(
            sqlite3.connect(sidecar.service.config.store.removeprefix("sqlite:///"))
        ) as db:
            states = dict(db.execute("SELECT channel, state FROM outbox"))
        assert states.get("webhook") == "pending"
        assert states.get("log") == "delivered"
    finally:
        receiver.close()


# --- standard error ---------------------------------------------------------------------------


def test_serve_with_standard_error_closed_still_serves(tmp_path, served) -> None:  # type: ignore[no-untyped-def]
    # Started with fd 2 closed (`serve 2>&-`, as some supervisors do), Python sets
    # sys.stderr to None: the log lines go nowhere, and the sidecar serves.
    grpc_port, http_port = free_port(), free_port()
    argv = serve_argv(tmp_path / "s.db", grpc_port, http_port)
    process = subprocess.Popen(
        ["/bin/sh", "-c", 'exec "$@" 2>&-', "sh", *argv], stdout=subprocess.DEVNULL, env=clean_env()
    )
    try:
        deadline = time.monotonic() + 20
        while not http_ok(f"http://127.0.0.1:{http_port}/healthz"):
            assert process.poll() is None, f"serve with stderr closed exited with code {process.returncode}"
            assert time.monotonic() < deadline, "serve with stderr closed did not come up"
            time.sleep(0.05)
        assert grpc_export(f"127.0.0.1:{grpc_port}", export_request("quiet", "q1"))[0] == grpc.StatusCode.OK
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert span_id_of("quiet", "q1") in stored_span_ids(tmp_path / "s.db")


def serve_with_unread_stderr(
    db: Path, grpc_port: int, http_port: int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """``serve`` with its standard error a pipe this test does not read, once it is healthy."""
    process = subprocess.Popen(
        serve_argv(db, grpc_port, http_port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    deadline = time.monotonic() + 20
    while not http_ok(f"http://127.0.0.1:{http_port}/healthz"):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError("serve did not come up")
        time.sleep(0.05)
    return process


def fill_stderr_with_alert_lines(grpc_port: int) -> list[str]:
    """Export 400 unkeyed payments: 400 alert lines, some 200 KiB, more than a pipe holds
    (64 KiB). Returns the sessions."""
    sessions = [f"burst-{uuid.uuid4().hex[:8]}-{n}" for n in range(400)]
    body = b"".join(export_request(session, "p1", kind="payment") for session in sessions)
    assert grpc_export(f"127.0.0.1:{grpc_port}", body)[0] == grpc.StatusCode.OK
    return sessions


@pytest.mark.parametrize("buffered", [False, True], ids=["unbuffered", "buffered"])
def test_sigterm_stops_serve_even_when_nobody_reads_its_standard_error(tmp_path, buffered: bool) -> None:  # type: ignore[no-untyped-def]
    # When the reader of the stderr pipe stalls (a stuck log shipper), the thread writing a
    # line blocks in the write. SIGTERM must still stop the sidecar within a bound ("SIGTERM
    # commits what it accepted", docs/deployment.md): other lines wait at most a second for
    # the stream, then are dropped and counted. Buffered (how `serve` runs by default), the
    # stuck thread also holds stderr's buffer, which Python flushes at exit.
    db = tmp_path / "s.db"
    grpc_port, http_port = free_port(), free_port()
    env = clean_env()
    if buffered:
        del env["PYTHONUNBUFFERED"]
    process = serve_with_unread_stderr(db, grpc_port, http_port, env)
    try:
        fill_stderr_with_alert_lines(grpc_port)
        time.sleep(0.5)  # the log's thread is now writing alert lines into the full pipe
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(20)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, "serve did not exit within 20 s of SIGTERM while its stderr pipe was full"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        assert process.stderr is not None
        process.stderr.close()


def test_exports_are_acknowledged_while_nobody_reads_standard_error_and_no_alert_line_is_lost(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    # Alert lines are queued for the log's own thread: a full stderr pipe must not stop the
    # writer thread committing records (before, it blocked in the write and every Export
    # waited out pipeline.ack_timeout_s). Once the pipe is read, every queued line comes out.
    grpc_port, http_port = free_port(), free_port()
    process = serve_with_unread_stderr(tmp_path / "s.db", grpc_port, http_port, clean_env())
    read: list[bytes] = []
    try:
        sessions = fill_stderr_with_alert_lines(grpc_port)
        time.sleep(1.5)  # the log's thread is now blocked in a write into the full pipe
        for round_ in range(5):
            later = [f"later-{round_}-{uuid.uuid4().hex[:8]}-{n}" for n in range(20)]
            sessions += later
            body = b"".join(export_request(session, "p1", kind="payment") for session in later)
            begun = time.monotonic()
            assert grpc_export(f"127.0.0.1:{grpc_port}", body, timeout=10)[0] == grpc.StatusCode.OK
            assert time.monotonic() - begun < 5
        assert process.stderr is not None
        reader = threading.Thread(target=lambda: read.append(process.stderr.read()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        reader.join(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    lines = [json.loads(line) for line in b"".join(read).decode().splitlines()]
    alerted = [line["session_id"] for line in lines if line["event"] == "violation"]
    assert sorted(alerted) == sorted(sessions)  # each session's one violation, once
    assert not [line for line in lines if line["event"] == "log-lines-dropped"]


# --- the wall clock steps backwards -----------------------------------------------------------


class SteppedClock:
    """The ``time`` module as the pipeline sees it, with the wall clock stepped by ``offset``."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_idle_sessions_are_still_ended_after_the_clock_steps_back(start_sidecar, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # After the wall clock steps back (an NTP step of an hour), idle sessions are still
    # ended: the sweeps are timed by the monotonic clock. The step is stood in for by the
    # pipeline module's view of the time.
    clock = SteppedClock()
    monkeypatch.setattr(pipeline_module, "time", clock)
    sidecar = start_sidecar(evaluation__idle_s=0.3)
    assert grpc_export(sidecar.grpc_endpoint, export_request("before-step", "a1"))[0] == grpc.StatusCode.OK
    wait_for(lambda: sidecar.session("before-step")["state"] == "ended", timeout=10)

    clock.offset = -3600.0  # the wall clock steps back one hour
    assert grpc_export(sidecar.grpc_endpoint, export_request("after-step", "a1"))[0] == grpc.StatusCode.OK
    deadline = time.monotonic() + 5
    while sidecar.session("after-step")["state"] != "ended" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sidecar.session("after-step")["state"] == "ended", (
        "a session idle for 5 s (idle_s = 0.3) was not ended after the clock stepped back"
    )


# --- large sessions ---------------------------------------------------------------------------


def test_a_session_past_max_actions_per_session_is_still_stored_and_judged(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # "action ids one session remembers": past the cap the session is not refused; its
    # spans are stored and acknowledged, and a later action is still judged.
    db = tmp_path / "sessions.db"
    sidecar = start_sidecar(db, evaluation__max_actions_per_session=5, evaluation__idle_s=60)
    body = export_request("big", *(f"t{n}" for n in range(50)))
    assert grpc_export(sidecar.grpc_endpoint, body)[0] == grpc.StatusCode.OK
    assert (
        grpc_export(sidecar.grpc_endpoint, export_request("big", "pay", kind="payment"))[0]
        == grpc.StatusCode.OK
    )
    detail = sidecar.session("big")
    assert detail["action_count"] == 51
    assert [v["rule"] for v in detail["violations"]] == ["unkeyed-side-effect"]
    assert detail["verdict"] == "unrecoverable"
