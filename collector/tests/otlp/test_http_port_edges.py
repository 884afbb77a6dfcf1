"""The HTTP port against the clients a production sidecar meets: slow and silent ones,
clients that go away, ambiguous body framing (request smuggling), ``Expect:
100-continue``, TLS spoken to the plain port, and request lines that are not HTTP.

Raw sockets against a real sidecar (in this process, so that a test can shorten the port's
timeouts: ``httpserver`` reads them when the sidecar starts). Cases already covered by
``test_otlp_conformance.py``, ``test_sidecar_bad_input.py`` and ``api/test_api_edges.py``
(keep-alive after error answers, chunked gzip bodies, HEAD, 405, 404, the token's scheme
case) are not repeated here.

References: RFC 9112 section 6.3 (message body length: a request with both
Transfer-Encoding and Content-Length, or an invalid Content-Length, is refused and its
connection closed) and section 7.1 (chunked coding); RFC 9110 section 10.1.1 (Expect).
"""

from __future__ import annotations

import io
import json
import socket
import ssl
import struct
import threading
import time
import tracemalloc
from typing import Any

import pytest
from conftest import wait_for
from durable_sessions_collector import __version__, httpserver
from durable_sessions_collector.jsonlog import JsonLog
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from sidecar_clients import any_value, one_action_export

TOKEN = "edge-token-0123456789abcdef"


def export_body(session: str, action: str = "a") -> bytes:
    span = {
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": action.encode().hex().ljust(16, "0")[:16],
        "name": f"step {action}",
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000000000000001",
        "attributes": [
            {"key": "session.id", "value": {"stringValue": session}},
            {"key": "agent.action.id", "value": {"stringValue": action}},
            {"key": "agent.action.kind", "value": {"stringValue": "tool_call"}},
        ],
    }
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()


