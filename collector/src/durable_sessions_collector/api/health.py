"""The standard gRPC health service, ``grpc.health.v1.Health``, on the gRPC port.

What Kubernetes ``grpc:`` probes, ``grpc_health_probe``, load balancers and gRPC's
client-side health checking ask (https://github.com/grpc/grpc/blob/master/doc/health-checking.md).
Its answer is the one ``GET /healthz`` gives, computed when asked, never a stored flag:
``SERVING`` when ``healthy()`` names no problem (the writer thread runs, the delivery
threads run, the store answers a read within :data:`HEALTH_CHECK_TIMEOUT_S`, see
:class:`StoreCheck`); ``NOT_SERVING`` otherwise, and from
:meth:`GrpcHealth.stop` on.

- ``Check``: the status of ``""`` (the whole server),
  ``opentelemetry.proto.collector.trace.v1.TraceService`` or
  ``durable_sessions.v1.SessionService`` — the same for all three, since they share the
  writer and the store. Any other name: ``NOT_FOUND``, as the protocol says.
- ``List``: the three names with that status.
- ``Watch``: the status at once, then a message each time it changes, looked at every
  ``poll_s`` (1 s). An unknown name gets ``SERVICE_UNKNOWN`` and the stream stays open, as
  the protocol says (here it never becomes known). The stream ends when the client
  cancels (at once: the cancellation wakes it) and when the sidecar stops, after a last
  ``NOT_SERVING``. Each stream holds a worker thread of the port, so at most
  ``max_watchers`` (:data:`MAX_HEALTH_WATCHERS`) are open at once, counted in
  :func:`..otlp.grpc_receiver.worker_count`; more are answered ``RESOURCE_EXHAUSTED``.

With a bearer token configured, ``Check`` alone is open, like ``GET /healthz`` (see
:data:`..security.OPEN_METHODS`): it tells nothing but the status, never the reason.
``Watch`` and ``List`` need the token; an open ``Watch`` ends ``UNAUTHENTICATED`` once its
token is no longer accepted (:class:`..security.StreamToken`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from durable_sessions_collector.api.grpc_api import SERVICE as SESSION_SERVICE
from durable_sessions_collector.api.grpc_api import parsing_handler
from durable_sessions_collector.credentials import BearerToken
from durable_sessions_collector.otlp.grpc_receiver import SERVICE as TRACE_SERVICE
from durable_sessions_collector.quote import quoted
from durable_sessions_collector.security import StreamToken
from durable_sessions_collector.store import StoreError

SERVICE = "grpc.health.v1.Health"
OVERALL = ""
"""The name standing for the whole server."""
SERVICES = (OVERALL, TRACE_SERVICE, SESSION_SERVICE)

MAX_HEALTH_WATCHERS = 4
"""Health ``Watch`` streams open at once. Probes (kubelet, ``grpc_health_probe``, Envoy)
call ``Check``; a watch is a gRPC client's own health checking, one per connection, and a
sidecar has few clients."""

WATCH_POLL_S = 1.0
"""How often an open ``Watch`` looks at the health (one read of the store each)."""

HEALTH_CHECK_TIMEOUT_S = 2.0
"""Longest a health probe waits for the store to answer (:class:`StoreCheck`): below the
1–3 s timeouts probes are given, so that they get an answer, and a reason, rather than
a timeout."""

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class StoreCheck:
    """The store's half of the health: ``check()`` (a read, raising :class:`StoreError`)
    run in a thread of its own, one at a time, and waited for at most ``timeout_s``.

    Called, it returns None when the store answered, else why not: the error, or that it
    did not answer in time. A store that does not answer at all (a PostgreSQL behind a
    network partition) keeps one check waiting on it, not one per probe: every probe
    meanwhile shares that check, and is answered when ``timeout_s`` is out. Waiting in the
    probe's own thread, each probe held a thread of its port and a read connection for as
    long as the store was silent, and answered nothing.
    """

    def __init__(
        self, check: Callable[[], None], name: str, timeout_s: float = HEALTH_CHECK_TIMEOUT_S
    ) -> None:
        """``name``: the store as the reason names it (its URL without the password)."""
        self.check = check
        self.name = name
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._running: _Outcome | None = None

    def __call__(self) -> str | None:
        with self._lock:
            outcome = self._running
            if outcome is None:
                outcome = self._running = _Outcome()
                threading.Thread(
                    target=self._run, args=(outcome,), name="durable-sessions-store-check", daemon=True
                ).start()
        if not outcome.done.wait(self.timeout_s):
            return f"store {self.name!r} did not answer within {self.timeout_s:g} s"
        if outcome.error is not None and not isinstance(outcome.error, StoreError):
            raise outcome.error
        return None if outcome.error is None else str(outcome.error)

    def _run(self, outcome: _Outcome) -> None:
        try:
            self.check()
        except Exception as error:
            outcome.error = error
        finally:
            with self._lock:
                self._running = None
            outcome.done.set()


class _Outcome:
    """One run of :class:`StoreCheck`: set once it is over, with its error if it failed."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Exception | None = None


