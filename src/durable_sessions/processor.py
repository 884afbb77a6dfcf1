"""``DurabilitySpanProcessor``: check durability rules inline, as spans end.

Add it to an existing ``TracerProvider`` beside your own processors::

    from opentelemetry import trace
    from durable_sessions.processor import DurabilitySpanProcessor

    provider = trace.get_tracer_provider()          # your existing SDK TracerProvider
    provider.add_span_processor(DurabilitySpanProcessor())

Each ended span is mapped to an action record (:mod:`durable_sessions.mapping`) and fed
to the rule engine; violations are reported through

- the ``durable_sessions`` logger, one line each, rate-limited (a summary says what
  was suppressed);
- the counter ``durable_sessions.violations`` (attributes ``rule``, ``severity``,
  ``kind``) on the given or the global ``MeterProvider``;
- the ``on_violation`` callback, when given.

The processor **fails open**: nothing it does raises into the code that starts or ends
a span. An internal error is caught, counted (``durable_sessions.internal_errors``)
and logged once. The single exception is ``mode="raise"``, for tests, which raises
:class:`DurabilityViolationError` from ``span.end()`` (add the processor after your
exporting processors, so that they still see the span).

Sessions are held in a bounded LRU (``max_sessions``); an evicted session, and every
session at :meth:`end_sessions` and :meth:`shutdown`, is ended and its end-of-session
rules run. :meth:`force_flush` reports what was found so far and ends no session. In
``on_start`` the processor copies the session id of the surrounding
:func:`durable_sessions.instrument.session` block, or of the parent span, onto spans
that carry none.

With ``checking="process"`` the processor only hands each candidate span to a checker
process (:mod:`durable_sessions.offload`) and the rules run there, on another CPU:
``span.end()`` stays cheap, violations are reported a moment later from a background
thread, ``force_flush`` waits for the checker to catch up, and a checker that falls
far behind drops spans (counted in ``spans_dropped``) rather than slow the application.
Where the optional C extension was built (:mod:`durable_sessions.native`), ``on_start``
and, with ``checking="process"``, ``on_end`` are its functions, set on the instance;
they give this class's Python code whatever they do not settle themselves.

Configuration comes from the constructor, else from the environment:

================================  ===========================================  ===========
Variable                          Meaning                                      Default
================================  ===========================================  ===========
``DURABLE_SESSIONS_MODE``         ``log``, ``silent`` (metric and callback     ``log``
                                  only), ``raise`` (tests) or ``off``
``DURABLE_SESSIONS_PRESET``       rule preset: ``all`` or ``seed``             ``all``
``DURABLE_SESSIONS_STRICT``       ``true`` adds the strict-only rules          ``false``
``DURABLE_SESSIONS_DISABLE``      comma-separated rule ids to skip             (none)
``DURABLE_SESSIONS_MAX_SESSIONS`` sessions held at once                        ``1000``
``DURABLE_SESSIONS_KEY_WINDOW_S`` idempotency key window, seconds              ``86400``
``DURABLE_SESSIONS_LOG_LIMIT``    violation log lines per minute               ``60``
``DURABLE_SESSIONS_CHECKING``     ``inline`` (in ``span.end()``) or            ``inline``
                                  ``process`` (a checker process; see below)
``DURABLE_SESSIONS_INTENT_LOG``   a file for side effects' write-ahead         (none)
                                  ``started`` records (``intent_log``)
``DURABLE_SESSIONS_COPY_SESSION`` ``false`` stops copying the session id onto  ``true``
                                  new spans (``copy_session``)
================================  ===========================================  ===========
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import re
import reprlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from typing import Literal

from opentelemetry import context as context_api
from opentelemetry import metrics
from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

from durable_sessions import __version__, forking
from durable_sessions import semconv as sc
from durable_sessions.engine import Checker
from durable_sessions.instrument import SESSION_CONTEXT_KEY
from durable_sessions.intent_log import IntentLog, intent_record
from durable_sessions.mapping import exact_attributes, sdk_attributes, sdk_resource_attributes, sdk_span_facts
from durable_sessions.native import native_module
from durable_sessions.offload import IN_CHECKER_ENV, RESOURCE, SPAN, CheckerProcess
from durable_sessions.pickling import reduced
from durable_sessions.rules import Rule, select_rules
from durable_sessions.rules.state import DEFAULT_KEY_WINDOW_S
from durable_sessions.seconds import positive_seconds, positive_seconds_from_text
from durable_sessions.span_check import SpanParts, check_span, may_be_action
from durable_sessions.violation import Violation

Mode = Literal["log", "silent", "raise", "off"]
MODES: tuple[str, ...] = ("log", "silent", "raise", "off")
Checking = Literal["inline", "process"]
CHECKINGS: tuple[str, ...] = ("inline", "process")
DEFAULT_MAX_SESSIONS = 1000
DEFAULT_LOG_LIMIT_PER_MINUTE = 60
SHUTDOWN_CHECK_TIMEOUT_S = 10.0
"""How long :meth:`DurabilitySpanProcessor.shutdown` waits for the checker process to
check what it was sent and end its sessions; one that has not answered by then (stopped,
starved of CPU) is stopped, and what it had not checked is counted in ``spans_dropped``."""

logger = logging.getLogger("durable_sessions")
_NO_ATTRIBUTES: dict[str, object] = {}
_NO_RESOURCE = object()  # told to the native hand-over while a resource is being declared


def _live_attributes(span: object) -> Mapping[str, object]:
    """A live SDK span's attributes as a plain dict (read-only use), else its public view.

    ``BoundedAttributes`` answers a missing key by raising and catching ``KeyError``;
    its dict answers at dict speed.
    """
    try:
        raw = span._attributes._dict  # type: ignore[attr-defined]
    except AttributeError:
        raw = None
    if type(raw) is dict:
        return raw
    return getattr(span, "attributes", None) or _NO_ATTRIBUTES


_SESSION_ID = sc.SESSION_ID
_current_context = context_api.get_current
# The context key under which the API keeps the current span, found through the public
# API once, so that ``on_start`` can read it with one ``dict.get`` (a Context is a dict).
_CURRENT_SPAN_KEY = next(iter(trace_api.set_span_in_context(trace_api.INVALID_SPAN, Context())))


def _current_context_var() -> ContextVar | None:
    """The ``ContextVar`` the API keeps the current ``Context`` in, when it is the default
    contextvars runtime (its value is then what ``context.get_current()`` returns)."""
    runtime = getattr(context_api, "_RUNTIME_CONTEXT", None)
    variable = getattr(runtime, "_current_context", None)
    if not isinstance(variable, ContextVar):
        return None
    try:
        return variable if variable.get() is _current_context() else None
    except LookupError:  # no value and no default: not the runtime we know
        return None


class DurabilityViolationError(AssertionError):
    """Raised from ``span.end()`` in ``mode="raise"``: the span broke durability rules.

    Raised for one span, it names the span (``span_name``) and, under each violation,
    the span attributes its message speaks of, with their values on the span
    (``attributes``) or ``not set``: the messages name record fields (``max_attempts``),
    as the offline checker's do."""

    def __init__(
        self,
        violations: list[Violation],
        span_name: str | None = None,
        attributes: Mapping[str, object] | None = None,
    ) -> None:
        self.violations = violations
        self.span_name = span_name
        self.attributes = dict(attributes) if attributes is not None else None
        lines = "\n".join(_violation_lines(v, self.attributes) for v in violations)
        where = f" in span {span_name!r}" if span_name is not None else ""
        super().__init__(f"{len(violations)} durability violation(s){where}:\n{lines}")

    def __reduce__(self) -> tuple[object, ...]:
        """Pickled as what it was made from, not as its message, which the constructor
        cannot take (a test run in a process pool got an unpickling error):
        :func:`~durable_sessions.pickling.reduced`."""
        return reduced(self, self.violations, self.span_name, self.attributes)


