"""From a finished span to the action record it describes.

:func:`map_span` is a pure function of :class:`SpanData`, a plain description of a
finished span that does not depend on the SDK's classes: the span processor builds it
from the SDK's ``ReadableSpan`` (:func:`from_readable_span`), the collector from OTLP
spans. The mapping follows ``docs/semconv.md``:

1. ``agent.action.*`` attributes first: each is the record field of the same name
   (``agent.action.id`` is ``action_id``; ``agent.action.result`` is JSON text and
   becomes the parsed value).
2. Without ``agent.action.kind``, the OpenTelemetry GenAI, OpenInference and
   OpenLLMetry (Traceloop) conventions are tried, in that order; the first that
   recognises the span decides whether it is an action and of which kind.
3. The session comes from the first of ``session.id``, ``gen_ai.conversation.id``,
   ``langfuse.session.id``, ``traceloop.association.properties.session_id`` (span), then
   resource ``session.id``; else the trace stands in and ``session_source`` is
   ``trace``. ``incarnation`` is resource ``service.instance.id``; ``seq`` is the start
   time in nanoseconds, ``ts`` the same in seconds (:func:`span_time`: a span without a
   start time is dated by its end, and says so).

Values are never coerced: ``agent.action.max_attempts = "3"`` stays a string so that the
rules report it. Sequence values become lists (as JSON would give them). The few things
that no field can carry (a result that is not JSON text) are returned as
:attr:`Mapped.problems`, and :func:`with_problems` hands them to the engine, whose
``invalid-field`` rule reports them.

A span describes **no action** (``map_span`` returns ``None``) when it has no
``agent.action.*`` attribute and no recognised convention identifies it, or when a
recognised convention says it is not an action (``invoke_agent``, ``CHAIN``,
``workflow``, …). A span with ``agent.action.*`` attributes but no kind, and not an
action by any convention, is mapped without a kind, so that ``missing-field`` reports
it: a mistyped instrumentation is never a silent pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from opentelemetry.trace import StatusCode

from durable_sessions import kinds
from durable_sessions import semconv as sc
from durable_sessions.digest import digest_text, digest_value
from durable_sessions.json_text import Failure, exact_integers, parse_with_stdlib
from durable_sessions.native import native_module
from durable_sessions.record import ActionRecord, Location, span_location

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

AttributeValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]

_PREFIX_LEN = len(sc.ACTION_PREFIX)
_FIELDS = sc.ACTION_ATTRIBUTES
_EMPTY: Mapping[str, Any] = {}
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class SpanData:
    """A finished span, independent of the SDK's classes (adapters build it).

    ``attribute_value_limit`` is the attribute value length limit that was in force
    when the span was recorded (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``), when known: a
    result exactly that long was probably cut. A time of 0 is none (OTLP's unset).
    """

    name: str
    attributes: Mapping[str, AttributeValue]
    resource: Mapping[str, AttributeValue]
    status_error: bool
    start_time_ns: int
    trace_id: str
    span_id: str
    attribute_value_limit: int | None = None
    end_time_ns: int = 0


@dataclass(frozen=True, slots=True)
class Mapped:
    """The action a span describes, where it was found, and what could not be mapped.

    ``problems`` holds one message per attribute whose value no record field can carry
    faithfully (``agent.action.result`` that is not JSON text); the record is still
    complete and checkable.
    """

    record: ActionRecord
    where: Location
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Convention:
    """How a recognised third-party convention describes one kind of span."""

    kind: str
    id_keys: tuple[str, ...] = ()
    result_key: str | None = None
    result_prefix: str | None = None
    result_ref_key: str | None = None


_NOT_ACTION = _Convention(kind="")
_GENAI_LLM = _Convention(
    kinds.LLM_CALL,
    result_key=sc.GEN_AI_OUTPUT_MESSAGES,
    result_prefix=sc.GEN_AI_COMPLETION_PREFIX,
    result_ref_key=sc.GEN_AI_OUTPUT_MESSAGES_REF,
)
_GENAI_TOOL = _Convention(kinds.TOOL_CALL, (sc.GEN_AI_TOOL_CALL_ID,), sc.GEN_AI_TOOL_CALL_RESULT)
_GENAI_READ = _Convention(kinds.EXTERNAL_READ)
_OPENINFERENCE = {
    "LLM": _Convention(
        kinds.LLM_CALL, result_key=sc.OUTPUT_VALUE, result_prefix=sc.LLM_OUTPUT_MESSAGES_PREFIX
    ),
    "TOOL": _Convention(kinds.TOOL_CALL, (sc.TOOL_CALL_ID, sc.TOOL_ID), sc.OUTPUT_VALUE),
    "RETRIEVER": _Convention(kinds.EXTERNAL_READ, result_key=sc.OUTPUT_VALUE),
}
_TRACELOOP = {"tool": _Convention(kinds.TOOL_CALL, result_key=sc.TRACELOOP_ENTITY_OUTPUT)}


def _convention(attributes: Mapping[str, Any]) -> _Convention | None:
    """The convention that recognises the span: an action, ``_NOT_ACTION``, or None.

    A convention's marker that is not a string names no operation or span kind it
    knows, as an unknown string does not (``_NOT_ACTION``): OTLP carries any value there,
    and a key-value list (a dict) cannot even be looked up, which was a TypeError that
    stopped the check with a traceback.
    """
    get = attributes.get
    operation = get(sc.GEN_AI_OPERATION_NAME)
    if operation is not None:
        if type(operation) is not str:
            return _NOT_ACTION
        if operation in sc.GEN_AI_LLM_OPERATIONS:
            return _GENAI_LLM
        if operation in sc.GEN_AI_TOOL_OPERATIONS:
            return _GENAI_TOOL
        if operation in sc.GEN_AI_READ_OPERATIONS:
            return _GENAI_READ
        return _NOT_ACTION
    openinference = get(sc.OPENINFERENCE_SPAN_KIND)
    if openinference is not None:
        return _OPENINFERENCE.get(openinference, _NOT_ACTION) if type(openinference) is str else _NOT_ACTION
    traceloop = get(sc.TRACELOOP_SPAN_KIND)
    if traceloop is not None:
        return _TRACELOOP.get(traceloop, _NOT_ACTION) if type(traceloop) is str else _NOT_ACTION
    if (get(sc.GEN_AI_SYSTEM) is not None or get(sc.GEN_AI_PROVIDER_NAME) is not None) and get(
        sc.GEN_AI_REQUEST_MODEL
    ) is not None:
        return _GENAI_LLM
    return None


_BUILT_IN = frozenset({str, int, float, bool})


def exact(value: Any) -> Any:
    """An attribute value as the built-in type it stands for. The SDK keeps a subclass
    (an ``enum.StrEnum`` kind, an ``IntEnum`` cap) as given, and an OTLP exporter sends
    its plain value, which the sidecar then judges; the rules check exact types, so the
    processor judged ``Kind.PAYMENT`` a kind that is no string."""
    kind = type(value)
    if kind in _BUILT_IN or value is None:
        return value
    if kind is tuple:
        return tuple(exact(item) for item in value) if any(type(i) not in _BUILT_IN for i in value) else value
    for built_in in (bool, str, int, float):  # bool before int: a bool is an int
        if isinstance(value, built_in):
            return built_in(value) if built_in is not str else str.__str__(value)
    if isinstance(value, tuple | list):
        return tuple(exact(item) for item in value)
    return value


def exact_attributes(attributes: Mapping[str, Any]) -> Mapping[str, Any]:
    """``attributes`` with :func:`exact` values: the same mapping when they are already
    (a tuple of plain values included, which :func:`exact` returns as it is)."""
    if all(type(value) in _BUILT_IN or exact(value) is value for value in attributes.values()):
        return attributes
    return {key: exact(value) for key, value in attributes.items()}


def _plain(value: Any) -> Any:
    """An attribute value as JSON would hold it: sequences become lists."""
    if type(value) is tuple:
        return list(value)
    return value


def map_span(span: SpanData, *, keep_result: bool = True) -> Mapped | None:
    """The action a span describes, or None when it describes none.

    With ``keep_result=False`` the record never holds result text: it carries
    ``result_digest`` (the given one, else computed from the result) so that it still
    counts as recorded, and ``redacted: True`` when the instrumentation hid the value.
    Records whose result was read from a string attribute carry ``result_length`` and,
    when the span's limit is known, ``value_limit``.
    """
    mapped = map_attributes(
        span.attributes,
        span.resource,
        span.status_error,
        span.start_time_ns,
        span.trace_id,
        span.span_id,
        span.attribute_value_limit,
        keep_result,
        span.end_time_ns,
    )
    if mapped is None:
        return None
    record, problems = mapped
    return Mapped(record, span_location(span.trace_id, span.span_id), problems)  # type: ignore[arg-type]


_NO_PROBLEMS: tuple[str, ...] = ()


def map_attributes(
    attributes: Mapping[str, Any],
    resource: Mapping[str, Any],
    status_error: bool,
    start_time_ns: int,
    trace_id: str | int,
    span_id: str | int,
    limit: int | None,
    keep_result: bool,
    end_time_ns: int = 0,
) -> tuple[ActionRecord, tuple[str, ...]] | None:
    """:func:`map_span` on the span's parts: ``(record, problems)`` or None. The end time
    dates a span without a start time (:func:`span_time`); 0 is none.

    For front ends that hold a span's parts already (the span processor, the OTLP
    decoder) and want to skip building :class:`SpanData` and :class:`Mapped`. The ids
    may be given as integers: they are formatted as hex only if the record needs them,
    so a span that is no action costs no formatting.

    Where ``durable_sessions._mapping`` was built, ``map_attributes`` is its C version of
    this function, which hands it every span it does not map itself, with the same
    results (:func:`_accelerated`); :data:`reference_map_attributes` is this one.
    """
    record: dict[str, Any] = {}
    result: Any = _EMPTY
    beyond_otlp: list[str] | None = None
    for key, value in attributes.items():
        if key.startswith(sc.ACTION_PREFIX):
            kind = type(value)
            if kind is not str:  # most values are: they skip these tests
                if kind not in _BUILT_IN:
                    value = exact(value)
                    kind = type(value)
                if (kind is int and not _INT64_MIN <= value <= _INT64_MAX) or (
                    kind is tuple and _beyond_int64(value)
                ):
                    beyond_otlp = [*(beyond_otlp or ()), key]
                    continue
            field = _FIELDS.get(key) or key[_PREFIX_LEN:]
            if field == "result":
                result = value
            else:
                record[field] = list(value) if kind is tuple else value
    problems = _NO_PROBLEMS if beyond_otlp is None else _beyond_otlp_problems(beyond_otlp)
    if "kind" in record:
        if result is not _EMPTY:
            result, problems = _own_result(record, result, limit, problems)
    else:
        convention = _convention(attributes)
        if convention is None or convention is _NOT_ACTION:
            if not record and result is _EMPTY:
                return None
        else:
            record["kind"] = convention.kind
            if "action_id" not in record:
                record["action_id"] = _first(attributes, convention.id_keys) or _hex(span_id, 16)
            if result is _EMPTY:
                result = _third_party_result(record, attributes, convention, limit)
            else:
                result, problems = _own_result(record, result, limit, problems)
            if convention.result_ref_key and "result_ref" not in record:
                ref = attributes.get(convention.result_ref_key)
                if ref is not None:
                    record["result_ref"] = ref
    if "status" not in record:
        record["status"] = sc.STATUS_ERROR if status_error else sc.STATUS_OK
    if "prompt" in record and "prompt_digest" not in record:
        record["prompt_digest"] = prompt_digest(record["prompt"])
    if result is not _EMPTY:
        if "result_digest" in record and record.get("redacted") is not True:
            problems = _drop_malformed_digest(record, problems)
        if keep_result:
            record["result"] = result
        elif record.get("redacted") is not True and "result_digest" not in record:
            record["result_digest"] = digest_value(result)
    if "session_id" not in record:
        session_id = _first(attributes, sc.SESSION_ATTRIBUTES)
        if session_id is None:
            session_id = exact(resource.get(sc.RESOURCE_SESSION_ID))
        if session_id is not None:
            record["session_id"] = session_id
        else:
            record["session_id"] = _hex(trace_id, 32)
            record["session_source"] = sc.SESSION_SOURCE_TRACE
    incarnation = exact(resource.get(sc.SERVICE_INSTANCE_ID))
    if incarnation is not None:
        record["incarnation"] = incarnation
    if "name" not in record:
        name = _first(attributes, sc.NAME_FALLBACKS)
        if name is not None:
            record["name"] = name
    time_ns, problem = span_time(start_time_ns, end_time_ns)
    if time_ns is not None:
        record["seq"] = time_ns
        record["ts"] = time_ns / 1e9
    if problem is not None:
        problems = (*problems, problem)
    return record, problems  # type: ignore[return-value]


reference_map_attributes = map_attributes
"""The Python :func:`map_attributes`: the reference the C path must agree with."""


def _accelerated(reference: _F) -> _F:
    """``reference`` (:func:`map_attributes`) behind the C path (``durable_sessions._mapping``),
    which maps the common span itself and hands every other to ``reference``; ``reference``
    itself where the extension was not built or ``DURABLE_SESSIONS_NATIVE`` turns it off.
    Chosen once, at import: the front ends call ``map_attributes`` per span."""
    module = native_module("_mapping", warn=False)  # each front end warns of a bad switch itself
    if module is None:
        return reference
    return module.Mapper(  # type: ignore[no-any-return]
        reference,
        fields=_FIELDS,
        prefix=sc.ACTION_PREFIX,
        session_keys=sc.SESSION_ATTRIBUTES,
        resource_session_key=sc.RESOURCE_SESSION_ID,
        instance_key=sc.SERVICE_INSTANCE_ID,
        name_keys=sc.NAME_FALLBACKS,
        convention=_convention,
        not_action=_NOT_ACTION,
        redacted=sc.REDACTED,
        status_ok=sc.STATUS_OK,
        status_error=sc.STATUS_ERROR,
        trace_source=sc.SESSION_SOURCE_TRACE,
        loads=orjson.loads,
        digest=digest_value,
        prompt_digest=prompt_digest,
        span_time=span_time,
    )


def span_time(start_time_ns: int, end_time_ns: int) -> tuple[int | None, str | None]:
    """When a span happened, in ns since the epoch, for its record's ``seq`` (its place
    in the session's listing) and ``ts`` (what ``key-outlived-window`` dates a key's uses
    by); and the mapping problem that says it is not its start time, or None.

    A time of 0 is none: OTLP's unset ``start_time_unix_nano``, or an SDK span started
    with ``start_time=0``. Taken for a time, it dated the action 1970: its key's first use
    decades before a retry a minute later, a retry days later decades before the first
    use. The end time, when there is one, is the nearest known moment; else the action is
    left undated (no ``seq`` or ``ts``), as a record without ``ts`` is.
    """
    if start_time_ns:
        return start_time_ns, None
    if end_time_ns:
        return end_time_ns, (
            "span has no start time (start_time_unix_nano is 0) — its end time dates the action instead"
        )
    return None, "span has no start or end time (both are 0) — the action is undated"


def prompt_digest(prompt: Any) -> str:
    """The digest of an ``agent.action.prompt``: what ``re-asked`` compares when a resumed
    process gives the question a new id, and all of it a store keeps."""
    return digest_text(prompt) if type(prompt) is str else digest_value(prompt)


def _hex(span_or_trace_id: str | int, width: int) -> str:
    if type(span_or_trace_id) is str:
        return span_or_trace_id
    return format(span_or_trace_id, f"0{width}x")


def _own_result(
    record: dict[str, Any], value: Any, limit: int | None, problems: tuple[str, ...]
) -> tuple[Any, tuple[str, ...]]:
    """``agent.action.result``: JSON text, parsed. Anything else is kept and reported
    (after ``problems``, those found before)."""
    if type(value) is not str:
        shown = _plain(value)
        return shown, (
            *problems,
            f"attribute {sc.ACTION_RESULT} is {_describe(shown)}, expected JSON text — "
            "the result cannot be replayed as it was recorded",
        )
    _measure(record, len(value), limit)
    if value == sc.REDACTED:
        record["redacted"] = True
        return value, problems
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError as error:
        parsed = parse_with_stdlib(value, error)  # JSON that orjson cannot hold: 1e999, huge integers
        if type(parsed) is not Failure:
            return parsed, problems
        if limit is not None and len(value) == limit:
            return value, problems  # cut by the SDK: truncated-result says so
        return value, (
            *problems,
            f"attribute {sc.ACTION_RESULT} is not JSON text ({error}) — "
            "the result cannot be replayed as it was recorded",
        )
    if type(parsed) is str and parsed == sc.REDACTED:  # the placeholder as JSON text, as action() writes it
        record["redacted"] = True
    return exact_integers(value, parsed), problems


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
"""OTLP carries integer attributes as signed 64-bit integers (``AnyValue.int_value``)."""


def _beyond_int64(values: tuple[Any, ...]) -> bool:
    return any(type(item) is int and not _INT64_MIN <= item <= _INT64_MAX for item in values)


def _beyond_otlp_problems(keys: list[str]) -> tuple[str, ...]:
    """Attributes holding an integer that OTLP cannot carry: the SDK's OTLP exporter drops
    such an attribute (with a logged error), so the sidecar never sees it; every front end
    leaves it out of the record so, and says why."""
    return tuple(
        f"attribute {key} holds an integer outside the signed 64-bit range, which OTLP cannot "
        "carry — an OTLP exporter drops it, so it is left out of the record"
        for key in keys
    )


def _drop_malformed_digest(record: dict[str, Any], problems: tuple[str, ...]) -> tuple[str, ...]:
    """Leave out a given ``result_digest`` that is not a non-empty string, when the result
    itself is recorded: the result, present, is the record of the outcome, and its digest
    is computed from it (a malformed digest must not hide it, as "present means recorded"
    says). The malformed value is reported among the problems."""
    given = record["result_digest"]
    if type(given) is str and given:
        return problems
    del record["result_digest"]
    shown = "the empty string" if given == "" else _describe(_plain(given))
    return (
        *problems,
        f"attribute {sc.ACTION_RESULT_DIGEST} is {shown}, expected sha256:<hex> — "
        f"the outcome is judged by {sc.ACTION_RESULT} instead",
    )


def _third_party_result(
    record: dict[str, Any], attributes: Mapping[str, Any], convention: _Convention, limit: int | None
) -> Any:
    """The result a convention records, as the instrumentation wrote it; ``_EMPTY`` if none."""
    if convention.result_key is not None:
        value = attributes.get(convention.result_key)
        if value is not None:
            if type(value) is str:
                _measure(record, len(value), limit)
                if value == sc.REDACTED:
                    record["redacted"] = True
            return _plain(value)
    prefix = convention.result_prefix
    if prefix is None:
        return _EMPTY
    parts = {key[len(prefix) :]: _plain(attributes[key]) for key in attributes if key.startswith(prefix)}
    if not parts:
        return _EMPTY
    longest = max((len(v) for v in parts.values() if type(v) is str), default=None)
    if longest is not None:
        _measure(record, longest, limit)
    if sc.REDACTED in parts.values():
        record["redacted"] = True
    return dict(sorted(parts.items()))


def _measure(record: dict[str, Any], length: int, limit: int | None) -> None:
    record["result_length"] = length
    if limit is not None:
        record["value_limit"] = limit


def _first(attributes: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = attributes.get(key)
        if value is not None:
            return value if type(value) in _BUILT_IN else exact(value)
    return None


def _describe(value: Any) -> str:
    """The type of a result, never its value: a message reaches logs, alerts and stores,
    which keep digests of results, not results (a card number is a number)."""
    if type(value) is bool:
        return "a boolean"
    if type(value) in (int, float):
        return "a number"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__}"


def with_problems(record: ActionRecord, problems: tuple[str, ...]) -> ActionRecord:
    """``record`` as the engine checks it: the mapping's problems go along as
    ``mapping_problems``, which the ``invalid-field`` rule reports in the one violation it
    gives the record, beside the record's own bad fields. (Two violations of one rule for
    one span share a key: a store keeps one of them.) Every front end checks spans so."""
    if problems:
        record["mapping_problems"] = problems  # type: ignore[typeddict-unknown-key]
    return record


def from_readable_span(span: ReadableSpan, *, attribute_value_limit: int | None = None) -> SpanData:
    """A finished SDK span as :class:`SpanData`.

    ``attribute_value_limit`` defaults to the limit the span's own attributes were
    recorded under (``SpanLimits.max_span_attribute_length``), when the SDK exposes it.
    """
    attributes, limit = sdk_attributes(span)
    context = span.context
    return SpanData(
        name=span.name,
        attributes=attributes,
        resource=sdk_resource_attributes(span.resource),
        status_error=is_error(span),
        start_time_ns=span.start_time or 0,
        end_time_ns=span.end_time or 0,
        trace_id=format(context.trace_id, "032x") if context is not None else "0" * 32,
        span_id=format(context.span_id, "016x") if context is not None else "0" * 16,
        attribute_value_limit=attribute_value_limit if attribute_value_limit is not None else limit,
    )


def sdk_attributes(span: ReadableSpan) -> tuple[Mapping[str, Any], int | None]:
    """A finished SDK span's attributes as a plain mapping, and their value length limit.

    The SDK hands ``on_end`` a ``ReadableSpan`` over the span's ``BoundedAttributes``,
    which are immutable once the span has ended; their dict is read directly, because
    ``BoundedAttributes.get`` costs an exception per missing key.
    """
    try:
        bounded = span._attributes  # type: ignore[attr-defined]
        raw, limit = bounded._dict, bounded.max_value_len
    except AttributeError:
        return (span.attributes or _EMPTY), getattr(getattr(span, "_attributes", None), "max_value_len", None)
    if type(raw) is dict:
        return raw, limit
    return (span.attributes or _EMPTY), limit


def sdk_resource_attributes(resource: Any) -> Mapping[str, Any]:
    """A ``Resource``'s attributes as a plain mapping (see :func:`sdk_attributes`)."""
    if resource is None:
        return _EMPTY
    attributes = resource.attributes
    raw = getattr(attributes, "_dict", None)
    return raw if type(raw) is dict else (attributes or _EMPTY)


