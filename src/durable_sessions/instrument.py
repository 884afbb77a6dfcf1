"""The instrumentation API: what an agent author writes.

::

    from durable_sessions.instrument import action, idempotency_key, session

    with session("trip-42"):
        with action("a01", "user_prompt") as act:
            act.record(ask_person("Budget?"))
        with action("a07", "payment", idempotency_key=idempotency_key("trip-42", "a07")) as act:
            act.record(charge(card, 2400))

- :class:`action` starts a span carrying the ``agent.action.*`` attributes. It is a
  context manager and a decorator. ``act.record(result)`` stores the result as JSON
  text with its digest, or, when the JSON is longer than ``max_result_chars``, writes
  it to a :class:`ResultStore` and records the reference. An exception sets the span
  status to ERROR and ``agent.action.status`` to ``error``, and propagates unchanged.
- :func:`session` makes every span started inside it carry ``session.id``: nested
  blocks, asyncio tasks (which copy the context) and threads that run in a copied
  context (``contextvars.copy_context().run``, or OpenTelemetry's threading
  instrumentation) see it; the span processor also copies it from a parent span.
- :func:`idempotency_key` derives the key from session and action identity only, so it
  is the same after a restart.
- :func:`resource` builds a ``Resource`` with a ``service.instance.id`` fixed once per
  process start: the incarnation that tells a resumed process from the one that died.

Nothing here raises into the caller's code because of the instrumentation itself: a
result that cannot be serialised is logged and left unrecorded (so the rules report
it), and a failing result store is logged the same way.
"""

from __future__ import annotations

import base64
import contextvars
import functools
import hashlib
import inspect
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson
from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from durable_sessions import __version__
from durable_sessions import semconv as sc
from durable_sessions.digest import PREFIX, digest_bytes

logger = logging.getLogger("durable_sessions")

SESSION_CONTEXT_KEY = context_api.create_key("durable_sessions.session_id")
"""The context key :func:`session` sets (a ``Context`` is a dict, so readers may ``get`` it)."""
DEFAULT_MAX_RESULT_CHARS = 32 * 1024
"""Results whose JSON text is longer go to the result store (the SDK's default
attribute length limit is unlimited, but backends and collectors commonly cut values)."""

F = TypeVar("F", bound=Callable[..., Any])

# -- sessions --------------------------------------------------------------------------


@contextmanager
def session(session_id: str) -> Iterator[str]:
    """Within the block, every span started carries ``session.id = session_id``.

    Blocks nest (the innermost wins) and the value travels with the OpenTelemetry
    context, so asyncio tasks created inside inherit it.
    """
    token = context_api.attach(context_api.set_value(SESSION_CONTEXT_KEY, session_id))
    try:
        yield session_id
    finally:
        context_api.detach(token)


def current_session(context: context_api.Context | None = None) -> str | None:
    """The session id of the innermost :func:`session` block in ``context`` (default: current)."""
    value = context_api.get_value(SESSION_CONTEXT_KEY, context)
    return value if type(value) is str else None


# -- identity ----------------------------------------------------------------------------


def idempotency_key(session_id: str, action_id: str, *, scope: str = "") -> str:
    """The idempotency key of an action: derived from its identity, never from time.

    The same ``(session_id, action_id, scope)`` gives the same key in every process and
    after every restart. It is ``ds1-`` and a 32-character base32 (lowercase) SHA-256
    prefix: short enough for any provider, and free of anything that reads as a date
    or an epoch timestamp.
    """
    material = _identity_text(scope, session_id, action_id).encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(material).digest()[:20]
    return "ds1-" + base64.b32encode(digest).decode("ascii").lower()


_SEPARATOR = "\x1f"


def _identity_text(*parts: str) -> str:
    """The text hashed into an idempotency key: one encoding per identity.

    Parts free of ``\x1f`` are joined with it, as they always were: those keys must not
    change between versions (a process upgraded mid-session would otherwise charge
    twice). A part holding ``\x1f`` would make that join ambiguous (``("a\x1fb", "c")``
    against ``("a", "b\x1fc")``), so such identities are written after three separators
    as length-prefixed parts instead: a plain join holds exactly two separators, so the
    two encodings never give the same text.
    """
    if not any(_SEPARATOR in part for part in parts):
        return _SEPARATOR.join(parts)
    return _SEPARATOR * 3 + "".join(f"{len(part)}:{part}" for part in parts)


_INCARNATION = str(uuid.uuid4())


def _new_incarnation() -> None:
    global _INCARNATION
    _INCARNATION = str(uuid.uuid4())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_incarnation)


def incarnation() -> str:
    """This process start's ``service.instance.id``, as :func:`resource` sets it."""
    return str(resource().attributes[sc.SERVICE_INSTANCE_ID])