_FIELD_MENTION = re.compile(r"'(\w+)'|\b([a-z]+(?:_[a-z]+)+)\b")
"""A record field in a message: quoted (``required field 'kind'``), or a name with an
underscore (``idempotency_key``); bare words (``kind``, ``result``) are prose too."""
_FIELDS = frozenset({*sc.ACTION_ATTRIBUTES.values(), "session_id"})


def _violation_lines(violation: Violation, attributes: Mapping[str, object] | None) -> str:
    """A violation's line and, given its span's attributes, the attributes it speaks of."""
    line = f"  {format_violation(violation)}"
    if attributes is None:
        return line
    named = []
    for quoted, bare in _FIELD_MENTION.findall(violation.message):
        if (field := quoted or bare) not in _FIELDS:
            continue
        key = sc.attribute(field)
        if field == "session_id":  # read from the first of the session attributes a span has
            key = next((k for k in sc.SESSION_ATTRIBUTES if k in attributes), sc.SESSION_ID)
        note = f"{key} = {reprlib.repr(attributes[key])}" if key in attributes else f"{key} not set"
        if note not in named:
            named.append(note)
    return f"{line}\n    attributes: {'; '.join(named)}" if named else line


class ConfigurationError(ValueError):
    """A constructor argument or environment variable has an unusable value."""


