"""The OTLP/gRPC receiver: ``opentelemetry.proto.collector.trace.v1.TraceService/Export``.

The method is registered with a raw-bytes deserializer, so a body that is not an
``ExportTraceServiceRequest`` is answered ``INVALID_ARGUMENT`` with the decoder's reason
(grpcio's own deserialization would answer ``INTERNAL``, which the Collector treats as
permanent *and* misattributes to the server). Answers, per the OTLP specification:

- OK, ``partial_success`` unset when every span was accepted; set, naming the rejected
  spans, when some were not (the valid ones are stored);
- ``INVALID_ARGUMENT``: the request cannot be decoded (not retried by clients);
- ``RESOURCE_EXHAUSTED``: over ``max_request_bytes`` (grpcio enforces the receive limit);
- ``UNAVAILABLE`` with ``RetryInfo``: the write queue is full, the decoding budget has
  no room for the request (:mod:`.budget`), the store failed, or the sidecar is stopping
  (:class:`Drain`); the ``RetryInfo`` is sent both in ``grpc-status-details-bin``
  (``google.rpc.Status``, as Go clients read it) and as ``google.rpc.retryinfo-bin`` (as
  the Python SDK reads it).
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from contextlib import suppress
from typing import Any

import grpc
from google.rpc import code_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from durable_sessions_collector.grpchandlers import answered_by
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.otlp.budget import DecodingRefused
from durable_sessions_collector.otlp.decode import BadData
from durable_sessions_collector.otlp.receiver import TraceReceiver, retry_info, rpc_status, spread_retry
from durable_sessions_collector.pipeline import Overloaded, Unavailable

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
TRANSPORT = "grpc"
EXPORT_METHOD = f"/{SERVICE}/Export"

SPARE_WORKERS = 8
"""Worker threads of the port beyond those that Exports waiting for their commit,
``WatchAlerts`` streams and health ``Watch`` streams can hold (see :func:`worker_count`):
the API's unary calls, health ``Check`` calls, and Exports answered ``UNAVAILABLE`` at once
when the write queue is full, always find one."""

MAX_METADATA_BYTES = 64 * 1024
"""Largest metadata (headers) of a call, as HTTP/2 counts it; more is ``RESOURCE_EXHAUSTED``.
grpcio's default is a soft limit of 8 KiB past which calls are refused *at random*, more
often the closer they are to a hard limit of 16 KiB: the same Export (a large token, say)
would be accepted or refused from one try to the next. One limit, soft = hard, refuses
the same calls every time; 64 KiB is the HTTP port's limit for one header line."""

MIN_PING_INTERVAL_MS = 5_000
"""Shortest interval between a client's HTTP/2 keepalive pings the port accepts, with or
without calls open (``grpc.http2.min_ping_interval_without_data_ms``, with
``grpc.keepalive_permit_without_calls``). With grpcio's defaults (5 min with calls, 2 h
without) a client's fourth ping within that time is answered GOAWAY ``too_many_pings``,
which ends every call on the connection, an open ``WatchAlerts`` stream included: a client
with the Collector's exporter keepalive (``time: 10s``) watching a quiet store lost its
watch after ~40 s.
gRPC clients in Go and Java cannot ping more often than every 10 s; half of that leaves
room for timer jitter."""

KEEPALIVE_TIME_MS = 60_000
"""The port pings a connection from which it has received nothing for this long..."""

KEEPALIVE_TIMEOUT_MS = 20_000
"""...and closes it when the ping is not answered within this time. grpcio's default (a
ping after 2 h) would let a client that vanished without closing its connection (a host
powered off, a dropped NAT mapping) hold a ``WatchAlerts`` slot, and its worker thread,
for two hours; now it is freed within about 80 s."""


def worker_count(pipeline_capacity: int, max_watchers: int, max_health_watchers: int) -> int:
    """Worker threads for the gRPC port: one per Export the write pipeline can hold
    (``pipeline_capacity``: the queue and the batch being committed), one per
    ``WatchAlerts`` stream (``max_watchers``), one per health ``Watch`` stream
    (``max_health_watchers``), and :data:`SPARE_WORKERS`. An Export holds its thread until
    its records are committed, a watch for as long as it is open; with fewer threads,
    Exports waiting on a slow store took every thread, so API calls waited behind them, and
    further Exports queued inside grpcio until their deadline instead of being answered
    ``UNAVAILABLE`` with ``RetryInfo`` when the write queue is full.
    Threads are started only as calls need them."""
    return pipeline_capacity + max_watchers + max_health_watchers + SPARE_WORKERS


