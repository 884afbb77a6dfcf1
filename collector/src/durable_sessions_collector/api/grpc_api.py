"""The gRPC ``durable_sessions.v1.SessionService`` (``proto/durable_sessions/v1/sessions.proto``).

Served on the gRPC port beside the OTLP ``TraceService``:

- ``GetSession``: one session with a page of its actions and one of its violations
  (``actions_page_token``, ``violations_page_token``, see :mod:`.paging`; ``NOT_FOUND``
  when unknown, ``INVALID_ARGUMENT`` for an empty id);
- ``ListSessions``: most recently active first (or by id: ``order``), an optional verdict,
  keyset paging with an opaque ``page_token`` (see :mod:`.paging`, shared with the HTTP API);
- ``WatchAlerts``: a server stream of violations, and of changes of their status
  (``ALERT_STATUS_RESOLVED``, ``ALERT_STATUS_FIRING`` again), as they are committed, read
  from the store's violation feed (so a replica also sees what the others commit), polled
  every ``poll_s``. The verdict and rule filters apply to changes as to new violations;
  a violation that no longer holds passes the verdict filter by the verdict its session
  had while it held too (:func:`alert_verdicts`), so that a watch gets the resolution of
  an alert it was sent.
  The initial metadata ``x-durable-sessions-cursor`` is the starting point; each Alert
  carries the cursor to resume after it; a cursor names its store, and one of another
  store starts from this one's first alert (see :mod:`.alert_cursor`). At most ``max_watchers`` streams at
  once (each holds a worker thread of the port); more are answered ``RESOURCE_EXHAUSTED``.
  A rule name the catalogue lacks is ``INVALID_ARGUMENT`` (a misspelt one matched
  nothing, for ever). With a bearer token, an open stream is ended ``UNAUTHENTICATED``
  within a second once its token is no longer accepted (replaced, and past the overlap):
  the check at the call's start alone let a rotated-out token go on watching. When the
  sidecar stops, open streams end ``UNAVAILABLE`` (retryable: watch again from the last
  cursor), not ``OK``, which a client's loop would take for the end of the watch.

Store failures are answered ``UNAVAILABLE`` (retryable); a stream whose reads fail logs
it once and polls less often until the store answers again.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from google.protobuf import struct_pb2, timestamp_pb2
from google.protobuf.message import DecodeError

from durable_sessions.report import verdict_of
from durable_sessions.rules import CATALOGUE
from durable_sessions.violation import Severity
from durable_sessions_collector.alerts import FIRING, RESOLVED
from durable_sessions_collector.api.alert_cursor import AlertCursors
from durable_sessions_collector.api.paging import (
    BY_ACTIVITY,
    BY_ID,
    DEFAULT_PAGE,
    MAX_PAGE,
    list_page,
    session_page,
)
from durable_sessions_collector.api.v1 import sessions_pb2 as pb
from durable_sessions_collector.api.v1 import sessions_pb2_grpc as pb_grpc
from durable_sessions_collector.credentials import BearerToken
from durable_sessions_collector.jsonlog import JsonLog
from durable_sessions_collector.jsontext import exact_int
from durable_sessions_collector.quote import quoted
from durable_sessions_collector.security import StreamToken
from durable_sessions_collector.store import Store, StoreError
from durable_sessions_collector.store.base import DEFAULT_DETAIL_PAGE, SessionSummary
from durable_sessions_collector.store.base import VERDICTS as BEST_TO_WORST

SERVICE = "durable_sessions.v1.SessionService"
CURSOR_METADATA = "x-durable-sessions-cursor"
MAX_WATCHERS = 8
"""``WatchAlerts`` streams open at once (each holds a worker thread of the port)."""
FEED_BATCH = 200
FAILING_POLL_S = 5.0
"""The longest wait between a watch's reads while the store fails."""

