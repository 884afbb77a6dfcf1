"""The HTTP port: a small router on the standard library's threading HTTP server.

Components register routes (``POST /v1/traces``, ``GET /api/sessions``, ``/healthz``,
``/metrics``); each handler gets a :class:`Request` and returns a :class:`Response`.
HTTP/1.1 keep-alive is supported; a request whose body is not fully read closes its
connection, so a rejected upload can never be misread as the next request.

A body is framed strictly (RFC 9112 section 6): one Content-Length of ASCII digits, or
``Transfer-Encoding: chunked`` alone; anything ambiguous (both headers, differing lengths,
other transfer codings, a malformed chunk) is refused and closes the connection, so that
no proxy in front can be made to see a different request boundary than this server.
Header lines are checked as received, for the same reason (:func:`header_problem`).
Every connection is bounded in time by :data:`IDLE_TIMEOUT_S`, :data:`HEADER_TIMEOUT_S`,
:data:`STALL_TIMEOUT_S` and :data:`BODY_TIMEOUT_S`: a thread serves each connection, and a
client that goes quiet (or trickles) must not hold one forever. The connections served at
once are capped (:class:`Connections`): past the cap a new connection waits in the listen
backlog, and idle keep-alive connections are closed to make room for it.
"""

from __future__ import annotations

import contextlib
import io
import re
import select
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from durable_sessions_collector import __version__, jsontext
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.quote import quoted

DRAIN_LIMIT = 256 * 1024 * 1024
CHUNK = 1024 * 1024
LINE_LIMIT = 65536  # a chunk-size line, and the whole trailer section (the stdlib's header line limit)

IDLE_TIMEOUT_S = 60.0
"""Longest the port waits for a request's first byte, on a new connection and between
requests on a keep-alive one (the OpenTelemetry Collector's ``idle_timeout`` default);
then it closes the connection without an answer."""

HEADER_TIMEOUT_S = 10.0
"""Longest the request line and headers may take from their first byte, however often
the client sends a byte (slowloris; the Collector's ``read_header_timeout``); then the
connection is closed without an answer."""

STALL_TIMEOUT_S = 30.0
"""Longest a request body may stall (no byte received for this long; the body as a whole
may take longer), and the bound on writing a response to a client that does not read it
(the Collector's ``write_timeout``). A stalled body is answered 400 and its connection
closed; a write that times out closes the connection."""

BODY_TIMEOUT_S = 60.0
"""Longest a request body may take as a whole, from the end of its headers, however often
bytes arrive (the Collector's ``read_timeout``; an exporter gives up on its request long
before: 10 s by default in the SDKs, 5 s in the Collector). A body past it is answered 400
and its connection closed."""

DEFAULT_MAX_CONNECTIONS = 256
"""Connections the port serves at once (``receivers.http.max_connections``)."""

SLOT_WAIT_S = 0.05
"""How long the accepting thread waits for a free slot before it looks again at whether
the port is stopping (it is also ``serve_forever``'s poll interval)."""

_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?\r?\n")
# A header line (RFC 9110 section 5.1, RFC 9112 section 5): a token, the colon at once,
# then a value without CR or NUL; the line ends in CRLF (or LF).
_FIELD_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):([^\r\n\x00]*)\r?\n")
_DIGITS = re.compile(r"[0-9]+")


class BodyTooLarge(Exception):
    pass


class DeadlineExceeded(TimeoutError):
    """A request's headers or body did not arrive by their deadline (not a stall: bytes
    may still be trickling in)."""