_ERROR = StatusCode.ERROR  # an enum member lookup per span adds up


def is_error(span: ReadableSpan) -> bool:
    """The span's status code is ERROR."""
    status = span.status
    return status is not None and status.status_code is _ERROR


def sdk_span_facts(span: ReadableSpan) -> tuple[bool, int, int, int, int, Any]:
    """``(is_error, start time ns, end time ns, trace id, span id, resource)`` of a finished
    span (a time the span has not is 0).

    An SDK ``ReadableSpan`` is read through its fields: each of its public properties
    is a Python call, and on the span processor's hot path those calls cost more than
    the rest of handing a span over. Any other span object is read through the public
    properties.
    """
    try:
        status, context = span._status, span._context  # type: ignore[attr-defined]
        return (
            status is not None and status._status_code is _ERROR,
            span._start_time or 0,  # type: ignore[attr-defined]
            span._end_time or 0,  # type: ignore[attr-defined]
            context.trace_id,
            context.span_id,
            span._resource,  # type: ignore[attr-defined]
        )
    except AttributeError:
        context = span.context
        return (
            is_error(span),
            span.start_time or 0,
            span.end_time or 0,
            context.trace_id,  # type: ignore[union-attr]
            context.span_id,  # type: ignore[union-attr]
            span.resource,
        )


# Here, once every helper the C path is given (span_time, prompt_digest, …) is defined.
map_attributes = _accelerated(reference_map_attributes)


__all__ = [
    "AttributeValue",
    "Mapped",
    "SpanData",
    "exact",
    "exact_attributes",
    "from_readable_span",
    "is_error",
    "map_attributes",
    "map_span",
    "reference_map_attributes",
    "sdk_attributes",
    "sdk_resource_attributes",
    "span_time",
    "with_problems",
]
