"""The instrumentation API: what an agent author writes.

::

    from durable_sessions.instrument import action, idempotency_key, session

    with session("trip-42"):
        with action("a01", "user_prompt") as act:
            act.record(ask_person("Budget?"))
        with action("a07", "payment", idempotency_key=idempotency_key("trip-42", "a07")) as act:
            act.record(charge(card, 2400))

- :class:`action` starts a span carrying the ``agent.action.*`` attributes. It is a
  context manager and a decorator (of functions, coroutine functions, generator and
  async generator functions, and callable objects whose ``__call__`` is one of them).
  ``act.record(result)`` stores the result as JSON text
  with its digest, or, when the JSON is longer than ``max_result_chars`` or would not
  fit under the span's attribute length limit, writes it to a :class:`ResultStore` and
  records the reference. An ``Exception`` sets the span status to ERROR and
  ``agent.action.status`` to ``error``; ``GeneratorExit`` is a normal end (but for a
  journaled side effect without a recorded outcome); any other ``BaseException``
  (``KeyboardInterrupt``, ``SystemExit``, cancellation) leaves an action without a
  recorded outcome ``started``. Every exception propagates unchanged.
- :func:`session` makes every action started inside it carry ``session.id``, and, on a
  provider with the span processor (which copies it in ``on_start``), every other span
  too: nested blocks, asyncio tasks (which copy the context) and threads that run in a
  copied context (``contextvars.copy_context().run``, or OpenTelemetry's threading
  instrumentation) see it; the span processor also copies it from a parent span.
- :func:`idempotency_key` derives the key from session and action identity only, so it
  is the same after a restart.
- :func:`resource` builds a ``Resource`` with a ``service.instance.id`` fixed once per
  process start: the incarnation that tells a resumed process from the one that died.

Identities given to :func:`session` and :func:`idempotency_key` must be ``str``:
anything else is a ``TypeError`` when the block is entered or the key derived. They are
not converted with ``str()``, whose text for an arbitrary object may differ in the next
process: a session or key that changes across a restart is what durability forbids.

Nothing here raises into the caller's code because of the instrumentation itself: a
result that cannot be serialised is logged and left unrecorded (so the rules report
it), and a failing result store is logged the same way (with a journal, which keeps
the result whatever the store does, the span carries the result's digest).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import sqlite3
import sys
import threading
import uuid
import weakref
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterator, Mapping
from contextlib import AbstractContextManager, ContextDecorator, ExitStack, contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

from opentelemetry import context as context_api
from opentelemetry import trace as trace_api
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from durable_sessions import __version__, crash, disk
from durable_sessions import semconv as sc
from durable_sessions.digest import PREFIX, digest_bytes, outcome_json
from durable_sessions.journal import (
    RUN_FIRST,
    SHAPE_ASYNC_ITERATOR,
    SHAPE_FUTURE,
    SHAPE_ITERATOR,
    ActionInDoubt,
    AttemptsExhausted,
    Entry,
    Journal,
    Plan,
    is_side_effect,
    journaled_key,
    plan,
)
from durable_sessions.mapping import exact
from durable_sessions.repeats import RepeatedFailures
from durable_sessions.session_lock import SessionInUse

logger = logging.getLogger("durable_sessions")

SESSION_CONTEXT_KEY = context_api.create_key("durable_sessions.session_id")
"""The context key :func:`session` sets (a ``Context`` is a dict, so readers may ``get`` it)."""
JOURNAL_CONTEXT_KEY = context_api.create_key("durable_sessions.journal")
"""The context key of the :class:`~durable_sessions.journal.Journal` given to :func:`session`."""
DEFAULT_MAX_RESULT_CHARS = 32 * 1024
"""Results whose JSON text is longer go to the result store (the SDK's default
attribute length limit is unlimited, but backends and collectors commonly cut values)."""

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# -- sessions --------------------------------------------------------------------------


def session(session_id: str, *, journal: Journal | None = None, exclusive: bool = True) -> _Session:
    """Within the block, every action carries ``session.id = session_id``, and so does
    every other span started, on a provider with the
    :class:`~durable_sessions.processor.DurabilitySpanProcessor` (its ``on_start`` copies it).

    Blocks nest (the innermost wins) and the value travels with the OpenTelemetry
    context, so asyncio tasks created inside inherit it. ``session_id`` must be a ``str``
    (``str(uuid)`` for a UUID): anything else is a ``TypeError`` when the block is entered.

    With a ``journal`` (:mod:`durable_sessions.journal`), the actions inside record their
    outcomes in it and, in a process that resumes the session, replay them instead of
    running again. An inner block without a journal keeps the outer block's.

    A block with a journal also holds the session for this process while it is open
    (``journal.hold``, :mod:`durable_sessions.session_lock`): entered while another live
    process has it open, it raises :class:`~durable_sessions.session_lock.SessionInUse`
    rather than run the session's actions a second time beside it. ``exclusive=False``
    does not hold it, for a helper process that runs some of the session's actions while
    the process that opened it waits.

    It also decorates a function, each call of which runs in a block of its own: a
    coroutine function's for its whole run, awaits included. A generator or async
    generator function is a ``TypeError``: its body runs between its consumer's steps,
    where the session's context cannot stay attached.
    """
    return _Session(session_id, journal, exclusive)


class _Session(ContextDecorator):
    """What :func:`session` returns: a ``with`` block, and a decorator of functions.

    ``contextlib``'s decorator form opens the block around the call only: around a
    coroutine function's, it closed before the body ran, so the actions inside ran with
    no session, unjournaled (a resumed process charged again).
    """

    def __init__(self, session_id: str, journal: Journal | None, exclusive: bool) -> None:
        self._arguments = (session_id, journal, exclusive)
        self._block = _session_block(session_id, journal=journal, exclusive=exclusive)

    def __enter__(self) -> str:
        return self._block.__enter__()

    def __exit__(self, *raised: Any) -> bool | None:
        return self._block.__exit__(*raised)

    def _recreate_cm(self) -> _Session:
        """A fresh block for each call of a decorated function (what ``ContextDecorator`` asks)."""
        return _Session(*self._arguments)

    def __call__(self, func: F) -> F:
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"session() cannot decorate the generator function {_text(func)}: its body runs between its "
                "consumer's steps; open the session block inside it, or around its consumer"
            )
        if not inspect.iscoroutinefunction(func):
            return super().__call__(func)  # type: ignore[return-value]

        @functools.wraps(func)
        async def run_in_session(*args: Any, **kwargs: Any) -> Any:
            with self._recreate_cm():
                return await func(*args, **kwargs)

        return run_in_session  # type: ignore[return-value]


@contextmanager
def _session_block(session_id: str, *, journal: Journal | None, exclusive: bool) -> Iterator[str]:
    """The block :func:`session` opens (see there)."""
    session_id = _identity("session", "session_id", session_id)
    values = context_api.set_value(SESSION_CONTEXT_KEY, session_id)
    if journal is not None:
        values = context_api.set_value(JOURNAL_CONTEXT_KEY, journal, values)
    with _held(journal if exclusive else None, session_id):
        token = context_api.attach(values)
        try:
            yield session_id
        finally:
            context_api.detach(token)


@contextmanager
def _held(journal: Journal | None, session_id: str) -> Iterator[None]:
    """``journal.hold(session_id)`` around the block, where the journal has one; any error
    of its own but :class:`SessionInUse` is logged and the block runs (fail open)."""
    hold = getattr(journal, "hold", None)
    with ExitStack() as holding:
        if hold is not None:
            try:
                holding.enter_context(hold(session_id))
            except SessionInUse:
                raise
            except Exception:
                logger.warning(
                    "durable_sessions: the journal could not hold session %r; it runs unheld",
                    session_id,
                    exc_info=True,
                )
        yield


def current_session(context: context_api.Context | None = None) -> str | None:
    """The session id of the innermost :func:`session` block in ``context`` (default: current)."""
    value = context_api.get_value(SESSION_CONTEXT_KEY, context)
    return value if type(value) is str else None


def current_journal(context: context_api.Context | None = None) -> Journal | None:
    """The journal of the innermost :func:`session` block given one (default context: current)."""
    return context_api.get_value(JOURNAL_CONTEXT_KEY, context)  # type: ignore[return-value]


# -- identity ----------------------------------------------------------------------------


def idempotency_key(session_id: str, action_id: str, *, scope: str = "") -> str:
    """The idempotency key of an action: derived from its identity, never from time.

    The same ``(session_id, action_id, scope)`` gives the same key in every process and
    after every restart. It is ``ds1-`` and a 32-character base32 (lowercase) SHA-256
    prefix: short enough for any provider, and free of anything that reads as a date
    or an epoch timestamp. Each part must be a ``str`` (a ``TypeError`` names the one that
    is not).
    """
    session_id = _identity("idempotency_key", "session_id", session_id)
    action_id = _identity("idempotency_key", "action_id", action_id)
    scope = _identity("idempotency_key", "scope", scope)
    material = _identity_text(scope, session_id, action_id).encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(material).digest()[:20]
    return "ds1-" + base64.b32encode(digest).decode("ascii").lower()


def _identity(function: str, argument: str, value: object) -> str:
    """``value`` as a plain ``str``, or a ``TypeError`` naming the argument.

    Never ``str(value)``: the text of an arbitrary object (a default ``repr`` holding an
    address, say) may differ in the next process, and an identity that changes across a
    restart is the failure durability exists to prevent. A ``str`` subclass is read as
    its text, which is what the span and the hash see.
    """
    if isinstance(value, str):
        return str.__str__(value)
    raise TypeError(
        f"{function}(): {argument} must be a str, not {type(value).__name__} "
        "(pass str(...) of a value that is the same in every process, e.g. str(uuid))"
    )


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
_incarnation: str | None = None
"""What :func:`incarnation` found in this process (None: not looked up yet)."""


_in_flight: Counter[tuple[str, str]] = Counter()
"""How many journaled runs of each (session, action) pair are under way in this process:
a ``started`` entry of one of them is no action a dead process left in doubt, but the
same action entered again while it runs (a retry from inside itself, another thread).
Counted, not a set: one of two runs ending (cut short, say) leaves the other in flight."""
_in_flight_lock = threading.Lock()


def _take_off(key: tuple[str, str]) -> None:
    with _in_flight_lock:
        _in_flight[key] += 1


def _land(key: tuple[str, str]) -> None:
    with _in_flight_lock:
        _in_flight[key] -= 1
        if _in_flight[key] <= 0:
            del _in_flight[key]


def _is_in_flight(session_id: str, action_id: str) -> bool:
    with _in_flight_lock:
        return (session_id, action_id) in _in_flight


def _new_incarnation() -> None:
    global _INCARNATION, _incarnation, _in_flight_lock
    _INCARNATION = str(uuid.uuid4())
    _incarnation = None  # a forked child looks its own up (the SDK renews its id after a fork too)
    # A forked child runs none of its parent's actions: their entries are the parent's.
    _in_flight_lock = threading.Lock()
    _in_flight.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_incarnation)


def incarnation() -> str:
    """This process start's ``service.instance.id``, as :func:`resource` sets it.

    Looked up once per process (and again in a forked child): ``Resource.create`` runs
    every resource detector, too slow to repeat for each journaled action.
    """
    global _incarnation
    found = _incarnation
    if found is None:
        found = _incarnation = str(resource().attributes[sc.SERVICE_INSTANCE_ID])
    return found


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
    """Keeps a large result out of the span; returns the URI recorded as ``result_ref``
    (a ``str``: anything else is logged as a store that failed)."""

    def put(self, session_id: str | None, action_id: str, data: bytes) -> str: ...


class FileResultStore:
    """Writes each result to ``<directory>/<session>/<action>.json`` (atomically, and
    durably: the file and the directories made for it survive a power loss once ``put``
    returns) and returns its ``file://`` URI. Path components are hashed when unsafe for
    a file name."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"FileResultStore({str(self.directory)!r})"

    def put(self, session_id: str | None, action_id: str, data: bytes) -> str:
        folder = self.directory / _safe_name(session_id or "no-session")
        disk.make_directories(folder)
        path = folder / (_safe_name(action_id) + ".json")
        disk.write_atomically(path, data)
        return path.resolve().as_uri()


