"""The ``webhook`` alert channel: POST each new violation as JSON, at least once.

Rows come from the store's outbox (written in the same transaction as the violation),
so an alert survives a crash or a restart and is delivered once it can be. Each alert
is POSTed to ``alerts.webhook.url`` with:

- ``Content-Type: application/json``; the body is the alert (session, rule, severity,
  action, message, the session's verdict, trace and span ids, detection time, and
  ``status``: ``firing``, or ``resolved`` for an end-of-session violation later spans
  settled) — never a result or a prompt, which the sidecar does not even store;
- ``Idempotency-Key``: derived from session + rule + action only (:func:`idempotency_key`),
  and for a change of status the change, the same on every attempt and after every
  restart, so a receiver can drop a repeat (a crash between a successful POST and
  marking it delivered sends it again);
- ``Authorization: Basic …`` when the URL has ``user:password@`` (removed from the URL).

``alerts.webhook.timeout_s`` bounds a whole attempt — connecting (and TLS), sending, the
status, the headers and the body — not each read: at the deadline a watchdog shuts the
connection's socket down (:class:`_Deadline`), and the attempt is a timeout to retry, so a
receiver (or a proxy) that trickles its answer cannot hold the delivery thread. An answer
that came whole is judged by its status however soon after it the deadline fires
(:func:`_read_whole`): a 2xx is a delivery, a 429 keeps its ``Retry-After``. A host
name is resolved (by the system resolver) within the same deadline: a resolver that does
not answer in time makes the attempt a timeout to retry as well (:func:`_resolve`).

A 2xx answer delivers the alert (interim 1xx answers before it are skipped). A
connection error, a timeout, 5xx, 408, 409, 425 or 429 is retried after ``backoff_s ·
2^(attempt-1)`` (capped by ``max_backoff_s``, with ±50% jitter so that many sidecars do
not retry in step; a ``Retry-After`` is honoured up to the cap). A connection error, a
timeout, 429, 502, 503 and 504 are the receiver's, not the alert's: no other alert is
sent before that retry (the channel pauses, see :mod:`.outbox`). Any other answer (a 4xx
the receiver will give again, or a redirect) and the ``max_attempts``-th failure move
the alert to the dead letter: it stays in the outbox with state ``dead`` and its last
error, and is never sent again. So does a URL that ``http.client`` refuses to send (a
space, a control character; the configuration refuses such a URL at start-up): no
attempt leaves the sidecar, and no retry would.

Metrics: ``durable_sessions_alert_deliveries_total{channel="webhook",outcome}``
(``delivered``, ``retry``, ``dead_letter``),
``durable_sessions_alert_outbox{channel="webhook",state}`` (``pending``, ``delivered``,
``dead``, read from the store), ``durable_sessions_alert_delivery_duration_seconds``
(one POST) and ``durable_sessions_alert_latency_seconds`` (detection to delivery).

The outbox loop (retries, backoff, dead letter, metrics) is :class:`.outbox.OutboxDelivery`,
shared with the ``otlp`` channel; this module says how one POST is made and judged.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import datetime
import email.message
import functools
import http.client
import ipaddress
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from durable_sessions_collector import __version__
from durable_sessions_collector.alerts import FIRING, WEBHOOK, idempotency_key
from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.alerts.outbox import (
    DEFAULT_POLICY,
    Attempt,
    DeliveryPolicy,
    OutboxDelivery,
    backoff_delay,
)
from durable_sessions_collector.config import is_loopback_host, redact_url
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.store import Alert, Store

RETRYABLE_STATUS = frozenset({408, 409, 425, 429})
UNAVAILABLE_STATUS = frozenset({429, 502, 503, 504})
"""Answers about the receiver, not the alert: rate-limited, or down behind a proxy."""
__all__ = ["Attempt", "WebhookAlerts", "backoff_delay", "idempotency_key"]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        return None  # a redirect is answered as the 3xx it is: the URL is wrong


class _Deadline:
    """The end of one attempt: when it comes, every socket the attempt opened is shut
    down, which ends whatever read or write is blocked on it (and any later one)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self.missed = "no complete answer"  # what the attempt lacked at the deadline, for its error
        self._end = time.monotonic() + seconds
        self._finished = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._end = time.monotonic() + self.seconds
        self._timer.start()
        return self

    def remaining(self) -> float:
        """Seconds left until the deadline (0 once it has passed)."""
        return max(0.0, self._end - time.monotonic())

    def expire(self, missed: str) -> None:
        """Reach the deadline now (if it has not come already), ``missed`` being what the
        attempt lacked when it came."""
        self.missed = missed
        self._expire()

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._finished = True  # an attempt that has ended is not cut off afterwards
        self._timer.cancel()

    def watch(self, sock: socket.socket) -> None:
        """Shut ``sock`` down at the deadline (at once if it has passed)."""
        with self._lock:
            if not self.expired:
                self._sockets.append(sock)
                return
        _shut_down(sock)

    def _expire(self) -> None:
        with self._lock:
            if self._finished:
                return
            self.expired = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _shut_down(sock)


