"""Edge cases of the sidecar's APIs, auth and webhook delivery: the HTTP JSON API, the gRPC
SessionService, the bearer token and TLS, and the webhook outbox.

Each test drives a real sidecar on free loopback ports with real clients: odd session ids
and query parameters, oversized input quoted back in errors, watch slots that must come
back, store connections that must not pile up, and a webhook receiver that answers with
Retry-After, timeouts and every class of status.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import socket
import sqlite3
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import pytest
from conftest import wait_for
from durable_sessions_collector.api.grpc_api import CURSOR_METADATA
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from durable_sessions_collector.store.stored import stored_text
from hypothesis import given, settings
from hypothesis import strategies as st
from sidecar_clients import Agent, grpc_exporter
from tls_certs import make_cert
from webhook_server import QuietHandler, serve_in_background, stop_serving

TOKEN = "edges-token-0123456789abcdef"
GRPC_ORDERS = {"last_seen": pb.LIST_ORDER_LAST_SEEN, "session_id": pb.LIST_ORDER_SESSION_ID}
OTHER_LISTING = "page_token: the token belongs to a listing with another verdict or order, or is damaged"
FAST = {
    "alerts__webhook__backoff_s": 0.05,
    "alerts__webhook__max_backoff_s": 0.2,
    "alerts__webhook__timeout_s": 2,
}


# --- helpers ---------------------------------------------------------------------------


def raw_request(
    sidecar: Any, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection, the path sent exactly as given."""
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.service.http_port, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def api_stub(sidecar: Any) -> tuple[grpc.Channel, pb_grpc.SessionServiceStub]:
    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    return channel, pb_grpc.SessionServiceStub(channel)


def grpc_page_after(sidecar: Any, page: dict[str, Any], **request: Any) -> pb.ListSessionsResponse:
    """The gRPC ListSessions page that follows ``page`` of the HTTP list, by its token."""
    channel, api = api_stub(sidecar)
    try:
        return api.ListSessions(
            pb.ListSessionsRequest(page_token=page["next_page_token"], **request), timeout=10
        )
    finally:
        channel.close()


def bad_request(sidecar: Any, path: str) -> str:
    """The error of the 400 the HTTP API answers ``path`` with."""
    status, document = sidecar.get(path)
    assert status == 400, (path, status, document)
    return str(document["error"])


def watch(api: pb_grpc.SessionServiceStub, cursor: str = "", timeout: float = 30) -> Any:
    """A started WatchAlerts stream (past its initial metadata). A slot still held by a
    stream that was just cancelled is waited for: its server side ends within a poll."""

    def start() -> Any:
        call = api.WatchAlerts(pb.WatchAlertsRequest(cursor=cursor), timeout=timeout)
        if call.initial_metadata():
            return call
        assert call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (call.code(), call.details())
        return None

    return wait_for(start)


def deliveries(sidecar: Any, outcome: str) -> float:
    return sidecar.metric("durable_sessions_alert_deliveries_total", channel="webhook", outcome=outcome)


def outbox(sidecar: Any, state: str) -> float:
    return sidecar.metric("durable_sessions_alert_outbox", channel="webhook", state=state)


def unkeyed_payment(sidecar: Any, session_id: str = "pay-1") -> None:
    """One unkeyed payment: an unkeyed-side-effect error, found at ingest."""
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action(session_id, "charge", "payment")
    agent.shutdown()


class ScriptedHook:
    """A webhook receiver answering each POST from a script of (status, headers, delay_s);
    past the script's end it answers 200. Records each request's headers and arrival time."""

    def __init__(self, script: list[tuple[int, dict[str, str], float]]) -> None:
        self.script = list(script)
        self.requests: list[tuple[float, dict[str, str]]] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with owner._lock:
                    index = len(owner.requests)
                    owner.requests.append((time.monotonic(), {k.lower(): v for k, v in self.headers.items()}))
                status, headers, delay = owner.script[index] if index < len(owner.script) else (200, {}, 0.0)
                if delay:
                    time.sleep(delay)
                body = b"{}"
                try:
                    self.send_response(status)
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass

        self.httpd = serve_in_background(Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"

    def __enter__(self) -> ScriptedHook:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_serving(self.httpd)


# --- HTTP JSON API: session ids, query parameters, methods --------------------------------

ODD_IDS = [
    "a/b/c",
    "50%off",
    "%2F-literal",
    "with space",
    "plus+sign",
    "q?x#y&z=1;p",
    "ünïcødé-会话-🙂",
    "dots..",
    "x" * 5000,
]


def test_odd_session_ids_round_trip_over_http_and_grpc(sidecar) -> None:  # type: ignore[no-untyped-def]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for session_id in ODD_IDS:
        agent.action(session_id, "a1", "tool_call")
    agent.shutdown()
    channel, api = api_stub(sidecar)
    for session_id in ODD_IDS:
        # Fully percent-encoded (what the CLI's client sends).
        status, document = sidecar.get("/api/sessions/" + quote(session_id, safe=""))
        assert status == 200, (session_id[:40], document)
        # An id over 256 characters is stored, and shown, as its digest; found by the id.
        assert document["session_id"] == stored_text(session_id) and document["action_count"] == 1
        got = api.GetSession(pb.GetSessionRequest(session_id=session_id), timeout=10)
        assert got.summary.session_id == stored_text(session_id)
    # A '/' left unencoded in the path reaches the same session.
    status, _, body = raw_request(sidecar, "GET", "/api/sessions/a/b/c")
    assert status == 200 and json.loads(body)["session_id"] == "a/b/c"
    # Encoded and unencoded '%' are told apart: "%2F-literal" is not "/-literal".
    assert sidecar.get("/api/sessions/" + quote("/-literal", safe=""))[0] == 404
    listed = sidecar.get("/api/sessions?limit=1000")[1]["sessions"]
    assert sorted(s["session_id"] for s in listed) == sorted(map(stored_text, ODD_IDS))
    channel.close()


def test_a_path_whose_escapes_are_not_utf8_is_a_400_not_another_session(sidecar) -> None:  # type: ignore[no-untyped-def]
    """``%E9`` (é in Latin-1) and ``%C3`` (a cut UTF-8 sequence) name no session: a span's
    id is UTF-8 text, and gRPC refuses such a string outright. Decoded with replacement,
    each was read as U+FFFD, and the session "\\ufffd" answered for an id never sent."""
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("\ufffd", "a1", "tool_call")
    agent.action("caf\ufffd", "a1", "tool_call")
    agent.shutdown()
    assert sidecar.get("/api/sessions/" + quote("\ufffd", safe=""))[0] == 200  # its own id finds it
    for path in ("/api/sessions/%E9", "/api/sessions/%C3", "/api/sessions/caf%E9", "/api/sessions/%ED%A0%80"):
        status, headers, body = raw_request(sidecar, "GET", path)
        assert (status, headers["Content-Type"]) == (400, "application/json"), (path, body)
        assert "not UTF-8" in json.loads(body)["error"], body
    assert [line for line in sidecar.log.lines() if line["level"] == "error"] == []


def raw_request_line(sidecar: Any, target: bytes) -> tuple[int, Any]:
    """The status and JSON of a GET of ``target``, its bytes sent as they are (as curl sends
    a URL typed with non-ASCII characters: unencoded)."""
    with socket.create_connection(("127.0.0.1", sidecar.service.http_port), timeout=10) as connection:
        connection.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_a_path_with_unencoded_utf8_reaches_the_session_it_names(sidecar) -> None:  # type: ignore[no-untyped-def]
    """``curl http://…/api/sessions/é-会话`` sends the id's UTF-8 bytes unencoded. The
    stdlib reads the request line as Latin-1, so the id looked up was 'Ã©-ä¼\\x9a…': a 404
    for a session that exists, quoting an id the user never typed."""
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("é-会话", "a1", "tool_call")
    agent.shutdown()
    status, document = raw_request_line(sidecar, "/api/sessions/é-会话".encode())
    assert (status, document["session_id"]) == (200, "é-会话"), document
    status, document = raw_request_line(sidecar, "/api/sessions?verdict=é".encode())
    assert (status, document["error"]) == (400, "verdict must be one of ok, at_risk, unrecoverable, got 'é'")
    status, document = raw_request_line(sidecar, b"/api/sessions/caf\xe9")  # a Latin-1 byte: no UTF-8
    assert status == 400 and "not UTF-8" in document["error"], document


def test_unknown_sessions_and_paths_answer_404_json(sidecar) -> None:  # type: ignore[no-untyped-def]
    status, document = sidecar.get("/api/sessions/" + quote("nope/../x", safe=""))
    assert status == 404 and "nope/../x" in document["error"]
    status, headers, body = raw_request(sidecar, "GET", "/nowhere")
    assert status == 404 and b"/nowhere" in body and headers["Content-Type"] == "application/json"


def test_an_empty_session_id_is_a_400_naming_it_as_over_grpc(sidecar) -> None:  # type: ignore[no-untyped-def]
    """``/api/sessions/`` gives an empty id, which no session has: a bad id, answered 400
    as a non-UTF-8 one is (and as gRPC answers INVALID_ARGUMENT), not 404 "no such path"
    for a path the API does serve. The list, ``/api/sessions``, is unchanged."""
    for method in ("GET", "HEAD"):
        status, headers, body = raw_request(sidecar, method, "/api/sessions/")
        assert (status, headers["Content-Type"]) == (400, "application/json"), (method, body)
    document = sidecar.get("/api/sessions/")[1]
    assert document == {"error": "the session id is empty; give one: /api/sessions/{id}"}
    assert sidecar.get("/api/sessions/?limit=1")[1]["error"].startswith("unknown argument 'limit'")
    assert sidecar.get("/api/sessions") == (200, {"sessions": [], "next_page_token": ""})


def test_a_request_line_too_long_to_read_is_a_414_json(sidecar) -> None:  # type: ignore[no-untyped-def]
    # The stdlib refuses a request line over 64 KiB before it has a path: the port's answer
    # looked that path up, so the connection was dropped unanswered (the CLI then asked
    # whether it was the gRPC port) and the sidecar logged an AttributeError.
    status, headers, body = raw_request(sidecar, "GET", "/api/sessions/" + quote("é" * 12_000, safe=""))
    assert status == 414 and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"error": "Request-URI Too Long"}
    assert [line for line in sidecar.log.lines() if line["level"] == "error"] == []
    assert sidecar.get("/api/sessions")[0] == 200  # and the port serves on