def bind_error(endpoint: str) -> str | None:
    """Why ``endpoint`` (host:port) cannot be listened on, as the OS says it ("Address
    already in use", "Cannot assign requested address", "Permission denied"), found by
    binding a socket to each of its addresses as grpcio does (``SO_REUSEADDR`` on); None
    when every bind succeeds. grpcio's own error says only "Failed to bind", and to set
    ``GRPC_VERBOSITY=debug``, which ``serve`` turns off."""
    host, _, port = endpoint.rpartition(":")
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (OSError, ValueError) as error:
        return str(error)
    for family, kind, protocol, _, address in addresses:
        try:
            with socket.socket(family, kind, protocol) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as error:
            return error.strerror or str(error)
    return None


QUIET_S = 0.05
"""A draining port closes once no call has arrived or been answered for this long and none
is in progress."""
MIN_CLOSE_GRACE_S = 0.5
"""The least grace the port's close gives the calls still in progress, after its drain."""
ALWAYS_ANSWERED = "/grpc.health.v1.Health/"
"""Methods a draining port still serves: the health service answers NOT_SERVING itself."""
PROBE = "/durable_sessions.internal.Drain/Probe"
"""The call a draining port sends itself (:meth:`Drain.drain`); refused like any other."""


class Drain(grpc.ServerInterceptor):
    """The first step of the port's stop: new calls are answered ``UNAVAILABLE`` with
    ``RetryInfo`` ("the sidecar is stopping") by a handler of the sidecar while the calls
    in progress end, before grpcio's stop closes the port.

    grpcio answers a call that has reached the server but no handler when its stop begins
    ``CANCELLED`` (retryable in the OTLP specification, but read by many clients as their
    own cancellation, and without a delay), and gives no way to answer it otherwise. A
    client told ``UNAVAILABLE`` with a delay during the drain waits, and meets a closed
    port (``UNAVAILABLE``) after it, so few calls are left to be caught so. The quiet the
    drain waits for starts at the last answer too: a client answered OK sends its next call
    at once, and is told to wait. Only unary calls are waited for: the sidecar ends its own
    streams before it stops the port.

    A call is seen when grpcio's one serving thread hands it to the interceptors, which a
    process short of CPU may not do for longer than :data:`QUIET_S` after it reached the
    port: the quiet alone then closed the port on calls waiting to be read, and grpcio
    answered them ``CANCELLED``. So once quiet, the drain sends the port a call of its own
    (:data:`PROBE`, where it can: see :meth:`GrpcReceiver.stop`); calls reach the serving
    thread in the order they reached the port, so when the probe has been seen every call
    before it has been too, and the drain ends only if none of them was new."""

    def __init__(self, retry_after_s: float, on_refused: Callable[[str], None] = lambda method: None) -> None:
        """``on_refused(method)`` is called for each call refused (``/package.Service/Method``)."""
        self.retry_after_s = retry_after_s
        self.on_refused = on_refused
        self.draining = threading.Event()
        self._lock = threading.Lock()
        self._in_progress = 0
        self._last_activity = -math.inf
        """``time.monotonic()`` of the last call's arrival or answer."""

    def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        if handler_call_details.method == PROBE and self.draining.is_set():  # the drain's own
            return grpc.unary_unary_rpc_method_handler(self._refuse)
        handler = continuation(handler_call_details)
        with self._lock:
            self._last_activity = time.monotonic()
        if handler is None or handler_call_details.method.startswith(ALWAYS_ANSWERED):
            return handler
        if self.draining.is_set():
            self.on_refused(handler_call_details.method)
            return answered_by(handler, self._refuse)
        if handler.unary_unary is not None:
            return answered_by(handler, self._counted(handler.unary_unary))
        return handler

    def drain(self, deadline: float, probe: Callable[[float], None] | None = None) -> None:
        """Answer new calls ``UNAVAILABLE`` from now on; return once no call is in progress
        and none arrived or was answered for :data:`QUIET_S`, nor before ``probe``'s call
        was seen, or at ``deadline`` (``time.monotonic()``). ``probe(timeout_s)`` sends
        :data:`PROBE` to the port and returns once it is answered (or fails)."""
        self.draining.set()
        while time.monotonic() < deadline:
            if self._quiet():
                if probe is None:
                    return
                sent = time.monotonic()
                probe(max(deadline - sent, 0.0))
                if self._quiet(since=sent):
                    return
            time.sleep(0.01)

    def _quiet(self, since: float | None = None) -> bool:
        """No call in progress, and none arrived or answered for :data:`QUIET_S` (or since ``since``)."""
        with self._lock:
            if since is not None:
                return self._in_progress == 0 and self._last_activity < since
            return self._in_progress == 0 and time.monotonic() - self._last_activity >= QUIET_S

    def _counted(self, behaviour: Any) -> Any:
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            with self._lock:
                self._in_progress += 1
            try:
                return behaviour(request, context)
            finally:
                with self._lock:
                    self._in_progress -= 1
                    self._last_activity = time.monotonic()

        return counted

    def _refuse(self, _request: Any, context: grpc.ServicerContext) -> Any:
        context.abort_with_status(
            unavailable_status(
                "the sidecar is stopping; retry later, or with another replica", self.retry_after_s
            )
        )