class BodyError(Exception):
    """The body cannot be read; ``status`` is the answer (400, or 501 for a transfer coding
    this server does not implement)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def body_length(headers: Any) -> int | None:
    """The request body's length from its headers, None for chunked (RFC 9112 section 6.3).

    Raises BodyError when the framing is invalid or ambiguous. A lenient reading here (the
    first of two Content-Lengths, ``int("+1_0")``, chunked and a Content-Length together)
    is how requests are smuggled past a proxy that reads the framing differently.
    """
    encodings = headers.get_all("Transfer-Encoding") or []
    lengths = headers.get_all("Content-Length") or []
    if encodings:
        shown = ", ".join(encodings)
        if lengths:
            raise BodyError("the request has both Transfer-Encoding and Content-Length; send one of them")
        codings = [coding.strip().lower() for value in encodings for coding in value.split(",")]
        if codings == ["chunked"]:
            return None
        if codings[-1] != "chunked" or codings.count("chunked") > 1:
            raise BodyError(f"Transfer-Encoding {shown!r}: chunked must be the last coding, once")
        raise BodyError(
            f"Transfer-Encoding {shown!r} is not supported; send chunked or a Content-Length", 501
        )
    values = {value.strip() for text in lengths for value in text.split(",")}
    if not values:
        return 0
    if len(values) > 1:
        raise BodyError(f"conflicting Content-Length values {', '.join(sorted(values))}")
    text = values.pop()
    if not _DIGITS.fullmatch(text):
        raise BodyError(f"Content-Length {text!r} is not a byte count")
    return int(text)


def header_problem(lines: list[bytes]) -> str | None:
    """Why a request's header section (its lines as received, up to the blank line) must
    be refused with 400, or None.

    The stdlib parses headers with the email package, which takes the first line it cannot
    read as the end of the headers and drops that line and every one after it without a
    word: ``Content-Length : 39`` left a body of 0 bytes, and the 39 bytes were served as
    the next request, while a proxy in front may have framed the body by them (RFC 9112
    section 5.1: such a request MUST be refused). It also splits lines at a bare CR, which a
    proxy reads as part of a value, and joins a folded line to the one above it.
    """
    for line in lines:
        if line in (b"\r\n", b"\n"):
            return None
        if _FIELD_LINE.fullmatch(line):
            continue
        text = line.rstrip(b"\r\n").decode("latin-1")
        name, colon, _ = text.partition(":")
        if line[:1] in (b" ", b"\t"):
            return f"header line {quoted(text)} is folded onto the one above (obsolete, RFC 9112 section 5.2)"
        if not colon:
            return f"header line {quoted(text)} has no colon"
        if not _FIELD_LINE.fullmatch(name.encode("latin-1") + b":\r\n"):
            return (
                f"header field name {quoted(name)} is not a token: no whitespace (before the "
                "colon either), control characters or separators (RFC 9110 section 5.1)"
            )
        return f"header field {quoted(name)} has a CR or NUL in its value"
    return None


class _LineRecorder:
    """A readline-only view of ``rfile`` that keeps the lines read through it."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.lines: list[bytes] = []

    def readline(self, limit: int = -1) -> bytes:
        line = self.stream.readline(limit)
        self.lines.append(line)
        return line


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: Any
    handler: BaseHTTPRequestHandler
    params: dict[str, str] = field(default_factory=dict)
    body_consumed: bool = False
    # Reading the body failed (bad framing, over the limit, stalled): where it ends is not
    # known, so it is not read again to discard it, and the connection is closed.
    body_failed: bool = False
    # True when the caller may be told everything: no auth gate is configured, or the gate
    # accepted its credentials. False on a path the gate leaves open (GET /healthz) to a
    # caller without a valid token.
    authenticated: bool = False

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)

    def header_list(self, name: str) -> str:
        """The field lines of ``name`` as one comma-separated list, as RFC 9110 section 5.3
        reads several lines of one name (``header`` gives the first)."""
        return ", ".join(self.headers.get_all(name) or ())

    def read_body(self, limit: int) -> bytes:
        """The request body, at most ``limit`` bytes; raise BodyTooLarge or BodyError."""
        return self._read_body(limit, keep=True)

    def _read_body(self, limit: int, *, keep: bool) -> bytes:
        """The body (b"" without ``keep``: read and dropped a piece at a time)."""
        try:
            return self._read_framed(limit, keep)
        except (BodyTooLarge, BodyError):
            self.body_failed = True
            raise

    def _read_framed(self, limit: int, keep: bool) -> bytes:
        length = body_length(self.headers)
        handler = self.handler
        if length is not None and length > limit:
            # With "Expect: 100-continue" the client has not sent the body: answer at once.
            if not getattr(handler, "continue_pending", False):
                self._drain(length)
            raise BodyTooLarge(f"request body is {length} bytes, over the {limit}-byte limit")
        if length == 0:
            self.body_consumed = True
            return b""
        try:
            _send_continue(handler)
            if length is None:
                return self._read_chunked(limit, keep)
            data = self._read_exactly(length, keep)
        except DeadlineExceeded:
            raise BodyError(
                f"request body not received within {handler.body_timeout_s:g} s"  # type: ignore[attr-defined]
            ) from None
        except TimeoutError:
            # A client that stops sending mid-body must not hold this thread: answer and close.
            raise BodyError(
                f"request body stalled: nothing received for {handler.stall_timeout_s:g} s"  # type: ignore[attr-defined]
            ) from None
        except OSError as error:  # the client went away (reset, broken pipe): not a server error
            raise BodyError(f"request body not received: {error.strerror or error}") from None
        if data is None:
            raise BodyError(f"request body ended before its {length} bytes")
        self.body_consumed = True
        return data

    def _read_exactly(self, size: int, keep: bool) -> bytes | None:
        """The body's next ``size`` bytes, None if it ends before. Without ``keep`` they are
        read a piece at a time and dropped (b"" is returned): a body read only to be
        discarded (a request refused with 401, 404 or 415) is never held whole, so a
        client without the token cannot make the port hold ``max_request_bytes`` per
        connection."""
        rfile = self.handler.rfile
        if keep:
            data = rfile.read(size)
            return data if len(data) == size else None
        while size > 0:
            got = rfile.read(min(CHUNK, size))
            if not got:
                return None
            size -= len(got)
        return b""

    def _read_chunked(self, limit: int, keep: bool) -> bytes:
        # Strict chunk syntax (RFC 9112 section 7.1): int(x, 16) also takes "-1" (which read
        # to the end of the stream), "0x10" and "1_0"; chunk data must end where its size says.
        rfile = self.handler.rfile
        # One buffer, not a list of the chunks: a 1-byte chunk took a bytes object of 34
        # bytes and a list slot, so a body sent in tiny chunks held 40 times its size.
        body = bytearray()
        total = 0
        while True:
            match = _CHUNK_SIZE_LINE.fullmatch(rfile.readline(LINE_LIMIT))
            if match is None:
                raise BodyError("malformed chunked transfer encoding: bad chunk-size line")
            size = int(match.group(1), 16)
            if size == 0:
                break
            total += size
            if total > limit:
                raise BodyTooLarge(f"request body is over the {limit}-byte limit")
            chunk = self._read_exactly(size, keep)
            if chunk is None:
                raise BodyError("request body ended inside a chunk")
            body += chunk
            if rfile.readline(3) not in (b"\r\n", b"\n"):
                raise BodyError("malformed chunked transfer encoding: chunk data longer than its size")
        trailers = 0
        while (line := rfile.readline(LINE_LIMIT)) not in (b"\r\n", b"\n"):
            trailers += len(line)
            if not line.endswith(b"\n") or trailers > LINE_LIMIT:
                raise BodyError("malformed chunked transfer encoding: bad trailer section")
        self.body_consumed = True
        return bytes(body)

    def _drain(self, length: int) -> None:
        if length > DRAIN_LIMIT:
            return
        rfile = self.handler.rfile
        remaining = length
        while remaining > 0:
            try:
                got = rfile.read(min(CHUNK, remaining))
            except OSError:  # stalled or reset: the connection is closed after the answer
                return
            if not got:
                return
            remaining -= len(got)
        self.body_consumed = True

    def discard_body(self, limit: int) -> None:
        """Read and drop an unwanted body (up to ``limit``) so the connection stays usable."""
        if self.body_consumed or getattr(self.handler, "continue_pending", False):
            return  # the client waits for 100 Continue: it has sent no body, and gets none
        if self.body_failed:
            # A second parse of a malformed chunked body waited on its next line until the
            # stall timeout (30 s) before the 400 went out.
            return
        with contextlib.suppress(BodyTooLarge, BodyError):
            self._read_body(limit, keep=False)


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, status: int, document: Any, **headers: str) -> Response:
        """``document`` as JSON that every parser reads as written: non-finite floats and
        integers past 2^53 are strings (:mod:`~durable_sessions_collector.jsontext`)."""
        body = jsontext.dumps(document, exact_ints=True, default=str, ensure_ascii=False).encode("utf-8")
        return cls(status, body, "application/json", dict(headers))