def test_query_parameters_are_validated(sidecar) -> None:  # type: ignore[no-untyped-def]
    unkeyed_payment(sidecar, "bad")
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    agent.action("good", "u1", "user_prompt", result='{"x": 1}')
    agent.shutdown()
    for query in (
        "verdict=bogus",
        "verdict=OK",
        "limit=0",
        "limit=1001",
        "limit=-1",
        "limit=abc",
        "limit=1.5",
    ):
        status, document = sidecar.get("/api/sessions?" + query)
        assert status == 400, query
        assert query.split("=")[0] in document["error"], (query, document)
    status, document = sidecar.get("/api/sessions?verdict=unrecoverable")
    assert status == 200 and [s["session_id"] for s in document["sessions"]] == ["bad"]
    status, document = sidecar.get("/api/sessions?verdict=ok&limit=1")
    assert status == 200 and [s["session_id"] for s in document["sessions"]] == ["good"]
    # A repeated argument is refused: one of the values was used, the other ignored unsaid.
    for path, name in (
        ("/api/sessions?verdict=ok&verdict=unrecoverable", "verdict"),
        ("/api/sessions?limit=1&verdict=ok&limit=1", "limit"),
        ("/api/sessions?page_token=&page_token=", "page_token"),
        ("/api/sessions/bad?actions_limit=1&actions_limit=2", "actions_limit"),
        ("/api/sessions/bad?violations_page_token=&violations_page_token=", "violations_page_token"),
    ):
        status, document = sidecar.get(path)
        assert (status, document["error"]) == (
            400,
            f"argument '{name}' is given more than once; give it once",
        )
    # An unknown or blank one is refused: a misspelt verdit=ok, or verdict=, listed every session.
    for path, error in (
        ("/api/sessions?verdit=ok", "unknown argument 'verdit'; this path takes verdict, limit, page_token, order"),
        ("/api/sessions?verdict=", "verdict must be one of ok, at_risk, unrecoverable, got ''"),
        ("/api/sessions/bad?limit=1", "unknown argument 'limit'; this path takes actions_limit, "
         "actions_page_token, violations_limit, violations_page_token"),
    ):  # fmt: skip
        status, document = sidecar.get(path)
        assert (status, document["error"]) == (400, error), path
    # But a blank page token is the first page, as an empty one is over gRPC. (Compared
    # once the sessions have ended: the sweep, idle_s 0.3 s, could end them between reads.)
    wait_for(lambda: all(s["state"] == "ended" for s in sidecar.get("/api/sessions")[1]["sessions"]))
    first = sidecar.get("/api/sessions")
    assert sidecar.get("/api/sessions?page_token=") == first and first[0] == 200
    assert sidecar.get("/api/sessions/bad?actions_page_token=&violations_page_token=") == sidecar.get(
        "/api/sessions/bad"
    )
    # A limit of 5,000 digits (int() refuses past 4,300: a 500), and one with leading zeros.
    status, document = sidecar.get("/api/sessions?limit=" + "9" * 5000)
    assert status == 400 and "limit must be an integer from 1 to 1000" in document["error"]
    status, document = sidecar.get("/api/sessions?limit=" + "0" * 5000 + "1")
    assert status == 200 and len(document["sessions"]) == 1
    assert not [line for line in sidecar.log.lines() if line.get("event") == "http-handler-failed"]
    status, document = sidecar.get("/api/sessions?limit=1")
    assert status == 200 and len(document["sessions"]) == 1