class GrpcHealth(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` answering what ``GET /healthz`` answers.

    ``healthy()`` returns why the sidecar is unhealthy (its threads, its store), or None:
    the callable the HTTP API's ``/healthz`` gets. :meth:`register` adds the service to a grpcio server before it starts;
    :meth:`stop` (before stopping that server) makes every answer ``NOT_SERVING`` and
    ends the open watches, so the server need not wait for them.
    """

    def __init__(
        self,
        healthy: Callable[[], str | None],
        *,
        services: Iterable[str] = SERVICES,
        poll_s: float = WATCH_POLL_S,
        max_watchers: int = MAX_HEALTH_WATCHERS,
        token: BearerToken | None = None,
    ) -> None:
        self.healthy = healthy
        self.token = token
        self.services = frozenset(services)
        self.poll_s = poll_s
        self.max_watchers = max_watchers
        self._watchers = threading.BoundedSemaphore(max_watchers)
        self._stopping = threading.Event()
        self._wakes: set[threading.Event] = set()
        self._lock = threading.Lock()

    def register(self, server: grpc.Server) -> None:
        """Add the service to ``server``. Each method parses its own request, as the
        SessionService's do: bytes that are not a request message get ``INVALID_ARGUMENT``,
        not grpcio's ``INTERNAL``."""
        unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        request, response = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        handlers = {
            "Check": parsing_handler(unary, self.Check, request, response),
            "List": parsing_handler(
                unary, self.List, health_pb2.HealthListRequest, health_pb2.HealthListResponse
            ),
            "Watch": parsing_handler(stream, self.Watch, request, response),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)

    def stop(self) -> None:
        """From now on everything is ``NOT_SERVING``; open watches say so and end now."""
        self._stopping.set()
        with self._lock:
            wakes = list(self._wakes)
        for wake in wakes:
            wake.set()

    def status(self) -> health_pb2.HealthCheckResponse.ServingStatus:
        """The status of every known service, now."""
        if self._stopping.is_set() or self.healthy() is not None:
            return NOT_SERVING
        return SERVING

    # --- the RPCs ---------------------------------------------------------------------------

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.services:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {quoted(request.service)}")
        return health_pb2.HealthCheckResponse(status=self.status())

    def List(
        self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthListResponse:
        answer = health_pb2.HealthCheckResponse(status=self.status())  # one check serves all
        return health_pb2.HealthListResponse(statuses=dict.fromkeys(self.services, answer))

    def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> Iterator[health_pb2.HealthCheckResponse]:
        if not self._watchers.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self.max_watchers} health Watch streams at once; call Check, or retry later",
            )
        try:
            yield from self._watch(request.service, context)
        finally:
            self._watchers.release()

    def _watch(self, service: str, context: grpc.ServicerContext) -> Iterator[health_pb2.HealthCheckResponse]:
        wake = threading.Event()
        # A cancelled call (the client went away, or the server stopped it) wakes the loop
        # at once: waiting out the poll would hold the worker thread and the slot.
        context.add_callback(wake.set)
        with self._lock:
            self._wakes.add(wake)
        try:
            last = None
            token = StreamToken(self.token, context)
            while context.is_active():
                token.check(context)
                # Read before the status: a stop after this read wakes the wait below, and
                # the next round sends the last NOT_SERVING; read after, a stop between the
                # two ended the stream without it.
                stopping = self._stopping.is_set()
                status = self.status() if service in self.services else SERVICE_UNKNOWN
                if status != last:
                    yield health_pb2.HealthCheckResponse(status=status)
                    last = status
                if stopping:
                    return
                wake.wait(self.poll_s)
        finally:
            with self._lock:
                self._wakes.discard(wake)