Handler = Callable[[Request], Response]


class Router:
    def __init__(self) -> None:
        self.exact: dict[str, dict[str, Handler]] = {}
        self.prefix: list[tuple[str, dict[str, Handler]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        """Route ``method path``; a path ending in ``/*`` matches its prefix (rest in params['rest'],
        percent-decoded as UTF-8: bytes that are not UTF-8 are lone surrogates there, for its
        handler to refuse, not U+FFFD, which is a character an id may hold).

        A handler with an ``error_response(request, status, message)`` method makes the
        port's own error answers on its path (405, 500), for a protocol whose errors have
        a body of their own (OTLP/HTTP: a ``google.rpc.Status``); elsewhere they are JSON,
        ``{"error": message}``."""
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
                return methods, {"rest": unquote(path[len(prefix) :], errors="surrogateescape")}
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
        tls: Callable[[], ssl.SSLContext] | None = None,
        auth: Callable[[Request], Response | None] | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        on_idle_closed: Callable[[], object] = lambda: None,
    ) -> None:
        """``tls``: serve HTTPS, handshaking with the context it gives for each connection
        (so that a renewed certificate is served from its next connection on); ``auth``: a
        gate run before every handler, returning None to go on or the response to send
        instead (e.g. 401); ``max_connections``: connections served at once,
        ``on_idle_closed`` called for each idle one closed to make room (see
        :class:`Connections`)."""
        host, _, port = endpoint.rpartition(":")
        self.router = router
        self.log = log
        self.body_limit = body_limit
        self.auth = auth
        self.tls = tls
        server = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = f"durable-sessions-collector/{__version__}"
            # Answers to a request line the stdlib cannot parse (garbage, "PRI * HTTP/2.0")
            # are sent before its version is known: with the default "HTTP/0.9" they went
            # out as a bare HTML page without a status line.
            default_request_version = "HTTP/1.1"
            # TCP_NODELAY: a response goes out in two writes (headers, then body), and with
            # Nagle's algorithm the body waited for the client's delayed ACK of the headers,
            # 40 ms on Linux: every request on a keep-alive connection took at least 40 ms.
            disable_nagle_algorithm = True
            # Read at construction, so that a test can shorten them for its sidecar.
            idle_timeout_s = IDLE_TIMEOUT_S
            header_timeout_s = HEADER_TIMEOUT_S
            stall_timeout_s = STALL_TIMEOUT_S
            body_timeout_s = BODY_TIMEOUT_S
            continue_pending = False

            def version_string(self) -> str:
                # product/version (RFC 9110); the stdlib appends " Python/3.x", or with an
                # empty sys_version a trailing space
                return self.server_version

            def setup(self) -> None:
                super().setup()
                self.rfile.close()
                self.reader = _ConnectionReader(self.connection, self.stall_timeout_s)
                self.rfile = io.BufferedReader(self.reader)

            def handle_one_request(self) -> None:
                # The stdlib reads with no timeout at all: an idle keep-alive connection, a
                # client trickling its headers, or one stalled mid-body held a thread forever.
                self.continue_pending = False
                self.command, self.headers_read = None, False  # not the last request's (see _refusal)
                self.reader.deadline = None
                self.reader.timeout = self.idle_timeout_s
                self.reader.idle_in = server.connections  # until the next request's first byte
                try:
                    first = self.rfile.peek(1)[:1]
                except OSError:  # idle too long, or the client reset the connection
                    first = b""
                finally:
                    self.reader.idle_in = None
                if not first:
                    self.close_connection = True
                    return
                if first == b"\x16":  # a TLS handshake record (0x16): no HTTP method starts so
                    server.log.debug(
                        "http-bad-request",
                        peer=str(self.client_address[0]),
                        error="TLS handshake on the plain-HTTP port (the client wants https://); connection closed",
                    )
                    self.close_connection = True
                    return
                self.reader.timeout = self.stall_timeout_s
                self.reader.deadline = time.monotonic() + self.header_timeout_s
                self.reader.late = "request headers not received in time"
                super().handle_one_request()

            def parse_request(self) -> bool:
                recorder = _LineRecorder(self.rfile)
                self.rfile = recorder  # type: ignore[assignment]
                try:
                    parsed = super().parse_request()
                finally:
                    self.rfile = recorder.stream
                self.headers_read = parsed
                if parsed and (problem := header_problem(recorder.lines)) is not None:
                    self.send_error(400, problem)
                    return False
                # The headers are in; the body, if any, has a deadline of its own.
                self.reader.deadline = time.monotonic() + self.body_timeout_s
                self.reader.late = "request body not received in time"
                return parsed

            def handle_expect_100(self) -> bool:
                # "Expect: 100-continue" (curl, bodies over 1 KiB): 100 Continue is sent only
                # when the body is read, so a request refused before (401, 404, 413 by its
                # Content-Length) is answered at once instead of after the upload.
                self.continue_pending = True
                return True

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

            def do_OPTIONS(self) -> None:
                server._dispatch(self)

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                # The stdlib's own answers (a request line or headers it cannot parse, a
                # method no handler has) were HTML pages; every other answer here is JSON.
                reason = message or HTTPStatus(code).phrase
                self.log_error("code %d, message %s", code, reason)
                self.close_connection = True
                server._send(self, server._refusal(self, code, reason))

            def log_message(self, format: str, *args: Any) -> None:
                server.log.debug("http-request", line=format % args)

        host = host.strip("[]")
        self.connections = Connections(max_connections, on_idle_closed)
        if tls is None:
            server_class = _server_class(log, self.connections)
        else:
            server_class = _tls_server_class(tls, log, self.connections)
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
        thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="http", daemon=True
        )
        thread.start()
        self._thread = thread  # only once it runs: stop() waits for it then
        return self.port

    def stop(self, grace: float = 2.0) -> None:
        """Stop accepting, close idle keep-alive connections, and give the requests being
        served up to ``grace`` seconds to be answered (with ``Connection: close``). A port
        never started is only closed: ``shutdown()`` waits for a ``serve_forever`` that never
        ran, and a start-up that failed after binding the port hung in its teardown."""
        if self._thread is not None:
            self.httpd.shutdown()
        self.httpd.server_close()
        if not self.connections.stop(grace):
            self.log.warning(
                "http-stop-timeout",
                connections=self.connections.open,
                note=f"requests still being served after {grace:g} s; their connections are dropped",
            )

    def _dispatch(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(request_target(handler.path))
        query = query_arguments(parts.query)
        request = Request(handler.command, parts.path, query, handler.headers, handler)
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
            elif handler.command == "OPTIONS":
                response = Response(200, b"", headers={"Allow": _allowed(methods)})
            elif handler.command not in methods and not (handler.command == "HEAD" and "GET" in methods):
                allowed = _allowed(methods)
                message = f"{handler.command} is not allowed on {parts.path}; use {allowed}"
                response = _error(methods, request, 405, message)
                response.headers["Allow"] = allowed
            else:
                response = methods.get(handler.command, methods.get("GET"))(request)  # type: ignore[misc]
        except Exception as error:
            self.log.error("http-handler-failed", path=parts.path, error=f"{type(error).__name__}: {error}")
            response = _error(methods, request, 500, "internal error; see the sidecar log")
        if not request.body_consumed:
            request.discard_body(self.body_limit)
        if not request.body_consumed and (
            "Content-Length" in handler.headers or "Transfer-Encoding" in handler.headers
        ):
            handler.close_connection = True
        if self.connections.stopping:
            handler.close_connection = True
        self._send(handler, response)

    def _refusal(self, handler: BaseHTTPRequestHandler, status: int, message: str) -> Response:
        """The answer to a request refused before it was routed (a header the port cannot
        read, a method it does not know): on a path whose protocol has its own error body
        (OTLP/HTTP's ``Status``), that body; JSON where the request line was not read."""
        # The request line was not read: None before it, "" when the stdlib refused it as
        # too long (the 414 it answers has no path to look up).
        if not getattr(handler, "command", None):
            return Response.json(status, {"error": message})
        path = urlsplit(request_target(handler.path)).path
        methods, params = self.router.match(path)
        headers = handler.headers if getattr(handler, "headers_read", False) else {}
        request = Request(handler.command, path, {}, headers, handler, params)
        return _error(methods, request, status, message)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, response: Response) -> None:
        handler.connection.settimeout(handler.stall_timeout_s)  # type: ignore[attr-defined]
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


