"""A real webhook receiver for the tests: a local HTTP server that records each POST.

``fail_first`` answers that many requests with ``fail_status`` (and ``retry_after`` as
its ``Retry-After``) before it starts accepting; ``fail_status`` with
``fail_first=None`` fails forever. ``delay_s`` holds every answer that long (a slow
receiver). It can be started
on a port chosen in advance (a receiver that is down, then comes up).
"""

from __future__ import annotations

import io
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from durable_sessions_collector.alerts.outbox import DeliveryPolicy
from durable_sessions_collector.alerts.webhook import WebhookAlerts
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import Alert

ALERT = Alert(
    id=1,
    channel="webhook",
    violation_key="k",
    payload={"session_id": "s-1", "rule": "unkeyed-side-effect", "action_id": "a-1", "key": "k"},
    attempts=0,
)
"""An alert to POST with :func:`webhook_channel`."""


def webhook_channel(url: str, timeout_s: float = 2) -> WebhookAlerts:
    """The webhook channel alone: :meth:`WebhookAlerts.post` needs no store or metrics."""
    return WebhookAlerts(None, JsonLog(io.StringIO()), None, url, policy=DeliveryPolicy(timeout_s=timeout_s))  # type: ignore[arg-type]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    raw: bytes
    at: float = field(default_factory=time.monotonic)


class ClosedPort:
    """A loopback port where connections are refused, as to a receiver that is down, held
    (bound, not listening) so that no other socket takes it meanwhile: a port that
    :func:`free_port` names is free again at once, and a sidecar binding port 0 could be
    given it, its alerts then going to its own HTTP port. :meth:`release` it right before
    the receiver starts on it."""

    def __init__(self) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = int(self._socket.getsockname()[1])

    def release(self) -> int:
        self._socket.close()
        return self.port


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that writes no access-log line to stderr for each request."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Ipv6HttpServer(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def serve_in_background(
    handler: type[BaseHTTPRequestHandler],
    host: str = "127.0.0.1",
    port: int = 0,
    tls: ssl.SSLContext | None = None,
) -> ThreadingHTTPServer:
    """A real HTTP server of ``handler`` on ``host`` (IPv6 for a host with a colon) and
    ``port`` (0: a free one), TLS when ``tls`` is given, serving from a daemon thread with
    a daemon thread per request. :func:`stop_serving` ends it."""
    server = (_Ipv6HttpServer if ":" in host else ThreadingHTTPServer)((host, port), handler)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def stop_serving(server: ThreadingHTTPServer) -> None:
    """Stop a server of :func:`serve_in_background` and close its port."""
    server.shutdown()
    server.server_close()


class WebhookServer:
    def __init__(
        self,
        port: int = 0,
        *,
        fail_first: int | None = 0,
        fail_status: int = 503,
        retry_after: str | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.requests: list[Received] = []
        self.accepted: list[Received] = []
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.retry_after = retry_after
        self._lock = threading.Lock()
        owner = self

        class Handler(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                received = Received(
                    self.path, {k.lower(): v for k, v in self.headers.items()}, json.loads(raw), raw
                )
                with owner._lock:
                    owner.requests.append(received)
                    failing = owner.fail_first is None or len(owner.requests) <= owner.fail_first
                    if not failing:
                        owner.accepted.append(received)
                status = owner.fail_status if failing else 200
                time.sleep(delay_s)
                body = b'{"ok": true}' if status == 200 else b'{"error": "try later"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if failing and owner.retry_after is not None:
                    self.send_header("Retry-After", owner.retry_after)
                self.end_headers()
                self.wfile.write(body)

        self.httpd = serve_in_background(Handler, port=port)
        self.port = self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/durable-sessions"

    def stop(self) -> None:
        stop_serving(self.httpd)

    def __enter__(self) -> WebhookServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