VERDICTS = {"ok": pb.VERDICT_OK, "at_risk": pb.VERDICT_AT_RISK, "unrecoverable": pb.VERDICT_UNRECOVERABLE}
VERDICT_NAMES = {number: name for name, number in VERDICTS.items()}
SEVERITIES = {"warning": pb.SEVERITY_WARNING, "error": pb.SEVERITY_ERROR}
STATES = {"active": pb.SESSION_STATE_ACTIVE, "ended": pb.SESSION_STATE_ENDED}
LIST_ORDERS = {pb.LIST_ORDER_LAST_SEEN: BY_ACTIVITY, pb.LIST_ORDER_SESSION_ID: BY_ID}
"""A ``ListSessionsRequest.order`` as the order :func:`~.paging.list_page` takes."""
ALERT_STATUSES = {FIRING: pb.ALERT_STATUS_FIRING, RESOLVED: pb.ALERT_STATUS_RESOLVED}
"""A feed item's ``status`` as the Alert's."""


def refused_verdicts(field: str, values: Iterable[int], *, every: str) -> str:
    """The INVALID_ARGUMENT message for ``values`` of ``field`` that name no verdict to
    filter by (VERDICT_UNSPECIFIED by its name, others by number, at most five): what to
    send instead, and ``every``, what asks for every verdict."""
    shown = ", ".join(
        pb.Verdict.Name(value) if value == pb.VERDICT_UNSPECIFIED else str(value)
        for value in sorted(set(values))[:5]
    )
    choices = ", ".join(pb.Verdict.Name(number) for number in sorted(VERDICT_NAMES))
    return f"{field}: [{shown}] is not a verdict to filter by; send {choices}, or {every} for every verdict"


class SessionApi(pb_grpc.SessionServiceServicer):
    """The servicer; :meth:`register` adds it to a grpcio server before it starts."""

    def __init__(
        self,
        store: Store,
        *,
        log: JsonLog | None = None,
        token: BearerToken | None = None,
        poll_s: float = 0.1,
        max_watchers: int = MAX_WATCHERS,
    ) -> None:
        self.store = store
        self.log = log
        self.token = token
        self.poll_s = poll_s
        self.max_watchers = max_watchers
        self._watchers = threading.BoundedSemaphore(max_watchers)
        self._stopping = threading.Event()

    def register(self, server: grpc.Server) -> None:
        """Add the service to ``server``. Each method parses its own request: grpcio's
        deserializer would answer bytes that are not the request message ``INTERNAL``
        ("Exception deserializing request!"), blaming the server for the client's error."""
        unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        handlers = {
            "GetSession": parsing_handler(unary, self.GetSession, pb.GetSessionRequest, pb.Session),
            "ListSessions": parsing_handler(
                unary, self.ListSessions, pb.ListSessionsRequest, pb.ListSessionsResponse
            ),
            "WatchAlerts": parsing_handler(stream, self.WatchAlerts, pb.WatchAlertsRequest, pb.Alert),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)

    def stop(self) -> None:
        """End the open watches (call before stopping the server, so it need not wait)."""
        self._stopping.set()

    # --- unary ----------------------------------------------------------------------------

    def GetSession(self, request: pb.GetSessionRequest, context: grpc.ServicerContext) -> pb.Session:
        if not request.session_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session_id is required")
        try:
            detail, actions_token, violations_token = session_page(
                self.store,
                request.session_id,
                actions_size=request.actions_page_size or DEFAULT_DETAIL_PAGE,
                actions_token=request.actions_page_token,
                violations_size=request.violations_page_size or DEFAULT_DETAIL_PAGE,
                violations_token=request.violations_page_token,
            )
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except StoreError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the store cannot be read: {error}")
        if detail is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no session {quoted(request.session_id)}")
        return pb.Session(
            summary=summary_message(detail.summary),
            actions=[action_message(action) for action in detail.actions],
            violations=[violation_message(violation) for violation in detail.violations],
            next_actions_page_token=actions_token,
            next_violations_page_token=violations_token,
        )

    def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.ServicerContext
    ) -> pb.ListSessionsResponse:
        if request.verdict != pb.VERDICT_UNSPECIFIED and request.verdict not in VERDICT_NAMES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                refused_verdicts("verdict", [request.verdict], every="VERDICT_UNSPECIFIED"),
            )
        if request.order not in LIST_ORDERS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown order {request.order}")
        verdict = VERDICT_NAMES.get(request.verdict)
        size = min(request.page_size or DEFAULT_PAGE, MAX_PAGE)
        try:
            sessions, token = list_page(
                self.store, verdict, size, request.page_token, LIST_ORDERS[request.order]
            )
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page_token: {error}")
        except StoreError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the store cannot be read: {error}")
        return pb.ListSessionsResponse(sessions=[summary_message(s) for s in sessions], next_page_token=token)

    # --- the stream -----------------------------------------------------------------------

    def WatchAlerts(
        self, request: pb.WatchAlertsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Alert]:
        # VERDICT_UNSPECIFIED included: in a list it was sent on purpose, and "every verdict"
        # (as ListSessions reads it) or "none" would both be a guess; an empty list is "every".
        refused = [v for v in request.verdicts if v not in VERDICT_NAMES]
        if refused:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                refused_verdicts("verdicts", refused, every="no verdicts (an empty list)"),
            )
        verdicts = {VERDICT_NAMES[v] for v in request.verdicts}
        rules = set(request.rules)
        unknown_rules = sorted(rule for rule in rules if rule not in CATALOGUE)
        if unknown_rules:
            # Each quoted shortened: a rule name of 16 KiB in the grpc-message trailer made the
            # client fail the call RESOURCE_EXHAUSTED ("metadata size exceeds hard limit").
            shown = ", ".join(quoted(rule) for rule in unknown_rules[:5])
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown rule(s) [{shown}]")
        if not self._watchers.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self.max_watchers} WatchAlerts streams at once; retry later",
            )
        try:
            yield from self._watch(request.cursor, verdicts, rules, context)
        finally:
            self._watchers.release()

    def _watch(
        self, cursor: str, verdicts: set[str], rules: set[str], context: grpc.ServicerContext
    ) -> Iterator[pb.Alert]:
        cursors = AlertCursors(self.store)
        try:
            position = cursors.position(cursor) if cursor else self.store.violation_cursor()
            self.store.violations_after(position, 0)
            start = cursors.cursor(position)  # reads the store's id, once: a failure is answered here
        except ValueError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cursor: {error}")
        except StoreError as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the store cannot be read: {error}")
        context.send_initial_metadata(((CURSOR_METADATA, start),))
        done = threading.Event()
        context.add_callback(done.set)  # the client went away
        token = StreamToken(self.token, context)
        feed = _FeedReads(self.store, self.log, self.poll_s)
        while context.is_active() and not self._stopping.is_set() and not done.is_set():
            token.check(context)
            items, position = feed.read(position)
            for item in items:
                if rules and item["rule"] not in rules:
                    continue
                if verdicts and not verdicts & alert_verdicts(item):
                    continue
                yield alert_message(item, cursors.cursor(item["cursor"]))
            if len(items) < FEED_BATCH:
                done.wait(feed.wait_s)
        if self._stopping.is_set() and not done.is_set():
            # Not OK: a client's loop over the stream would end as if the watch were over.
            context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the sidecar is stopping; watch again from the last alert's cursor",
            )