def request_target(path: str) -> str:
    """The request-target as the stdlib read it (as Latin-1) with its bytes past ASCII
    percent-encoded, so that they are decoded as UTF-8 with the rest. curl sends a URL
    typed with non-ASCII characters unencoded: the session 'é' was looked up as 'Ã©', and
    answered 404, quoting an id never typed."""
    if path.isascii():
        return path
    return "".join(char if char.isascii() else f"%{ord(char):02X}" for char in path)


def query_arguments(query: str) -> dict[str, list[str]]:
    """The arguments of a request's query, percent-decoded as UTF-8 (bytes that are not
    UTF-8 are lone surrogates, as in a routed path's rest, for a handler to refuse), a
    ``+`` kept as the character it is (RFC 3986), and blank ones kept (``verdict=`` is a
    bad verdict, not none). Read as form encoding, ``limit=+1`` was refused quoting
    ``' 1'``, a value the client never sent; no argument of this port's holds a space."""
    return parse_qs(query.replace("+", "%2B"), keep_blank_values=True, errors="surrogateescape")


def _error(methods: dict[str, Handler] | None, request: Request, status: int, message: str) -> Response:
    """The port's own error answer on a path: its handler's ``error_response``, else JSON."""
    for handler in (methods or {}).values():
        if (error_response := getattr(handler, "error_response", None)) is not None:
            return error_response(request, status, message)  # type: ignore[no-any-return]
    return Response.json(status, {"error": message})