def _reference(store: ResultStore, ref: object) -> str:
    """``ref``, what ``store.put`` returned, as the URI text it must be (a ``str``
    subclass as its text); anything else (a ``Path``) is a ``TypeError``, a store that
    failed: kept as ``result_ref``, the span would drop it and the journal could not take
    the completed entry, so a payment that went through stayed in doubt."""
    text = exact(ref)
    if type(text) is not str:
        raise TypeError(f"the result store {store!r} returned a {type(ref).__name__}, not a str URI")
    return text


def _safe_name(name: str) -> str:
    if name and len(name) <= 100 and all(c.isalnum() or c in "-_." for c in name) and name[0] != ".":
        return name
    return "h-" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


_default_store: ResultStore | None = None
RESULT_DIR_ENV = "DURABLE_SESSIONS_RESULT_DIR"
"""Where :func:`default_result_store` keeps results too long for a span."""


def default_result_store() -> ResultStore:
    """A :class:`FileResultStore` under ``DURABLE_SESSIONS_RESULT_DIR`` (default
    ``.durable_sessions/results`` in the working directory)."""
    global _default_store
    if _default_store is None:
        _default_store = FileResultStore(os.environ.get(RESULT_DIR_ENV) or ".durable_sessions/results")
    return _default_store


# -- result JSON -----------------------------------------------------------------------


def _value_limit(span: Span) -> int | None:
    """The length the SDK cuts this span's attribute values at; None when unlimited or unknown.

    Read where the SDK keeps it (as :func:`durable_sessions.mapping.sdk_attributes` does),
    so a limit from ``SpanLimits`` and one from ``OTEL_*_VALUE_LENGTH_LIMIT`` both count.
    """
    limit = getattr(getattr(span, "_attributes", None), "max_value_len", None)
    return limit if type(limit) is int else None


# -- actions ---------------------------------------------------------------------------


def _tracer(provider: trace_api.TracerProvider | None) -> Tracer:
    return trace_api.get_tracer("durable_sessions", __version__, tracer_provider=provider)


