"""The HTTP port: a small router on the standard library's threading HTTP server.

Components register routes (``POST /v1/traces``, ``GET /api/sessions``, ``/healthz``,
``/metrics``); each handler gets a :class:`Request` and returns a :class:`Response`.
HTTP/1.1 keep-alive is supported; a request whose body is not fully read closes its
connection, so a rejected upload can never be misread as the next request.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from durable_sessions_collector.jsonlog import JsonLog

DRAIN_LIMIT = 256 * 1024 * 1024
CHUNK = 1024 * 1024


class BodyTooLarge(Exception):
    pass


class BodyError(Exception):
    pass


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Any
    handler: BaseHTTPRequestHandler
    params: dict[str, str] = field(default_factory=dict)
    body_consumed: bool = False
    # True when the caller may be told everything: no auth gate is configured, or the gate
    # accepted its credentials. False on a path the gate leaves open (GET /healthz) to a
    # caller without a valid token.
    authenticated: bool = False

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)

    def read_body(self, limit: int) -> bytes:
        """The request body, at most ``limit`` bytes; raise BodyTooLarge or BodyError."""
        rfile = self.handler.rfile
        encoding = self.header("Transfer-Encoding").lower()
        if "chunked" in encoding:
            return self._read_chunked(limit)
        length_text = self.header("Content-Length")
        if not length_text:
            self.body_consumed = True
            return b""
        try:
            length = int(length_text)
            if length < 0:
                raise ValueError
        except ValueError:
            raise BodyError(f"Content-Length {length_text!r} is not a byte count") from None
        if length > limit:
            self._drain(length)
            raise BodyTooLarge(f"request body is {length} bytes, over the {limit}-byte limit")
        data = rfile.read(length)
        if len(data) != length:
            raise BodyError(f"request body ended after {len(data)} of {length} bytes")
        self.body_consumed = True
        return data

    def _read_chunked(self, limit: int) -> bytes:
        rfile = self.handler.rfile
        parts: list[bytes] = []
        total = 0
        while True:
            line = rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BodyError("malformed chunked transfer encoding") from None
            if size == 0:
                while rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass
                self.body_consumed = True
                return b"".join(parts)
            total += size
            if total > limit:
                raise BodyTooLarge(f"request body is over the {limit}-byte limit")
            chunk = rfile.read(size)
            if len(chunk) != size:
                raise BodyError("request body ended inside a chunk")
            parts.append(chunk)
            rfile.readline(16)

    def _drain(self, length: int) -> None:
        if length > DRAIN_LIMIT:
            return
        rfile = self.handler.rfile
        remaining = length
        while remaining > 0:
            got = rfile.read(min(CHUNK, remaining))
            if not got:
                return
            remaining -= len(got)
        self.body_consumed = True

    def discard_body(self, limit: int) -> None:
        """Read and drop an unwanted body (up to ``limit``) so the connection stays usable."""
        if self.body_consumed:
            return
        with contextlib.suppress(BodyTooLarge, BodyError):
            self.read_body(limit)


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, status: int, document: Any, **headers: str) -> Response:
        body = json.dumps(document, default=str, ensure_ascii=False, indent=None).encode("utf-8")
        return cls(status, body, "application/json", dict(headers))


Handler = Callable[[Request], Response]


class Router:
    def __init__(self) -> None:
        self.exact: dict[str, dict[str, Handler]] = {}
        self.prefix: list[tuple[str, dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        """Route ``method path``; a path ending in ``/*`` matches its prefix (rest in params['rest'])."""
        if path.endswith("/*"):
            prefix = path[:-1]
            for existing, methods in self.prefix:
                if existing == prefix:
                    methods[method] = handler
                    return
            self.prefix.append((prefix, {method: handler}))
        else:
            self.exact.setdefault(path, {})[method] = handler

    def match(self, path: str) -> tuple[dict[str, Handler] | None, dict[str, str]]:
        if path in self.exact:
            return self.exact[path], {}
        for prefix, methods in self.prefix:
            if path.startswith(prefix) and len(path) > len(prefix):
                return methods, {"rest": unquote(path[len(prefix) :])}
        return None, {}


class HttpServer:
    """The sidecar's HTTP port."""

    def __init__(
        self,
        endpoint: str,
        router: Router,
        log: JsonLog,
        *,
        body_limit: int,
        tls: ssl.SSLContext | None = None,
        auth: Callable[[Request], Response | None] | None = None,
    ) -> None:
        """``tls``: serve HTTPS with this context; ``auth``: a gate run before every handler,
        returning None to go on or the response to send instead (e.g. 401)."""
        host, _, port = endpoint.rpartition(":")
        self.router = router
        self.log = log
        self.body_limit = body_limit
        self.auth = auth
        self.tls = tls
        server = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "durable-sessions-collector"
            sys_version = ""

            def do_GET(self) -> None:
                server._dispatch(self)

            def do_POST(self) -> None:
                server._dispatch(self)

            def do_PUT(self) -> None:
                server._dispatch(self)

            def do_DELETE(self) -> None:
                server._dispatch(self)

            def do_PATCH(self) -> None:
                server._dispatch(self)

            def do_HEAD(self) -> None:
                server._dispatch(self)

            def log_message(self, format: str, *args: Any) -> None:
                server.log.debug("http-request", line=format % args)

        host = host.strip("[]")
        server_class = ThreadingHTTPServer if tls is None else _tls_server_class(tls, log)
        if ":" in host:  # an IPv6 address ([::1]:4320, [::]:4320): the server is AF_INET only
            server_class = type(
                "Ipv6" + server_class.__name__, (server_class,), {"address_family": socket.AF_INET6}
            )
        try:
            self.httpd = server_class((host, int(port)), _Handler)
        except OSError as error:
            raise OSError(
                f"receivers.http.endpoint: cannot listen on {endpoint}: {error.strerror or error}"
            ) from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="http", daemon=True
        )
        self._thread.start()
        return self.port

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _dispatch(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        request = Request(handler.command, parts.path, parse_qs(parts.query), handler.headers, handler)
        methods, params = self.router.match(parts.path)
        request.params = params
        request.authenticated = self.auth is None
        try:
            denied = self.auth(request) if self.auth is not None else None
            if denied is not None:
                response = denied
                handler.close_connection = True
            elif methods is None:
                response = Response.json(404, {"error": f"no such path: {parts.path}"})
            elif handler.command not in methods and not (handler.command == "HEAD" and "GET" in methods):
                allowed = ", ".join(sorted(methods))
                response = Response.json(
                    405,
                    {"error": f"{handler.command} is not allowed on {parts.path}; use {allowed}"},
                    Allow=allowed,
                )
            else:
                response = methods.get(handler.command, methods.get("GET"))(request)  # type: ignore[misc]
        except Exception as error:
            self.log.error("http-handler-failed", path=parts.path, error=f"{type(error).__name__}: {error}")
            response = Response.json(500, {"error": "internal error; see the sidecar log"})
        if not request.body_consumed:
            request.discard_body(self.body_limit)
        if not request.body_consumed and (
            handler.headers.get("Content-Length") or "chunked" in handler.headers.get("Transfer-Encoding", "")
        ):
            handler.close_connection = True
        self._send(handler, response)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, response: Response) -> None:
        try:
            handler.send_response(response.status, HTTPStatus(response.status).phrase)
            handler.send_header("Content-Type", response.content_type)
            handler.send_header("Content-Length", str(len(response.body)))
            for name, value in response.headers.items():
                handler.send_header(name.replace("_", "-"), value)
            if handler.close_connection:
                handler.send_header("Connection", "close")
            handler.end_headers()
            if handler.command != "HEAD":
                handler.wfile.write(response.body)
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True


def _tls_server_class(context: ssl.SSLContext, log: JsonLog) -> type[ThreadingHTTPServer]:
    """A ThreadingHTTPServer that does each TLS handshake in the connection's own thread."""
    from durable_sessions_collector.security import wrap_accepted

    class _TlsServer(ThreadingHTTPServer):
        def finish_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            try:
                wrapped = wrap_accepted(context, request)
            except (ssl.SSLError, OSError) as error:
                log.debug("tls-handshake-failed", peer=str(client_address[0]), error=str(error))
                return
            try:
                self.RequestHandlerClass(wrapped, client_address, self)
            finally:
                with contextlib.suppress(OSError):
                    wrapped.shutdown(socket.SHUT_WR)
                wrapped.close()

    return _TlsServer