def test_a_query_value_is_quoted_back_as_sent_with_its_plus_signs(sidecar) -> None:  # type: ignore[no-untyped-def]
    """A ``+`` in a query value is the character the client sent (RFC 3986; no value this
    API takes holds a space), so ``limit=+1`` is refused quoting ``'+1'``: read as form
    encoding, the error quoted ``' 1'``, a value never sent. A sign is refused: a limit is
    digits, as the documented range says."""
    unkeyed_payment(sidecar, "bad")
    for path, error in (
        ("/api/sessions?limit=+1", "limit must be an integer from 1 to 1000, got '+1'"),
        ("/api/sessions?verdict=at+risk", "verdict must be one of ok, at_risk, unrecoverable, got 'at+risk'"),
        ("/api/sessions?order=last+seen", "order must be one of last_seen, session_id, got 'last+seen'"),
        ("/api/sessions/bad?actions_limit=+5", "actions_limit must be an integer from 1 to 5000, got '+5'"),
        ("/api/sessions/bad?violations_limit=1+", "violations_limit must be an integer from 1 to 5000, got '1+'"),
        ("/api/sessions?limit=%2B1", "limit must be an integer from 1 to 1000, got '+1'"),
        ("/api/sessions?limit=%201", "limit must be an integer from 1 to 1000, got ' 1'"),
    ):  # fmt: skip
        assert bad_request(sidecar, path) == error, path
    assert bad_request(sidecar, "/api/sessions?verd+ict=ok").startswith("unknown argument 'verd+ict'")


def test_a_query_argument_that_is_not_utf8_is_a_400_quoting_its_bytes(sidecar) -> None:  # type: ignore[no-untyped-def]
    """``verdict=%E9`` (a Latin-1 é) is refused as the path's non-UTF-8 id is, naming the
    argument and quoting the bytes sent. Decoded with replacement, the error quoted
    ``'\ufffd'``, a character never sent, and a page token ``%E9`` was "not a page token"."""
    unkeyed_payment(sidecar, "bad")
    for path, error in (
        ("/api/sessions?verdict=%E9", "argument 'verdict' is not UTF-8 once percent-decoded: '%E9'"),
        ("/api/sessions?order=caf%E9", "argument 'order' is not UTF-8 once percent-decoded: 'caf%E9'"),
        ("/api/sessions?page_token=%C3", "argument 'page_token' is not UTF-8 once percent-decoded: '%C3'"),
        ("/api/sessions?verd%E9=ok", "an argument name is not UTF-8 once percent-decoded: 'verd%E9'"),
        ("/api/sessions/bad?actions_page_token=%ED%A0%80",
         "argument 'actions_page_token' is not UTF-8 once percent-decoded: '%ED%A0%80'"),
    ):  # fmt: skip
        assert bad_request(sidecar, path) == error, path
    assert [line for line in sidecar.log.lines() if line["level"] == "error"] == []


def test_a_non_ascii_digit_limit_is_a_400(sidecar) -> None:  # type: ignore[no-untyped-def]
    """``limit=²`` is answered 400 like every other bad limit. '²' is a Unicode digit
    (``str.isdigit`` says so) that ``int()`` refuses, so a check by ``isdigit`` alone would
    let it through to a failing conversion: a 500 and an error in the log for bad input."""
    status, document = sidecar.get("/api/sessions?limit=%C2%B2")  # limit=²
    assert status == 400, document
    assert "limit" in document["error"]
    assert not [line for line in sidecar.log.lines() if line.get("event") == "http-handler-failed"]


def test_methods_head_and_405(sidecar) -> None:  # type: ignore[no-untyped-def]
    status, headers, body = raw_request(sidecar, "HEAD", "/api/sessions")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    status, headers, body = raw_request(sidecar, "HEAD", "/healthz")
    assert status == 200 and body == b""
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, body = raw_request(sidecar, method, "/api/sessions/x", body=b"{}")
        assert status == 405, method
        assert headers["Allow"] == "GET, HEAD, OPTIONS"
    status, headers, _ = raw_request(sidecar, "GET", "/v1/traces")
    assert status == 405 and headers["Allow"] == "OPTIONS, POST"


