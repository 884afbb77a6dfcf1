"""The HTTP JSON API on the HTTP port.

- ``GET /api/sessions?verdict=ok|at_risk|unrecoverable&limit=N&page_token=T&order=O``:
  sessions, most recently active first (``order=last_seen``, the default) or by id
  (``order=session_id``: a walk through the pages that lists each session once, however
  active it is meanwhile), a page of at most ``limit`` (default 100, at most 1,000);
  ``next_page_token`` asks for the next page, and is empty on the last one (keyset
  paging shared with the gRPC API: :mod:`.paging`);
- ``GET /api/sessions/{id}``: one session (400 for an empty id, ``/api/sessions/``): its
  verdict, a page of its actions in order (start time, then arrival; digests only, never
  result or prompt text) and a page of its violations, at most ``actions_limit`` and
  ``violations_limit`` (default 1,000, at most 5,000); ``next_actions_page_token`` and
  ``next_violations_page_token``, passed back as ``actions_page_token`` and
  ``violations_page_token``, ask for the next pages, and are empty on the last;
- ``GET /healthz``: 200 when the writer runs and the store answers, else 503; the reason
  is given only to a caller that may see it (no token configured, or the token sent),
  since it names the store;
- ``GET /metrics``: Prometheus text format 0.0.4, or OpenMetrics 1.0.0 when the scraper's
  ``Accept`` asks for it (as Prometheus does), gzipped when ``Accept-Encoding`` allows —
  negotiated as prometheus-client's own handler does (its ``name[]`` filter too).
"""

from __future__ import annotations

import gzip
from collections.abc import Callable

from prometheus_client.exposition import choose_encoder, gzip_accepted

from durable_sessions_collector.alerts.metrics import Metrics
from durable_sessions_collector.api.paging import (
    BY_ACTIVITY,
    DEFAULT_PAGE,
    MAX_PAGE,
    ORDERS,
    list_page,
    session_page,
)
from durable_sessions_collector.httpserver import Request, Response, Router
from durable_sessions_collector.quote import not_text, quoted
from durable_sessions_collector.store import Store, StoreError
from durable_sessions_collector.store.base import DEFAULT_DETAIL_PAGE, MAX_DETAIL_PAGE, VERDICTS


class HttpApi:
    def __init__(self, store: Store, metrics: Metrics, healthy: Callable[[], str | None]) -> None:
        self.store = store
        self.metrics = metrics
        self.healthy = healthy

    def register(self, router: Router) -> None:
        router.add("GET", "/api/sessions", self.list_sessions)
        router.add("GET", "/api/sessions/*", self.get_session)
        # The prefix route needs a character past its '/': an empty id was "no such path".
        router.add("GET", "/api/sessions/", self.get_session)
        router.add("GET", "/healthz", self.healthz)
        router.add("GET", "/metrics", self.metrics_page)

    def list_sessions(self, request: Request) -> Response:
        if (refused := argument_error(request, LIST_ARGUMENTS)) is not None:
            return refused
        verdict = (request.query.get("verdict") or [None])[-1]
        if verdict is not None and verdict not in VERDICTS:
            return Response.json(
                400, {"error": f"verdict must be one of {', '.join(VERDICTS)}, got {quoted(verdict)}"}
            )
        order = (request.query.get("order") or [BY_ACTIVITY])[-1]
        if order not in ORDERS:
            return Response.json(
                400, {"error": f"order must be one of {', '.join(ORDERS)}, got {quoted(order)}"}
            )
        limit = page_size(request, "limit", DEFAULT_PAGE, MAX_PAGE)
        if isinstance(limit, Response):
            return limit
        try:
            sessions, token = list_page(
                self.store, verdict, limit, (request.query.get("page_token") or [""])[-1], order
            )
        except ValueError as error:
            return Response.json(400, {"error": f"page_token: {error}"})
        except StoreError as error:
            return store_unavailable(error)
        return Response.json(200, {"sessions": [s.as_dict() for s in sessions], "next_page_token": token})

    def get_session(self, request: Request) -> Response:
        session_id = request.params.get("rest", "")
        if (refused := argument_error(request, DETAIL_ARGUMENTS)) is not None:
            return refused
        if not session_id:  # no session has one; gRPC answers INVALID_ARGUMENT too
            return Response.json(400, {"error": "the session id is empty; give one: /api/sessions/{id}"})
        if (shown := not_text(session_id)) is not None:
            # Read with replacement, %E9 (Latin-1 é) was the session "\ufffd", answered for an
            # id never sent; no span's id is other than UTF-8, and gRPC refuses such a string.
            return Response.json(
                400, {"error": f"the session id {quoted(shown)} is not UTF-8 once percent-decoded"}
            )
        actions_size = page_size(request, "actions_limit", DEFAULT_DETAIL_PAGE, MAX_DETAIL_PAGE)
        if isinstance(actions_size, Response):
            return actions_size
        violations_size = page_size(request, "violations_limit", DEFAULT_DETAIL_PAGE, MAX_DETAIL_PAGE)
        if isinstance(violations_size, Response):
            return violations_size
        try:
            detail, actions_token, violations_token = session_page(
                self.store,
                session_id,
                actions_size=actions_size,
                actions_token=(request.query.get("actions_page_token") or [""])[-1],
                violations_size=violations_size,
                violations_token=(request.query.get("violations_page_token") or [""])[-1],
            )
        except ValueError as error:
            return Response.json(400, {"error": str(error)})
        except StoreError as error:
            return store_unavailable(error)
        if detail is None:
            return Response.json(404, {"error": f"no session {quoted(session_id)}"})
        tokens = {"next_actions_page_token": actions_token, "next_violations_page_token": violations_token}
        return Response.json(200, {**detail.as_dict(), **tokens})

    def healthz(self, request: Request) -> Response:
        problem = self.healthy()
        if problem is not None:
            if not request.authenticated:  # an open probe: the reason names the store
                return Response.json(503, {"status": "unhealthy"})
            return Response.json(503, {"status": "unhealthy", "reason": problem})
        return Response.json(200, {"status": "ok"})

    def metrics_page(self, request: Request) -> Response:
        # Negotiated as prometheus-client's make_wsgi_app does. Before, every scrape got the
        # text format, even one asking for OpenMetrics, under prometheus-client's
        # CONTENT_TYPE_LATEST (now "version=1.0.0", not the 0.0.4 its handler answers a plain
        # Accept with), never gzipped.
        # Every line of each header (header_list): the first alone missed an OpenMetrics or
        # gzip asked on a later line, which a WSGI server hands prometheus-client's joined.
        encoder, content_type = choose_encoder(request.header_list("Accept"))
        registry = self.metrics.registry
        if "name[]" in request.query:
            registry = registry.restricted_registry(request.query["name[]"])  # type: ignore[assignment]
        body = encoder(registry)
        if gzip_accepted(request.header_list("Accept-Encoding")):
            return Response(200, gzip.compress(body), content_type, {"Content-Encoding": "gzip"})
        return Response(200, body, content_type)