def _allowed(methods: dict[str, Handler]) -> str:
    """The ``Allow`` header of a path: its routed methods, HEAD where GET is, and OPTIONS."""
    allowed = set(methods) | {"OPTIONS"} | ({"HEAD"} if "GET" in methods else set())
    return ", ".join(sorted(allowed))


def _send_continue(handler: BaseHTTPRequestHandler) -> None:
    """Send the 100 Continue a client with ``Expect: 100-continue`` waits for, once."""
    if getattr(handler, "continue_pending", False):
        handler.continue_pending = False  # type: ignore[attr-defined]
        handler.send_response_only(100)
        handler.end_headers()


class Connections:
    """The port's open connections: at most ``limit`` are served at once, and those idle
    (waiting for a next request) can be closed to make room for a waiting one or to stop.

    The accepting thread takes a slot before it accepts a connection (:meth:`take`); the
    connection's thread gives it back when the connection ends (:meth:`release`). With no
    slot free, the next connection is left in the listen backlog, where its client waits
    (its TCP connect has completed), and the connection idle the longest is closed: an HTTP
    client reconnects when its idle keep-alive connection is closed, as after the idle timeout.
    """

    def __init__(self, limit: int, on_idle_closed: Callable[[], object] = lambda: None) -> None:
        self.limit = limit
        self.on_idle_closed = on_idle_closed
        self.open = 0
        self.stopping = False
        # Idle connections closed whose slots are not back yet: while one is on its way,
        # a waiting connection closes no other (the accepting thread looks every
        # SLOT_WAIT_S, and a busy machine may take longer than that to end a connection).
        self._closing = 0
        self._changed = threading.Condition(threading.Lock())
        self._idle: dict[socket.socket, None] = {}  # insertion order: the longest idle first

    def take(self, wait_s: float) -> bool:
        """Take a slot for a connection about to be accepted; False if none freed within ``wait_s``."""
        with self._changed:
            if self.open >= self.limit:
                if self._closing == 0 and self._close_longest_idle():
                    self._closing += 1
                self._changed.wait(wait_s)
                if self.open >= self.limit:
                    return False
            self.open += 1
            return True

    def release(self) -> None:
        with self._changed:
            self.open -= 1
            self._closing = max(0, self._closing - 1)  # whichever ended, a slot is free
            self._changed.notify_all()

    def wait_for_request(self, connection: socket.socket, timeout: float) -> bool:
        """Wait, as an idle connection, until ``connection`` has bytes to read: True then;
        False if it was closed meanwhile to make room or because the port stops. Raises
        TimeoutError after ``timeout`` seconds.

        Nothing is read while the connection counts as idle: a connection is closed only
        when no byte of a next request has arrived, checked under the lock that the
        connection takes to stop being idle.
        """
        with self._changed:
            if self.stopping:
                return False
            self._idle[connection] = None
        try:
            readable = _readable(connection, timeout)
        finally:
            with self._changed:
                closed = connection not in self._idle
                self._idle.pop(connection, None)
        if closed:
            return False
        if not readable:
            raise TimeoutError("no request on an idle connection")
        return True

    def stop(self, grace_s: float) -> bool:
        """Close the idle connections, let the others finish the request they are serving
        (their answers say ``Connection: close``) for up to ``grace_s``; whether all ended."""
        deadline = time.monotonic() + grace_s
        with self._changed:
            self.stopping = True
            for connection in list(self._idle):
                self._close_if_idle(connection)
            while self.open > 0 and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            return self.open == 0

    def _close_longest_idle(self) -> bool:
        # Called with the lock held.
        for connection in list(self._idle):
            if self._close_if_idle(connection):
                self.on_idle_closed()
                return True
        return False

    def _close_if_idle(self, connection: socket.socket) -> bool:
        """Close ``connection`` unless a byte of its next request has arrived: then it is
        not idle any more, though its thread may not have seen it yet, and its request is
        served (while stopping, with ``Connection: close``). Called with the lock held; the
        connection's thread, waiting in wait_for_request, ends it and gives its slot back."""
        if _readable(connection, 0):
            return False
        del self._idle[connection]
        _wake_with_end_of_stream(connection)
        return True