class Action:
    """The handle of one running action: record its outcome on it.

    With a journal, ``replayed`` says that an earlier process completed the action and
    ``result`` holds its recorded outcome: the block should use it instead of running the
    action again (the decorator form does that itself)::

        with action("a01", "user_prompt") as act:
            budget = act.result if act.replayed else act.record(ask("Budget?"))

    An outcome recorded by reference (:meth:`record_ref`, or a result too long for the
    span) is where ``result_ref`` says, also on a replay, where ``result`` is ``None`` for
    an outcome the journal holds by reference only: fetch it from there.

    ``skipped`` says the same of an in-doubt ``replay="skip"`` side effect, which
    recovery steps over (``result`` is ``None``). ``attempt`` counts this action's
    attempts across processes, this one included.
    """

    __slots__ = (
        "_ending",
        "_handed_over",
        "_max_result_chars",
        "_recorded_as",
        "_replay_awaitable",
        "_replay_shape",
        "_store",
        "action_id",
        "attempt",
        "recorded",
        "replayed",
        "result",
        "result_ref",
        "session_id",
        "skipped",
        "span",
    )

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
        self.replayed = False
        self.skipped = False
        self.result: Any = None
        self.result_ref: str | None = None
        self.attempt = 1
        self._max_result_chars = max_result_chars
        self._store = store
        self._recorded_as: tuple[bytes | None, str | None, str | None] = (None, None, None)
        """(JSON, keys in their order; digest; reference) of the recorded outcome, for the journal."""
        self._ending: _Ending | None = None
        self._handed_over = False
        """Whether an awaitable the decorated function returned ends the run (:func:`_awaited`)."""
        self._replay_awaitable = False
        """Whether the function's first run returned an awaitable (its replayed or skipped
        call returns one too, for the caller's ``await``)."""
        self._replay_shape: str | None = None
        """What the function's first run returned, where its replay returns the same kind
        of object (:attr:`~durable_sessions.journal.Entry.shape`)."""

    def record(self, result: Any) -> Any:
        """Record ``result`` (any JSON-serialisable value, ``None`` included); return it.

        Sets ``agent.action.result`` (JSON text) and ``agent.action.result_digest``, or
        ``agent.action.result_ref`` and the digest when the JSON is longer than
        ``max_result_chars`` or not shorter than the span's attribute length limit. A
        value that cannot be serialised (NaN and ±Infinity included: JSON has no such
        numbers) is logged and left unrecorded, so the rules report the action instead of
        your code failing. A journal keeps the same JSON with each dictionary's keys in
        their own order, which its replay hands back. A result store that fails is logged;
        the result is then left unrecorded, unless a journal keeps it, in which case the
        span carries its digest only.
        """
        try:
            data = outcome_json(result)
            kept = outcome_json(result, in_order=True) if self._journaled() else data
        except Exception as error:  # fail open: whatever the value's types raise, the agent goes on
            logger.warning(
                "durable_sessions: result of action %r is not JSON-serialisable (%s); it is not recorded",
                self.action_id,
                error,
            )
            return result
        digest = digest_bytes(data)
        try:
            ref = self._set_outcome(data, None)
        except Exception as error:  # fail open: a broken store must not break the agent
            logged = _STORE_FAILURES.failed(self._store or default_result_store(), "put", _text(error))
            if not self._journaled():
                if logged:
                    logger.warning(
                        "durable_sessions: could not record the result of action %r (%s); it is not recorded%s",
                        self.action_id,
                        error,
                        _STORE_REPEATS,
                    )
                return result
            # The journal keeps the outcome in full whatever the store does: losing it
            # would ask the person again (or replay a payment as None) after a restart.
            # The span carries its digest, which says where the outcome is kept.
            if logged:
                logger.warning(
                    "durable_sessions: could not put the result of action %r on its span (%s); the span "
                    "carries only the digest, and the journal keeps the outcome%s",
                    self.action_id,
                    error,
                    _STORE_REPEATS,
                )
            ref = None
        self.span.set_attribute(sc.ACTION_RESULT_DIGEST, digest)
        self._recorded_as = (kept, digest, ref)
        self.result_ref = ref
        self.recorded = True
        if self.replayed:  # the block ran the action again after all: the span must not say replayed
            self.replayed = False
            self.span.set_attribute(sc.ACTION_REPLAYED, False)
        return result

    def _journaled(self) -> bool:
        """Whether this run's outcome goes to a journal."""
        return self._ending is not None and self._ending.entry is not None

    def _replay(self, entry: Entry, outcome: Any) -> None:
        """Serve the journal's recorded ``outcome`` (``entry``'s, read): the span says
        replayed, with the same result."""
        self.replayed = True
        self.result = outcome
        self.result_ref = entry.result_ref
        self._replay_awaitable = entry.awaited
        self._replay_shape = entry.shape
        self.span.set_attribute(sc.ACTION_REPLAYED, True)
        if entry.result_digest is not None:
            self.span.set_attribute(sc.ACTION_RESULT_DIGEST, entry.result_digest)
        try:
            if entry.result is not None:
                self._set_outcome(entry.result, entry.result_ref)
            elif entry.result_ref is not None:  # recorded by reference only (record_ref)
                self.span.set_attribute(sc.ACTION_RESULT_REF, entry.result_ref)
        except Exception as error:  # fail open: a store that fails leaves the span the digest
            logger.warning(
                "durable_sessions: could not put the replayed result of action %r on its span (%s); "
                "the span carries only the digest",
                self.action_id,
                error,
            )

    def _set_outcome(self, data: bytes, ref: str | None) -> str | None:
        """Put the outcome on the span, by value or by reference (stored now unless ``ref``
        is given); return the reference, if any."""
        if ref is None:
            text = self._inline_text(data)
            if text is not None:
                self.span.set_attribute(sc.ACTION_RESULT, text)
                return None
            store = self._store or default_result_store()
            ref = _reference(store, store.put(self.session_id, self.action_id, data))
            _store_worked(store)
        self.span.set_attribute(sc.ACTION_RESULT_REF, ref)
        return ref

    def _inline_text(self, data: bytes) -> str | None:
        """The JSON text to set on the span, or None when it belongs in the result store.

        The SDK cuts a value longer than the span's attribute length limit into invalid
        JSON, and the rules read a value exactly at the limit as cut, so the text must be
        shorter than the limit as well as within ``max_result_chars``.
        """
        if len(data) > self._max_result_chars:
            return None
        text = data.decode("utf-8")
        limit = _value_limit(self.span)
        if limit is not None and len(text) >= limit:
            return None
        return text

    def record_ref(self, ref: str, *, digest: str | None = None) -> None:
        """Record the outcome by reference (a URI you stored it under), with its digest if known.

        A reference that is no ``str`` (a ``Path``) is logged and not recorded, as a
        result that cannot be serialised is not; a digest that is no text is logged, set
        on the span as given, and left out of the journal. Kept there, either made the
        journal's completed entry fail, and a payment that went through stayed in doubt.
        """
        if not _takes(sc.ACTION_RESULT_REF, ref, self.action_id):
            return  # not recorded, as a result that cannot be serialised is not
        ref = exact(ref)
        if type(ref) is not str:
            logger.warning(
                "durable_sessions: the reference of action %r is a %s, not a str URI; it is not recorded",
                self.action_id,
                type(ref).__name__,
            )
            return
        self.span.set_attribute(sc.ACTION_RESULT_REF, ref)
        if digest is not None and not _takes(sc.ACTION_RESULT_DIGEST, digest, self.action_id):
            digest = None
        if digest is not None:
            if not (isinstance(digest, str) and digest.startswith(PREFIX)):
                logger.warning("durable_sessions: digest %r is not text starting with %r", digest, PREFIX)
            self.span.set_attribute(sc.ACTION_RESULT_DIGEST, digest)
        journaled_digest = exact(digest)
        self._recorded_as = (None, journaled_digest if type(journaled_digest) is str else None, ref)
        self.result_ref = ref
        self.recorded = True

    def set(self, **fields: Any) -> None:
        """Set more ``agent.action.*`` fields on the running span (``attempts=2``, …)."""
        for field, value in fields.items():
            if _takes(sc.attribute(field), value, self.action_id):
                self.span.set_attribute(sc.attribute(field), value)