def post_head(body_length: int | str, path: str = "/v1/traces", **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: sidecar", "Content-Type: application/json"]
    lines.append(f"Content-Length: {body_length}")
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def connect(sidecar) -> socket.socket:  # type: ignore[no-untyped-def]
    return socket.create_connection(("127.0.0.1", sidecar.service.http_port), timeout=10)


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sends within ``timeout`` s, and whether it closed the connection."""
    deadline = time.monotonic() + timeout
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            got = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:  # closed with our unread request bytes in its buffer
            return data, True
        if not got:
            return data, True
        data += got
    return data, False


def read_response(sock: socket.socket, timeout: float = 10) -> tuple[bytes, bool]:
    """What the server sends until one whole response is in (within ``timeout`` s), and
    whether it closed the connection. Unlike :func:`read_until_closed`, it returns as soon
    as the response is whole: a connection kept open is not waited on for a set time, which
    a loaded machine (the sanitizer's run) could exceed before the response came."""
    deadline = time.monotonic() + timeout
    data = b""
    while not _whole_response(data) and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            got = sock.recv(65536)
        except TimeoutError:
            break
        if not got:
            return data, True
        data += got
    return data, False


def _whole_response(data: bytes) -> bool:
    head, separator, body = data.partition(b"\r\n\r\n")
    if not separator:
        return False
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    return len(body) >= length


def responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 responses in ``data``, in order (status, lower-case headers, body)."""
    found = []
    while data:
        head, separator, data = data.partition(b"\r\n\r\n")
        assert separator, f"incomplete response {head!r}"
        status_line, *lines = head.decode("latin-1").split("\r\n")
        assert status_line.startswith("HTTP/1.1 "), status_line
        headers = {name.strip().lower(): value.strip() for name, value in (x.split(":", 1) for x in lines)}
        length = int(headers.get("content-length", 0))
        found.append((int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    return found


def reset(sock: socket.socket) -> None:
    """Close with a TCP RST, as a client that crashes or a load balancer does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def assert_healthy(sidecar, session: str = "after") -> None:  # type: ignore[no-untyped-def]
    assert sidecar.get("/healthz") == (200, {"status": "ok"})
    with connect(sidecar) as sock:
        body = export_body(session)
        sock.sendall(post_head(len(body), Connection="close") + body)
        data, closed = read_until_closed(sock, 10)
    assert closed and responses(data)[0][0] == 200
    assert sidecar.session(session)["action_count"] == 1


def quiet_log(sidecar, capfd) -> None:  # type: ignore[no-untyped-def]
    """No Python traceback on standard error, and no error or warning in the JSON log."""
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out, captured.err
    loud = [line for line in sidecar.log.lines() if line["level"] in ("error", "warning")]
    assert not loud, loud


def server_threads() -> int:
    return threading.active_count()


@pytest.fixture
def short(start_sidecar, monkeypatch):  # type: ignore[no-untyped-def]
    """A sidecar whose HTTP port times out within seconds (the defaults are 60/10/30/60 s)."""
    monkeypatch.setattr(httpserver, "IDLE_TIMEOUT_S", 1.5)
    monkeypatch.setattr(httpserver, "HEADER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(httpserver, "STALL_TIMEOUT_S", 1.0)
    monkeypatch.setattr(httpserver, "BODY_TIMEOUT_S", 1.5)
    return start_sidecar(log_level="DEBUG")


# --- slow and silent clients ---------------------------------------------------------------


def test_a_client_trickling_its_headers_is_cut_off_while_others_are_served(short, capfd) -> None:  # type: ignore[no-untyped-def]
    # Slowloris: one byte every 0.2 s never lets a per-receive timeout (1 s) expire; only the
    # header deadline ends it. The stdlib server has neither: the thread was held forever.
    assert_healthy(short, "before")
    baseline = server_threads()
    slow = connect(short)
    request = b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\nX-Slow: " + b"a" * 1000
    started = time.monotonic()
    closed_after = None
    for n, byte in enumerate(request):
        try:
            slow.sendall(bytes([byte]))
        except OSError:
            closed_after = time.monotonic() - started
            break
        if n == 1:
            assert_healthy(short)  # served while the slow client trickles
        data, closed = read_until_closed(slow, 0.2)
        if closed:
            assert data == b""  # closed without an answer, as Go's server does
            closed_after = time.monotonic() - started
            break
        if time.monotonic() - started > 6:
            break
    slow.close()
    assert closed_after is not None, "a client trickling its headers was never cut off"
    assert closed_after < 4, closed_after
    wait_for(lambda: server_threads() <= baseline, timeout=5)
    quiet_log(short, capfd)


def test_a_body_that_stalls_is_answered_400_and_closed(short, capfd) -> None:  # type: ignore[no-untyped-def]
    baseline = server_threads()
    body = export_body("stalled")
    with connect(short) as sock:
        sock.sendall(post_head(len(body)) + body[:10])  # then nothing
        data, closed = read_until_closed(sock, 5)
    assert closed, "the connection of a stalled body was never closed"
    [(status, headers, answer)] = responses(data)
    assert status == 400 and headers["connection"] == "close"
    assert "request body stalled: nothing received for 1 s" in json.loads(answer)["message"]
    # Also a body nobody asked for (the API ignores it) stalled: the connection is closed.
    with connect(short) as sock:
        sock.sendall(post_head(100, path="/api/sessions/x").replace(b"POST", b"GET") + b"{")
        data, closed = read_until_closed(sock, 5)
    assert closed and [status for status, _, _ in responses(data)] == [404]
    wait_for(lambda: server_threads() <= baseline, timeout=5)
    assert short.get("/api/sessions/stalled")[0] == 404
    assert_healthy(short)
    quiet_log(short, capfd)


def test_idle_keep_alive_connections_do_not_pin_threads(short) -> None:  # type: ignore[no-untyped-def]
    # 200 connections: half never send anything, half stay open after one request.
    baseline = server_threads()
    idle: list[socket.socket] = []
    for n in range(200):
        sock = connect(short)
        if n % 2:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n")
        idle.append(sock)
    wait_for(lambda: server_threads() > baseline + 50, timeout=5)  # one thread per open connection
    try:
        for n, sock in enumerate(idle):
            data, closed = read_until_closed(sock, 6)
            assert closed, f"idle connection {n} was never closed"
            assert [status for status, _, _ in responses(data)] == ([200] if n % 2 else [])
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: server_threads() <= baseline, timeout=5)
    assert_healthy(short)


def test_a_burst_of_connections_is_accepted_without_syn_retransmissions(sidecar) -> None:  # type: ignore[no-untyped-def]
    # socketserver's listen backlog of 5 overflowed under a burst: a dropped SYN costs its
    # client a 1 s retransmission (100 concurrent requests took up to 4 s on loopback).
    took: list[float] = []

    def one() -> None:
        started = time.monotonic()
        with connect(sidecar) as sock:
            took.append(time.monotonic() - started)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
            data, _ = read_until_closed(sock, 10)
            assert responses(data)[0][0] == 200

    clients = [threading.Thread(target=one) for _ in range(150)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    assert len(took) == 150 and max(took) < 0.9, sorted(took)[-5:]


def test_clients_that_reset_their_connection_leave_no_traceback_and_no_error(sidecar, capfd) -> None:  # type: ignore[no-untyped-def]
    # A client (or load balancer) that drops its connection mid-request is no server error:
    # the stdlib printed a traceback to standard error, and a body cut off on /v1/traces
    # was logged as http-handler-failed with a 500.
    body = export_body("reset")
    for data in (
        b"GET /healthz HTTP/1.1\r\nHost",  # inside the headers
        post_head(len(body)) + body[:10],  # inside an Export's body
        post_head(100, path="/nowhere") + b"{",  # inside a body nobody reads
    ):
        sock = connect(sidecar)
        sock.sendall(data)
        time.sleep(0.2)
        reset(sock)
    sock = connect(sidecar)  # idle on keep-alive, after an answer
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n")
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
    time.sleep(0.2)
    reset(sock)
    time.sleep(0.3)
    assert not [line for line in sidecar.log.lines() if line["event"] == "http-handler-failed"]
    assert sidecar.get("/api/sessions/reset")[0] == 404
    assert_healthy(sidecar)
    quiet_log(sidecar, capfd)


# --- body framing (request smuggling) ----------------------------------------------------------

SMUGGLED = b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n"
BODY = export_body("smuggled")
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
TE_HEAD = (
    b"POST /v1/traces HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: %s\r\n\r\n"
)


@pytest.mark.parametrize(
    ("request_bytes", "status", "message"),
    [
        (
            post_head(len(CHUNKED), Transfer_Encoding="chunked") + CHUNKED,
            400,
            "both Transfer-Encoding and Content-Length",
        ),
        (
            post_head(len(BODY), Content_Length=str(len(BODY) - 40)) + BODY,
            400,
            "conflicting Content-Length values",
        ),
        (post_head(f"+{len(BODY)}") + BODY, 400, "is not a byte count"),
        (post_head(f"0_{len(BODY)}") + BODY, 400, "is not a byte count"),
        (TE_HEAD % b"gzip, chunked" + CHUNKED, 501, "is not supported; send chunked or a Content-Length"),
        (TE_HEAD % b"chunked, identity" + CHUNKED, 400, "chunked must be the last coding"),
        (TE_HEAD % b"chunked" + b"-1\r\n" + BODY + b"\r\n0\r\n\r\n", 400, "bad chunk-size line"),
        (TE_HEAD % b"chunked" + b"0x%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY), 400, "bad chunk-size line"),
        (TE_HEAD % b"chunked" + b"%x\r\n%s\r\n0\r\n\r\n" % (10, BODY), 400, "longer than its size"),
    ],
    ids=[
        "chunked-and-content-length",
        "two-content-lengths",
        "content-length-plus",
        "content-length-underscore",
        "unsupported-transfer-coding",
        "chunked-not-last",
        "negative-chunk-size",
        "0x-chunk-size",
        "chunk-longer-than-its-size",
    ],
)
def test_ambiguous_framing_is_refused_and_closes_the_connection(
    sidecar, request_bytes, status, message
) -> None:  # type: ignore[no-untyped-def]
    # The bytes after the refused request ("GET /healthz") must never be answered: a proxy in
    # front may frame the body differently, and the rest would be a smuggled request.
    with connect(sidecar) as sock:
        sock.sendall(request_bytes + SMUGGLED)
        data, closed = read_until_closed(sock, 5)
    assert closed
    [(got, headers, body)] = responses(data)
    assert (got, headers["connection"]) == (status, "close")
    assert message in json.loads(body)["message"]
    assert sidecar.get("/api/sessions/smuggled")[0] == 404


def test_ambiguous_framing_closes_the_connection_on_every_path(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    # Paths that never read the body (404, 401, 405) must not trust its framing either.
    sidecar = start_sidecar(auth__token=TOKEN)
    for path, auth, status in (
        ("/nowhere", f"Bearer {TOKEN}", 404),
        ("/v1/traces", "Bearer wrong", 401),
        ("/healthz", f"Bearer {TOKEN}", 405),
    ):
        head = post_head(len(CHUNKED), path=path, Transfer_Encoding="chunked", Authorization=auth)
        with connect(sidecar) as sock:
            sock.sendall(head + CHUNKED + SMUGGLED)
            data, closed = read_until_closed(sock, 5)
        assert closed, path
        assert [got for got, _, _ in responses(data)] == [status], path
        with connect(sidecar) as sock:
            sock.sendall(TE_HEAD.replace(b"/v1/traces", path.encode()) % b"xchunked" + CHUNKED + SMUGGLED)
            data, closed = read_until_closed(sock, 5)
        assert closed and len(responses(data)) == 1, path


def test_valid_framing_variants_are_served_in_order_on_one_connection(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Pipelined, on one keep-alive connection: a chunked body with a chunk extension and a
    # trailer, a Content-Length repeated with the same value (RFC 9110 section 8.6 allows it),
    # a HEAD, then a request with Connection: close.
    first, second = export_body("framing", "c1"), export_body("framing", "c2")
    chunked = b"10;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: yes\r\n\r\n" % (
        first[:16],
        len(first) - 16,
        first[16:],
    )
    pipeline = (
        TE_HEAD % b"Chunked"
        + chunked
        + post_head(f"{len(second)}, {len(second)}", Content_Length=str(len(second)))
        + second
        + b"HEAD /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n"
        + b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n"
    )
    with connect(sidecar) as sock:
        sock.sendall(pipeline)
        data, closed = read_until_closed(sock, 10)
    assert closed
    head = data.split(b"HTTP/1.1 ")
    assert [part[:3] for part in head[1:]] == [b"200"] * 4
    assert [a["action_id"] for a in sidecar.session("framing")["actions"]] == ["c1", "c2"]


SMUGGLING_HEAD = b"POST /v1/traces HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/json\r\n%s\r\n"


@pytest.mark.parametrize(
    ("field_lines", "message"),
    [
        (b"Content-Length : %d\r\n", "header field name 'Content-Length ' is not a token"),
        (b"Content-Length\t: %d\r\n", "header field name 'Content-Length\\t' is not a token"),
        (b"Content\x01Length: %d\r\n", "header field name 'Content\\x01Length' is not a token"),
        (b"Content-Length %d\r\n", "has no colon"),
        (b"X-Before: 1\r\n Content-Length: %d\r\n", "is folded onto the one above"),
        (b"X-Before: 1\rContent-Length: %d\r\n", "header field 'X-Before' has a CR or NUL in its value"),
    ],
    ids=["space-before-colon", "tab-before-colon", "control-in-name", "no-colon", "obs-fold", "bare-cr"],
)
def test_a_malformed_header_line_is_refused_and_closes_the_connection(sidecar, field_lines, message) -> None:  # type: ignore[no-untyped-def]
    # RFC 9112 section 5.1. The stdlib's parser ended the headers at a line it could not
    # read and dropped it: the body (a whole request, for a proxy that framed it by that
    # Content-Length) was then answered as a second request.
    head = SMUGGLING_HEAD % (field_lines % len(SMUGGLED))
    with connect(sidecar) as sock:
        sock.sendall(head + SMUGGLED)
        data, closed = read_until_closed(sock, 5)
    assert closed
    [(status, headers, body)] = responses(data)
    assert (status, headers["connection"], headers["content-type"]) == (400, "close", "application/json")
    refusal = json.loads(body)  # a google.rpc.Status, as OTLP/HTTP wants for every 4xx there
    assert refusal["code"] == code_pb2.INVALID_ARGUMENT and message in refusal["message"], refusal
    assert_healthy(sidecar)


@pytest.mark.parametrize(
    ("body_start", "status"),
    [(b"zz\r\n", 400), (b"-1\r\n", 400), (b"%x\r\n" % (64 * 1024 * 1024 + 1), 413)],
    ids=["bad-chunk-size", "negative-chunk-size", "chunk-over-the-limit"],
)
def test_a_refused_chunked_body_is_answered_at_once(sidecar, body_start, status) -> None:  # type: ignore[no-untyped-def]
    # The client sends nothing after the line refused. The body was parsed a second time to
    # discard it, which waited on its next line until the stall timeout (30 s) before the
    # answer went out.
    with connect(sidecar) as sock:
        sock.sendall(TE_HEAD % b"chunked" + body_start)
        started = time.monotonic()
        data, closed = read_until_closed(sock, 5)
        took = time.monotonic() - started
    assert closed and took < 1, took
    [(got, headers, _)] = responses(data)
    assert (got, headers["connection"]) == (status, "close")


# --- Expect: 100-continue ------------------------------------------------------------------------


def test_expect_100_continue_is_answered_before_the_upload_only_when_the_body_is_wanted(
    start_sidecar,
) -> None:  # type: ignore[no-untyped-def]
    # curl sends "Expect: 100-continue" for large bodies and waits (1 s) for 100 Continue.
    # A request refused anyway (bad token, too large by its Content-Length) is answered at
    # once, so the client does not upload a body only to have it thrown away.
    sidecar = start_sidecar(auth__token=TOKEN)
    body = export_body("expect")
    with connect(sidecar) as sock:
        sock.sendall(post_head(len(body), Expect="100-continue", Authorization=f"Bearer {TOKEN}"))
        interim, closed = read_until_closed(sock, 1)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n" and not closed
        sock.sendall(body)
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
    with connect(sidecar) as sock:
        sock.sendall(
            f"GET /api/sessions/expect HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n".encode()
        )
        data, _ = read_until_closed(sock, 5)
    assert json.loads(responses(data)[0][2])["action_count"] == 1
    for auth, length, status in (
        ("Bearer wrong", 10 * 1024 * 1024, 401),
        (f"Bearer {TOKEN}", 100 * 1024 * 1024, 413),
    ):
        with connect(sidecar) as sock:
            sock.sendall(post_head(length, Expect="100-continue", Authorization=auth))
            data, closed = read_until_closed(sock, 5)
        assert closed
        [(got, headers, _)] = responses(data)  # no 100 Continue before it
        assert (got, headers["connection"]) == (status, "close")
    # RFC 7235: 1*SP between the scheme and the token; a tab is not a separator.
    for header, status in ((f"Bearer   {TOKEN}", 200), (f"bEaReR {TOKEN}", 200), (f"Bearer\t{TOKEN}", 401)):
        with connect(sidecar) as sock:
            sock.sendall(
                f"GET /metrics HTTP/1.1\r\nAuthorization: {header}\r\nConnection: close\r\n\r\n".encode()
            )
            data, _ = read_until_closed(sock, 5)
        assert responses(data)[0][0] == status, header


# --- not HTTP at all ---------------------------------------------------------------------------


def test_tls_spoken_to_the_plain_port_is_closed_at_once_and_logged(start_sidecar, capfd) -> None:  # type: ignore[no-untyped-def]
    # A client configured for https:// sends a ClientHello, which holds no line feed the
    # stdlib could end a request line at: both sides waited, forever.
    sidecar = start_sidecar(log_level="DEBUG")
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    started = time.monotonic()
    with connect(sidecar) as raw, pytest.raises((ssl.SSLError, ConnectionError)):
        raw.settimeout(5)
        context.wrap_socket(raw, server_hostname="localhost")
    assert time.monotonic() - started < 2
    events = [line for line in sidecar.log.lines() if line["event"] == "http-bad-request"]
    assert events and "TLS handshake on the plain-HTTP port" in events[0]["error"]
    assert_healthy(sidecar)
    quiet_log(sidecar, capfd)


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"\x00\x01\x02\xff garbage\r\n\r\n", 400),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),  # a gRPC client on the HTTP port
        (b"GET /healthz HTTP/1.1.1\r\n\r\n", 400),
    ],
    ids=["garbage", "http2-preface", "bad-version"],
)
def test_request_lines_that_are_not_http_get_a_status_line_and_a_close(
    sidecar, request_bytes, status
) -> None:  # type: ignore[no-untyped-def]
    # Answered before the version is known: the stdlib sent them HTTP/0.9-style, a bare HTML
    # page without any status line.
    with connect(sidecar) as sock:
        sock.sendall(request_bytes)
        data, closed = read_until_closed(sock, 5)
    assert closed
    assert data.startswith(b"HTTP/1.1 %d " % status), data[:80]
    [(_, headers, body)] = responses(data)
    # The stdlib's own error page was HTML; every answer of this port is JSON.
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"]
    assert_healthy(sidecar)


def test_other_request_forms(sidecar) -> None:  # type: ignore[no-untyped-def]
    cases: list[tuple[bytes, int, dict[str, Any]]] = [
        (b"GET /healthz HTTP/1.0\r\n\r\n", 200, {"connection": "close"}),
        (b"GET http://sidecar:4320/healthz HTTP/1.1\r\nConnection: close\r\n\r\n", 200, {}),  # absolute form
        (b"BREW /v1/traces HTTP/1.1\r\nHost: sidecar\r\n\r\n", 501, {"connection": "close"}),
        (b"GET /api/sessions/..%2F..%2Fmetrics HTTP/1.1\r\nConnection: close\r\n\r\n", 404, {}),
        (b"GET /healthz HTTP/1.1\r\n" + b"X-H: 1\r\n" * 101 + b"\r\n", 431, {"connection": "close"}),
        (b"GET /healthz HTTP/1.1\r\nX-H: " + b"h" * 70_000 + b"\r\n\r\n", 431, {"connection": "close"}),
    ]
    for request_bytes, status, expected in cases:
        with connect(sidecar) as sock:
            sock.sendall(request_bytes)
            data, closed = read_until_closed(sock, 5)
        assert closed, request_bytes[:40]
        [(got, headers, _)] = responses(data)
        assert got == status, (request_bytes[:40], got)
        assert expected.items() <= headers.items()
    assert_healthy(sidecar)


def test_an_unknown_method_is_answered_in_json(sidecar) -> None:  # type: ignore[no-untyped-def]
    """JSON everywhere; on the OTLP path a ``google.rpc.Status`` in the request's
    encoding (JSON when it names none), as for every error there."""
    for path, content_type, expected in (
        (b"/api/sessions", b"", {"error": "Unsupported method ('BREW\"')"}),
        (b"/v1/traces", b"", {"code": code_pb2.UNIMPLEMENTED, "message": "Unsupported method ('BREW\"')"}),
    ):
        with connect(sidecar) as sock:
            sock.sendall(b'BREW" %s HTTP/1.1\r\nHost: sidecar\r\n%s\r\n' % (path, content_type))
            data, closed = read_until_closed(sock, 5)
        [(status, headers, body)] = responses(data)
        assert (status, headers["content-type"], closed) == (501, "application/json", True)
        assert json.loads(body) == expected
    with connect(sidecar) as sock:
        sock.sendall(
            b"BREW /v1/traces HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/x-protobuf\r\n\r\n"
        )
        data, closed = read_until_closed(sock, 5)
    [(status, headers, body)] = responses(data)
    assert (status, headers["content-type"]) == (501, "application/x-protobuf")
    assert status_pb2.Status.FromString(body).code == code_pb2.UNIMPLEMENTED


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/v1/traces", "OPTIONS, POST"),
        ("/api/sessions", "GET, HEAD, OPTIONS"),
        ("/api/sessions/s-1", "GET, HEAD, OPTIONS"),
    ],
)
def test_options_names_the_methods_of_a_path(sidecar, path, allowed) -> None:  # type: ignore[no-untyped-def]
    # Was 501 with an HTML page: OPTIONS had no handler.
    with connect(sidecar) as sock:
        sock.sendall(b"OPTIONS %s HTTP/1.1\r\nHost: sidecar\r\n\r\n" % path.encode())
        data, closed = read_until_closed(sock, 1)
    [(status, headers, body)] = responses(data)
    assert (status, headers["allow"], body, closed) == (200, allowed, b"", False)
    with connect(sidecar) as sock:  # the Allow of a 405 is the same list
        sock.sendall(b"DELETE %s HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n" % path.encode())
        data, _ = read_until_closed(sock, 5)
    [(status, headers, _)] = responses(data)
    assert (status, headers["allow"]) == (405, allowed)