def _wake_with_end_of_stream(connection: socket.socket) -> None:
    """Shut ``connection`` down under the thread waiting on it, which sees the end of the
    stream and ends the connection. socket.socket's own shutdown: SSLSocket.shutdown would
    drop its TLS state under that thread."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(connection, socket.SHUT_RDWR)


def _readable(connection: socket.socket, timeout: float) -> bool:
    """Whether ``connection`` has bytes to read (or its end) within ``timeout`` seconds,
    without reading them."""
    if isinstance(connection, ssl.SSLSocket) and connection.pending():
        return True  # decrypted and buffered already: the descriptor may show nothing
    poller = select.poll()
    try:
        poller.register(connection, select.POLLIN)
    except (OSError, ValueError):  # closed meanwhile
        return True  # reading will tell
    return bool(poller.poll(max(0, int(timeout * 1000))))


class _ConnectionReader(io.RawIOBase):
    """The raw stream under a connection's ``rfile``: each receive waits at most ``timeout``
    seconds, and never past ``deadline`` (``time.monotonic()``) when one is set. A socket
    timeout alone bounds each receive, not a request sent one byte at a time."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.timeout = timeout
        self.deadline: float | None = None
        self.late = "deadline passed"  # what DeadlineExceeded says
        self.idle_in: Connections | None = None  # set while waiting for a next request

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        timeout = self.timeout
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise DeadlineExceeded(self.late)
        if self.idle_in is not None and not self.idle_in.wait_for_request(self.sock, timeout):
            return 0  # closed to make room or because the port stops: the end of the stream
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv_into(buffer)
        except TimeoutError:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise DeadlineExceeded(self.late) from None
            raise