class _FeedReads:
    """One stream's reads of the store's violation feed. A store that fails is logged once
    (and again once it answers), not at every poll, and read less often meanwhile."""

    def __init__(self, store: Store, log: JsonLog | None, poll_s: float) -> None:
        self.store = store
        self.log = log
        self.poll_s = poll_s
        self.wait_s = poll_s
        self.failing = False

    def read(self, position: str) -> tuple[list[dict[str, Any]], str]:
        """The violations after the feed's ``position`` (none while the store fails) and
        the new position."""
        try:
            items, position = self.store.violations_after(position, FEED_BATCH)
        except StoreError as error:
            if not self.failing and self.log is not None:
                self.log.error("watch-read-failed", error=str(error), note="logged once until it reads again")
            self.failing, self.wait_s = True, min(FAILING_POLL_S, self.wait_s * 2)
            return [], position
        if self.failing and self.log is not None:
            self.log.info("watch-read-recovered")
        self.failing, self.wait_s = False, self.poll_s
        return items, position


def alert_verdicts(item: dict[str, Any]) -> set[str | None]:
    """The session verdicts under which a watch's ``verdicts`` filter passes the feed's
    ``item``: its session's verdict now and, for a violation that no longer holds (resolved
    since, or this item its resolution), the verdict the session had while it held, the
    worse of its verdict now and the one the violation gives it alone.

    A resolution leaves its session better off (usually ``ok``): filtered by the verdict
    now alone, a watch of ``unrecoverable`` sessions was sent the firing and never its
    resolution. Read from the item alone, the filter passes the same alerts to a watch that
    was open then as to one that reads them later from a cursor."""
    now = item["session_verdict"]
    held = item["resolved"] or item["status"] == RESOLVED
    if now not in BEST_TO_WORST or not held or item["severity"] not in SEVERITIES:  # None: no session
        return {now}
    alone = verdict_of([Severity(item["severity"])])
    return {now, max(now, alone, key=BEST_TO_WORST.index)}