LIST_ARGUMENTS = ("verdict", "limit", "page_token", "order")
DETAIL_ARGUMENTS = ("actions_limit", "actions_page_token", "violations_limit", "violations_page_token")


def argument_error(request: Request, known: tuple[str, ...]) -> Response | None:
    """The 400 answer naming a query parameter that is not UTF-8 text, one that ``known``
    lacks (a misspelt ``verdit=ok`` was ignored, and every session listed) or one given
    more than once (``verdict=ok&verdict=at_risk`` was answered for one of them), if
    there is one."""
    if (not_utf8 := not_utf8_argument(request)) is not None:
        return not_utf8
    unknown = sorted(set(request.query) - set(known))
    if unknown:
        return Response.json(
            400, {"error": f"unknown argument {quoted(unknown[0])}; this path takes {', '.join(known)}"}
        )
    repeated = sorted(name for name, values in request.query.items() if len(values) > 1)
    if repeated:
        return Response.json(
            400, {"error": f"argument {quoted(repeated[0])} is given more than once; give it once"}
        )
    return None


def not_utf8_argument(request: Request) -> Response | None:
    """The 400 answer naming a query parameter whose name or value is not UTF-8 once
    percent-decoded (``verdict=%E9``), quoting its bytes, if there is one. Read with
    replacement, the error quoted a '\ufffd' never sent, as the path's id was once."""
    for name, values in request.query.items():
        if (shown := not_text(name)) is not None:
            message = f"an argument name is not UTF-8 once percent-decoded: {quoted(shown)}"
            return Response.json(400, {"error": message})
        for value in values:
            if (shown := not_text(value)) is not None:
                message = f"argument {quoted(name)} is not UTF-8 once percent-decoded: {quoted(shown)}"
                return Response.json(400, {"error": message})
    return None


def page_size(request: Request, name: str, default: int, maximum: int) -> int | Response:
    """The query parameter ``name`` as a page size from 1 to ``maximum`` (``default`` when
    absent), or the 400 answer naming it."""
    text = (request.query.get(name) or [str(default)])[-1]
    digits = text.lstrip("0")  # int() refuses over 4,300 digits: a 500 for "limit=0…05"
    if (
        not (text.isascii() and text.isdigit())
        or len(digits) > len(str(maximum))
        or not 1 <= int(digits or "0") <= maximum
    ):
        return Response.json(
            400, {"error": f"{name} must be an integer from 1 to {maximum}, got {quoted(text)}"}
        )
    return int(digits)


def store_unavailable(error: StoreError) -> Response:
    """The store cannot be read now: 503, retry later (not a 500: nothing is wrong with the request)."""
    return Response.json(
        503, {"error": f"the store cannot be read: {error}; retry later"}, **{"Retry-After": "1"}
    )