class action:
    """Run an agent action inside a span that carries its ``agent.action.*`` attributes.

    ``fields`` are record fields by name (``idempotency_key=``, ``retryable=``,
    ``max_attempts=``, ``side_effects=``, ``replay="skip"``, …); each becomes its
    ``agent.action.<field>`` attribute as given, without coercion, so a wrong value is
    reported by the rules rather than repaired.

    ``awaitable=True`` declares that a decorated sync function returns an awaitable (a
    coroutine, a Task or a Future) that its callers ``await``: its replayed or stepped-over
    calls return a coroutine of the recorded outcome whatever the journal noted (but a
    done Future where it noted a Task or a Future, as without the option). Without
    it that is so only when the journal noted the first run's awaitable, which it cannot
    for a run that died before the function returned: such a call is handed back bare,
    and its caller's ``await`` raises TypeError. It is accepted, and changes nothing, on a
    coroutine function (whose calls are awaitable anyway); anything but a bool, and the
    option on a generator function or in a ``with`` block (neither has a call to replay),
    is a ``TypeError`` when the action is made, decorates or is entered.

    As a context manager it yields an :class:`Action`; as a decorator it records the
    function's return value (``record=False`` to leave that to you) and accepts an
    ``action_id`` that is a callable of the function's arguments, since an action id
    must differ between actions::

        @action(lambda order: f"charge-{order.id}", "payment", side_effects=True)
        def charge(order): ...

    On a generator or async generator function (a streaming model call) the span is
    started when iteration starts and ends when the generator finishes, fails or is
    closed; it is the current span inside the body throughout, and never in the
    consumer's code between items. Nothing is recorded automatically: the items go to
    the consumer, and a generator's return value is not the outcome. To record a
    streamed outcome, run the consumption in ``with action(...) as act:`` and
    ``act.record(...)`` the assembled output instead of decorating the generator.

    A sync function that returns a Task or a Future gets it back as it is, and is
    journaled when it is done; its replayed call returns a done Future of the running
    loop (a coroutine, with no loop running). One that returns a generator (and is no
    generator function) gets back a generator running it inside the action, and is
    journaled, with the list of its items, when it is exhausted; its replayed call returns
    a generator of them. One that returns an async generator gets back an async generator,
    the same way, and its replayed call an async generator of the items. A coroutine
    function whose await gives a generator or an async generator is handled the same way:
    the await gives the wrapped one, and the await of its replayed call one of the items.

    An ``Exception`` marks the action failed (span status ERROR, ``status=error``, an
    ``exception`` event). ``GeneratorExit`` (a consumer that stopped early) ends it
    normally, unless it is a journaled side effect that has recorded no outcome yet,
    which it interrupts. Any other ``BaseException`` (``KeyboardInterrupt``,
    ``SystemExit``, a cancelled task) interrupts it: the span status stays UNSET and,
    unless an outcome was recorded or a status set, ``agent.action.status`` is
    ``started``; with a journal, the action is in doubt for a later run.
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
        journal: Journal | None = None,
        awaitable: bool = False,
        **fields: Any,
    ) -> None:
        if type(awaitable) is not bool:
            raise TypeError(f"action(): awaitable must be True or False, not {type(awaitable).__name__}")
        self.action_id = action_id
        self.kind = kind
        self.name = name
        self.record_return = record
        self.max_result_chars = max_result_chars
        self.result_store = result_store
        self.tracer_provider = tracer_provider
        self.journal = journal
        self.awaitable = awaitable
        self.fields = fields
        self._open: list[tuple[Any, Action]] = []  # every block open, in any context
        self._warned_sessionless = False
        self._warned_not_awaitable = False

    # context manager -------------------------------------------------------------------
    #
    # One ``action`` object may be entered by several asyncio tasks or threads at once,
    # and re-entered within one. The running span of each ``with`` block is kept in the
    # execution context (``_RUNNING``), so each exit ends the span its own block started.
    # A block exited in another context than it was entered in (an ``ExitStack`` closed
    # by another task, a test fixture's set-up and tear-down) is found in ``_open`` when
    # it is the object's only open block; with several, which one ends is unknowable.

    def __enter__(self) -> Action:
        if callable(self.action_id):
            raise TypeError("a callable action_id is only for the decorator form; pass the id as a string")
        if self.awaitable:
            raise TypeError(
                f"action {self.action_id!r}: awaitable=True is only for the decorator form of a sync function; "
                "a with block returns nothing to await"
            )
        manager = self._start(self.action_id)
        act = manager.__enter__()
        _RUNNING.set((*_RUNNING.get(), (self, manager, act)))
        self._open.append((manager, act))
        return act

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        block = self._running_here()
        if block is not None:
            self._open.remove(block)
            block[0].__exit__(exc_type, exc, tb)
            return
        block = self._entered_elsewhere()
        if block is not None:
            self._open.remove(block)
            with _foreign_detach_unlogged():
                block[0].__exit__(exc_type, exc, tb)

    def _running_here(self) -> tuple[Any, Action] | None:
        """This object's innermost block open in this context, taken off ``_RUNNING``."""
        running = _RUNNING.get()
        for index in range(len(running) - 1, -1, -1):
            if running[index][0] is self:
                _RUNNING.set(running[:index] + running[index + 1 :])
                return running[index][1:]
        return None

    def _entered_elsewhere(self) -> tuple[Any, Action] | None:
        """The block to end on an exit in a context it was not entered in, if one can tell."""
        if len(self._open) == 1:
            return self._open[0]
        logger.warning(
            "durable_sessions: action %r exited in a context it was not entered in, with %d blocks "
            "open; its span is not ended",
            self.action_id,
            len(self._open),
        )
        return None

    # decorator ---------------------------------------------------------------------------
    #
    # Each form of function gets a wrapper of the same form, so that inspect (and the
    # frameworks that dispatch on it) still see a coroutine or generator function.

    def __call__(self, func: F) -> F:
        if self.awaitable and (
            _is_form(inspect.isasyncgenfunction, func) or _is_form(inspect.isgeneratorfunction, func)
        ):
            raise TypeError(
                f"action(awaitable=True) cannot decorate the generator function {_text(func)}: a generator's "
                "action is not journaled, so no call of it is replayed"
            )
        if _is_form(inspect.isasyncgenfunction, func):
            return self._wrap_async_generator(func)  # type: ignore[return-value]
        if _is_form(inspect.isgeneratorfunction, func):
            return self._wrap_generator(func)  # type: ignore[return-value]
        if _is_form(inspect.iscoroutinefunction, func):

            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with self._start(self._id_for(args, kwargs)) as act:
                    if act.replayed or act.skipped:
                        return _replayed_value(act)
                    value = await func(*args, **kwargs)
                    # What the await gave may be a Task or a Future whose effect runs
                    # until it is done, or a stream whose effect runs as it is iterated:
                    # the action ends with it, as a sync function's does.
                    if asyncio.isfuture(value):
                        return _settled(act, value, self.record_return)
                    if _is_stream(value):
                        return _iterated(act, value, self.record_return)
                    if self.record_return:
                        act.record(value)
                    return value

            return run_async  # type: ignore[return-value]

        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self._start(self._id_for(args, kwargs)) as act:
                if act.replayed or act.skipped:
                    return _reshaped(act, self.awaitable)
                value = func(*args, **kwargs)
                # A coroutine's effect runs when it is awaited: so does the action. A Task
                # or a Future is given back as it is (as a coroutine it would break a caller
                # that cancels it or adds a callback), and the action ends when it is done.
                # A generator's (or an async generator's) effect runs as it is iterated: the
                # action ends when it is exhausted, with its items as the outcome.
                if inspect.iscoroutine(value):
                    return _awaited(act, value, self.record_return)
                if asyncio.isfuture(value):
                    return _settled(act, value, self.record_return)
                if self.awaitable and not inspect.isawaitable(value):
                    self._warn_not_awaitable(act.action_id, value)
                if _is_stream(value):
                    return _iterated(act, value, self.record_return)
                if self.record_return:
                    act.record(value)
                return value

        return run  # type: ignore[return-value]

    # A generator's body runs in steps, in between which the consumer's code runs. Each
    # step runs in a context of the generator's own (as each asyncio task has), entered
    # and left around the step: the span is current in the body across yields, never
    # leaks into the consumer between them, and is detached in the context that attached
    # it, whichever thread or task resumes or closes the generator.

    def _wrap_generator(self, func: Callable[..., Generator[Any, Any, Any]]) -> Callable[..., Any]:
        @functools.wraps(func)
        def run_generator(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            context = contextvars.copy_context()
            with _entered(context, self._start(self._id_for(args, kwargs), journaled=False)):
                return (yield from _stepped(context, func(*args, **kwargs)))

        return run_generator

    def _wrap_async_generator(self, func: Callable[..., AsyncGenerator[Any, Any]]) -> Callable[..., Any]:
        @contextmanager
        def started(*args: Any, **kwargs: Any) -> Iterator[tuple[contextvars.Context, None]]:
            context = contextvars.copy_context()
            with _entered(context, self._start(self._id_for(args, kwargs), journaled=False)):
                yield context, None

        return functools.wraps(func)(_async_stepping(started, func))

    # internals ---------------------------------------------------------------------------

    def _id_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if callable(self.action_id):
            return self.action_id(*args, **kwargs)
        return self.action_id

    @contextmanager
    def _start(self, action_id: str, *, journaled: bool = True) -> Iterator[Action]:
        """The span of one run of the action, with the journal's say on what the run does.

        Generator actions are not journaled (``journaled=False``): their items go to the
        consumer, so there is no outcome to replay.
        """
        session_id = current_session()
        journal = (self.journal or current_journal()) if journaled and session_id is not None else None
        if self.journal is not None and journaled and session_id is None:
            self._warn_sessionless(action_id)
        if journal is not None and not (_hashable(action_id) and _has_text(action_id)):
            logger.error(
                "durable_sessions: action id %s is a %s, which cannot key a journal entry; it is not journaled",
                _text(action_id, repr),
                type(action_id).__name__,
            )
            journal = None
        in_doubt: ActionInDoubt | None = None
        this_process = incarnation() if journal is not None else None
        try:
            step, outcome = _plan(journal, session_id, action_id, self.kind, self.fields)
        except ActionInDoubt as error:
            step, outcome, in_doubt = Plan("skip"), None, error
        if step is _RUN_UNJOURNALED:
            journal = None
        attributes = self._attributes(action_id, session_id, step)
        tracer = _tracer(self.tracer_provider)
        # Exceptions are marked here, not by the API's use_span: opentelemetry-api 1.31.0
        # marked GeneratorExit, KeyboardInterrupt and the like as errors too
        # (open-telemetry/opentelemetry-python#4484), which this package allows.
        # The span is ended here, not on leaving the block: an awaitable returned by a
        # decorated function finishes the run when it is awaited (see _awaited).
        with tracer.start_as_current_span(
            self.name or f"{_text(self.kind)} {_text(action_id)}",
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
            end_on_exit=False,
        ) as span:
            act = Action(span, action_id, session_id, self.max_result_chars, self.result_store)
            act.attempt = step.attempts
            try:
                if (
                    in_doubt is not None
                ):  # the span records the unresolved intent, then the caller hears of it
                    raise in_doubt
                runs = step.decision == "run"
                journal_entry, boundary = None, 0
                if runs:
                    journal_entry = _journal_entry(
                        journal,
                        session_id,
                        action_id,
                        self.kind,
                        self.fields,
                        step.attempts,
                        this_process,
                    )
                    # Write-ahead, for every action: durable before it runs, so that a side
                    # effect cut short is known to be in doubt, and a crash loop is counted.
                    if journal_entry is not None:
                        _journal_put(journal, journal_entry)
                    boundary = crash.before(self.tracer_provider)
                else:
                    _served(act, step, outcome)
                side_effect = journal_entry is not None and _touches_world(self.kind, self.fields)
                act._ending = _Ending(act, journal, journal_entry, boundary, runs, side_effect)
                try:
                    yield act
                except BaseException as error:
                    act._ending.raised(error)
                    raise
                if not act._handed_over:
                    act._ending.ok()
            finally:
                if not act._handed_over:
                    span.end()

    def _warn_sessionless(self, action_id: object) -> None:
        """Say once per action object that its journal goes unused: entries are keyed by
        session, so outside a session block the action runs again after every restart."""
        if self._warned_sessionless:
            return
        self._warned_sessionless = True
        logger.warning(
            "durable_sessions: action %r is given a journal but runs outside a session block; a journal keys "
            "its entries by session id, so it is not journaled and a restart runs it again: run it inside "
            "session(...) (this is logged once per action)",
            action_id,
        )

    def _warn_not_awaitable(self, action_id: object, value: object) -> None:
        """Say once per action object that a function declared ``awaitable=True`` returned
        no awaitable: its replays are handed back awaitable, unlike this call."""
        if self._warned_not_awaitable:
            return
        self._warned_not_awaitable = True
        logger.warning(
            "durable_sessions: action %r is declared awaitable=True, but its function returned a %s, not an "
            "awaitable: its replayed calls return a coroutine of the outcome, which a caller that does not "
            "await gets instead of the value (this is logged once per action)",
            action_id,
            type(value).__name__,
        )

    def _attributes(self, action_id: str, session_id: str | None, step: Plan) -> dict[str, Any]:
        attributes: dict[str, Any] = {sc.ACTION_ID: action_id, sc.ACTION_KIND: self.kind}
        if session_id is not None:
            attributes[sc.SESSION_ID] = session_id
        if self.name is not None:
            attributes[sc.ACTION_NAME] = self.name
        for field, value in self.fields.items():
            attributes[sc.attribute(field)] = value
        if step.attempts > 1 and "attempts" not in self.fields:
            attributes[sc.ACTION_ATTEMPTS] = step.attempts
        if step.decision == "skip":
            attributes[sc.ACTION_STATUS] = sc.STATUS_STARTED
        elif step.decision == "replay":  # at start, so that on_start sees no effect about to run
            attributes[sc.ACTION_REPLAYED] = True
        return {key: value for key, value in attributes.items() if _takes(key, value, action_id)}


def _hashable(value: object) -> bool:
    """Whether ``value`` can key the journal's bookkeeping (a list action id cannot)."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _is_form(is_form: Callable[[Any], bool], func: Callable[..., Any]) -> bool:
    """Whether ``func`` is of the form ``is_form`` tells (``inspect.iscoroutinefunction``,
    …): itself, or, for a callable object, its class's ``__call__``, also through
    ``functools.partial`` (which ``inspect`` sees through to functions only). An object
    whose ``__call__`` is ``async def`` or yields is a coroutine or generator function in
    all but name, and its replay must take the form its first run had."""
    if is_form(func):
        return True
    while isinstance(func, functools.partial):
        func = func.func
    if inspect.isroutine(func):
        return False
    return is_form(inspect.getattr_static(type(func), "__call__", None))


class _Ending:
    """How one run of an action ends: its span's status, its journal entry, its crash point."""

    __slots__ = ("act", "boundary", "entry", "flying", "journal", "runs", "side_effect")

    def __init__(
        self,
        act: Action,
        journal: Journal | None,
        entry: Entry | None,
        boundary: int,
        runs: bool,
        side_effect: bool = False,
    ) -> None:
        self.act = act
        self.journal = journal
        self.entry = entry
        self.boundary = boundary
        self.runs = runs
        self.side_effect = side_effect
        """Whether the run is a journaled side effect (whose early end leaves it in doubt)."""
        self.flying = entry is not None
        """Whether this run is counted in flight (landed once, however it ends)."""
        if entry is not None:
            _take_off((entry.session_id, entry.action_id))

    def ok(self, *, awaited: bool = False) -> None:
        """The body ran to its end (``awaited``: the awaitable it returned did): past the
        ``after`` crash point, completed in the journal."""
        if self.runs:
            crash.after(self.boundary)
            if self.entry is not None:
                _journal_put(self.journal, _completed(self.entry, self.act, awaited=awaited))
        self._landed()

    def raised(self, error: BaseException) -> None:
        """The body raised ``error`` (which the caller re-raises).

        ``GeneratorExit`` (the consumer of a generator stopped early) is a normal end, but
        for a journaled side effect that had recorded no outcome yet: stopped before or
        after its effect, nobody can tell, and journaled ``ok`` it would be replayed as
        ``None`` for ever, an effect that never happened included. It is cut short, as by
        a cancellation, and in doubt for a later run.
        """
        if isinstance(error, Exception):
            _fail(self.act.span, error)
            if self.entry is not None:
                _journal_put(self.journal, dataclasses.replace(self.entry, status=sc.STATUS_ERROR))
        elif isinstance(error, GeneratorExit) and (self.act.recorded or not self.side_effect):
            self.ok()
        else:
            _interrupted(self.act)
        self._landed()

    def interrupted(self) -> None:
        """The run was cut short: its entry stays ``started``, in doubt for a later process."""
        _interrupted(self.act)
        self._landed()

    def _landed(self) -> None:
        if self.flying and self.entry is not None:
            self.flying = False
            _land((self.entry.session_id, self.entry.action_id))


class _ForeignDetach(logging.Filter):
    """Drops this thread's "Failed to detach context" from the OpenTelemetry API: a span
    ended in another context than it was attached in cannot be detached there, which is
    expected there, not an error (the context it was attached in is gone or not ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.thread == threading.get_ident() and record.msg == "Failed to detach context")


@contextmanager
def _foreign_detach_unlogged() -> Iterator[None]:
    otel_context_log = logging.getLogger("opentelemetry.context")
    unlogged = _ForeignDetach()
    otel_context_log.addFilter(unlogged)
    try:
        yield
    finally:
        otel_context_log.removeFilter(unlogged)


def _touches_world(kind: str, fields: dict[str, Any]) -> bool:
    """:func:`~durable_sessions.journal.is_side_effect`, failing open: a kind that cannot be
    looked up (an unhashable value the rules report) is read as no side-effecting kind."""
    try:
        return is_side_effect(kind, fields)
    except Exception:
        return fields.get("side_effects") is True


def _awaited(act: Action, awaitable: Awaitable[Any], record: bool) -> Awaitable[Any]:
    """A coroutine that awaits what a decorated sync function returned, inside its action.

    The effect of an awaitable (an ``async def __call__``, an async client's method called
    without ``await``) happens when it is awaited, not when the function returns: the span
    stays open, current in the awaitable's steps, and the outcome, the ``after`` crash
    point and the journal's completion come after the await. One never awaited is ended
    when it is collected (:func:`_never_ran`).
    """
    ending = _handed_over(act, awaited=True)
    context = contextvars.copy_context()  # the span is current here, and the session

    async def finish() -> Any:
        unawaited.detach()
        try:
            try:
                value = await _InContext(context, awaitable)
            except GeneratorExit:  # closed mid-await: the effect may or may not have happened
                if ending is not None:
                    ending.interrupted()
                raise
            except BaseException as error:
                if ending is not None:
                    ending.raised(error)
                raise
            _succeeded(act, ending, value, record=record, awaited=True)
            return value
        finally:
            act.span.end()

    coroutine = finish()
    unawaited = weakref.finalize(coroutine, _never_ran, act, ending, "awaited")
    return coroutine


def _succeeded(act: Action, ending: _Ending | None, outcome: Any, *, record: bool, awaited: bool) -> None:
    """End ``act``, handed over to what its function returned, which succeeded with
    ``outcome`` (recorded when ``record``)."""
    if record:
        act.record(outcome)
    if ending is not None:
        ending.ok(awaited=awaited)


def _handed_over(act: Action, *, awaited: bool, shape: str | None = None) -> _Ending | None:
    """Hand the end of ``act``'s run to the awaitable (or generator) its function returned;
    return how it ends. The journal notes the shape of what was returned (``awaited``,
    ``shape``) before the effect runs (it runs when awaited or iterated, or as a Task): a
    run cut short meanwhile is in doubt, and its skip, or the outcome an operator resolves
    it with, must be handed back in that shape too."""
    act._handed_over = True
    ending = act._ending
    if ending is not None and ending.entry is not None:
        ending.entry = dataclasses.replace(ending.entry, awaited=awaited, shape=shape)
        _journal_put(ending.journal, ending.entry)
    return ending


def _settled(act: Action, future: asyncio.Future[Any], record: bool) -> asyncio.Future[Any]:
    """``future`` (a Task or a Future a decorated sync function returned, or a decorated
    coroutine function's await gave), as it is, with ``act`` ending when it is done: its
    effect has happened then, not when it was returned.

    Done with a result, the action records it and completes ``ok`` (its replay is handed
    back as a done Future, :func:`_replayed_value`); failed, it ends ``error``; cancelled,
    it is cut short, in doubt as a cancelled coroutine is. The callback fails open.
    """
    ending = _handed_over(act, awaited=True, shape=SHAPE_FUTURE)

    def done(settled: asyncio.Future[Any]) -> None:
        try:
            if settled.cancelled():  # the effect may or may not have happened
                if ending is not None:
                    ending.interrupted()
            elif (error := settled.exception()) is not None:
                if ending is not None:
                    ending.raised(error)
            else:
                _succeeded(act, ending, settled.result(), record=record, awaited=True)
        except Exception:  # fail open: this runs on the event loop, not in the caller's code
            logger.warning("durable_sessions: could not end action %r", act.action_id, exc_info=True)
        finally:
            act.span.end()

    try:
        future.add_done_callback(done)
    except RuntimeError:  # done already, on a loop since closed: no callback can be scheduled there
        done(future)
    return future


def _never_ran(act: Action, ending: _Ending | None, verb: str) -> None:
    """End the action of a coroutine (or generator) collected, or left at exit, without
    being ``verb`` (awaited, iterated).

    Its effect never ran, so the action failed, and a later run may run it again: left
    open, its span would never be exported and its journal entry would stay ``started``,
    in doubt, and in flight in this process for ever. Python's own "never awaited"
    warning still names a coroutine. Runs wherever the last reference goes: fails open.
    """
    error = RuntimeError(f"what it returned was never {verb}: its effect did not run")
    try:
        if ending is not None:
            ending.raised(error)
        else:
            _fail(act.span, error)
        act.span.end()
    except Exception:  # fail open
        logger.debug("durable_sessions: could not end an action never %s", verb, exc_info=True)


def _iterated(
    act: Action, steps: Generator[Any, Any, Any] | AsyncGenerator[Any, Any], record: bool
) -> Generator[Any, Any, Any] | AsyncGenerator[Any, Any]:
    """A generator (an async generator, for one) that runs ``steps`` (what a decorated sync
    function returned, or a decorated coroutine function's await gave) inside its action,
    each step in the action's context, passing on items, sent values, thrown exceptions and
    ``close()`` (``aclose()``).

    The generator's effect happens as it is iterated: exhausted, the action records the
    list of its items (kept until then) and completes ``ok`` (its replay is a generator, or
    an async generator, of them: :func:`_reshaped`); failed, it ends ``error``; closed
    early, it ends as a decorated generator function's does (a side effect with no outcome
    is in doubt, anything else completes without an outcome and runs again). One never
    iterated is ended when it is collected (:func:`_never_ran`).
    """
    asynchronous = inspect.isasyncgen(steps)
    ending = _handed_over(act, awaited=False, shape=SHAPE_ASYNC_ITERATOR if asynchronous else SHAPE_ITERATOR)
    context = contextvars.copy_context()  # the span is current here, and the session

    @contextmanager
    def exhausting() -> Iterator[tuple[contextvars.Context, Callable[[Any], None] | None]]:
        """Around the steps: the action ends when they do (as :func:`_iterated` says)."""
        unstarted.detach()
        items: list[Any] = []
        try:
            try:
                yield context, (items.append if record else None)
            except BaseException as error:
                if ending is not None:
                    ending.raised(error)
                raise
            _succeeded(act, ending, items, record=record, awaited=False)
        finally:
            act.span.end()

    def iterate() -> Generator[Any, Any, Any]:
        with exhausting() as (_, seen):
            return (yield from _stepped(context, steps, seen))  # type: ignore[arg-type]

    iterator: Any = _async_stepping(exhausting, lambda: steps)() if asynchronous else iterate()
    unstarted = weakref.finalize(iterator, _never_ran, act, ending, "iterated")
    return iterator


def _reshaped(act: Action, declared_awaitable: bool) -> Any:
    """The replayed (or stepped-over) outcome of a decorated sync function, in the shape its
    first run's caller got: a coroutine (noted, or declared awaitable) unless a Future was
    noted, which is awaitable itself, else as :func:`_replayed_value` gives it."""
    if (declared_awaitable or act._replay_awaitable) and act._replay_shape != SHAPE_FUTURE:
        return _resolved(act.result)
    return _replayed_value(act)


def _replayed_value(act: Action) -> Any:
    """The replayed (or stepped-over) outcome as what a call (or a coroutine function's
    await) gave its first caller: a done Future of the running loop holding it when it gave
    a Task or a Future (:func:`_done_future`), a generator, or an async generator, of the
    recorded items when it gave one, else the value itself."""
    if act._replay_shape == SHAPE_FUTURE:
        return _done_future(act.action_id, act.result)
    if act._replay_shape in (SHAPE_ITERATOR, SHAPE_ASYNC_ITERATOR):
        return _replayed_items(
            act.action_id, act.result, asynchronous=act._replay_shape == SHAPE_ASYNC_ITERATOR
        )
    return act.result


def _is_stream(value: object) -> bool:
    """Whether ``value`` is a generator or an async generator: its effect runs as it is
    iterated, so the action that returned it ends with it (:func:`_iterated`)."""
    return inspect.isgenerator(value) or inspect.isasyncgen(value)


def _done_future(action_id: str, value: Any) -> Any:
    """A Future of the running loop holding ``value``: the replay of an action whose first
    run returned a Task or a Future (or whose await gave one). With no loop running (only
    a sync function's replay can have none) there is none to bind it to (the first run's
    had one): a coroutine of ``value``, which a loop started later awaits, is handed back
    instead, and logged."""
    try:
        future = asyncio.get_running_loop().create_future()
    except RuntimeError:
        logger.warning(
            "durable_sessions: action %r returned a Task or a Future when it ran, but is replayed with no "
            "event loop running: its replay is a coroutine of the outcome, not a Future",
            action_id,
        )
        return _resolved(value)
    future.set_result(value)
    return future


def _replayed_items(action_id: str, items: Any, *, asynchronous: bool) -> Any:
    """A generator (an async generator, when ``asynchronous``) of the recorded ``items``:
    the replay of an action whose first run returned one; none (nothing recorded, or
    stepped over) is an empty one. An outcome that is no list (resolved by hand as another
    value) is logged and returned as it is."""
    if items is None:
        items = []
    if not isinstance(items, list):
        logger.warning(
            "durable_sessions: action %r returned %s when it ran, but its journaled outcome is a %s, "
            "not the list of its items: its replay returns the outcome as it is",
            action_id,
            "an async generator" if asynchronous else "a generator",
            type(items).__name__,
        )
        return items
    return _async_items(items) if asynchronous else (item for item in items)


async def _async_items(items: list[Any]) -> AsyncGenerator[Any, None]:
    """An async generator of ``items``."""
    for item in items:
        yield item


async def _resolved(value: Any) -> Any:
    """``value``, awaitable: the replay of an action whose first run returned a coroutine."""
    return value


def _plan(
    journal: Journal | None,
    session_id: str | None,
    action_id: str,
    kind: str,
    fields: dict[str, Any],
) -> tuple[Plan, Any]:
    """The journal's plan for the action, and the outcome a replay returns; a journal that
    cannot be read is logged and the action runs (fail open), unless it is in doubt
    (:class:`ActionInDoubt` propagates). An entry's attempts that are no integer are
    logged and counted as 1; an outcome that does not read is logged and taken as none
    recorded (:func:`_outcome_of`)."""
    if journal is None or session_id is None:
        return RUN_FIRST, None
    try:
        in_flight = _is_in_flight(session_id, action_id)
        entry = journal.get(session_id, action_id)
    except Exception as error:
        _journal_failed(journal, "read", error, f"could not read action {action_id!r} from")
        return RUN_FIRST, None
    _journal_worked(journal, "read")
    try:
        step = plan(entry, kind, fields, in_flight=in_flight)
    except (ActionInDoubt, AttemptsExhausted):
        raise
    except Exception as error:  # an entry that does not read (a row damaged or edited by hand)
        logger.error(
            "could not read action %r from the journal %s (%s); it runs", action_id, _where(journal), error
        )
        return RUN_FIRST, None
    if not isinstance(step.attempts, int):  # a row damaged or edited by hand: its decision stands
        logger.error(
            "the journal %s counts %r attempts of action %r, not an integer; counted as 1",
            _where(journal),
            step.attempts,
            action_id,
        )
        step = dataclasses.replace(step, attempts=1)
    return _outcome_of(step, action_id, kind, fields)


def _outcome_of(step: Plan, action_id: str, kind: str, fields: dict[str, Any]) -> tuple[Plan, Any]:
    """``step``, and the outcome its replay returns, read once. An outcome that does not
    read (a row damaged or edited by hand, an integer longer than this process's
    ``sys.get_int_max_str_digits()``) is logged and taken as none recorded: the action
    runs again, and a side effect is replayed as ``None``, never run twice (the agent's
    code got ``None`` for a value it had computed). The run is not journaled
    (:data:`_RUN_UNJOURNALED`): the row keeps its outcome, and would refuse its writes."""
    entry = step.entry
    if step.decision != "replay" or entry is None or entry.result is None:
        return step, None
    try:
        return step, entry.outcome
    except Exception:  # fail open
        logger.warning(
            "durable_sessions: the journal's outcome of action %r does not read; it is taken as not recorded: "
            "a side effect is replayed as None, any other action runs again, unjournaled (discard the entry "
            "to journal it afresh)",
            action_id,
            exc_info=True,
        )
    without = plan(dataclasses.replace(entry, result=None, attempts=step.attempts), kind, fields)
    return (_RUN_UNJOURNALED if without.decision == "run" else without), None


_RUN_UNJOURNALED = Plan("run")
"""The plan of an action whose recorded outcome does not read: it runs, unjournaled."""


def _served(act: Action, step: Plan, outcome: Any) -> None:
    """Make ``act`` a replay of the journal's ``outcome``, or a skipped in-doubt side effect."""
    if step.decision == "replay" and step.entry is not None:
        act._replay(step.entry, outcome)
    else:
        act.skipped = True
        act._replay_awaitable = step.entry is not None and step.entry.awaited
        act._replay_shape = None if step.entry is None else step.entry.shape


def _journal_entry(
    journal: Journal | None,
    session_id: str | None,
    action_id: str,
    kind: str,
    fields: dict[str, Any],
    attempts: int,
    this_process: str | None,
) -> Entry | None:
    """The write-ahead entry of a run (``started``), or None without a journal."""
    if journal is None or session_id is None:
        return None
    return Entry(
        session_id,
        action_id,
        kind,
        sc.STATUS_STARTED,
        attempts,
        idempotency_key=journaled_key(fields),
        incarnation=this_process or incarnation(),
    )


def _completed(entry: Entry, act: Action, *, awaited: bool = False) -> Entry:
    """The write-ahead ``entry``, completed ``ok`` with ``act``'s recorded outcome
    (``awaited``: the outcome of awaiting what the action returned)."""
    data, digest, ref = act._recorded_as
    return dataclasses.replace(
        entry, status=sc.STATUS_OK, result=data, result_digest=digest, result_ref=ref, awaited=awaited
    )


def _journal_put(journal: Journal | None, entry: Entry) -> None:
    """Write ``entry``, failing open: a journal that cannot be written is logged, the agent
    goes on, and a process that resumes the session later runs the action again."""
    if journal is None:
        return
    try:
        try:
            journal.put(entry)
        except (sqlite3.DataError, OverflowError) as error:  # an outcome beyond SQLite's length limit
            if entry.result is None:
                raise
            # Completed without it, as a value JSON cannot hold: left `started`, a side
            # effect that went through would be in doubt for the next process.
            journal.put(dataclasses.replace(entry, result=None))
            logger.warning(
                "durable_sessions: the journal %s could not take the outcome of action %r (%s); the action is "
                "journaled completed without it: a side effect is replayed as None, any other action runs again",
                _where(journal),
                entry.action_id,
                error,
            )
    except Exception as error:
        _journal_failed(
            journal, "write", error, f"could not write action {entry.action_id!r} ({entry.status}) to"
        )
        return
    _journal_worked(journal, "write")


def _journal_failed(journal: Journal, what: str, error: Exception, doing: str) -> None:
    """Log "``doing`` the journal (``error``)", unless it repeats the error this journal
    last failed with (:mod:`durable_sessions.repeats`). ``doing`` is text, not a format
    (an action id may hold a ``%``)."""
    text = _text(error)
    if _FAILURES.failed(journal, what, text):
        logger.error(
            "%s the journal %s (%s); actions run unjournaled (a resumed run runs them again), and repeats of "
            "this error are not logged until the journal works again",
            doing,
            _where(journal),
            text,
        )


def _journal_worked(journal: Journal, what: str) -> None:
    """Note that ``journal`` was ``what`` ("read", "write"); log the end of a failure."""
    ended = _FAILURES.worked(journal, what)
    if ended is not None:
        logger.warning(
            "durable_sessions: the journal %s works again (%d more failures with %s were not logged)",
            _where(journal),
            ended[1],
            ended[0],
        )


_STORE_FAILURES = RepeatedFailures(weak=True)
"""Result stores that fail (a read-only or full disk), logged once per error, not per result."""
_STORE_REPEATS = " (repeats of this error are not logged until the result store works again)"


def _store_worked(store: ResultStore) -> None:
    """Note that ``store`` kept a result; log the end of a failure."""
    ended = _STORE_FAILURES.worked(store, "put")
    if ended is not None:
        logger.warning(
            "durable_sessions: the result store %r works again (%d more results failed with %s, not logged)",
            store,
            ended[1],
            ended[0],
        )


_FAILURES = RepeatedFailures(weak=True)
"""Journals that fail, logged once per error: one on a read-only or full file system would
otherwise log three lines per action."""


def _where(journal: Journal) -> str:
    """The journal as a log line names it: its file, when it has one."""
    path = getattr(journal, "path", None)
    return str(path) if path is not None else repr(journal)


_RUNNING: contextvars.ContextVar[tuple[tuple[action, Any, Action], ...]] = contextvars.ContextVar(
    "durable_sessions.running_actions", default=()
)
"""The ``with action(...)`` blocks running in this execution context, innermost last:
``(action object, its span's context manager, the Action handle)``."""


def _fail(span: Span, error: Exception) -> None:
    """Mark the span's action failed, with the exception as an event.

    Each step fails open on its own: an exception whose ``str()`` raises (the SDK's event
    needs its text) still leaves the action ``error``, never an apparent success.
    """
    try:
        span.set_attribute(sc.ACTION_STATUS, sc.STATUS_ERROR)
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {_text(error)}"))
        span.record_exception(error)
    except Exception:  # fail open
        logger.debug("durable_sessions: could not mark the span failed", exc_info=True)


def _text(value: object, show: Callable[[object], str] = str) -> str:
    """``show(value)`` (its ``str()``), or a placeholder when the value cannot give its text."""
    try:
        return show(value)
    except Exception:
        if isinstance(value, BaseException):
            return "<exception str() failed>"  # as the interpreter shows it in a traceback
        return f"<unprintable {type(value).__name__}>"


_ATTRIBUTE_TYPES = (bool, str, bytes, int, float, type(None))


def _has_text(value: object) -> bool:
    """Whether the SDK can take ``value`` as an attribute value: it makes a value of no
    attribute type (inside a sequence or mapping too) its ``str()``, and lets what that
    raises out of the span's start or ``set_attribute``."""
    if isinstance(value, _ATTRIBUTE_TYPES):
        return True
    if isinstance(value, list | tuple):
        return all(map(_has_text, value))
    if isinstance(value, Mapping):
        return all(map(_has_text, value.values()))
    try:
        str(value)
    except Exception:
        return False
    return True


def _takes(key: str, value: object, action_id: object) -> bool:
    """Whether the span can take ``value`` for ``key``; a value it cannot (its ``str()``
    fails: an ORM row read after its session closed) is said at warning level, so that
    the action runs, its span without the attribute, and the rules report what is missing."""
    if _has_text(value):
        return True
    logger.warning(
        "durable_sessions: %s is left off the span of action %s: its value (a %s) cannot give its str()",
        key,
        _text(action_id),
        type(value).__name__,
    )
    return False


def _interrupted(act: Action) -> None:
    """Leave an action cut short by ``KeyboardInterrupt``, ``SystemExit`` or cancellation ``started``.

    These are not errors of the action (OpenTelemetry does not mark them either), but
    the action did not finish: its side effect may or may not have happened. ``ok``
    would claim an outcome nothing backs; ``started`` says exactly that much, so the
    rules ask for an idempotency key or ``replay: skip`` on a side effect, and a later
    attempt under the same action id completes it. A recorded outcome, or a status the
    caller set, stands.
    """
    try:
        attributes = getattr(act.span, "attributes", None) or {}
        if not act.recorded and sc.ACTION_STATUS not in attributes:
            act.span.set_attribute(sc.ACTION_STATUS, sc.STATUS_STARTED)
    except Exception:  # fail open
        logger.debug("durable_sessions: could not mark the span interrupted", exc_info=True)


@contextmanager
def _entered(context: contextvars.Context, manager: AbstractContextManager[T]) -> Iterator[T]:
    """``with manager``, entered and left inside ``context`` (its attach and detach pair there)."""
    value = context.run(manager.__enter__)
    try:
        yield value
    except BaseException as error:
        if not context.run(manager.__exit__, type(error), error, error.__traceback__):
            raise
    else:
        context.run(manager.__exit__, None, None, None)


def _stepped(
    context: contextvars.Context,
    steps: Generator[Any, Any, T],
    seen: Callable[[Any], None] | None = None,
) -> Generator[Any, Any, T]:
    """``yield from steps``, each step of ``steps`` run inside ``context`` (and each item
    handed to ``seen`` first, when given).

    Sent values, thrown exceptions and ``close()`` are passed on as ``yield from`` does.
    Also drives an awaitable's ``__await__`` iterator (see :class:`_InContext`).
    """
    advance: Callable[[], Any] = functools.partial(steps.send, None)
    while True:
        try:
            item = context.run(advance)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if seen is not None:
            seen(item)
        try:
            sent = yield item
        except GeneratorExit:
            context.run(steps.close)
            raise
        except BaseException as error:
            advance = functools.partial(steps.throw, error)
        else:
            advance = functools.partial(steps.send, sent)


def _first_step_unregistered(steps: AsyncGenerator[Any, Any]) -> Awaitable[Any]:
    """``steps.asend(None)``, without handing ``steps`` to the event loop to finalise.

    The wrapper closes ``steps`` itself, in the generator's context; a loop that closed
    it too at shutdown would close it twice at once ("aclose(): asynchronous generator is
    already running"). An async generator takes the hooks current at its first ``asend``
    (and runs no code then), so none are current for that call.
    """
    hooks = sys.get_asyncgen_hooks()
    sys.set_asyncgen_hooks(firstiter=None, finalizer=None)
    try:
        return steps.asend(None)
    finally:
        sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=hooks.finalizer)


_Started = Callable[..., AbstractContextManager[tuple[contextvars.Context, Callable[[Any], None] | None]]]
"""What :func:`_async_stepping` runs an async generator inside: given the call's arguments,
a block that yields the context to run each step in, and what to hand each item to."""


def _async_stepping(
    started: _Started, make: Callable[..., AsyncGenerator[Any, Any]]
) -> Callable[..., AsyncGenerator[Any, Any]]:
    """An async generator function that runs ``make(*args, **kwargs)`` as :func:`_stepped`
    runs a generator (``yield from``, which Python lacks for an async generator), inside
    the block ``started(*args, **kwargs)`` opens when iteration starts.

    A function of its own, not a helper to delegate to: a decorated async generator
    function must stay one (``inspect.isasyncgenfunction``), and an async generator can
    only pass sent values, thrown exceptions and ``aclose()`` on through its own loop.
    """

    async def stepped(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, Any]:
        with started(*args, **kwargs) as (context, seen):
            steps = make(*args, **kwargs)
            step: Awaitable[Any] = _first_step_unregistered(steps)
            while True:
                try:
                    item = await _InContext(context, step)
                except StopAsyncIteration:
                    return
                if seen is not None:
                    seen(item)
                try:
                    sent = yield item
                except GeneratorExit:
                    await _InContext(context, steps.aclose())
                    raise
                except BaseException as error:  # thrown in by the consumer: the body's to handle
                    step = steps.athrow(error)
                else:
                    step = steps.asend(sent)

    return stepped


class _InContext:
    """An awaitable that awaits ``awaitable`` with each of its steps run inside ``context``.

    The event loop sees the same futures it would see awaiting ``awaitable`` itself, so
    any loop (asyncio or another) drives it, and cancellation reaches the body.
    """

    __slots__ = ("awaitable", "context")

    def __init__(self, context: contextvars.Context, awaitable: Awaitable[Any]) -> None:
        self.context = context
        self.awaitable = awaitable

    def __await__(self) -> Generator[Any, Any, Any]:
        return (yield from _stepped(self.context, self.awaitable.__await__()))  # type: ignore[arg-type]


__all__ = [
    "DEFAULT_MAX_RESULT_CHARS",
    "RESULT_DIR_ENV",
    "Action",
    "FileResultStore",
    "ResultStore",
    "action",
    "current_journal",
    "current_session",
    "default_result_store",
    "idempotency_key",
    "incarnation",
    "resource",
    "session",
]