def test_http_reads_keep_store_handles_bounded(sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The number of open handles on the store file stays bounded however many HTTP
    connections were served. The HTTP port runs every client connection in a thread of
    its own, and every probe, scrape or API call reads the store: a read connection kept
    per thread would leave two file descriptors (the database and its WAL) behind per
    client connection until the store closes; a liveness probe every 10 s would exhaust
    a 1024-fd limit in under 3 hours."""
    database = str(tmp_path / "sessions.db")

    def open_handles() -> int:
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith(database):
                    count += 1
            except OSError:
                pass
        return count

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    sidecar.get("/healthz")
    before = open_handles()
    for _ in range(100):
        assert sidecar.get("/healthz")[0] == 200  # a new connection (and thread) each time
    after = open_handles()
    assert after - before < 20, f"{after - before} store handles left open by 100 served connections"


def test_http_list_pages_through_every_session_with_the_grpc_apis_tokens(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Before, the HTTP list stopped at 1,000 sessions, with no way to the rest.
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(5):
        agent.action(f"ok-{n}", "u1", "user_prompt", result='{"x": 1}')
    agent.action("bad", "t1", "tool_call", retryable=True)  # unbounded-retry
    agent.shutdown()
    seen: list[str] = []
    token, pages = "", 0
    while True:
        status, page = sidecar.get(f"/api/sessions?verdict=ok&limit=2&page_token={quote(token)}")
        assert status == 200 and len(page["sessions"]) <= 2
        seen += [s["session_id"] for s in page["sessions"]]
        pages += 1
        token = page["next_page_token"]
        if not token:
            break
    assert pages == 3 and sorted(seen) == [f"ok-{n}" for n in range(5)] and len(set(seen)) == 5
    status, everything = sidecar.get("/api/sessions")
    assert [s["session_id"] for s in everything["sessions"] if s["verdict"] == "ok"] == seen  # the same order
    assert everything["next_page_token"] == ""
    # One scheme: a token of the HTTP API is one of the gRPC API.
    _, first = sidecar.get("/api/sessions?verdict=ok&limit=2")
    rest = grpc_page_after(sidecar, first, verdict=pb.VERDICT_OK, page_size=10)
    assert [s.session_id for s in rest.sessions] == seen[2:]
    # A token of another listing, or none of this API's, is refused with the reason.
    token = first["next_page_token"]
    assert bad_request(sidecar, f"/api/sessions?verdict=unrecoverable&page_token={token}") == OTHER_LISTING
    assert (
        bad_request(sidecar, "/api/sessions?page_token=not-a-token")
        == "page_token: not a page token of this API"
    )


def test_the_list_by_session_id_walks_every_session_once_while_they_receive_spans(  # type: ignore[no-untyped-def]
    start_sidecar, store_url: str
) -> None:
    """``order=session_id`` (HTTP) and ``LIST_ORDER_SESSION_ID`` (gRPC): each page by id,
    whatever spans arrive between the pages, with tokens of one scheme; a token of the
    other order, or an unknown order, is refused."""
    sidecar = start_sidecar(store_url)
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    names = [f"s-{n}" for n in range(7)]
    for name in reversed(names):
        agent.action(name, "u1", "user_prompt", result='{"x": 1}')
    agent.action("bad", "t1", "tool_call", retryable=True)  # unbounded-retry: another verdict
    seen: list[str] = []
    token = ""
    while True:
        status, page = sidecar.get(
            f"/api/sessions?verdict=ok&limit=2&order=session_id&page_token={quote(token)}"
        )
        assert status == 200, page
        seen += [s["session_id"] for s in page["sessions"]]
        # Every session not listed yet becomes the most recently active one.
        for name in names:
            if name not in seen:
                agent.action(name, f"u-{len(seen)}", "user_prompt", result='{"x": 1}')
        token = page["next_page_token"]
        if not token:
            break
    assert seen == names
    _, first = sidecar.get("/api/sessions?limit=3&order=session_id")
    rest = grpc_page_after(sidecar, first, page_size=10, order=pb.LIST_ORDER_SESSION_ID)
    assert [s["session_id"] for s in first["sessions"]] + [s.session_id for s in rest.sessions] == [
        "bad",
        *names,
    ]
    for order in (pb.LIST_ORDER_LAST_SEEN, 7):
        with pytest.raises(grpc.RpcError) as refused:
            grpc_page_after(sidecar, first, order=order)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    _, by_activity = sidecar.get("/api/sessions?limit=1")
    token = by_activity["next_page_token"]
    assert bad_request(sidecar, f"/api/sessions?order=session_id&page_token={token}") == OTHER_LISTING
    assert bad_request(sidecar, "/api/sessions?order=first_seen") == (
        "order must be one of last_seen, session_id, got 'first_seen'"
    )
    agent.shutdown()


def test_a_list_token_with_a_session_id_no_store_holds_is_refused_as_damaged(  # type: ignore[no-untyped-def]
    start_sidecar, store_url: str
) -> None:
    """A tampered token whose session id has a lone surrogate (JSON ``"\\ud800"``) is a
    damaged token, of either order; the store's codec error ("surrogates not allowed")
    was answered in its place."""
    sidecar = start_sidecar(store_url)
    documents = ({"t": 1.0, "s": "\ud800", "v": ""}, {"o": "session_id", "s": "a\udfff", "v": ""})
    for order, document in zip(("last_seen", "session_id"), documents, strict=True):
        token = base64.urlsafe_b64encode(json.dumps(document).encode()).decode()
        assert bad_request(sidecar, f"/api/sessions?order={order}&page_token={quote(token)}") == OTHER_LISTING


def test_a_page_token_of_another_store_is_refused_not_read_as_a_position_of_this_one(  # type: ignore[no-untyped-def]
    start_sidecar, tmp_path: Path
) -> None:
    """Two sidecars, each with its own SQLite store, behind one address (pods of a
    Deployment): a walk whose next page reached the other one went on from a position of
    the first store's, skipping the other's sessions before it and listing ones the walk
    had not begun with; a detail's token named an action id of the other store. Each is
    refused, naming the token; a token without a store (an earlier sidecar's) still works."""
    # idle_s: no session ends while the pages are compared (with the fixture's 0.3 s, a
    # loaded machine saw "bad" active on one page and ended on the next).
    sidecars = [start_sidecar(tmp_path / f"{name}.db", evaluation__idle_s=3600) for name in ("a", "b")]
    for sidecar in sidecars:
        agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
        for n in range(4):
            agent.action(f"s-{n}", "u1", "user_prompt", result='{"x": 1}')
            agent.action(f"s-{n}", "u2", "user_prompt", result='{"x": 1}')
        for n in range(2):
            agent.action("bad", f"t{n}", "tool_call", retryable=True)  # unbounded-retry each
        agent.shutdown()
    first, other = sidecars
    another_store = (
        "the token is of another store, whose positions are not this one's; start again from the first page"
    )
    for order in ("last_seen", "session_id"):
        _, page = first.get(f"/api/sessions?limit=2&order={order}")
        wait_for(lambda: len(other.get("/api/sessions")[1]["sessions"]) == 5)
        token = page["next_page_token"]
        assert bad_request(other, f"/api/sessions?order={order}&page_token={token}") == (
            f"page_token: {another_store}"
        )
        channel, api = api_stub(other)
        with pytest.raises(grpc.RpcError) as refused:
            api.ListSessions(pb.ListSessionsRequest(page_token=token, order=GRPC_ORDERS[order]), timeout=10)
        assert (refused.value.code(), refused.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"page_token: {another_store}",
        )
        channel.close()
        # An earlier sidecar's token names no store: read as a position, as it was.
        document = json.loads(base64.urlsafe_b64decode(token))
        document.pop("d", None)
        earlier = base64.urlsafe_b64encode(json.dumps(document).encode()).decode()
        status, rest = first.get(f"/api/sessions?order={order}&page_token={quote(earlier)}")
        _, everything = first.get(f"/api/sessions?order={order}")
        assert status == 200 and page["sessions"] + rest["sessions"] == everything["sessions"]
    _, detail = first.get("/api/sessions/bad?actions_limit=1&violations_limit=1")
    for name in ("actions", "violations"):
        token = detail[f"next_{name}_page_token"]
        assert token and bad_request(other, f"/api/sessions/bad?{name}_page_token={quote(token)}") == (
            f"{name}_page_token: {another_store}"
        )
        status, rest = first.get(f"/api/sessions/bad?{name}_page_token={quote(token)}")
        assert status == 200 and len(rest[name]) == 1


def walk_detail(sidecar: Any, session_id: str, name: str, size: int, query: str = "") -> list[dict[str, Any]]:
    """Every page of a session's ``name`` list (actions, violations), ``size`` a page."""
    pages, token = [], ""
    while True:
        status, page = sidecar.get(
            f"/api/sessions/{session_id}?{name}_limit={size}&{name}_page_token={quote(token)}{query}"
        )
        assert status == 200 and len(page[name]) <= size
        pages.append(page)
        token = page[f"next_{name}_page_token"]
        if not token:
            return pages


def test_a_sessions_actions_page_through_both_apis_with_one_token(sidecar) -> None:  # type: ignore[no-untyped-def]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(7):
        agent.action("long", f"a{n}", "llm_call", result='{"text": "ok"}')
    agent.shutdown()
    _, whole = sidecar.get("/api/sessions/long")
    order = [a["action_id"] for a in whole["actions"]]
    assert order == [f"a{n}" for n in range(7)] and whole["next_actions_page_token"] == ""
    pages = walk_detail(sidecar, "long", "actions", 3)
    assert [a["action_id"] for page in pages for a in page["actions"]] == order
    assert len(pages) == 3 and all(page["action_count"] == 7 for page in pages)
    # The HTTP API's token goes on through the gRPC API, and the other way round.
    _, first = sidecar.get("/api/sessions/long?actions_limit=2")
    channel, api = api_stub(sidecar)
    second = api.GetSession(
        pb.GetSessionRequest(
            session_id="long", actions_page_size=2, actions_page_token=first["next_actions_page_token"]
        ),
        timeout=10,
    )
    assert [a.action_id for a in second.actions] == order[2:4]
    _, third = sidecar.get(f"/api/sessions/long?actions_page_token={quote(second.next_actions_page_token)}")
    assert [a["action_id"] for a in third["actions"]] == order[4:]
    with pytest.raises(grpc.RpcError) as caught:  # a token of another session
        api.GetSession(
            pb.GetSessionRequest(session_id="other", actions_page_token=first["next_actions_page_token"]),
            timeout=10,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "actions_page_token: the token belongs to another session, or is damaged"
    channel.close()
    for query, error in (
        ("actions_limit=0", "actions_limit must be an integer from 1 to 5000, got '0'"),
        ("actions_limit=5001", "actions_limit must be an integer from 1 to 5000, got '5001'"),
        ("actions_page_token=zz", "actions_page_token: not a page token of this API"),
        ("violations_limit=0", "violations_limit must be an integer from 1 to 5000, got '0'"),
        ("violations_page_token=zz", "violations_page_token: not a page token of this API"),
    ):
        status, refused = sidecar.get(f"/api/sessions/long?{query}")
        assert (status, refused["error"]) == (400, error), query


def test_a_sessions_violations_page_through_both_apis_beside_its_actions(sidecar) -> None:  # type: ignore[no-untyped-def]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(5):
        agent.action("runaway", f"t{n}", "tool_call", retryable=True)  # unbounded-retry, each
    agent.shutdown()
    _, whole = sidecar.get("/api/sessions/runaway")
    keys = [v["key"] for v in whole["violations"]]
    assert len(keys) == 5 and whole["next_violations_page_token"] == ""
    pages = walk_detail(sidecar, "runaway", "violations", 2, "&actions_limit=1")
    assert [v["key"] for page in pages for v in page["violations"]] == keys
    assert len(pages) == 3 and all(len(page["actions"]) == 1 for page in pages)
    _, first = sidecar.get("/api/sessions/runaway?violations_limit=3")
    channel, api = api_stub(sidecar)
    rest = api.GetSession(
        pb.GetSessionRequest(session_id="runaway", violations_page_token=first["next_violations_page_token"]),
        timeout=10,
    )
    channel.close()
    assert [v.key for v in rest.violations] == keys[3:] and rest.next_violations_page_token == ""
    status, refused = sidecar.get(
        f"/api/sessions/other?violations_page_token={first['next_violations_page_token']}"
    )
    assert (status, refused["error"]) == (
        400,
        "violations_page_token: the token belongs to another session, or is damaged",
    )


def test_sessions_with_long_ids_page_through_the_list_and_their_detail(sidecar) -> None:  # type: ignore[no-untyped-def]
    # The tokens held the session id, and one over 1,024 characters was refused: a
    # 750-character id, or 130 CJK ones (six characters each in JSON), ended a walk.
    ids = ["a" * 3000, "会話" * 300, "short"]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for session in ids:
        for n in range(3):
            agent.action(session, f"a{n}", "tool_call")
    agent.shutdown()
    listed, token = [], ""
    while True:
        status, page = sidecar.get(f"/api/sessions?limit=1&page_token={quote(token)}")
        assert status == 200, page
        listed += [s["session_id"] for s in page["sessions"]]
        if not (token := page["next_page_token"]):
            break
    assert sorted(listed) == sorted(map(stored_text, ids))  # a long id is listed as its digest
    for session in ids:
        seen, token = [], ""
        while True:
            status, page = sidecar.get(
                f"/api/sessions/{quote(session, safe='')}?actions_limit=1&actions_page_token={quote(token)}"
            )
            assert status == 200, page
            assert len(page["next_actions_page_token"]) < 200  # a digest of the id, not the id
            seen += [a["action_id"] for a in page["actions"]]
            if not (token := page["next_actions_page_token"]):
                break
        assert seen == ["a0", "a1", "a2"], session[:10]


def test_a_crafted_page_token_is_a_400_not_an_internal_error(sidecar) -> None:  # type: ignore[no-untyped-def]
    # A token of nested arrays made json.loads raise RecursionError: a 500 and an error
    # logged for each request.
    deep = base64.urlsafe_b64encode(b"[" * 5000).decode()
    for path in (f"/api/sessions?page_token={deep}", f"/api/sessions/s?violations_page_token={deep}"):
        status, refused = sidecar.get(path)
        assert (status, refused["error"].split(": ", 1)[-1]) == (400, "not a page token of this API"), path


@pytest.mark.parametrize("last_seen", ["1e400", "NaN", "Infinity", "-Infinity", "true", "10" + "0" * 400])
def test_a_page_token_whose_position_is_not_a_finite_number_is_refused(last_seen: str) -> None:
    # 10**400 raised OverflowError (a 500, UNKNOWN on gRPC); NaN gave an empty page and
    # Infinity the first one, as if the token were good.
    from durable_sessions_collector.api import paging

    token = base64.urlsafe_b64encode(f'{{"t":{last_seen},"s":"x","v":""}}'.encode()).decode()
    with pytest.raises(ValueError, match="damaged"):
        paging.decode_page_token(token, None)


@settings(max_examples=300, deadline=None)
@given(
    token=st.text(max_size=1200)
    | st.binary(max_size=300).map(lambda b: base64.urlsafe_b64encode(b).decode())
    | st.integers(1, 3000).map(lambda n: base64.urlsafe_b64encode(b"[" * n).decode())
)
def test_fuzz_any_page_token_is_a_position_or_a_value_error(token: str) -> None:
    from durable_sessions_collector.api import paging

    for decode in (
        lambda: paging.decode_page_token(token, None),
        lambda: paging._position(token, "s", "actions_page_token", paging._action_position),
        lambda: paging._position(token, "s", "violations_page_token", paging._violation_position),
    ):
        with contextlib.suppress(ValueError):
            decode()


def test_a_full_page_of_typical_actions_fits_a_grpc_clients_default_limit() -> None:
    from durable_sessions_collector.api.grpc_api import action_message
    from durable_sessions_collector.store.base import MAX_DETAIL_PAGE

    action = {
        "trace_id": "5b8efff798038103d269b633813fc60c",
        "span_id": "eee19b7ec3c1b174",
        "received_at": 1796055284.85,
        "action_id": "a1234",
        "kind": "tool_call",
        "name": "search_flights",
        "status": "ok",
        "session_id": "session-" + "0" * 28,
        "incarnation": "inc-7f3a9c1e-0b2d-4e5f-8a6b",
        "seq": 1796055284851999463,
        "ts": 1796055284.85,
        "result_digest": "sha256:" + "ab" * 32,
        "result_length": 1234,
        "idempotency_key": "booking-" + "k" * 32,
        "retryable": True,
        "max_attempts": 3,
    }
    page = pb.Session(actions=[action_message(action)] * MAX_DETAIL_PAGE)
    assert page.ByteSize() < 4 * 1024 * 1024 * 0.8  # grpcio's default receive limit, with room


def strict_json(body: bytes) -> Any:
    """``body`` read as JavaScript's JSON.parse reads it: NaN and Infinity are not JSON."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(body, parse_constant=refuse)


def post_json_span(sidecar: Any, span: dict[str, Any]) -> None:
    """POST ``span`` alone as an OTLP/JSON Export to the sidecar's HTTP port; it must be taken."""
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()
    request = urllib.request.Request(
        sidecar.http_url + "/v1/traces", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_non_finite_numbers_in_a_record_are_served_as_json_any_parser_reads(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Before, the detail held NaN and Infinity as Python's json writes them: not JSON.
    def attribute(key: str, value: str) -> dict[str, Any]:
        return {"key": key, "value": {"doubleValue": value}}

    span = {
        "traceId": "5b8efff798038103d269b633813fc6aa",
        "spanId": "eee19b7ec3c1b1aa",
        "name": "tool",
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000000000000001",
        "attributes": [
            {"key": "session.id", "value": {"stringValue": "odd-numbers"}},
            {"key": "agent.action.id", "value": {"stringValue": "t1"}},
            {"key": "agent.action.kind", "value": {"stringValue": "tool_call"}},
            {"key": "agent.action.retryable", "value": {"boolValue": True}},
            attribute("agent.action.max_attempts", "NaN"),
            attribute("agent.action.result_length", "-Infinity"),
        ],
    }
    post_json_span(sidecar, span)
    with urllib.request.urlopen(sidecar.http_url + "/api/sessions/odd-numbers", timeout=10) as response:
        detail = strict_json(response.read())
    [action] = detail["actions"]
    assert (action["max_attempts"], action["result_length"]) == ("NaN", "-Infinity")
    assert [v["rule"] for v in detail["violations"]] == ["unbounded-retry"]  # a NaN bound is no bound


def test_integers_past_2_53_are_served_as_their_decimal_text(sidecar) -> None:  # type: ignore[no-untyped-def]
    # Before, seq (the span's start in nanoseconds) and an int64 attribute past 2**53 were
    # JSON numbers, which JavaScript's JSON.parse, and every parser reading numbers as
    # doubles, read as another number (seq off by up to 256 ns).
    span = {
        "traceId": "5b8efff798038103d269b633813fc6ab",
        "spanId": "eee19b7ec3c1b1ab",
        "name": "tool",
        "startTimeUnixNano": "1700000000000000123",
        "endTimeUnixNano": "1700000000000000124",
        "attributes": [
            {"key": "session.id", "value": {"stringValue": "big-numbers"}},
            {"key": "agent.action.id", "value": {"stringValue": "t1"}},
            {"key": "agent.action.kind", "value": {"stringValue": "tool_call"}},
            {"key": "agent.action.max_attempts", "value": {"intValue": str(2**53 + 1)}},
            {"key": "agent.action.result_length", "value": {"intValue": str(2**53)}},
        ],
    }
    post_json_span(sidecar, span)
    with urllib.request.urlopen(sidecar.http_url + "/api/sessions/big-numbers", timeout=10) as response:
        served = response.read()
    exact, as_doubles = json.loads(served), json.loads(served, parse_int=float)
    assert as_doubles == exact  # no number that a double reads as another
    [action] = exact["actions"]
    assert (action["seq"], action["max_attempts"]) == ("1700000000000000123", str(2**53 + 1))
    assert action["result_length"] == 2**53  # a double holds it exactly: still a number


def test_jsontext_writes_non_finite_floats_as_protobuf_json_strings() -> None:
    from durable_sessions_collector import jsontext

    document = {"a": [1.5, float("nan"), {"b": float("inf"), "c": (float("-inf"), 2)}], "d": "NaN", "e": True}
    assert strict_json(jsontext.dumps(document).encode()) == {
        "a": [1.5, "NaN", {"b": "Infinity", "c": ["-Infinity", 2]}],
        "d": "NaN",
        "e": True,
    }
    assert jsontext.dumps({"x": 1.0}, separators=(",", ":")) == '{"x":1.0}'


# --- gRPC SessionService ---------------------------------------------------------------


def test_grpc_list_arguments_are_validated(sidecar) -> None:  # type: ignore[no-untyped-def]
    channel, api = api_stub(sidecar)
    with pytest.raises(grpc.RpcError) as caught:
        api.ListSessions(pb.ListSessionsRequest(verdict=7), timeout=10)  # type: ignore[arg-type]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for token in ("not-base64!", "eyJ4IjoxfQ==", "é"):
        with pytest.raises(grpc.RpcError) as caught:
            api.ListSessions(pb.ListSessionsRequest(page_token=token), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, token
    with pytest.raises(grpc.RpcError) as caught:
        next(api.WatchAlerts(pb.WatchAlertsRequest(verdicts=[9]), timeout=10))  # type: ignore[list-item]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert api.ListSessions(pb.ListSessionsRequest(page_size=5000), timeout=10).sessions == []
    channel.close()


def test_grpc_verdict_unspecified_in_a_watch_list_is_refused_by_name(sidecar) -> None:  # type: ignore[no-untyped-def]
    """VERDICT_UNSPECIFIED (0) in WatchAlerts' verdicts is no verdict to watch: refused
    naming it and saying an empty list watches every verdict (it read "unknown verdict(s)
    [0]"). ListSessions takes it as "not set", every verdict, and refuses a number that
    is no verdict with a message of the same shape."""
    channel, api = api_stub(sidecar)
    for verdicts in ([pb.VERDICT_UNSPECIFIED], [pb.VERDICT_AT_RISK, pb.VERDICT_UNSPECIFIED]):
        with pytest.raises(grpc.RpcError) as caught:
            next(api.WatchAlerts(pb.WatchAlertsRequest(verdicts=verdicts), timeout=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == (
            "verdicts: [VERDICT_UNSPECIFIED] is not a verdict to filter by; send VERDICT_OK, "
            "VERDICT_AT_RISK, VERDICT_UNRECOVERABLE, or no verdicts (an empty list) for every verdict"
        )
    with pytest.raises(grpc.RpcError) as caught:
        api.ListSessions(pb.ListSessionsRequest(verdict=7), timeout=10)  # type: ignore[arg-type]
    assert caught.value.details() == (
        "verdict: [7] is not a verdict to filter by; send VERDICT_OK, VERDICT_AT_RISK, "
        "VERDICT_UNRECOVERABLE, or VERDICT_UNSPECIFIED for every verdict"
    )
    unset = pb.ListSessionsRequest(verdict=pb.VERDICT_UNSPECIFIED)
    assert api.ListSessions(unset, timeout=10).sessions == []
    channel.close()


def test_grpc_get_of_a_very_long_unknown_id_is_not_found(sidecar) -> None:  # type: ignore[no-untyped-def]
    """An unknown id of any length is NOT_FOUND, the id quoted back shortened. The status
    message travels in the grpc-message trailer; past the client's metadata limit
    (16 KiB in grpcio) the client cannot read it and fails the call RESOURCE_EXHAUSTED
    ("received metadata size exceeds hard limit") instead — a code clients treat as
    throttling, not as "no such session"."""
    channel, api = api_stub(sidecar)
    for length in (5_000, 20_000):
        with pytest.raises(grpc.RpcError) as caught:
            api.GetSession(pb.GetSessionRequest(session_id="x" * length), timeout=10)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND, (length, caught.value.details())
        assert "xxxx" in caught.value.details() and len(caught.value.details()) < 200
    channel.close()


def test_grpc_watch_with_a_very_long_bad_cursor_is_invalid_argument(sidecar) -> None:  # type: ignore[no-untyped-def]
    """A bad cursor of any length is INVALID_ARGUMENT, the cursor quoted back shortened: the
    whole of it in the message would put the trailer past the client's metadata limit and
    the client would see RESOURCE_EXHAUSTED instead (as for a long id above)."""
    channel, api = api_stub(sidecar)
    with pytest.raises(grpc.RpcError) as caught:
        next(api.WatchAlerts(pb.WatchAlertsRequest(cursor="y" * 20_000), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "yyyy" in caught.value.details() and len(caught.value.details()) < 300
    channel.close()


def test_a_watch_cursor_out_of_integer_range_is_invalid_argument(sidecar) -> None:  # type: ignore[no-untyped-def]
    """``sqlite:<digits>`` past 2**63-1 is INVALID_ARGUMENT like every other cursor that is
    not one of this store's. SQLite cannot bind such an integer (OverflowError), and an
    error of that kind escaping the stream would fail it UNKNOWN ("Exception iterating
    responses"), which a client cannot tell from a server fault."""
    channel, api = api_stub(sidecar)
    with pytest.raises(grpc.RpcError) as caught:
        next(api.WatchAlerts(pb.WatchAlertsRequest(cursor="sqlite:99999999999999999999999"), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    channel.close()


def test_a_watch_cursor_naming_a_store_badly_is_invalid_argument(sidecar) -> None:  # type: ignore[no-untyped-def]
    """A cursor is a feed position and a store id (``sqlite:V:C@ID``): one whose store id
    or position is not of that form is no cursor of this API, and is not taken for one of
    another store (which would send the whole feed again)."""
    channel, api = api_stub(sidecar)
    for cursor in ("sqlite:1:0@", "sqlite:1:0@not-a-store-id", "@0123456789abcdef", "yes@0123456789abcdef"):
        with pytest.raises(grpc.RpcError) as caught:
            next(api.WatchAlerts(pb.WatchAlertsRequest(cursor=cursor), timeout=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (cursor, caught.value.details())
    channel.close()


def test_a_watch_of_a_rule_the_catalogue_lacks_is_invalid_argument(sidecar) -> None:  # type: ignore[no-untyped-def]
    # A misspelt rule was accepted, and the stream then matched nothing, for ever.
    channel, api = api_stub(sidecar)
    with pytest.raises(grpc.RpcError) as caught:
        next(api.WatchAlerts(pb.WatchAlertsRequest(rules=["unkeyed-side-efect"]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "unknown rule(s) ['unkeyed-side-efect']"
    call = api.WatchAlerts(pb.WatchAlertsRequest(rules=["unkeyed-side-effect"]), timeout=10)
    call.initial_metadata()  # a rule of the catalogue opens the stream
    call.cancel()
    channel.close()


def test_a_watch_of_a_long_unknown_rule_is_invalid_argument_quoting_it_shortened(sidecar) -> None:  # type: ignore[no-untyped-def]
    # The names were quoted whole in the grpc-message trailer: past grpcio's 16 KiB of
    # metadata the client failed the call RESOURCE_EXHAUSTED ("Stream removed"), not the
    # INVALID_ARGUMENT the sidecar chose.
    channel, api = api_stub(sidecar)
    with pytest.raises(grpc.RpcError) as caught:
        next(api.WatchAlerts(pb.WatchAlertsRequest(rules=["x" * 20_000, "y" * 5_000]), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert caught.value.details() == f"unknown rule(s) ['{'x' * 80}…', '{'y' * 80}…']"
    channel.close()


def test_a_watch_logs_a_store_that_fails_once_and_reads_less_often(start_sidecar, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Each open stream logged watch-read-failed at every poll, ten lines a second, for as
    # long as the store failed.
    db = tmp_path / "sessions.db"
    sidecar = start_sidecar(db)
    channel, api = api_stub(sidecar)
    call = api.WatchAlerts(pb.WatchAlertsRequest(), timeout=30)
    call.initial_metadata()
    with sqlite3.connect(db, isolation_level=None) as other:  # reads of the feed fail meanwhile
        other.execute("ALTER TABLE violations RENAME TO violations_away")
        wait_for(lambda: events(sidecar, "watch-read-failed") == 1)
        time.sleep(2)
        other.execute("ALTER TABLE violations_away RENAME TO violations")
    other.close()
    wait_for(lambda: events(sidecar, "watch-read-recovered") == 1, timeout=10)
    assert events(sidecar, "watch-read-failed") == 1
    unkeyed_payment(sidecar, "after")  # the stream goes on
    assert next(call).violation.session_id == "after"
    call.cancel()
    channel.close()


def events(sidecar: Any, name: str) -> int:
    return sum(line.get("event") == name for line in sidecar.log.lines())


def test_cancelled_watches_free_their_slots_and_late_watchers_see_only_new_alerts(sidecar) -> None:  # type: ignore[no-untyped-def]
    channel, api = api_stub(sidecar)
    unkeyed_payment(sidecar, "early")  # committed before any watch
    for _ in range(3):  # three rounds of 8 watches, each round cancelled: slots come back
        calls = [watch(api) for _ in range(8)]
        for call in calls:
            call.cancel()
    late = watch(api)
    cursor = dict(late.initial_metadata())[CURSOR_METADATA]
    unkeyed_payment(sidecar, "late")
    alert = next(late)
    assert alert.violation.session_id == "late"  # not "early", committed before the watch
    late.cancel()
    # From the beginning of the feed ("sqlite:0") both come back, in commit order.
    assert cursor.startswith("sqlite:")
    replay = api.WatchAlerts(pb.WatchAlertsRequest(cursor="sqlite:0"), timeout=30)
    assert [next(replay).violation.session_id for _ in range(2)] == ["early", "late"]
    replay.cancel()
    channel.close()


def test_a_slow_watcher_that_goes_away_frees_its_slot(sidecar) -> None:  # type: ignore[no-untyped-def]
    channel, api = api_stub(sidecar)
    stalled = [watch(api, "sqlite:0", timeout=60) for _ in range(8)]
    agent = Agent(grpc_exporter(sidecar.grpc_endpoint), "inc-1")
    for n in range(300):  # 300 alerts queued to clients that never read them
        agent.action(f"s{n}", "charge", "payment")
    agent.shutdown()
    for call in stalled:
        call.cancel()
    fresh = [watch(api, "sqlite:0") for _ in range(8)]
    for call in fresh:
        assert next(call).violation.rule == "unkeyed-side-effect"
        call.cancel()
    # The port still answers unary calls.
    assert len(api.ListSessions(pb.ListSessionsRequest(page_size=1000), timeout=10).sessions) == 300
    channel.close()


# --- bearer token and TLS ------------------------------------------------------------------


def test_token_scheme_is_case_insensitive_and_required_everywhere_but_healthz(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    sidecar = start_sidecar(auth__token=TOKEN, log_level="DEBUG")
    # RFC 7235 §2.1 / RFC 6750: the auth-scheme is case-insensitive.
    for scheme in ("Bearer", "bearer", "BEARER"):
        status, _, _ = raw_request(sidecar, "GET", "/api/sessions", {"Authorization": f"{scheme} {TOKEN}"})
        assert status == 200, scheme
    for path in ("/api/sessions", "/api/sessions/x", "/metrics", "/nowhere"):
        for header in (None, f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN[:-1]}"):
            status, headers, _ = raw_request(
                sidecar, "GET", path, {"Authorization": header} if header else {}
            )
            assert status == 401, (path, header)
            assert headers["WWW-Authenticate"].startswith('Bearer realm="durable-sessions"')
    assert raw_request(sidecar, "GET", "/healthz")[0] == 200
    assert raw_request(sidecar, "HEAD", "/healthz")[0] == 200
    assert raw_request(sidecar, "POST", "/healthz", body=b"x")[0] == 401  # only GET/HEAD are open
    assert raw_request(sidecar, "GET", "/metrics", {"Authorization": f"Bearer {TOKEN}"})[0] == 200

    channel = grpc.insecure_channel(sidecar.grpc_endpoint)
    api = pb_grpc.SessionServiceStub(channel)
    for scheme in ("Bearer", "bearer"):
        api.ListSessions(
            pb.ListSessionsRequest(), metadata=(("authorization", f"{scheme} {TOKEN}"),), timeout=10
        )
    with pytest.raises(grpc.RpcError) as caught:
        api.GetSession(pb.GetSessionRequest(session_id="x"), metadata=(("authorization", TOKEN),), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()
    assert TOKEN not in "".join(str(line) for line in sidecar.log.lines())


def test_tls_on_the_http_port_is_tls_1_2_or_later(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ca, cert, key = make_cert(tmp_path)
    sidecar = start_sidecar(tls__cert_file=str(cert), tls__key_file=str(key), auth__token=TOKEN)
    context = ssl.create_default_context(cafile=str(ca))
    connection = http.client.HTTPSConnection(
        "127.0.0.1", sidecar.service.http_port, context=context, timeout=10
    )
    connection.request("GET", "/metrics", headers={"Authorization": f"bearer {TOKEN}"})
    response = connection.getresponse()
    assert response.status == 200
    assert connection.sock.version() in ("TLSv1.2", "TLSv1.3")  # type: ignore[union-attr]
    connection.close()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
    channel = grpc.secure_channel(sidecar.grpc_endpoint, credentials)
    api = pb_grpc.SessionServiceStub(channel)
    assert api.ListSessions(
        pb.ListSessionsRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10
    )
    channel.close()
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{sidecar.service.http_port}/healthz", timeout=5)


# --- webhook -------------------------------------------------------------------------------


def test_webhook_honours_retry_after_on_429_and_503(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    script = [(429, {"Retry-After": "1"}, 0.0), (503, {"Retry-After": "1"}, 0.0)]
    with ScriptedHook(script) as hook:
        sidecar = start_sidecar(
            alerts__webhook__url=hook.url,
            alerts__webhook__backoff_s=0.05,
            alerts__webhook__max_backoff_s=5,
        )
        unkeyed_payment(sidecar)
        wait_for(lambda: outbox(sidecar, "delivered") == 1)
        times = [at for at, _ in hook.requests]
        assert len(times) == 3
        assert times[1] - times[0] >= 0.9 and times[2] - times[1] >= 0.9  # not the 0.05 s backoff
        assert len({headers["idempotency-key"] for _, headers in hook.requests}) == 1
        assert deliveries(sidecar, "retry") == 2


def test_webhook_caps_retry_after_at_max_backoff(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    with ScriptedHook([(503, {"Retry-After": "3600"}, 0.0)]) as hook:
        sidecar = start_sidecar(alerts__webhook__url=hook.url, **FAST)
        unkeyed_payment(sidecar)
        wait_for(lambda: outbox(sidecar, "delivered") == 1)
        assert len(hook.requests) == 2
        # max_backoff_s 0.2, not 3600 s (with room for a loaded machine).
        assert hook.requests[1][0] - hook.requests[0][0] < 30


def test_webhook_retries_a_timeout_then_delivers(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    with ScriptedHook([(200, {}, 2.0)]) as hook:  # the first answer comes too late
        sidecar = start_sidecar(
            alerts__webhook__url=hook.url,
            alerts__webhook__timeout_s=0.5,
            alerts__webhook__backoff_s=0.05,
            alerts__webhook__max_backoff_s=0.2,
        )
        unkeyed_payment(sidecar)
        wait_for(lambda: outbox(sidecar, "delivered") == 1)
        assert deliveries(sidecar, "retry") >= 1
        assert len({headers["idempotency-key"] for _, headers in hook.requests}) == 1


@pytest.mark.parametrize(
    ("status", "retried"), [(408, True), (425, True), (404, False), (401, False), (301, False)]
)
def test_webhook_status_classes(start_sidecar, status: int, retried: bool) -> None:  # type: ignore[no-untyped-def]
    headers = {"Location": "http://127.0.0.1:1/elsewhere"} if status == 301 else {}
    with ScriptedHook([(status, headers, 0.0)]) as hook:
        sidecar = start_sidecar(alerts__webhook__url=hook.url, alerts__webhook__max_attempts=4, **FAST)
        unkeyed_payment(sidecar)
        if retried:
            wait_for(lambda: outbox(sidecar, "delivered") == 1)
            assert len(hook.requests) == 2
        else:
            wait_for(lambda: outbox(sidecar, "dead") == 1)
            assert len(hook.requests) == 1 and deliveries(sidecar, "dead_letter") == 1
            [dead] = [line for line in sidecar.log.lines() if line["event"] == "alert-dead-letter"]
            assert dead["reason"] == "rejected by the receiver" and dead["error"] == f"HTTP {status}"


def test_webhook_a_malformed_retry_after_still_counts_the_attempt(start_sidecar) -> None:  # type: ignore[no-untyped-def]
    """A 503 with a malformed Retry-After ('²', byte 0xB2 as http.client decodes it: a
    Unicode digit that ``float()`` refuses) is an ordinary retry: the header is ignored as
    other unparsable values are, the attempt counts, and the alert is dead-lettered after
    ``max_attempts``. An attempt that failed without being recorded would be tried again
    forever and never reach the dead letter."""
    with ScriptedHook([(503, {"Retry-After": "\u00b2"}, 0.0)] * 10) as hook:
        sidecar = start_sidecar(alerts__webhook__url=hook.url, alerts__webhook__max_attempts=2, **FAST)
        unkeyed_payment(sidecar)
        wait_for(lambda: outbox(sidecar, "dead") == 1)
        assert len(hook.requests) == 2  # max_attempts, no more
        assert deliveries(sidecar, "retry") == 1 and deliveries(sidecar, "dead_letter") == 1
        assert not [line for line in sidecar.log.lines() if line["event"] == "alert-delivery-failed"]


def test_an_unreadable_store_is_a_503_to_retry_not_a_500(start_sidecar, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Nothing is wrong with the request: the client (or the CLI's user) should retry.
    import sqlite3

    store = tmp_path / "sessions.db"
    sidecar = start_sidecar(store)
    assert sidecar.get("/api/sessions")[0] == 200
    with sqlite3.connect(store) as db:
        db.execute("DROP TABLE sessions")
    db.close()
    for path in ("/api/sessions", "/api/sessions/some-session"):
        status, headers, body = raw_request(sidecar, "GET", path)
        assert status == 503 and headers["Retry-After"] == "1"
        assert "no such table: sessions" in json.loads(body)["error"]
    assert "http-handler-failed" not in [line.get("event") for line in sidecar.log.lines()]