def format_violation(violation: Violation) -> str:
    """One log line: ``[rule] severity session/action (span …): message``."""
    where = f" span {violation.span_id}" if violation.span_id else ""
    return (
        f"[{violation.rule}] {violation.severity} session {violation.session_id!r} "
        f"action {violation.action_id!r}{where}: {violation.message}"
    )


class _RateLimitedLog:
    """At most ``limit`` lines per ``period_s``; then one summary of what was suppressed."""

    def __init__(self, target: logging.Logger, limit: int, period_s: float = 60.0) -> None:
        self._logger = target
        self._limit = limit
        self._period_s = period_s
        self._window_start = time.monotonic()
        self._logged = 0
        self._suppressed: Counter[str] = Counter()
        self._lock = threading.Lock()

    def violation(self, violation: Violation) -> None:
        level = logging.ERROR if violation.severity == "error" else logging.WARNING
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self._period_s:
                self._summarise_locked()
                self._window_start, self._logged = now, 0
            if self._logged >= self._limit:
                self._suppressed[violation.rule] += 1
                return
            self._logged += 1
        self._logger.log(level, "durability violation %s", format_violation(violation))

    def flush(self) -> None:
        with self._lock:
            self._summarise_locked()

    def _summarise_locked(self) -> None:
        if not self._suppressed:
            return
        total = sum(self._suppressed.values())
        by_rule = ", ".join(f"{rule}: {n}" for rule, n in self._suppressed.most_common())
        self._logger.warning(
            "durable_sessions suppressed %d violation log line(s) over the limit of %d per %gs (%s)",
            total,
            self._limit,
            self._period_s,
            by_rule,
        )
        self._suppressed.clear()


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value.strip() if value and value.strip() else None


def _env_int(name: str, default: int) -> int:
    value = _env(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigurationError(f"{name}={value!r} is not an integer") from None
    return _at_least_one(name, number, value)


def _flag(name: str, value: object) -> None:
    """A constructor argument that must be a bool: a string's truth value ("false" is
    true) would turn on what it meant to turn off."""
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name}={value!r} is not a bool (True or False)")


def _positive_int(name: str, value: object) -> int:
    """A constructor argument that must be an integer of at least 1, as its variable must."""
    try:
        number = operator.index(value)  # int and its kin (numpy integers), not float or str
    except TypeError:
        number = None
    if number is None or isinstance(value, bool):
        raise ConfigurationError(f"{name}={value!r} is not an integer")
    return _at_least_one(name, number, value)


def _at_least_one(name: str, number: int, given: object) -> int:
    """``number`` (read from ``given``, as the message shows it) when it is at least 1."""
    if number < 1:
        raise ConfigurationError(f"{name}={given!r} must be at least 1")
    return number


def _rule_ids(name: str, value: object) -> list[str]:
    """A constructor argument that must be rule ids: text, or an iterable of texts."""
    try:
        ids = list(value)  # type: ignore[call-overload]
    except TypeError:
        ids = None
    if ids is None or not all(isinstance(rule, str) for rule in ids):
        raise ConfigurationError(f"{name}={value!r} is not a list of rule ids")
    return ids


def _env_seconds(name: str, default: float) -> float:
    value = _env(name)
    if value is None:
        return default
    try:
        return positive_seconds_from_text(value)
    except ValueError as reason:
        raise ConfigurationError(f"{name}={value!r} {reason}") from None


def _positive_seconds(name: str, value: object) -> float:
    """A duration that must be a finite number of seconds above 0."""
    try:
        return positive_seconds(value)
    except ValueError as reason:
        # reprlib: an integer of 400 digits is named by its ends, not written out
        raise ConfigurationError(f"{name}={reprlib.repr(value)} {reason}") from None