class _Status(grpc.Status):
    def __init__(
        self, code: grpc.StatusCode, details: str, trailing_metadata: tuple[tuple[str, Any], ...]
    ) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


def unavailable_status(message: str, retry_after_s: float) -> grpc.Status:
    """``UNAVAILABLE`` carrying ``RetryInfo`` (both where Go and Python clients look), its
    delay spread above ``retry_after_s`` (see :func:`spread_retry`)."""
    retry_after_s = spread_retry(retry_after_s)
    status = rpc_status(code_pb2.UNAVAILABLE, message, retry_after_s=retry_after_s)
    return _Status(
        grpc.StatusCode.UNAVAILABLE,
        message,
        (
            ("grpc-status-details-bin", status.SerializeToString()),
            ("google.rpc.retryinfo-bin", retry_info(retry_after_s).SerializeToString()),
        ),
    )


def invalid_argument_status(message: str) -> grpc.Status:
    status = rpc_status(code_pb2.INVALID_ARGUMENT, message, bad_request=True)
    return _Status(
        grpc.StatusCode.INVALID_ARGUMENT, message, (("grpc-status-details-bin", status.SerializeToString()),)
    )


class GrpcReceiver:
    """A grpcio server with the trace service (more services can be added before start)."""

    def __init__(
        self,
        receiver: TraceReceiver,
        endpoint: str,
        *,
        max_request_bytes: int,
        log: JsonLog,
        workers: int = 16,
        credentials: grpc.ServerCredentials | None = None,
        interceptors: tuple[grpc.ServerInterceptor, ...] = (),
    ) -> None:
        """``credentials``: serve TLS (see :mod:`..security`); ``interceptors`` run before
        every RPC of the port (the bearer-token check), the trace service's and any other's."""
        self.receiver = receiver
        self.metrics = receiver.metrics
        self.endpoint = endpoint
        self.log = log
        self.credentials = credentials
        self.drain = Drain(receiver.pipeline.retry_after_s, on_refused=self._refused_while_stopping)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="otlp-grpc"),
            # The drain first: a stopping port answers every call alike, asked with a token or not.
            interceptors=(self.drain, *interceptors),
            options=[
                ("grpc.max_receive_message_length", max_request_bytes),
                ("grpc.max_send_message_length", 4 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
                ("grpc.max_metadata_size", MAX_METADATA_BYTES),
                ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
                ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                # grpcio 1.85 bounds a keepalive ping's answer by the ping timeout (1 min by
                # default), not by keepalive_timeout_ms: both say the same.
                ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ],
        )
        handler = grpc.unary_unary_rpc_method_handler(
            self._export,
            request_deserializer=None,  # raw bytes: decoding errors are ours to answer
            response_serializer=ExportTraceServiceResponse.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Export": handler}),)
        )
        self.port = 0

    def start(self) -> int:
        """Listen on the endpoint and serve; return the port. :class:`OSError` naming the
        setting, the endpoint and why, when the port cannot be bound."""
        try:
            if self.credentials is not None:
                port = self.server.add_secure_port(self.endpoint, self.credentials)
            else:
                port = self.server.add_insecure_port(self.endpoint)
        except RuntimeError as error:
            reason = bind_error(self.endpoint) or str(error)
            raise OSError(f"receivers.grpc.endpoint: cannot listen on {self.endpoint}: {reason}") from None
        if port == 0:
            reason = bind_error(self.endpoint)
            raise OSError(
                f"receivers.grpc.endpoint: cannot listen on {self.endpoint}"
                + (f": {reason}" if reason else "")
            )
        self.server.start()
        self.port = port
        return port

    def stop(self, grace: float = 2.0) -> None:
        """Drain the port (:class:`Drain`) for up to ``grace`` seconds, then close it,
        cancelling the calls still in progress after what is left of ``grace`` (at least
        :data:`MIN_CLOSE_GRACE_S`): grpcio answers those ``UNAVAILABLE``. A TLS port is
        drained without the probe: the sidecar has no certificate its port would accept
        from a client (mutual TLS), nor always the CA that signed its own."""
        deadline = time.monotonic() + grace
        if self.port:  # started: calls may be coming
            self.drain.drain(deadline, None if self.credentials is not None else self._probe)
        close_grace = max(deadline - time.monotonic(), MIN_CLOSE_GRACE_S)
        self.server.stop(close_grace).wait(close_grace + 1)

    def _probe(self, timeout_s: float) -> None:
        """Call :data:`PROBE` on the port, over this host's loopback when the port listens
        on every address, and wait for the answer: a refusal, or a failure to connect."""
        host = self.endpoint.rpartition(":")[0]
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
        # Its answer does not matter, only that the port has read it.
        with grpc.insecure_channel(f"{host}:{self.port}") as channel, suppress(grpc.RpcError):
            channel.unary_unary(PROBE)(b"", timeout=min(timeout_s, 1.0))

    def _refused_while_stopping(self, method: str) -> None:
        """An Export the drain refused counts as ``unavailable``, as one the stopping writer refuses."""
        if method == EXPORT_METHOD:
            self.metrics.requests.labels(TRANSPORT, "unavailable").inc()

    def _export(self, body: bytes, context: grpc.ServicerContext) -> ExportTraceServiceResponse:
        start = time.perf_counter()
        metrics = self.metrics
        try:
            rejected: list[str] = []
            try:
                spans = self.receiver.decode(body, rejected, TRANSPORT)
            except BadData as error:
                metrics.requests.labels(TRANSPORT, "invalid").inc()
                context.abort_with_status(invalid_argument_status(str(error)))
            except DecodingRefused as error:
                metrics.requests.labels(TRANSPORT, "unavailable").inc()
                context.abort_with_status(unavailable_status(str(error), error.retry_after_s))
            try:
                outcome = self.receiver.export(spans, rejected, TRANSPORT)
            except Overloaded as error:
                metrics.requests.labels(TRANSPORT, "unavailable").inc()
                context.abort_with_status(unavailable_status(str(error), error.retry_after_s))
            except Unavailable as error:
                metrics.requests.labels(TRANSPORT, "unavailable").inc()
                context.abort_with_status(unavailable_status(str(error), error.retry_after_s))
            except Exception as error:
                self.log.error("export-failed", transport=TRANSPORT, error=f"{type(error).__name__}: {error}")
                metrics.requests.labels(TRANSPORT, "unavailable").inc()
                context.abort_with_status(
                    unavailable_status("internal error in the sidecar (see its log); retry later", 1)
                )
            metrics.requests.labels(TRANSPORT, "partial" if outcome.rejected else "ok").inc()
            return outcome.response()
        finally:
            metrics.export_latency.labels(TRANSPORT).observe(time.perf_counter() - start)