def _shut_down(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed, or handed over to its TLS socket
        sock.shutdown(socket.SHUT_RDWR)


MIN_CONNECT_SHARE_S = 2.0
"""The least time a connect to one of a host name's addresses is given (when the attempt
has that much left): Go's dialer's sane minimum."""

_AddrInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[Any, ...]]


def _resolve(deadline: _Deadline, host: str, port: int) -> list[_AddrInfo]:
    """``socket.getaddrinfo(host, port, type=SOCK_STREAM)``, waited for until ``deadline`` at
    most. If the resolver has not answered by then, the deadline is reached and
    :class:`TimeoutError` raised.

    No socket can cut a system resolver short, so it runs in a daemon thread of its own,
    left behind if it is late: it ends whenever the resolver answers, and holds nothing."""
    answer: concurrent.futures.Future[list[_AddrInfo]] = concurrent.futures.Future()

    def resolve() -> None:
        try:
            answer.set_result(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except Exception as error:  # handed to the attempt, which says what it was
            answer.set_exception(error)

    threading.Thread(target=resolve, name=f"resolve {host}", daemon=True).start()
    done, _ = concurrent.futures.wait([answer], timeout=deadline.remaining())
    if not done:
        deadline.expire(f"host name {host!r} not resolved")
        raise TimeoutError(f"resolving {host!r} took longer than timeout_s = {deadline.seconds:g} s")
    return answer.result()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)  # v4, or v6 (with a zone too) as http.client gives it, unbracketed
    except ValueError:
        return False
    return True


def _connect_watched(
    deadline: _Deadline,
    address: tuple[str, int],
    timeout: Any = socket._GLOBAL_DEFAULT_TIMEOUT,  # seconds, None, or "the socket default"
    source_address: tuple[str, int] | None = None,
) -> socket.socket:
    """``socket.create_connection(address, timeout, source_address)``, a host name resolved
    within ``deadline`` (:func:`_resolve`), the socket then watched by ``deadline``.

    Only the TCP connection is made here: TLS (server name, certificate check) is still
    done by the connection class, against the host name of the URL."""
    host, port = address
    if _is_ip(host):  # nothing to wait for: no thread
        sock = socket.create_connection(address, timeout, source_address)
    else:
        sock = _connect_first(deadline, host, _resolve(deadline, host, port), timeout, source_address)
    deadline.watch(sock)
    return sock