def resource(attributes: Mapping[str, Any] | None = None) -> Resource:
    """``Resource.create(attributes)`` with ``service.instance.id`` set once per process start.

    An id already given (in ``attributes`` or ``OTEL_RESOURCE_ATTRIBUTES``) is kept.
    Recent SDKs (1.45 does) detect a per-process id themselves, renewed after a fork,
    and that one is used; with older SDKs the helper supplies a UUID4 made at import and renewed in a
    forked child.
    """
    created = Resource.create(dict(attributes or {}))
    if sc.SERVICE_INSTANCE_ID in created.attributes:
        return created
    return created.merge(Resource({sc.SERVICE_INSTANCE_ID: _INCARNATION}))


# -- result store ----------------------------------------------------------------------


class ResultStore(Protocol):
    """Keeps a large result out of the span; returns the URI recorded as ``result_ref``."""

    def put(self, session_id: str | None, action_id: str, data: bytes) -> str: ...


class FileResultStore:
    """Writes each result to ``<directory>/<session>/<action>.json`` (atomically) and
    returns its ``file://`` URI. Path components are hashed when unsafe for a file name."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def put(self, session_id: str | None, action_id: str, data: bytes) -> str:
        folder = self.directory / _safe_name(session_id or "no-session")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / (_safe_name(action_id) + ".json")
        partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_bytes(data)
        os.replace(partial, path)
        return path.resolve().as_uri()


def _safe_name(name: str) -> str:
    if name and len(name) <= 100 and all(c.isalnum() or c in "-_." for c in name) and name[0] != ".":
        return name
    return "h-" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


_default_store: ResultStore | None = None


def default_result_store() -> ResultStore:
    """A :class:`FileResultStore` under ``DURABLE_SESSIONS_RESULT_DIR`` (default
    ``.durable_sessions/results`` in the working directory)."""
    global _default_store
    if _default_store is None:
        _default_store = FileResultStore(
            os.environ.get("DURABLE_SESSIONS_RESULT_DIR") or ".durable_sessions/results"
        )
    return _default_store


# -- actions ---------------------------------------------------------------------------


def _tracer(provider: trace_api.TracerProvider | None) -> Tracer:
    return trace_api.get_tracer("durable_sessions", __version__, tracer_provider=provider)


class Action:
    """The handle of one running action: record its outcome on it."""

    __slots__ = ("_max_result_chars", "_store", "action_id", "recorded", "session_id", "span")

    def __init__(
        self,
        span: Span,
        action_id: str,
        session_id: str | None,
        max_result_chars: int,
        store: ResultStore | None,
    ) -> None:
        self.span = span
        self.action_id = action_id
        self.session_id = session_id
        self.recorded = False
        self._max_result_chars = max_result_chars
        self._store = store

    def record(self, result: Any) -> Any:
        """Record ``result`` (any JSON-serialisable value, ``None`` included); return it.

        Sets ``agent.action.result`` (JSON text) and ``agent.action.result_digest``, or
        ``agent.action.result_ref`` and the digest when the JSON is longer than
        ``max_result_chars``. A value that cannot be serialised is logged and left
        unrecorded, so the rules report the action instead of your code failing.
        """
        try:
            data = orjson.dumps(result, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
        except (TypeError, orjson.JSONEncodeError) as error:
            logger.warning(
                "durable_sessions: result of action %r is not JSON-serialisable (%s); it is not recorded",
                self.action_id,
                error,
            )
            return result
        digest = digest_bytes(data)
        try:
            if len(data) > self._max_result_chars:
                store = self._store or default_result_store()
                ref = store.put(self.session_id, self.action_id, data)
                self.span.set_attribute(sc.ACTION_RESULT_REF, ref)
            else:
                self.span.set_attribute(sc.ACTION_RESULT, data.decode("utf-8"))
        except Exception as error:  # fail open: a broken store must not break the agent
            logger.warning(
                "durable_sessions: could not record the result of action %r (%s); it is not recorded",
                self.action_id,
                error,
            )
            return result
        self.span.set_attribute(sc.ACTION_RESULT_DIGEST, digest)
        self.recorded = True
        return result

    def record_ref(self, ref: str, *, digest: str | None = None) -> None:
        """Record the outcome by reference (a URI you stored it under), with its digest if known."""
        self.span.set_attribute(sc.ACTION_RESULT_REF, ref)
        if digest is not None:
            if not digest.startswith(PREFIX):
                logger.warning("durable_sessions: digest %r does not start with %r", digest, PREFIX)
            self.span.set_attribute(sc.ACTION_RESULT_DIGEST, digest)
        self.recorded = True

    def set(self, **fields: Any) -> None:
        """Set more ``agent.action.*`` fields on the running span (``attempts=2``, …)."""
        for field, value in fields.items():
            self.span.set_attribute(sc.attribute(field), value)


class action:
    """Run an agent action inside a span that carries its ``agent.action.*`` attributes.

    ``fields`` are record fields by name (``idempotency_key=``, ``retryable=``,
    ``max_attempts=``, ``side_effects=``, ``replay="skip"``, …); each becomes its
    ``agent.action.<field>`` attribute as given, without coercion, so a wrong value is
    reported by the rules rather than repaired.

    As a context manager it yields an :class:`Action`; as a decorator it records the
    function's return value (``record=False`` to leave that to you) and accepts an
    ``action_id`` that is a callable of the function's arguments, since an action id
    must differ between actions::

        @action(lambda order: f"charge-{order.id}", "payment", side_effects=True)
        def charge(order): ...
    """

    def __init__(
        self,
        action_id: str | Callable[..., str],
        kind: str,
        *,
        name: str | None = None,
        record: bool = True,
        max_result_chars: int = DEFAULT_MAX_RESULT_CHARS,
        result_store: ResultStore | None = None,
        tracer_provider: trace_api.TracerProvider | None = None,
        **fields: Any,
    ) -> None:
        self.action_id = action_id
        self.kind = kind
        self.name = name
        self.record_return = record
        self.max_result_chars = max_result_chars
        self.result_store = result_store
        self.tracer_provider = tracer_provider
        self.fields = fields

    # context manager -------------------------------------------------------------------
    #
    # One ``action`` object may be entered by several asyncio tasks or threads at once,
    # and re-entered within one. The running span of each ``with`` block is kept in the
    # execution context (``_RUNNING``), so each exit ends the span its own block started.

    def __enter__(self) -> Action:
        if callable(self.action_id):
            raise TypeError("a callable action_id is only for the decorator form; pass the id as a string")
        manager = self._start(self.action_id)
        act = manager.__enter__()
        _RUNNING.set((*_RUNNING.get(), (self, manager, act)))
        return act

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        running = _RUNNING.get()
        for index in range(len(running) - 1, -1, -1):
            if running[index][0] is self:
                break
        else:  # entered in another execution context: its span cannot be found here
            logger.warning(
                "durable_sessions: action %r exited in a context it was not entered in; its span is not ended",
                self.action_id,
            )
            return
        _, manager, act = running[index]
        _RUNNING.set(running[:index] + running[index + 1 :])
        if exc is not None:
            _fail(act.span, exc)
        manager.__exit__(exc_type, exc, tb)

    # decorator ---------------------------------------------------------------------------

    def __call__(self, func: F) -> F:
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with self._start(self._id_for(args, kwargs)) as act:
                    try:
                        value = await func(*args, **kwargs)
                    except BaseException as error:
                        _fail(act.span, error)
                        raise
                    if self.record_return:
                        act.record(value)
                    return value

            return run_async  # type: ignore[return-value]

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self._start(self._id_for(args, kwargs)) as act:
                try:
                    value = func(*args, **kwargs)
                except BaseException as error:
                    _fail(act.span, error)
                    raise
                if self.record_return:
                    act.record(value)
                return value

        return run  # type: ignore[return-value]

    # internals ---------------------------------------------------------------------------

    def _id_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if callable(self.action_id):
            return self.action_id(*args, **kwargs)
        return self.action_id

    @contextmanager
    def _start(self, action_id: str) -> Iterator[Action]:
        attributes: dict[str, Any] = {sc.ACTION_ID: action_id, sc.ACTION_KIND: self.kind}
        session_id = current_session()
        if session_id is not None:
            attributes[sc.SESSION_ID] = session_id
        if self.name is not None:
            attributes[sc.ACTION_NAME] = self.name
        for field, value in self.fields.items():
            attributes[sc.attribute(field)] = value
        tracer = _tracer(self.tracer_provider)
        with tracer.start_as_current_span(
            self.name or f"{self.kind} {action_id}",
            attributes=attributes,
            record_exception=True,
            set_status_on_exception=True,
        ) as span:
            yield Action(span, action_id, session_id, self.max_result_chars, self.result_store)


_RUNNING: contextvars.ContextVar[tuple[tuple[action, Any, Action], ...]] = contextvars.ContextVar(
    "durable_sessions.running_actions", default=()
)
"""The ``with action(...)`` blocks running in this execution context, innermost last:
``(action object, its span's context manager, the Action handle)``."""


def _fail(span: Span, error: BaseException) -> None:
    """Mark the span's action failed (the SDK records the exception itself)."""
    try:
        span.set_attribute(sc.ACTION_STATUS, sc.STATUS_ERROR)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    except Exception:  # fail open
        logger.debug("durable_sessions: could not mark the span failed", exc_info=True)


__all__ = [
    "DEFAULT_MAX_RESULT_CHARS",
    "Action",
    "FileResultStore",
    "ResultStore",
    "action",
    "current_session",
    "default_result_store",
    "idempotency_key",
    "incarnation",
    "resource",
    "session",
]