def _env_bool(name: str, *, default: bool = False) -> bool:
    value = _env(name)
    if value is None:
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{name}={value!r} is not a boolean (true or false)")


def _open_intent_log(path: str | os.PathLike[str] | None) -> IntentLog | None:
    path = path if path is not None else _env("DURABLE_SESSIONS_INTENT_LOG")
    if not path:
        return None
    if not isinstance(path, str | bytes | os.PathLike):
        raise ConfigurationError(f"intent_log={path!r} is not a path")
    try:
        return IntentLog(path)
    except OSError as error:
        raise ConfigurationError(
            f"cannot open the intent log {os.fspath(path)}: {error.strerror or error}"
        ) from None


def _fresh_locks(processor: DurabilitySpanProcessor) -> None:
    """New locks in a forked child, as the SDK's processors take: a lock another thread
    held at the fork stays held, and the child's first action span would wait on it
    (8 forks in 20 hung, with a thread ending spans)."""
    processor._lock = threading.Lock()
    processor._log._lock = threading.Lock()


def _in_forked_child(processor: DurabilitySpanProcessor) -> None:
    """A forked child gets fresh locks (:func:`_fresh_locks`) and none of its parent's
    sessions, as the SDK's batch processor drops its parent's queue: those sessions go on
    in the parent, which ends them. Kept, the child's ``shutdown`` (a helper flushing its
    exporters before it exits) ended them midway and reported end-of-session findings
    the parent was about to settle: a retry it was about to escalate, a side effect it
    was about to complete.

    Checking inline, the child gets a new checker at once. With ``checking="process"``,
    the parent's checker process, sender and reader stay the parent's: the child starts
    a checker process of its own at its first action span (:meth:`_check_ended`), as the
    SDK's batch processor starts a worker thread of its own, but only in a child that
    ends one (a pool's workers may never). Until 2026-12 the child dropped its spans,
    so a server that preloads the app checked nothing in its workers."""
    _fresh_locks(processor)
    if processor.checker is not None:
        processor.checker = processor._new_checker()
    elif processor._offload is not None:
        # Kept, never used: collected here, its streams' close would wait for ever on
        # the locks the parent's sender and reader threads held at the fork.
        processor._parents_checker = processor._offload
        processor._offload = None
        processor._resource = None  # the new checker is told the resource afresh
        processor.__dict__.pop("on_end", None)  # the parent's native hand-over drops every span