def test_options_of_an_unknown_path_is_not_found(sidecar) -> None:  # type: ignore[no-untyped-def]
    with connect(sidecar) as sock:
        sock.sendall(b"OPTIONS /nowhere HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
        data, _ = read_until_closed(sock, 5)
    [(status, _, _)] = responses(data)
    assert status == 404


def test_the_server_header_names_the_product_and_its_version(sidecar) -> None:  # type: ignore[no-untyped-def]
    with connect(sidecar) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        data, _ = read_until_closed(sock, 5)
    assert f"\r\nServer: durable-sessions-collector/{__version__}\r\n".encode() in data, data[:200]


# --- how many connections, a body's whole time, and stopping ------------------------------


def connection_threads() -> int:
    """Threads serving the HTTP port's connections (socketserver names them so)."""
    return sum("process_request_thread" in thread.name for thread in threading.enumerate())


def half_sent_body(sidecar, session: str) -> socket.socket:  # type: ignore[no-untyped-def]
    """A connection in the middle of a request: headers sent, and 10 bytes of the body."""
    body = export_body(session)
    sock = connect(sidecar)
    sock.sendall(post_head(len(body)) + body[:10])
    return sock


def test_connections_over_the_cap_wait_in_the_backlog_without_a_thread_each(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    # Before, each connection got a thread at once: 100 clients stuck mid-body were 100
    # threads, for as long as their bodies took.
    sidecar = start_sidecar(receivers__http__max_connections=3)
    busy = [half_sent_body(sidecar, f"busy-{n}") for n in range(3)]
    wait_for(lambda: connection_threads() == 3, timeout=5)
    waiting = [half_sent_body(sidecar, f"waiting-{n}") for n in range(40)]  # connects succeed
    time.sleep(0.5)
    assert connection_threads() == 3
    assert sidecar.service.http.connections.open == 3
    # The three busy clients finish their bodies: the waiting ones are served in turn.
    for n, sock in enumerate(busy):
        sock.sendall(export_body(f"busy-{n}")[10:])
        data, _ = read_until_closed(sock, 0.5)
        assert responses(data)[0][0] == 200
    for n, sock in enumerate(waiting):
        sock.sendall(export_body(f"waiting-{n}")[10:] + b"")
    for n, sock in enumerate(waiting):
        data, _ = read_until_closed(sock, 0.3)
        while not data.endswith(b"}"):
            more, closed = read_until_closed(sock, 10)
            assert more or not closed, f"waiting connection {n} got no answer"
            data += more
        assert responses(data)[0][0] == 200, n
        sock.close()
        assert connection_threads() <= 3
    for sock in busy:
        sock.close()
    wait_for(lambda: sidecar.service.http.connections.open == 0, timeout=5)
    assert all(sidecar.session(f"waiting-{n}")["action_count"] == 1 for n in range(40))


def test_at_the_cap_the_longest_idle_keep_alive_connection_makes_room(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    # Idle keep-alive connections hold their slots for up to 60 s; a new client must not
    # wait for that while they sit unused.
    sidecar = start_sidecar(receivers__http__max_connections=2)
    idle = []
    for _ in range(2):
        sock = connect(sidecar)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n")
        data, closed = read_response(sock)
        assert not closed and responses(data)[0][0] == 200
        assert read_until_closed(sock, 0.3) == (b"", False)  # and kept open
        idle.append(sock)
        time.sleep(0.1)  # the first is idle the longer
    started = time.monotonic()
    with connect(sidecar) as newcomer:
        newcomer.sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
        data, closed = read_until_closed(newcomer, 10)
    assert closed and responses(data)[0][0] == 200
    assert time.monotonic() - started < 2  # not the 60 s idle timeout
    first, closed_first = read_until_closed(idle[0], 1)
    assert closed_first and first == b"", "the longest idle connection was not the one closed"
    registry = sidecar.service.metrics.registry
    assert registry.get_sample_value("durable_sessions_http_idle_connections_closed_total") == 1
    assert registry.get_sample_value("durable_sessions_http_connections_limit") == 2
    wait_for(
        lambda: registry.get_sample_value("durable_sessions_http_connections") == 1
    )  # the other idle one
    idle[1].sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
    data, _ = read_until_closed(idle[1], 10)
    assert responses(data)[0][0] == 200  # the other one is still served
    for sock in idle:
        sock.close()


def test_a_body_trickled_past_its_deadline_is_answered_400_and_closed(short, capfd) -> None:  # type: ignore[no-untyped-def]
    # Each pause (0.2 s) stays under the stall timeout (1 s), so only the whole body's
    # deadline (1.5 s here) ends it. Before, a body sent a byte at a time held its thread
    # for as long as the client liked.
    trickled = export_body("trickled") * 4
    started = time.monotonic()
    with connect(short) as sock:
        sock.sendall(post_head(len(trickled)))
        answer, closed = b"", False
        for byte in trickled:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            answer, closed = read_until_closed(sock, 0.2)
            if answer or closed:
                break
        more, closed = read_until_closed(sock, 5)
    took = time.monotonic() - started
    [(status, headers, body)] = responses(answer + more)
    assert status == 400 and headers["connection"] == "close" and closed
    assert "request body not received within 1.5 s" in json.loads(body)["message"]
    assert 1.4 < took < 4, took
    assert short.get("/api/sessions/trickled")[0] == 404
    assert_healthy(short)
    quiet_log(short, capfd)


def test_stopping_closes_idle_connections_at_once_and_answers_requests_in_flight(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    # Before, stop() left keep-alive connections open (for up to the 60 s idle timeout),
    # and a request sent on one after the stop was still dispatched.
    sidecar = start_sidecar()
    idle = connect(sidecar)
    idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n")
    data, closed = read_response(idle)
    assert not closed and responses(data)[0][0] == 200
    assert read_until_closed(idle, 0.3) == (b"", False)  # and kept open
    in_flight = half_sent_body(sidecar, "in-flight")
    wait_for(lambda: sidecar.service.http.connections.open == 2, timeout=5)
    stopping = threading.Thread(target=sidecar.service.stop)
    started = time.monotonic()
    stopping.start()
    data, closed = read_until_closed(idle, 1.5)
    assert closed and data == b"", "an idle keep-alive connection was left open by stop()"
    assert time.monotonic() - started < 1.5
    in_flight.sendall(export_body("in-flight")[10:])  # within the 2 s grace
    data, closed = read_until_closed(in_flight, 5)
    [(status, headers, _)] = responses(data)
    assert status == 200 and headers["connection"] == "close" and closed
    stopping.join(timeout=10)
    assert not stopping.is_alive()
    in_flight.close()
    idle.close()
    with pytest.raises(OSError):
        connect(sidecar)


def test_over_tls_an_idle_connection_makes_room_too(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The idle connection's thread waits on a TLS socket: it must wake, and give its slot
    # back, when the port closes it under it.
    from tls_certs import make_cert

    ca, cert, key = make_cert(tmp_path)
    sidecar = start_sidecar(
        tls__cert_file=str(cert), tls__key_file=str(key), receivers__http__max_connections=1
    )
    context = ssl.create_default_context(cafile=str(ca))

    def tls_connect() -> ssl.SSLSocket:
        return context.wrap_socket(connect(sidecar), server_hostname="localhost")

    idle = tls_connect()
    idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n")
    data, closed = read_response(idle)
    assert not closed and responses(data)[0][0] == 200
    assert read_until_closed(idle, 0.3) == (b"", False)  # and kept open
    started = time.monotonic()
    with tls_connect() as newcomer:
        newcomer.sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
        data, _ = read_until_closed(newcomer, 10)
    assert responses(data)[0][0] == 200
    assert time.monotonic() - started < 3
    data, closed = read_until_closed(idle, 2)
    assert closed and data == b""
    idle.close()


def test_requests_on_a_keep_alive_connection_are_not_held_by_delayed_acks(sidecar) -> None:  # type: ignore[no-untyped-def]
    # A response is written as headers, then body. Without TCP_NODELAY, Nagle's algorithm
    # held the body until the client ACKed the headers, which Linux delays by 40 ms: 50
    # requests on one connection took over 2 s (tens of milliseconds now).
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=10)
    started = time.monotonic()
    for _ in range(50):
        connection.request("GET", "/not-routed")
        response = connection.getresponse()
        response.read()
        assert response.status == 404
    took = time.monotonic() - started
    connection.close()
    assert took < 1.0, f"50 keep-alive requests took {took:.2f} s"


def test_one_waiting_connection_closes_one_idle_connection_however_slow_its_end() -> None:
    # The accepting thread looks for a slot every SLOT_WAIT_S; an idle connection it closed
    # may take longer than that to give its slot back on a busy machine. Before, each look
    # closed another idle connection.
    closed: list[int] = []
    connections = httpserver.Connections(2, on_idle_closed=lambda: closed.append(1))
    pairs = [socket.socketpair() for _ in range(2)]
    waiting = []
    for server_side, _ in pairs:
        assert connections.take(0)
        thread = threading.Thread(target=connections.wait_for_request, args=(server_side, 30), daemon=True)
        thread.start()
        waiting.append(thread)
    wait_for(lambda: len(connections._idle) == 2)
    for _ in range(5):  # five looks, and no slot given back meanwhile
        assert not connections.take(0.01)
    assert closed == [1]
    waiting[0].join(timeout=5)
    assert not waiting[0].is_alive()  # the longest idle was woken (and would end its connection)
    assert waiting[1].is_alive()  # the other is still waiting for its next request
    connections.release()  # the closed one's slot comes back
    assert connections.take(0)
    connections.stop(0)
    for server_side, client_side in pairs:
        server_side.close()
        client_side.close()


def test_stopping_serves_a_connection_whose_request_has_arrived_but_not_been_seen() -> None:
    # Between a waiting connection's poll seeing its next request and its thread taking it
    # out of the idle ones, stop() closed it as idle: the request went unanswered (seen as
    # a rare failure of the stopping test above on a busy machine).
    connections = httpserver.Connections(2)
    arriving, idle = socket.socketpair(), socket.socketpair()
    for server_side, _ in (arriving, idle):
        assert connections.take(0)
        connections._idle[server_side] = None  # as wait_for_request counts it, before its poll returns
    arriving[1].sendall(b"POST /v1/traces HTTP/1.1\r\n")
    wait_for(lambda: httpserver._readable(arriving[0], 0))
    connections.stop(0)
    idle[1].settimeout(5)
    assert idle[1].recv(1) == b""  # the idle one is closed
    arriving[1].setblocking(False)
    with pytest.raises(BlockingIOError):
        arriving[1].recv(1)  # the other is left open, for its thread to serve the request
    assert arriving[0].recv(100) == b"POST /v1/traces HTTP/1.1\r\n"
    for pair in (arriving, idle):
        for side in pair:
            side.close()


DISCARDED_BYTES = 24 * 1024 * 1024


def _send_discarded_body(sock: socket.socket, head: bytes, chunked: bool) -> None:
    """``head``, then a body of :data:`DISCARDED_BYTES` sent in pieces (the test's own
    memory stays small), as one chunk when ``chunked``."""
    piece = b"\0" * (1024 * 1024)
    sock.sendall(head + (b"%x\r\n" % DISCARDED_BYTES if chunked else b""))
    for _ in range(DISCARDED_BYTES // len(piece)):
        sock.sendall(piece)
    sock.sendall(b"\r\n0\r\n\r\n" if chunked else b"")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [
        ("/v1/traces", {}, 401),  # no token
        ("/v1/traces", {"Authorization": f"Bearer {TOKEN}", "Content-Type": "text/plain"}, 415),
        ("/nowhere", {"Authorization": f"Bearer {TOKEN}"}, 404),
    ],
    ids=["401", "415", "404"],
)
def test_a_refused_requests_body_is_discarded_without_being_held(  # type: ignore[no-untyped-def]
    start_sidecar, path: str, headers: dict[str, str], status: int, chunked: bool
) -> None:
    """The body of a request refused before it is read (no token, a Content-Type or path
    the port does not serve) is read to keep the connection in step, and dropped a piece
    at a time. It was read whole into memory first: a client without the token could
    make the port hold ``max_request_bytes`` (64 MiB) on each of its 256 connections."""
    sidecar = start_sidecar(auth__token=TOKEN)
    lines = [f"POST {path} HTTP/1.1", "Host: sidecar", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in {"Content-Type": "application/json", **headers}.items()]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {DISCARDED_BYTES}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    tracemalloc.start()  # the sidecar runs in this process: its allocations are traced
    try:
        with connect(sidecar) as sock:
            _send_discarded_body(sock, head, chunked)
            data, closed = read_until_closed(sock, 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    [(answered, _, _)] = responses(data)
    assert closed and answered == status
    assert peak < DISCARDED_BYTES // 4, f"{peak} bytes held while discarding a {DISCARDED_BYTES}-byte body"


def test_a_discarded_body_keeps_the_connection_in_step(sidecar) -> None:  # type: ignore[no-untyped-def]
    """After a body discarded piece by piece (a 404's), the next request on the connection
    is read from where that body ended."""
    body = export_body("after-discard", "d1")
    with connect(sidecar) as sock:
        _send_discarded_body(sock, post_head(DISCARDED_BYTES, path="/nowhere"), chunked=False)
        sock.sendall(post_head(len(body), Connection="close") + body)
        data, closed = read_until_closed(sock, 10)
    assert closed
    assert [status for status, _, _ in responses(data)] == [404, 200]
    assert [a["action_id"] for a in sidecar.session("after-discard")["actions"]] == ["d1"]


def test_a_body_in_tiny_chunks_is_held_at_its_own_size(sidecar) -> None:  # type: ignore[no-untyped-def]
    """Each chunk of a chunked body was kept as its own bytes object until the body was
    joined: a body sent one byte per chunk held about 40 times its size (a 34-byte object
    and a list slot per byte), past what ``max_request_bytes`` promises. The chunks go
    into one buffer now."""
    request = ExportTraceServiceRequest.FromString(one_action_export(1, "tiny-chunks"))
    pad = KeyValue(key="foreign.pad", value=any_value("p" * 100_000))  # read by no rule
    request.resource_spans[0].resource.attributes.append(pad)
    body = request.SerializeToString()
    head = (
        b"POST /v1/traces HTTP/1.1\r\nHost: sidecar\r\nContent-Type: application/x-protobuf\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    wire = head + b"".join(b"1\r\n%c\r\n" % byte for byte in body) + b"0\r\n\r\n"
    tracemalloc.start()  # the sidecar runs in this process: its allocations are traced
    try:
        with connect(sidecar) as sock:
            sock.sendall(wire)
            data, closed = read_until_closed(sock, 60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    [(status, _, _)] = responses(data)
    assert closed and status == 200
    assert [a["action_id"] for a in sidecar.session("tiny-chunks")["actions"]] == ["a1"]
    assert peak < 12 * len(body), f"{peak} bytes held for a {len(body)}-byte body in 1-byte chunks"


def test_a_port_never_started_stops_at_once() -> None:
    """A start-up that fails after the HTTP port is bound (before its serving thread runs)
    tears the port down: ``stop()`` waited for a ``serve_forever`` that never ran, so
    ``serve`` hung for ever instead of exiting with its error."""
    server = httpserver.HttpServer(
        "127.0.0.1:0", httpserver.Router(), JsonLog(io.StringIO()), body_limit=1024
    )
    port = server.port
    stopping = threading.Thread(target=server.stop, daemon=True)
    stopping.start()
    stopping.join(10)
    assert not stopping.is_alive(), "stop() of a port never started did not return"
    with pytest.raises(ConnectionRefusedError):  # and the port is closed
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