def _connect_first(
    deadline: _Deadline,
    host: str,
    addresses: list[_AddrInfo],
    timeout: Any,
    source_address: tuple[str, int] | None,
) -> socket.socket:
    """A socket connected to the first of ``addresses`` that accepts, tried in order as
    ``socket.create_connection`` does; if none does, the last one's error is raised.

    Until it is connected a socket is not watched by ``deadline`` (shutting down a socket
    that is connecting does not end the connect): each connect is given a share of what
    is left of the attempt, so that an address that never answers (a black-holed IPv6
    route, a pod that is gone) leaves time for the next; and :class:`TimeoutError` is
    raised once nothing is left. As Go's dialer does, the time left is spread evenly
    over the addresses left, each given at least :data:`MIN_CONNECT_SHARE_S` (or all
    that is left)."""
    error: OSError = OSError("getaddrinfo returns an empty list")
    cut = False  # whether the last connect was given all that was left of the attempt
    for index, (family, kind, proto, _, sockaddr) in enumerate(addresses):
        left = deadline.remaining()
        if left <= 0:
            break
        share = max(left / (len(addresses) - index), min(MIN_CONNECT_SHARE_S, left))
        sock = socket.socket(family, kind, proto)
        try:
            given = share if timeout in (None, socket._GLOBAL_DEFAULT_TIMEOUT) else min(timeout, share)
            cut = given == left
            sock.settimeout(given)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            # Reads are bounded by the connection's timeout, as create_connection leaves them.
            sock.settimeout(
                socket.getdefaulttimeout() if timeout is socket._GLOBAL_DEFAULT_TIMEOUT else timeout
            )
            return sock
        except OSError as failure:
            sock.close()
            error = failure
    if deadline.remaining() <= 0 or (cut and isinstance(error, TimeoutError)):
        deadline.expire(f"no connection to {host!r}")
        raise TimeoutError(f"no connection to {host!r} within timeout_s = {deadline.seconds:g} s")
    raise error


class _FinalResponse(http.client.HTTPResponse):
    """The answer to a POST, read past its interim (1xx) answers: http.client skips only
    ``100 Continue``, and took a ``102 Processing`` or ``103 Early Hints`` for the answer,
    a refusal, dead-lettering an alert the receiver went on to accept. ``101 Switching
    Protocols`` stays an answer: it ends HTTP on the connection."""

    def _read_status(self) -> tuple[str, int, str]:
        while True:
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 100 <= status < 200 or status == 101:
                return version, status, reason
            http.client.parse_headers(self.fp)  # the interim answer's fields: nothing to use