def _server_class(log: JsonLog, connections: Connections) -> type[ThreadingHTTPServer]:
    class _Server(ThreadingHTTPServer):
        # socketserver listens with a backlog of 5: a burst of connections (a Collector's
        # exporter opens up to num_consumers, 10, at once; SDKs starting together) overflows
        # it, and each dropped SYN costs its client a 1 s (then 3 s) retransmission.
        request_queue_size = socket.SOMAXCONN

        def _handle_request_noblock(self) -> None:
            # serve_forever calls this when a connection waits to be accepted. Without a
            # free slot it is left in the backlog, and serve_forever polls again (so a
            # shutdown is still seen within SLOT_WAIT_S).
            if connections.take(SLOT_WAIT_S):
                super()._handle_request_noblock()  # type: ignore[misc]

        def get_request(self) -> tuple[socket.socket, Any]:
            try:
                return super().get_request()
            except BaseException:  # nothing accepted: the slot taken for it is free again
                connections.release()
                raise

        def shutdown_request(self, request: Any) -> None:
            # Called once for every accepted connection, however it ends.
            try:
                super().shutdown_request(request)
            finally:
                connections.release()

        def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            # The stdlib prints a traceback to standard error (into the JSON log stream) for
            # anything its handler raises, a client that resets its connection included.
            error = sys.exc_info()[1]
            peer = str(client_address[0]) if client_address else ""
            if isinstance(error, OSError):  # reset, broken pipe, timeout, a bad TLS record
                log.debug("http-connection-closed", peer=peer, error=f"{type(error).__name__}: {error}")
            else:
                log.error("http-connection-failed", peer=peer, error=f"{type(error).__name__}: {error}")

    return _Server


def _tls_server_class(
    context: Callable[[], ssl.SSLContext], log: JsonLog, connections: Connections
) -> type[ThreadingHTTPServer]:
    """A ThreadingHTTPServer that does each TLS handshake in the connection's own thread."""
    from durable_sessions_collector.security import wrap_accepted

    class _TlsServer(_server_class(log, connections)):  # type: ignore[misc,valid-type]
        def finish_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            try:
                wrapped = wrap_accepted(context(), request)
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