class DurabilitySpanProcessor(SpanProcessor):
    """Maps ended spans to action records and checks them against the durability rules.

    Every argument left ``None`` is read from its ``DURABLE_SESSIONS_*`` environment
    variable (see the module documentation), else its default. ``rules`` overrides
    ``preset``/``strict``/``disable``. Unusable configuration raises
    :class:`ConfigurationError` here, at setup, never later.
    """

    def __init__(
        self,
        *,
        mode: Mode | None = None,
        rules: Iterable[Rule] | None = None,
        preset: str | None = None,
        strict: bool | None = None,
        disable: Iterable[str] | None = None,
        max_sessions: int | None = None,
        key_window_s: float | None = None,
        on_violation: Callable[[Violation], object] | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        log_limit_per_minute: int | None = None,
        copy_session: bool | None = None,
        checking: Checking | None = None,
        intent_log: str | os.PathLike[str] | None = None,
    ) -> None:
        mode = mode or _env("DURABLE_SESSIONS_MODE") or "log"  # type: ignore[assignment]
        if mode not in MODES:
            raise ConfigurationError(f"unknown durability mode {mode!r}; expected one of {', '.join(MODES)}")
        self.mode: Mode = mode  # type: ignore[assignment]
        checking = checking or _env("DURABLE_SESSIONS_CHECKING") or "inline"  # type: ignore[assignment]
        if checking not in CHECKINGS:
            raise ConfigurationError(f"unknown checking {checking!r}; expected one of {', '.join(CHECKINGS)}")
        if checking == "process" and mode == "raise":
            raise ConfigurationError(
                'mode="raise" needs checking="inline": a checker process cannot raise into span.end()'
            )
        self.checking: Checking = checking  # type: ignore[assignment]
        if copy_session is None:
            copy_session = _env_bool("DURABLE_SESSIONS_COPY_SESSION", default=True)
        _flag("copy_session", copy_session)
        if strict is not None:
            _flag("strict", strict)
        if on_violation is not None and not callable(on_violation):
            raise ConfigurationError(f"on_violation={on_violation!r} is not callable")
        if rules is None:
            disabled = disable if disable is not None else _env("DURABLE_SESSIONS_DISABLE") or ""
            if isinstance(disabled, str):  # "a,b", as in the variable: not its characters
                disabled = disabled.split(",")
            disabled = _rule_ids("disable", disabled)
            try:
                rules = select_rules(
                    preset or _env("DURABLE_SESSIONS_PRESET") or "all",  # type: ignore[arg-type]
                    strict=strict if strict is not None else _env_bool("DURABLE_SESSIONS_STRICT"),
                    disable=[rule.strip() for rule in disabled if rule.strip()],
                )
            except (KeyError, ValueError) as error:
                raise ConfigurationError(str(error).strip("'\"")) from None
        if max_sessions is None:
            max_sessions = _env_int("DURABLE_SESSIONS_MAX_SESSIONS", DEFAULT_MAX_SESSIONS)
        else:
            max_sessions = _positive_int("max_sessions", max_sessions)
        if key_window_s is None:
            key_window_s = _env_seconds("DURABLE_SESSIONS_KEY_WINDOW_S", DEFAULT_KEY_WINDOW_S)
        else:
            key_window_s = _positive_seconds("key_window_s", key_window_s)
        if log_limit_per_minute is None:
            log_limit_per_minute = _env_int("DURABLE_SESSIONS_LOG_LIMIT", DEFAULT_LOG_LIMIT_PER_MINUTE)
        else:
            log_limit_per_minute = _positive_int("log_limit_per_minute", log_limit_per_minute)
        rules = tuple(rules)
        self._checker_options = (rules, key_window_s, max_sessions)
        self.checker: Checker | None = None
        self._offload: CheckerProcess | None = None
        self._unstarted: CheckerProcess | None = None  # a checker process that could not start
        self._parents_checker: CheckerProcess | None = None  # in a forked child: see _in_forked_child
        self.on_violation = on_violation
        self.copy_session = copy_session
        self.internal_errors = 0
        self.violations_reported = 0
        self._lock = threading.Lock()
        self._log = _RateLimitedLog(logger, log_limit_per_minute)
        forking.after_fork(self, _in_forked_child)
        self._error_logged = False
        self._late_span_logged = False
        self._shut_down = False
        meter = (meter_provider or metrics.get_meter_provider()).get_meter("durable_sessions", __version__)
        self._counter = meter.create_counter(
            sc.METRIC_VIOLATIONS,
            unit="{violation}",
            description="Durability rule violations found in ended spans",
        )
        self._error_counter = meter.create_counter(
            "durable_sessions.internal_errors",
            unit="{error}",
            description="Errors inside the durability processor (it failed open)",
        )
        self._intents = _open_intent_log(intent_log) if mode != "off" else None
        self._metric_attributes: dict[tuple[str, str, str], dict[str, str]] = {}
        self._resource: object = None
        self._resource_attributes: Mapping[str, object] = _NO_ATTRIBUTES
        with self._lock:  # a checker process that ends at once gives way only once set up here
            self._start_checking()
            self._go_native()

    def _start_checking(self) -> None:
        rules, key_window_s, max_sessions = self._checker_options
        if self.checking == "process" and os.environ.get(IN_CHECKER_ENV):
            # Built inside a checker process (a sitecustomize that reaches every Python
            # process): another checker from here would start another, and so on.
            logger.debug("durable_sessions: in a checker process; this processor checks inline")
            self.checking = "inline"
        if self.checking == "process" and self.mode != "off":
            try:
                self._offload = CheckerProcess(
                    rules,
                    key_window_s=key_window_s,
                    max_sessions=max_sessions,
                    report=self._report_found,
                    on_error=self._internal_error,
                    on_unstartable=self._check_inline_instead,
                )
            except Exception as error:  # fail open: check here rather than not at all
                # OSError: no process could be started; RuntimeError: a thread it needs
                # could not (a process at its thread limit), the process already reaped.
                self._internal_error("starting the checker process (checking inline instead)", error)
                self.checking = "inline"
        if self.checking == "inline":
            self.checker = self._new_checker()

    def _start_in_forked_child(self) -> None:
        """Start this forked child's own checker process (see :func:`_in_forked_child`),
        or check inline if it cannot start."""
        with self._lock:
            if self.checker is None and self._offload is None:  # else another thread did
                self._start_checking()
                self._go_native()

    def _new_checker(self) -> Checker:
        rules, key_window_s, max_sessions = self._checker_options
        return Checker(rules, key_window_s=key_window_s, max_sessions=max_sessions)

    def _check_inline_instead(self, where: str, error: Exception) -> None:
        """The checker process ended before it could check anything (an embedding
        program's ``sys.executable`` that is no Python, an import that failed there):
        check inline from now on, as when no process could be started at all. What was
        handed to it meanwhile is counted in ``spans_dropped``."""
        with self._lock:
            if self._offload is None:  # told twice (its reader and its sender both saw it end)
                return
            self.checker = self._new_checker()
            self._unstarted, self._offload = self._offload, None
            self.checking = "inline"
            self.__dict__.pop("on_end", None)  # the native hand-over: back to _check_ended
        self._internal_error(f"{where} (it could not start; checking inline instead)", error)

    def _go_native(self) -> None:
        """Where the C extension was built, make its functions this instance's ``on_start``
        and (with the native sender) ``on_end``.

        The SDK calls ``processor.on_start(span, parent_context)`` and
        ``processor.on_end(span)``: as instance attributes, the extension's functions run
        with no Python frame per span, and give this class's Python code whatever they do
        not settle themselves (a span that is not the SDK's, a parent span to read, a new
        resource, a value they do not encode).
        """
        native = native_module()
        if native is None or self.mode == "off":
            return
        cls = type(self)  # a subclass's own on_start or on_end is left to run
        if self.copy_session and self._intents is None and cls.on_start is DurabilitySpanProcessor.on_start:
            self.on_start = native.SessionCopier(  # type: ignore[method-assign]
                session_key=_SESSION_ID,
                context_key=SESSION_CONTEXT_KEY,
                current_span_key=_CURRENT_SPAN_KEY,
                context_var=_current_context_var(),
                fallback=self._copy_session,
            ).on_start
        if (
            self._offload is not None
            and cls.on_end is DurabilitySpanProcessor.on_end
            and (on_end := self._offload.span_handler(self._check_ended))
        ):
            self.on_end = on_end  # type: ignore[method-assign]

    # -- SpanProcessor -------------------------------------------------------------

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        """Copy the surrounding session id onto a span that has none; with an intent log,
        write a side effect's ``started`` record durably before the span's code runs."""
        if self.mode == "off":
            return
        if self.copy_session:
            self._copy_session(span, parent_context)
        if self._intents is not None and not self._shut_down:
            self._write_intent(span)

    def _write_intent(self, span: Span) -> None:
        try:
            context = span.get_span_context()
            record = intent_record(
                _live_attributes(span),
                sdk_resource_attributes(getattr(span, "resource", None)),
                span.start_time or 0,  # type: ignore[attr-defined]
                context.trace_id,
                context.span_id,
            )
            if record is not None and not self._intents.write(record):  # type: ignore[union-attr]
                self._started_after_shutdown()
        except Exception as error:  # fail open: the effect runs, the missing intent is logged
            self._internal_error("writing the intent record", error)

    def _started_after_shutdown(self) -> None:
        """A span that started while :meth:`shutdown` closed the intent log: not checked,
        as no span after shutdown is, and said once at debug level, not as a failure."""
        if not self._late_span_logged:
            self._late_span_logged = True
            logger.debug("durable_sessions: a span started during shutdown; it is not checked")

    def _copy_session(self, span: Span, parent_context: Context | None) -> None:
        try:
            try:  # _live_attributes' fast path, written out: on_start runs for every span
                attributes = span._attributes._dict  # type: ignore[attr-defined]
            except AttributeError:
                attributes = _live_attributes(span)
            if _SESSION_ID in attributes:
                return
            context = parent_context if parent_context is not None else _current_context()
            session_id = context.get(SESSION_CONTEXT_KEY)
            if type(session_id) is not str:
                parent = context.get(_CURRENT_SPAN_KEY)
                if parent is None or not isinstance(parent, trace_api.Span) or not parent.is_recording():
                    return
                session_id = _live_attributes(parent).get(sc.SESSION_ID)
            if session_id is not None:
                span.set_attribute(sc.SESSION_ID, session_id)
        except Exception as error:  # fail open
            self._internal_error("on_start", error)

    def on_end(self, span: ReadableSpan) -> None:
        """Check the ended span; report what it breaks. Raises only in ``mode="raise"``."""
        if self.mode == "off" or self._shut_down:
            return
        self._check_ended(span)

    def _check_ended(self, span: ReadableSpan) -> None:
        try:
            attributes, limit = sdk_attributes(span)
            if not may_be_action(attributes):
                return
            if self.checker is None and self._offload is None:
                self._start_in_forked_child()
            error, start_time, end_time, trace_id, span_id, resource = sdk_span_facts(span)
            # Spans of several providers (resources) may end at once on different threads.
            # The current resource is switched and used in one step, under the lock:
            # switched outside it, a span could be checked (or, with a checker process,
            # sent after the declaration of) another thread's resource.
            offload = self._offload
            if offload is not None:
                attributes = exact_attributes(attributes)  # marshal takes no enum member
                if type(attributes) is not dict:
                    attributes = dict(attributes)
                message = (SPAN, attributes, error, start_time, end_time, trace_id, span_id, limit)
                with self._lock:
                    if resource is not self._resource:
                        self._use_resource(resource)
                    offload.submit(message)  # a checker that could not start counts it dropped
                return
            parts = SpanParts(attributes, error, start_time, end_time, trace_id, span_id, limit)
            with self._lock:
                if resource is not self._resource:
                    self._use_resource(resource)
                violations = check_span(self.checker, parts, self._resource_attributes)  # type: ignore[arg-type]
            if violations:
                self._report(violations, span=span)
        except DurabilityViolationError:
            raise
        except Exception as error:  # fail open
            self._internal_error("on_end", error)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Report the findings of every span ended so far; every session stays open.

        With ``checking="process"`` this waits, at most ``timeout_millis``, for the
        checker process to check every span handed over so far; False if it did not.
        No session is ended: a flush comes mid-session (a serverless handler flushes
        after each invocation), where end-of-session rules would judge a retry or a
        side effect that the session has yet to settle. :meth:`end_sessions`,
        :meth:`end_session`, eviction and :meth:`shutdown` end sessions.
        """
        try:
            return self.wait_checked(timeout_millis / 1000)
        finally:
            self._log.flush()  # the summary of lines over the limit, as the docs say

    def end_sessions(self, timeout_s: float = 30.0) -> bool:
        """End every open session now and report its end-of-session findings.

        In ``mode="raise"`` the findings are raised as :class:`DurabilityViolationError`.
        With ``checking="process"`` this waits, at most ``timeout_s``, for the checker
        process; False if it did not answer in time.
        """
        if self._shut_down:
            return True  # every session was ended then, as wait_checked answers
        try:
            return self._finish(timeout_s=timeout_s)
        except DurabilityViolationError:
            raise
        except Exception as error:  # fail open
            self._internal_error("end_sessions", error)
        finally:
            self._log.flush()
        return True

    def shutdown(self) -> None:
        """End every session (never raises, whatever the mode); later spans are ignored."""
        if self._shut_down:
            return
        self.__dict__.pop("on_end", None)  # back to the methods that ignore spans after shutdown
        self.__dict__.pop("on_start", None)
        try:
            self._finish(raising=False, timeout_s=SHUTDOWN_CHECK_TIMEOUT_S)
            for offload in (self._offload, self._unstarted):
                if offload is not None:
                    offload.close()
            if self._intents is not None:
                self._intents.close()
        except Exception as error:  # fail open
            self._internal_error("shutdown", error)
        self._shut_down = True
        self._log.flush()

    # -- public helpers ------------------------------------------------------------

    def end_session(self, session_id: str) -> list[Violation]:
        """End one session now (e.g. the agent finished it) and report its end-of-session findings."""
        try:
            if (offload := self._offload) is not None:
                return offload.end_session(session_id, timeout_s=30.0) or []
            if self.checker is None:
                return []
            with self._lock:
                violations = self.checker.end_session(session_id)
            self._report(violations, raising=False)
            return violations
        except Exception as error:  # fail open
            self._internal_error("end_session", error)
            return []

    # -- internals -----------------------------------------------------------------

    def wait_checked(self, timeout_s: float = 30.0) -> bool:
        """Return once every span ended so far is checked and its violations reported.

        Immediate with ``checking="inline"``; with ``checking="process"`` it waits (at
        most ``timeout_s``; False if that was not enough) for the checker process, without
        ending any session. Tests use it before looking at what was reported.
        """
        offload = self._offload
        if offload is None or self._shut_down:
            return True  # nothing is being checked any more
        try:
            return offload.sync(timeout_s)
        except Exception as error:  # fail open
            self._internal_error("wait_checked", error)
            return False

    @property
    def actions_checked(self) -> int:
        """Action spans checked so far (with ``checking="process"``: as of the latest
        :meth:`wait_checked`, ``force_flush`` or ``end_session``)."""
        if (offload := self._offload) is not None:
            return offload.actions
        return self.checker.actions if self.checker is not None else 0

    @property
    def native(self) -> bool:
        """Whether the optional C extension runs this processor's ``on_start`` (and, with
        ``checking="process"``, its ``on_end``)."""
        return "on_start" in self.__dict__ or "on_end" in self.__dict__

    @property
    def spans_dropped(self) -> int:
        """Spans not checked because the checker process fell behind or stopped."""
        return sum(offload.dropped for offload in (self._offload, self._unstarted) if offload is not None)

    def _use_resource(self, resource: object) -> None:
        """Spans from here on come from ``resource``; the checker process is told first.

        Called with ``self._lock`` held. The native hand-over sends a span by itself only
        when the span's resource is the one it was told about, so it is told of no
        resource before the new declaration is queued, and of the new one after: a span
        of the old resource never lands after the new declaration.
        """
        self._resource_attributes = exact_attributes(sdk_resource_attributes(resource))
        self._resource = resource
        if self._offload is not None:
            self._offload.sent_resource(_NO_RESOURCE)
            self._offload.submit((RESOURCE, dict(self._resource_attributes)))
            self._offload.sent_resource(resource)

    def _finish(self, *, raising: bool = True, timeout_s: float = 30.0) -> bool:
        if self.mode == "off":
            return True
        if (offload := self._offload) is not None:
            return offload.finish(timeout_s) is not None  # reported as they arrive
        if self.checker is None:  # a forked child that has checked nothing yet
            return True
        with self._lock:
            violations = self.checker.finish()
        self._report(violations, raising=raising)
        return True

    def _report_found(self, violations: list[Violation]) -> None:
        """What the checker process found (on its reader thread)."""
        try:
            self._report(violations, raising=False)
        except Exception as error:  # fail open
            self._internal_error("reporting", error)

    def _report(
        self, violations: list[Violation], *, raising: bool = True, span: ReadableSpan | None = None
    ) -> None:
        self.violations_reported += len(violations)
        for violation in violations:
            kind = violation.kind or "unknown"
            key = (violation.rule, str(violation.severity), kind)
            labels = self._metric_attributes.get(key)
            if labels is None:
                labels = {"rule": key[0], "severity": key[1], "kind": kind}
                if len(self._metric_attributes) < 1024:
                    self._metric_attributes[key] = labels
            self._counter.add(1, labels)
            if self.mode == "log":
                self._log.violation(violation)
            if self.on_violation is not None:
                try:
                    self.on_violation(violation)
                except Exception as error:  # a broken callback must not break the app
                    self._internal_error("on_violation callback", error)
        if self.mode == "raise" and raising and violations:
            if span is None:  # end-of-session findings: of no one span
                raise DurabilityViolationError(violations)
            raise DurabilityViolationError(violations, span.name, sdk_attributes(span)[0])

    def _internal_error(self, where: str, error: Exception) -> None:
        if not self._error_logged:
            self._error_logged = True
            logger.warning(
                "durable_sessions processor failed in %s and is failing open "
                "(spans and your code are unaffected; further errors are only counted)",
                where,
                exc_info=error,
            )
        with contextlib.suppress(Exception):
            self._error_counter.add(1, {"where": where})
        self.internal_errors += 1  # last: who sees the count sees the error logged and metered


__all__ = [
    "MODES",
    "ConfigurationError",
    "DurabilitySpanProcessor",
    "DurabilityViolationError",
    "Mode",
    "format_violation",
]