class _HTTPConnection(http.client.HTTPConnection):
    """An :class:`http.client.HTTPConnection` whose socket is watched by a :class:`_Deadline`."""

    response_class = _FinalResponse

    def __init__(self, deadline: _Deadline, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = functools.partial(_connect_watched, deadline)


class _HTTPSConnection(http.client.HTTPSConnection):
    """:class:`http.client.HTTPSConnection` (same TLS context and checks), its TCP socket
    and then its TLS socket, handshake included, watched by a :class:`_Deadline`."""

    response_class = _FinalResponse

    def __init__(self, deadline: _Deadline, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = deadline
        self._create_connection = functools.partial(_connect_watched, deadline)

    def connect(self) -> None:
        # http.client.HTTPSConnection.connect, with the handshake done after the TLS
        # socket is watched rather than inside wrap_socket.
        http.client.HTTPConnection.connect(self)  # TCP, and the CONNECT tunnel of a proxy
        server_hostname = self._tunnel_host or self.host
        sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            self.sock, server_hostname=server_hostname, do_handshake_on_connect=False
        )
        self.sock = sock
        self._deadline.watch(sock)
        sock.do_handshake()


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPConnection, self._deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(
            functools.partial(_HTTPSConnection, self._deadline),
            req,
            context=self._context,  # type: ignore[attr-defined]
        )


ANSWER_READ_LIMIT = 64 * 1024
"""The most of an answer's body read: a receiver's answer past it is not needed."""


def _read_whole(response: http.client.HTTPResponse, deadline: _Deadline) -> bool:
    """Read the body of ``response`` (up to :data:`ANSWER_READ_LIMIT`) and return whether
    it came whole, which no later deadline can undo.

    A body of a known length (``Content-Length``, or none, as a 204's) came whole if the
    read got all it asked for; a chunked one if http.client read it at all (it raises
    :class:`http.client.IncompleteRead` at a cut). A body that ends with the connection
    came whole if the read got all it asked for, or if ``deadline`` had not been reached
    when the read returned: the deadline is marked reached before its watchdog shuts a
    socket down, so an end read before that is the receiver's close. Read once the
    deadline was reached, it cannot be told from the shutdown: False, for the deadline
    to judge. (So are headers cut short by the connection's end, which http.client takes
    for their end: the body's read comes after them.)"""
    expected = response.length
    body = response.read(ANSWER_READ_LIMIT)
    ended_before_the_deadline = not deadline.expired  # judged now: the watchdog may fire any moment
    if response.chunked:
        return True
    if expected is None:
        return len(body) == ANSWER_READ_LIMIT or ended_before_the_deadline
    return len(body) == min(expected, ANSWER_READ_LIMIT)


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # "²".isdigit() is true, and float() refuses it
        return float(value)
    try:
        at = parsedate_to_datetime(value)
        if at.tzinfo is None:  # asctime's form, or -0000: every HTTP date is UTC, not local time
            at = at.replace(tzinfo=datetime.UTC)
        return max(0.0, at.timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


class WebhookAlerts(OutboxDelivery):
    """Delivers the ``webhook`` outbox rows from a thread of its own."""

    channel = WEBHOOK
    thread_name = "webhook-alerts"

    def __init__(
        self,
        store: Store,
        log: JsonLog,
        metrics: Metrics,
        url: str,
        *,
        policy: DeliveryPolicy = DEFAULT_POLICY,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(store, log, metrics, policy, rng=rng)
        self.shown_url = redact_url(url, hide_path=True)
        parts = urlsplit(url)
        self._headers = {
            "Content-Type": "application/json",
            "User-Agent": f"durable-sessions-collector/{__version__}",
        }
        if parts.username is not None or parts.password is not None:
            credentials = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            self._headers["Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
            host = parts.hostname or ""
            netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
            url = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
        self._url = url

    def start(self) -> None:
        parts = urlsplit(self._url)
        if parts.scheme == "http" and not is_loopback_host(parts.hostname or ""):
            password = (
                ", and the URL's user:password as Basic auth," if "Authorization" in self._headers else ""
            )
            self.log.warning(
                "not-loopback",
                key="alerts.webhook.url",
                url=self.shown_url,
                note=f"alerts{password} are sent in plaintext to another host; use https://",
            )
        super().start()

    def send(self, alert: Alert) -> Attempt:
        return self.post(alert)

    def target(self) -> dict[str, Any]:
        return {"url": self.shown_url}

    def body(self, alert: Alert) -> dict[str, Any]:
        """The JSON document POSTed for ``alert``: the same on every attempt."""
        payload = alert.payload
        return {
            "event": "durable_sessions.violation",
            "idempotency_key": idempotency_key(payload),
            "session_id": payload.get("session_id"),
            "rule": payload.get("rule"),
            "severity": payload.get("severity"),
            "action_id": payload.get("action_id"),
            "message": payload.get("message"),
            "session_verdict": payload.get("session_verdict"),
            "trace_id": payload.get("trace_id"),
            "span_id": payload.get("span_id"),
            "violation_key": payload.get("key"),
            "detected_at": payload.get("detected_at"),
            "status": payload.get("status") or FIRING,  # an alert queued before statuses fired
        }

    def post(self, alert: Alert) -> Attempt:
        """One POST of ``alert``, cut off ``timeout_s`` after it began."""
        data = json.dumps(self.body(alert), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        headers = dict(self._headers)
        headers["Idempotency-Key"] = idempotency_key(alert.payload)
        request = urllib.request.Request(self._url, data=data, headers=headers, method="POST")
        with _Deadline(self.timeout_s) as deadline:
            # The default handlers (proxies from the environment, the default TLS
            # context), with no redirect followed and every socket watched by the deadline.
            opener = urllib.request.build_opener(
                _NoRedirect(), _HTTPHandler(deadline), _HTTPSHandler(deadline)
            )
            return self._post(opener, request, deadline)

    def _timed_out(self, deadline: _Deadline) -> Attempt:
        return Attempt(
            "retry",
            f"timed out: {deadline.missed} within timeout_s = {self.timeout_s:g} s",
            receiver_unavailable=True,
        )

    def _post(
        self, opener: urllib.request.OpenerDirector, request: urllib.request.Request, deadline: _Deadline
    ) -> Attempt:
        try:
            status, headers, whole = self._answer(opener, request, deadline)
        except (OSError, http.client.HTTPException, UnicodeEncodeError) as error:
            # Anything that failed past the deadline failed of its shutdown.
            return self._timed_out(deadline) if deadline.expired else self._failure(error)
        # The deadline may fire just after a whole answer arrived: that answer stands, a
        # 2xx a delivery (not a timeout to POST again), a 429 with its Retry-After, a 400
        # a rejection. One it may have cut short is judged by whether it had been reached
        # when the read returned (it is marked reached before it shuts a socket down).
        if deadline.expired and not whole:
            return self._timed_out(deadline)
        return _judge(status, headers)

    def _answer(
        self, opener: urllib.request.OpenerDirector, request: urllib.request.Request, deadline: _Deadline
    ) -> tuple[int, email.message.Message, bool]:
        """The answer to ``request``: its status, its headers, and whether it came whole
        (:func:`_read_whole`). Raises what the connection or the request raised.

        The socket timeout bounds each step too (and connecting, before the deadline
        watches a socket); the deadline bounds the whole."""
        try:
            response = opener.open(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as error:  # a non-2xx answer, its body not read yet
            with contextlib.closing(error):
                return error.code, error.headers, _read_whole_non_2xx(error, deadline)
        with response:
            return response.status, response.headers, _read_whole(response, deadline)

    def _failure(self, error: Exception) -> Attempt:
        """The attempt that ``error``, raised before any answer was judged, made."""
        if isinstance(error, urllib.error.URLError):
            return Attempt("retry", f"cannot connect: {error.reason}", receiver_unavailable=True)
        if isinstance(error, http.client.InvalidURL | UnicodeEncodeError):
            # The URL itself cannot be sent (configuration refuses such a URL): no retry
            # can help, and the receiver was never asked. Its text would quote the path.
            return Attempt("rejected", f"{type(error).__name__}: the URL {self.shown_url} cannot be sent")
        return Attempt(
            "retry",
            f"{type(error).__name__}: {error}" if str(error) else type(error).__name__,
            receiver_unavailable=True,
        )


def _read_whole_non_2xx(error: urllib.error.HTTPError, deadline: _Deadline) -> bool:
    """:func:`_read_whole` of the answer ``error`` carries. A body that fails to read
    leaves the answer judged by its status (as before its body was read at all) unless
    the deadline cut it: False, for the deadline to judge."""
    if error.fp is None:
        return False
    try:
        return _read_whole(error.fp, deadline)
    except (OSError, http.client.HTTPException):
        return False


def _judge(status: int, headers: email.message.Message) -> Attempt:
    """The attempt a whole answer of ``status`` with ``headers`` made."""
    if 200 <= status < 300:
        return Attempt("delivered")
    if status >= 500 or status in RETRYABLE_STATUS:
        return Attempt(
            "retry", f"HTTP {status}", _retry_after(headers.get("Retry-After")), status in UNAVAILABLE_STATUS
        )
    return Attempt("rejected", f"HTTP {status}")
