"""One ended span, given as its parts, through the mapping into the engine.

The span processor takes this step in the application's process (``checking="inline"``)
or hands the parts to a checker process that takes it there (``checking="process"``);
either way the same code turns a span into findings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from durable_sessions import semconv as sc
from durable_sessions.engine import Checker
from durable_sessions.mapping import map_attributes, with_problems
from durable_sessions.record import span_location
from durable_sessions.violation import Violation

MAYBE_ACTION_KEYS = frozenset(
    (
        sc.GEN_AI_OPERATION_NAME,
        sc.OPENINFERENCE_SPAN_KIND,
        sc.TRACELOOP_SPAN_KIND,
        sc.GEN_AI_SYSTEM,
        sc.GEN_AI_PROVIDER_NAME,
    )
)
"""Marker attributes of the third-party conventions: a span with one may be an action."""
ACTION_PREFIX = sc.ACTION_PREFIX
ACTION_KIND = sc.ACTION_KIND
_join_keys = "\n".join


class SpanParts(NamedTuple):
    """What the mapping needs of one ended span; plain values, so it can cross a pipe."""

    attributes: Mapping[str, Any]
    is_error: bool
    start_time_ns: int
    end_time_ns: int
    trace_id: int
    span_id: int
    value_limit: int | None


def may_be_action(attributes: Mapping[str, Any]) -> bool:
    """False only for spans the mapping certainly calls "not an action".

    A span is an action only through an ``agent.action.*`` attribute or one of the
    third-party conventions' marker attributes, so a span with neither is skipped
    without being mapped.
    """
    if ACTION_KIND in attributes or not MAYBE_ACTION_KEYS.isdisjoint(attributes):
        return True
    # One search of the joined keys beats a loop over them; a key that merely contains
    # the prefix passes too, and the mapping then decides.
    return ACTION_PREFIX in _join_keys(attributes)


def check_span(checker: Checker, parts: SpanParts, resource: Mapping[str, Any]) -> list[Violation]:
    """The violations of one span (the mapping's problems among them: :func:`with_problems`)."""
    attributes, is_error, start_time_ns, end_time_ns, trace_id, span_id, value_limit = parts
    mapped = map_attributes(
        attributes, resource, is_error, start_time_ns, trace_id, span_id, value_limit, False, end_time_ns
    )
    if mapped is None:
        return []
    record, problems = mapped
    where = span_location(format(trace_id, "032x"), format(span_id, "016x"))
    return checker.feed(with_problems(record, problems), where)