def parsing_handler(kind: Any, method: Any, request_type: Any, response_type: Any) -> grpc.RpcMethodHandler:
    """A ``kind`` handler calling ``method`` with the request parsed from its raw bytes, or
    answering ``INVALID_ARGUMENT`` when they are not a ``request_type`` message."""
    name = request_type.DESCRIPTOR.full_name

    def handle(body: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = request_type.FromString(body)
        except DecodeError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {name} message")
        return method(request, context)

    return kind(handle, response_serializer=response_type.SerializeToString)  # type: ignore[no-any-return]


# --- conversions ------------------------------------------------------------------------


def timestamp(seconds: float | None) -> timestamp_pb2.Timestamp | None:
    if seconds is None or not math.isfinite(seconds):
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(round(seconds * 1e9))
    return stamp


def summary_message(summary: SessionSummary) -> pb.SessionSummary:
    return pb.SessionSummary(
        session_id=summary.session_id,
        verdict=VERDICTS.get(summary.verdict, pb.VERDICT_UNSPECIFIED),
        state=STATES.get(summary.state, pb.SESSION_STATE_UNSPECIFIED),
        action_count=summary.actions,
        errors=summary.errors,
        warnings=summary.warnings,
        first_seen=timestamp(summary.first_seen),
        last_seen=timestamp(summary.last_seen),
        ended_at=timestamp(summary.ended_at),
    )


def action_message(action: dict[str, Any]) -> pb.Action:
    record = struct_pb2.Struct()
    record.update({str(k): _plain(v) for k, v in action.items()})
    return pb.Action(
        trace_id=_text(action.get("trace_id")),
        span_id=_text(action.get("span_id")),
        received_at=timestamp(action.get("received_at")),
        action_id=_text(action.get("action_id")),
        kind=_text(action.get("kind")),
        status=_text(action.get("status")),
        record=record,
    )


def alert_message(item: dict[str, Any], cursor: str) -> pb.Alert:
    """An item of the store's violation feed (:func:`~durable_sessions_collector.store.base.feed_item`)
    as the ``Alert`` it is sent as, with the client's ``cursor`` after it."""
    return pb.Alert(
        violation=violation_message(item),
        session_verdict=VERDICTS.get(item["session_verdict"] or "", pb.VERDICT_UNSPECIFIED),
        cursor=cursor,
        status=ALERT_STATUSES[item["status"]],
        detected_at=timestamp(item["detected_at"]),
    )


def violation_message(violation: dict[str, Any]) -> pb.Violation:
    return pb.Violation(
        key=_text(violation.get("key")),
        rule=_text(violation.get("rule")),
        severity=SEVERITIES.get(violation.get("severity") or "", pb.SEVERITY_UNSPECIFIED),
        message=_text(violation.get("message")),
        session_id=_text(violation.get("session_id")),
        action_id=_text(violation.get("action_id")),
        trace_id=_text(violation.get("trace_id")),
        span_id=_text(violation.get("span_id")),
        at_session_end=bool(violation.get("at_session_end")),
        resolved=bool(violation.get("resolved")),
        not_counted=bool(violation.get("not_counted")),
        created_at=timestamp(violation.get("created_at")),
    )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def _plain(value: Any) -> Any:
    """A value a ``google.protobuf.Struct`` holds. Numbers become doubles, but for an
    integer a double cannot hold exactly, which becomes its decimal text, as protobuf's
    JSON mapping writes an int64, and as the HTTP API writes it (:func:`~durable_sessions_collector.jsontext.exact_int`):
    a ``seq`` (a span's start in nanoseconds, about 1.8e18) read as a double was another
    number, off by up to 256 ns."""
    if value is None or isinstance(value, bool | str | float):
        return value
    if isinstance(value, int):
        exact = exact_int(value)
        return exact if isinstance(exact, str) else float(exact)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return {"bytes_hex": bytes(value).hex()}
    return repr(value)
