"""``DurabilitySpanProcessor`` on a real ``TracerProvider`` with an in-memory exporter."""

from __future__ import annotations

import enum
import gc
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from durable_sessions import semconv as sc
from durable_sessions.check import check_paths
from durable_sessions.engine import Checker
from durable_sessions.instrument import session
from durable_sessions.otlp_json import FileSpanExporter
from durable_sessions.processor import (
    ConfigurationError,
    DurabilitySpanProcessor,
    DurabilityViolationError,
)
from durable_sessions.rules import Explanation, Rule, select_rules
from durable_sessions.violation import Severity, Violation
from tests.support import undated_spans
from tests.support.senders import use_sender
from tests.support.undated_spans import end_undated_payments
from tests.support.waiting import GENEROUS_S


class Setup:
    def __init__(self, **options: Any) -> None:
        self.exporter = InMemorySpanExporter()
        self.metrics = InMemoryMetricReader()
        self._found: list[Violation] = []
        limits = options.pop("span_limits", None)
        self.provider = TracerProvider(
            resource=Resource.create({"service.instance.id": "run-1"}), span_limits=limits
        )
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        options.setdefault("on_violation", self._found.append)
        options.setdefault("meter_provider", MeterProvider(metric_readers=[self.metrics]))
        self.processor = DurabilitySpanProcessor(**options)
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("test")

    def action(self, action_id: str | None, kind: str | None, error: bool = False, **fields: Any) -> None:
        attributes = {sc.attribute(f): v for f, v in fields.items()}
        if action_id is not None:
            attributes[sc.ACTION_ID] = action_id
        if kind is not None:
            attributes[sc.ACTION_KIND] = kind
        with self.tracer.start_as_current_span(f"{kind} {action_id}", attributes=attributes) as span:
            if error:
                span.set_status(Status(StatusCode.ERROR))

    @property
    def violations(self) -> list[Violation]:
        """What was reported so far (once the checker, in whichever process, has caught up)."""
        assert self.processor.wait_checked(timeout_s=30)
        return self._found

    def rules(self) -> list[str]:
        return [v.rule for v in self.violations]

    def counted(self) -> dict[tuple[str, str, str], int]:
        data = self.metrics.get_metrics_data()
        counts: dict[tuple[str, str, str], int] = {}
        for resource_metrics in data.resource_metrics if data else []:
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == sc.METRIC_VIOLATIONS:
                        for point in metric.data.data_points:
                            a = point.attributes
                            counts[(a["rule"], a["severity"], a["kind"])] = point.value
        return counts


@pytest.fixture(params=["inline", "process", "process-python"])
def setup(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    """A provider whose processor checks in ``span.end()``, or in a checker process fed
    by the native sender, or by the pure-Python one."""
    checking, _, sender = request.param.partition("-")
    if checking == "process":
        use_sender(monkeypatch, sender or "native")
    s = Setup(mode="silent", checking=checking)
    yield s
    assert s.processor.wait_checked(timeout_s=30)
    assert s.processor.spans_dropped == 0  # nothing passed by being lost on the way
    s.provider.shutdown()


def test_clean_actions_report_nothing(setup: Setup) -> None:
    with session("s-1"):
        setup.action("a1", "llm_call", result='{"text": "hi"}')
        setup.action("a2", "payment", idempotency_key="pay-s-1-a2", result='{"charge": "ch_1"}')
        setup.action("a3", "tool_call", retryable=True, max_attempts=3, attempts=1)
    setup.provider.force_flush()
    assert setup.violations == []
    assert len(setup.exporter.get_finished_spans()) == 3


def test_violation_reaches_callback_metric_and_location(setup: Setup) -> None:
    with session("s-1"):
        setup.action("a7", "payment")
    (violation,) = setup.violations
    assert violation.rule == "unkeyed-side-effect"
    assert violation.session_id == "s-1"
    assert violation.action_id == "a7"
    (span,) = setup.exporter.get_finished_spans()
    assert violation.span_id == format(span.context.span_id, "016x")
    assert violation.trace_id == format(span.context.trace_id, "032x")
    assert setup.counted() == {("unkeyed-side-effect", "error", "payment"): 1}


def test_end_of_session_findings_are_counted_with_their_action_kind(setup: Setup) -> None:
    with session("s-1"):
        setup.action("e1", "email", status="started")  # intent of an unkeyed email, never completed
    assert setup.violations == []
    setup.processor.end_sessions()
    assert setup.rules() == ["unresolved-side-effect"]
    assert setup.counted() == {("unresolved-side-effect", "error", "email"): 1}


def test_violations_are_logged_one_line_each(caplog: pytest.LogCaptureFixture) -> None:
    s = Setup(mode="log")
    with caplog.at_level(logging.WARNING, logger="durable_sessions"), session("s-1"):
        s.action("a1", "payment")
        s.action("a2", "llm_call")
    lines = [r.getMessage() for r in caplog.records if r.name == "durable_sessions"]
    assert len(lines) == 2
    assert "[unkeyed-side-effect] error session 's-1' action 'a1'" in lines[0]
    assert "[unrecorded-result]" in lines[1]


def test_log_is_rate_limited_with_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    s = Setup(mode="log", log_limit_per_minute=3)
    with caplog.at_level(logging.WARNING, logger="durable_sessions"), session("s-1"):
        for i in range(10):
            s.action(f"a{i}", "payment")
        s.provider.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "durable_sessions"]
    assert len(s.violations) == 10  # the callback and metric see everything
    assert len([line for line in lines if line.startswith("durability violation")]) == 3
    assert "suppressed 7 violation log line(s)" in lines[-1]
    assert "unkeyed-side-effect: 7" in lines[-1]


def test_raise_mode_raises_into_the_code_that_ended_the_span() -> None:
    s = Setup(mode="raise")
    with pytest.raises(DurabilityViolationError) as caught, session("s-1"):
        s.action("a1", "payment")
    assert [v.rule for v in caught.value.violations] == ["unkeyed-side-effect"]
    assert "unkeyed-side-effect" in str(caught.value)
    assert len(s.exporter.get_finished_spans()) == 1  # added before it: still exported


def test_a_durability_violation_error_pickles_as_itself() -> None:
    """A test run in a process pool (pytest-xdist's workers, a multiprocessing helper)
    hands the error back pickled; it pickled as its message, which the constructor read
    as violations, and unpickling it raised AttributeError instead."""
    s = Setup(mode="raise")
    with pytest.raises(DurabilityViolationError) as caught, session("s-1"):
        s.action("a1", "payment")
    copy = pickle.loads(pickle.dumps(caught.value))
    assert type(copy) is DurabilityViolationError
    assert (copy.violations, str(copy)) == (caught.value.violations, str(caught.value))


def test_raise_mode_names_the_span_and_the_attributes_to_fix() -> None:
    """The error raised from span.end() named the span by its id alone and the fields by
    their record names (max_attempts, 'kind'): a test's reader had to find the span by
    hex id and guess the attribute. It names the span and each attribute the violation
    speaks of, with its value on the span or 'not set'."""
    s = Setup(mode="raise")
    with pytest.raises(DurabilityViolationError) as caught, session("s-1"):
        s.action("p1", "payment", max_attempts="3")
    text = str(caught.value)
    assert text.startswith("2 durability violation(s) in span 'payment p1':\n"), text
    assert "\n    attributes: agent.action.idempotency_key not set\n" in text, text
    assert text.endswith("\n    attributes: agent.action.max_attempts = '3'"), text
    with pytest.raises(DurabilityViolationError) as caught, session("s-1"):
        s.action("l1", b"tool_call")  # type: ignore[arg-type]
    assert "in span \"b'tool_call' l1\"" in str(caught.value)
    assert "attributes: agent.action.kind = b'tool_call'" in str(caught.value)
    copy = pickle.loads(pickle.dumps(caught.value))
    assert str(copy) == str(caught.value)
    s.provider.shutdown()


def test_raise_mode_raises_end_of_session_findings_from_end_sessions() -> None:
    s = Setup(mode="raise")
    with session("s-1"):
        s.action("a1", "payment", status="started")
    assert s.provider.force_flush()  # ends no session: nothing to raise yet
    with pytest.raises(DurabilityViolationError) as caught:
        s.processor.end_sessions()
    assert [v.rule for v in caught.value.violations] == ["unresolved-side-effect"]
    s.provider.shutdown()  # never raises


def test_off_mode_does_nothing() -> None:
    s = Setup(mode="off")
    with session("s-1"):
        s.action("a1", "payment")
    s.provider.force_flush()
    assert s.violations == []
    (span,) = s.exporter.get_finished_spans()
    assert sc.SESSION_ID not in span.attributes


# -- sessions ------------------------------------------------------------------------


def test_session_is_copied_onto_spans_that_have_none(setup: Setup) -> None:
    with session("s-outer"):
        with setup.tracer.start_as_current_span("plain"):
            pass
        with session("s-inner"), setup.tracer.start_as_current_span("inner"):
            pass
        with setup.tracer.start_as_current_span("own", attributes={sc.SESSION_ID: "mine"}):
            pass
    with setup.tracer.start_as_current_span("outside"):
        pass
    spans = {span.name: span.attributes.get(sc.SESSION_ID) for span in setup.exporter.get_finished_spans()}
    assert spans == {"plain": "s-outer", "inner": "s-inner", "own": "mine", "outside": None}


@pytest.mark.parametrize(("value", "copied"), [("false", None), ("off", None), ("true", "s-outer")])
def test_copying_the_session_is_set_by_its_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, copied: str | None
) -> None:
    """DURABLE_SESSIONS_COPY_SESSION, as every other setting of the processor has its variable."""
    monkeypatch.setenv("DURABLE_SESSIONS_COPY_SESSION", value)
    s = Setup(mode="silent")
    try:
        with session("s-outer"), s.tracer.start_as_current_span("plain"):
            pass
        (span,) = s.exporter.get_finished_spans()
        assert span.attributes.get(sc.SESSION_ID) == copied
        assert s.processor.copy_session is (copied is not None)
    finally:
        s.provider.shutdown()


def test_copying_the_session_argument_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_SESSIONS_COPY_SESSION", "false")
    processor = DurabilitySpanProcessor(mode="silent", copy_session=True)
    assert processor.copy_session is True
    processor.shutdown()


def test_session_is_inherited_from_the_parent_span_across_threads(setup: Setup) -> None:
    from opentelemetry import trace

    with setup.tracer.start_as_current_span("root", attributes={sc.SESSION_ID: "s-9"}) as root:
        parent = trace.set_span_in_context(root)

        def work() -> None:
            with setup.tracer.start_as_current_span("child", context=parent):
                pass

        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    spans = {span.name: span.attributes.get(sc.SESSION_ID) for span in setup.exporter.get_finished_spans()}
    assert spans["child"] == "s-9"


def test_sessions_are_held_in_a_bounded_lru() -> None:
    s = Setup(mode="silent", max_sessions=2)
    for session_id in ("s-1", "s-2", "s-3"):
        with session(session_id):
            s.action("a1", "payment", status="started")
    # s-1 was evicted when s-3 arrived: its end-of-session rules ran then.
    assert [(v.rule, v.session_id) for v in s.violations] == [("unresolved-side-effect", "s-1")]
    assert s.processor.checker.open_sessions == 2
    s.processor.end_sessions()
    assert sorted(v.session_id for v in s.violations) == ["s-1", "s-2", "s-3"]
    s.provider.shutdown()


def test_end_sessions_runs_end_of_session_rules(setup: Setup) -> None:
    with session("s-1"):
        for attempt in (1, 2, 3):
            setup.action("a4", "tool_call", error=True, retryable=True, max_attempts=3, attempts=attempt)
    assert setup.violations == []
    assert setup.processor.end_sessions()
    assert setup.rules() == ["retry-not-escalated"]


def test_force_flush_mid_session_ends_no_session(setup: Setup) -> None:
    """A serverless handler flushes after each invocation; the session goes on in the next.
    Ending it at the flush flagged a tool that failed its last attempt, which the next
    invocation escalated to the user, as a retry never escalated."""
    with session("s-1"):
        for attempt in (1, 2, 3):
            setup.action("a4", "tool_call", error=True, retryable=True, max_attempts=3, attempts=attempt)
    assert setup.provider.force_flush()
    assert setup.violations == []
    with session("s-1"):
        setup.action("q1", "user_prompt", result='{"answer": "use the backup"}')
    assert setup.processor.end_sessions()
    assert setup.violations == []


def test_end_session(setup: Setup) -> None:
    with session("s-1"):
        setup.action("a1", "email", status="started")
    assert [v.rule for v in setup.processor.end_session("s-1")] == ["unresolved-side-effect"]
    assert setup.processor.end_session("s-1") == []


def test_session_rules_across_spans(setup: Setup) -> None:
    with session("s-1"):
        setup.action("a1", "user_prompt", result='{"budget": 2400}', prompt_digest="sha256:" + "1" * 64)
        setup.action("a2", "user_prompt", result='{"budget": 2000}', prompt_digest="sha256:" + "1" * 64)
        setup.action("a3", "tool_call")
        setup.action("a3", "tool_call")
    assert "duplicate-action-id" in setup.rules()


# -- bad input ends as a violation, never an exception ---------------------------------


@pytest.mark.parametrize(
    ("fields", "rule"),
    [
        ({"retryable": True, "max_attempts": "3"}, "unbounded-retry"),
        ({"retryable": True, "max_attempts": True}, "unbounded-retry"),
        ({"retryable": True, "max_attempts": -1}, "unbounded-retry"),
        ({"max_attempts": "3"}, "invalid-field"),
        ({"result": "not json"}, "invalid-field"),
        ({"retryable": "yes"}, "invalid-field"),
        ({"status": "done"}, "invalid-field"),
        ({"on_failure": "pray"}, "invalid-field"),
    ],
)
def test_wrong_attribute_types_end_as_violations(setup: Setup, fields: dict[str, Any], rule: str) -> None:
    with session("s-1"):
        setup.action("a1", "tool_call", **fields)
    assert rule in setup.rules()
    assert setup.processor.internal_errors == 0


def test_unknown_kind_is_neutral(setup: Setup) -> None:
    with session("s-1"):
        setup.action("a1", "teleport")
    assert setup.violations == []


def test_missing_kind_and_id_are_reported(setup: Setup) -> None:
    with session("s-1"):
        setup.action(None, "llm_call", result="1")
        setup.action("a2", None, idempotency_key="k")
    assert setup.rules() == ["missing-field", "missing-field"]
    assert "'action_id'" in setup.violations[0].message
    assert "'kind'" in setup.violations[1].message


def test_twenty_megabyte_result(setup: Setup) -> None:
    big = '"' + "x" * (20 * 1024 * 1024) + '"'
    with session("s-1"):
        setup.action("a1", "llm_call", result=big)
    assert setup.violations == []
    assert setup.processor.internal_errors == 0
    assert setup.processor.spans_dropped == 0
    assert setup.processor.actions_checked == 1  # checked, not lost on the way


def test_result_cut_by_the_sdk_is_flagged() -> None:
    s = Setup(mode="silent", span_limits=SpanLimits(max_span_attribute_length=32))
    with session("s-1"):
        s.action("a1", "llm_call", result='{"text": "' + "y" * 100 + '"}')
    assert s.rules() == ["truncated-result"]
    s.provider.shutdown()


def test_third_party_span_is_checked(setup: Setup) -> None:
    with (
        session("s-1"),
        setup.tracer.start_as_current_span("chat", attributes={"gen_ai.operation.name": "chat"}),
    ):
        pass
    assert setup.rules() == ["unrecorded-result"]
    assert setup.counted() == {("unrecorded-result", "error", "llm_call"): 1}


def test_not_an_action_is_ignored(setup: Setup) -> None:
    with (
        setup.tracer.start_as_current_span("agent", attributes={"gen_ai.operation.name": "invoke_agent"}),
        setup.tracer.start_as_current_span("GET /", attributes={"http.request.method": "GET"}),
    ):
        pass
    setup.provider.force_flush()
    assert setup.violations == []
    assert setup.processor.actions_checked == 0


# -- fail open -------------------------------------------------------------------------


def _exploding_rule() -> Rule:
    def check(record: Any) -> str | None:
        raise RuntimeError("bug inside a rule")

    return Rule(
        id="exploding",
        severity=Severity.ERROR,
        scope="record",
        fix="-",
        explanation=Explanation("explodes", "why", "example", "instead"),
        check=check,
    )


def test_fail_open_leaves_spans_return_values_and_exceptions_untouched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = Setup(mode="log", rules=[*select_rules(), _exploding_rule()])

    def agent_step(n: int) -> int:
        with s.tracer.start_as_current_span(
            f"step {n}", attributes={sc.ACTION_ID: f"a{n}", sc.ACTION_KIND: "tool_call"}
        ):
            return n * 2

    def failing_step() -> None:
        with s.tracer.start_as_current_span(
            "failing", attributes={sc.ACTION_ID: "f", sc.ACTION_KIND: "tool_call"}
        ):
            raise KeyError("the application's own error")

    with caplog.at_level(logging.WARNING, logger="durable_sessions"), session("s-1"):
        assert [agent_step(n) for n in range(5)] == [0, 2, 4, 6, 8]
        with pytest.raises(KeyError, match="the application's own error"):
            failing_step()
    assert len(s.exporter.get_finished_spans()) == 6
    assert s.processor.internal_errors == 6
    failures = [r for r in caplog.records if "failing open" in r.getMessage()]
    assert len(failures) == 1  # logged once, then only counted
    assert failures[0].exc_info is not None


def test_broken_callback_does_not_reach_the_application() -> None:
    def callback(violation: Violation) -> None:
        raise ValueError("broken callback")

    s = Setup(mode="silent", on_violation=callback)
    with session("s-1"):
        s.action("a1", "payment")
    assert s.processor.internal_errors == 1
    assert len(s.exporter.get_finished_spans()) == 1


def test_raise_mode_does_not_raise_internal_errors() -> None:
    s = Setup(mode="raise", rules=[_exploding_rule()])
    with session("s-1"):
        s.action("a1", "tool_call")
    assert s.processor.internal_errors == 1


def test_processor_is_thread_safe(setup: Setup) -> None:
    def worker(n: int) -> None:
        with session(f"s-{n % 3}"):
            for i in range(200):
                setup.action(f"t{n}-a{i}", "llm_call", result="1")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    setup.provider.force_flush()
    assert setup.violations == []
    assert setup.processor.internal_errors == 0
    assert setup.processor.actions_checked == 1200


# -- configuration -------------------------------------------------------------------


def test_configuration_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DURABLE_SESSIONS_MODE", "raise")
    monkeypatch.setenv("DURABLE_SESSIONS_DISABLE", "unkeyed-side-effect, unrecorded-result")
    monkeypatch.setenv("DURABLE_SESSIONS_MAX_SESSIONS", "5")
    monkeypatch.setenv("DURABLE_SESSIONS_STRICT", "true")
    processor = DurabilitySpanProcessor()
    assert processor.mode == "raise"
    assert processor.checker.max_sessions == 5
    ids = {rule.id for rule in processor.checker.rules}
    assert "unkeyed-side-effect" not in ids
    assert "dead-end" in ids  # strict-only
    assert DurabilitySpanProcessor(mode="silent").mode == "silent"  # code wins


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("DURABLE_SESSIONS_MODE", "loud", "unknown durability mode 'loud'"),
        ("DURABLE_SESSIONS_MAX_SESSIONS", "many", "DURABLE_SESSIONS_MAX_SESSIONS='many' is not an integer"),
        ("DURABLE_SESSIONS_MAX_SESSIONS", "0", "must be at least 1"),
        ("DURABLE_SESSIONS_STRICT", "maybe", "is not a boolean"),
        ("DURABLE_SESSIONS_DISABLE", "no-such-rule", "unknown rule 'no-such-rule'"),
        ("DURABLE_SESSIONS_PRESET", "most", "unknown rule preset 'most'"),
    ],
)
def test_bad_configuration_fails_at_setup(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=message):
        DurabilitySpanProcessor()


@pytest.mark.parametrize("argument", ["strict", "copy_session"])
def test_a_flag_given_as_a_string_fails_at_setup(argument: str) -> None:
    """A configuration system handing over "false" turned strict on (a string's truth)."""
    with pytest.raises(ConfigurationError, match=f"{argument}='false' is not a bool"):
        DurabilitySpanProcessor(mode="silent", **{argument: "false"})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"on_violation": "alerts.page"}, "on_violation='alerts.page' is not callable"),
        ({"disable": ["unkeyed-side-effect", None]}, "is not a list of rule ids"),
        ({"disable": 5}, "disable=5 is not a list of rule ids"),
        ({"intent_log": 5}, "intent_log=5 is not a path"),
    ],
)
def test_arguments_of_the_wrong_type_fail_at_setup(arguments: dict[str, Any], message: str) -> None:
    """ConfigurationError at setup, as the docs promise: a callback that is no callable was
    accepted and failed at each violation later (counted as internal errors, reports lost);
    the others raised AttributeError or TypeError."""
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        DurabilitySpanProcessor(mode="silent", **arguments)


def test_uses_the_global_meter_provider_by_default() -> None:
    processor = DurabilitySpanProcessor(mode="silent")
    provider = TracerProvider()
    provider.add_span_processor(processor)
    unkeyed_payment(provider, "s")
    assert processor.violations_reported == 1
    provider.shutdown()


def test_spans_after_shutdown_are_ignored(setup: Setup) -> None:
    setup.processor.shutdown()
    setup.processor.shutdown()  # idempotent
    with session("s-1"):
        setup.action("a1", "payment")
    assert setup.violations == []


def test_an_earlier_span_is_cited_without_an_unknown_trace(setup: Setup) -> None:
    with session("s-1"):
        setup.action("a1", "llm_call", result="1")
        setup.action("a1", "llm_call", result="1")
    (violation,) = setup.violations
    assert violation.rule == "duplicate-action-id"
    first = setup.exporter.get_finished_spans()[0]
    assert f"first at span {first.context.span_id:016x})" in violation.message
    assert "None" not in violation.message


# -- found by a helper's run (each test fails on the code before its fix) -------------------


def unkeyed_payment(provider: TracerProvider, session_id: str) -> None:
    """One span of an unkeyed payment (unkeyed-side-effect) in ``session_id``."""
    with (
        session(session_id),
        provider.get_tracer("t").start_as_current_span(
            "pay", attributes={sc.ACTION_ID: "p", sc.ACTION_KIND: "payment"}
        ),
    ):
        pass


class Kind(enum.StrEnum):
    PAYMENT = "payment"


class Cap(enum.IntEnum):
    THREE = 3


def test_enum_attribute_values_are_judged_as_their_plain_values(setup: Setup) -> None:
    # The SDK keeps an enum member as given and an OTLP exporter sends its value. Inline,
    # Kind.PAYMENT was "a kind that is no string" (missing-field, the unkeyed payment
    # missed); with a checker process, the span was dropped (marshal takes no enum).
    with session("s-1"):
        setup.action("pay-1", Kind.PAYMENT)  # type: ignore[arg-type]
        setup.action("t-1", "tool_call", retryable=True, max_attempts=Cap.THREE, attempts=Cap.THREE)
    assert setup.rules() == ["unkeyed-side-effect"]


@pytest.mark.parametrize("checking", ["inline", "process"])
def test_an_enum_value_in_the_resource_keeps_its_session_and_incarnation(checking: str) -> None:
    # With a checker process the resource's declaration was lost whole: the trace stood in
    # for the resource's session.id, and the incarnation was gone.
    found: list[Violation] = []
    provider = TracerProvider(
        resource=Resource.create({"session.id": "res-session", "deployment.environment": Kind.PAYMENT})
    )
    processor = DurabilitySpanProcessor(mode="silent", checking=checking, on_violation=found.append)  # type: ignore[arg-type]
    provider.add_span_processor(processor)
    with provider.get_tracer("t").start_as_current_span(
        "pay", attributes={sc.ACTION_ID: "p", sc.ACTION_KIND: "payment"}
    ):
        pass
    assert processor.wait_checked(30) and processor.spans_dropped == 0
    provider.shutdown()
    assert [(v.rule, v.session_id) for v in found] == [("unkeyed-side-effect", "res-session")]


def test_force_flush_logs_the_summary_of_suppressed_lines(caplog: pytest.LogCaptureFixture) -> None:
    # The docs promise it at force_flush; it came at shutdown only.
    s = Setup(mode="log", log_limit_per_minute=1)
    with caplog.at_level(logging.WARNING, logger="durable_sessions"), session("s-1"):
        for i in range(3):
            s.action(f"a{i}", "payment")
        assert s.provider.force_flush()
    assert "suppressed 2 violation log line(s)" in caplog.records[-1].getMessage()
    s.provider.shutdown()


def test_disable_takes_a_comma_separated_string_as_the_variable_does() -> None:
    # A string was taken as its characters: "unknown rule 'd'".
    processor = DurabilitySpanProcessor(mode="silent", disable="dead-end, unkeyed-side-effect", strict=True)
    ids = {rule.id for rule in processor.checker.rules}  # type: ignore[union-attr]
    assert "dead-end" not in ids and "unkeyed-side-effect" not in ids and "unbounded-retry" in ids


def test_a_key_window_past_a_floats_range_is_a_configuration_error() -> None:
    with pytest.raises(
        ConfigurationError, match="must be at most 1000000000 seconds"
    ) as refused:  # was OverflowError
        DurabilitySpanProcessor(key_window_s=10**400)
    assert len(str(refused.value)) < 120  # the value is named by its ends, not its 401 digits


def test_an_on_violation_callback_may_flush_with_a_checker_process() -> None:
    # The callback runs on the thread that reads the checker's findings; a flush waited on
    # that thread for its whole timeout, and every report stalled meanwhile.
    provider = TracerProvider()
    took: list[float] = []

    def flush_on_violation(_violation: Violation) -> None:
        start = time.monotonic()
        provider.force_flush(timeout_millis=60_000)
        took.append(time.monotonic() - start)

    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=flush_on_violation)
    provider.add_span_processor(processor)
    unkeyed_payment(provider, "s-1")
    assert processor.wait_checked(30)
    provider.shutdown()
    assert len(took) == 1 and took[0] < 30  # not its whole timeout


@pytest.mark.parametrize("native", ["true", "false"])
def test_an_on_violation_callback_may_shut_down_with_a_checker_process(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, native: str
) -> None:
    # An application that stops on its first violation: shutdown, on the thread that reads
    # the checker's findings, joined that thread and failed there ("cannot join current
    # thread"), logged as the processor failing open.
    monkeypatch.setenv("DURABLE_SESSIONS_NATIVE", native)
    provider = TracerProvider()
    found: list[str] = []
    shut_down = threading.Event()

    def stop_on_violation(violation: Violation) -> None:
        found.append(violation.rule)
        provider.shutdown()
        shut_down.set()

    processor = DurabilitySpanProcessor(mode="silent", checking="process", on_violation=stop_on_violation)
    provider.add_span_processor(processor)
    checker = processor._offload._process  # type: ignore[union-attr]
    unkeyed_payment(provider, "s-1")
    assert shut_down.wait(30)
    assert found == ["unkeyed-side-effect"]
    assert checker.poll() == 0  # ended and reaped by the shutdown
    assert processor.internal_errors == 0, caplog.text
    assert "failing open" not in caplog.text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_holds_the_lock_can_end_spans() -> None:
    # A forked child has only the forking thread: the lock another thread held at the fork
    # stayed held, and the child's first action span hung (8 forks of 20).
    s = Setup(mode="silent")
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with s.processor._lock:
            holding.set()
            release.wait(GENEROUS_S)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(GENEROUS_S)  # else the fork would find the lock free
    pid = os.fork()
    if pid == 0:  # the child: end an action span, then report by the exit code
        try:
            with session("child"):
                s.action("pay-child", "payment")
        finally:
            os._exit(0)
    release.set()
    holder.join()
    deadline = time.monotonic() + GENEROUS_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child hung ending a span")
    s.provider.shutdown()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_end_its_parents_sessions(tmp_path: Path) -> None:
    """A helper forked mid-session that shut its provider down (to flush its exporters)
    ended the parent's sessions with them: the last attempt that had just failed was
    reported retry-not-escalated there, while the parent went on to escalate it."""
    s = Setup(mode="silent")
    with session("s-1"):
        s.action("a1", "llm_call", error=True, status="error", retryable=True, max_attempts=3, attempts=3)
    found = tmp_path / "child-found.txt"
    pid = os.fork()
    if pid == 0:  # the helper: one action of its own, then a shutdown, then it exits
        try:
            with session("s-2"):
                s.action("h1", "payment")  # unkeyed: the child's own finding
            s.provider.shutdown()
            found.write_text("\n".join(v.rule + " " + v.session_id for v in s._found))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert found.read_text().splitlines() == ["unkeyed-side-effect s-2"]
    with session("s-1"):
        s.action("a2", "user_prompt", result='"use the other model"')  # the parent escalates
    s.provider.shutdown()
    assert [v.rule for v in s._found] == []


# -- intent records --------------------------------------------------------------------


def _intent_agent(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "agent.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor
            from durable_sessions.instrument import action, resource, session
            from durable_sessions.otlp_json import FileSpanExporter
            from durable_sessions.processor import DurabilitySpanProcessor
            provider = TracerProvider(resource=resource())
            provider.add_span_processor(DurabilitySpanProcessor(mode="silent"))  # the intent log from the environment
            provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter("traces.jsonl")))
            trace.set_tracer_provider(provider)
            tracer = trace.get_tracer("agent")
            """
        )
        + textwrap.dedent(body)
        + "\nprovider.shutdown()\n"
    )
    return [sys.executable, str(script)]


def _run_intent_agent(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "DURABLE_SESSIONS_INTENT_LOG": "intents.jsonl", **env}
    agent = _intent_agent(tmp_path, body)
    return subprocess.run(agent, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=60)


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    durable_sessions = Path(sys.executable).with_name("durable-sessions")
    return subprocess.run(
        [str(durable_sessions), "check", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


def _check_with_intents(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return _check(tmp_path, "traces.jsonl", "--intents", "intents.jsonl")


PAYMENT = """
with session("s-1"):
    action("a1", "llm_call")(lambda: "plan")()
    action("p1", "payment"{key})(lambda: print("charged", flush=True))()
"""


def test_a_side_effect_killed_midway_is_known_from_its_intent_record(tmp_path: Path) -> None:
    """SIGKILL inside the payment span (after the charge): no span of it is exported, but
    its intent record is on disk, and the check of the traces with it reports it."""
    done = _run_intent_agent(tmp_path, PAYMENT.format(key=""), DURABLE_SESSIONS_KILL_AT="after:2")
    assert done.returncode == -signal.SIGKILL and done.stdout == "charged\n"
    (intent,) = [json.loads(line) for line in (tmp_path / "intents.jsonl").read_text().splitlines()]
    assert (intent["action_id"], intent["kind"], intent["status"], intent["session_id"]) == (
        "p1",
        "payment",
        "started",
        "s-1",
    )
    assert '"p1"' not in (tmp_path / "traces.jsonl").read_text()  # the span itself never ended
    checked = _check_with_intents(tmp_path)
    assert checked.returncode == 1 and "unresolved-side-effect" in checked.stdout
    assert "intents.jsonl:1" in checked.stdout  # where the evidence is
    assert _check(tmp_path, "traces.jsonl").returncode == 0  # the traces alone cannot tell


def test_a_completed_side_effect_and_its_intent_are_one_action(tmp_path: Path) -> None:
    done = _run_intent_agent(tmp_path, PAYMENT.format(key=', idempotency_key="k-1"'))
    assert done.returncode == 0, done.stderr
    assert (
        len((tmp_path / "intents.jsonl").read_text().splitlines()) == 1
    )  # the payment only, not the model call
    checked = _check_with_intents(tmp_path)
    assert checked.returncode == 0, checked.stdout


def test_an_interrupted_side_effect_is_one_action_with_its_intent(tmp_path: Path) -> None:
    """The span ends ``started`` (KeyboardInterrupt): no duplicate of its intent record."""
    body = """
    try:
        with session("s-1"), action("p1", "payment", idempotency_key="k-1"):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    """
    assert _run_intent_agent(tmp_path, body).returncode == 0
    checked = _check_with_intents(tmp_path)
    assert checked.returncode == 0, checked.stdout


def test_a_retry_killed_midway_is_found_whatever_came_before(tmp_path: Path) -> None:
    """Attempt 1 fails and is exported; attempt 2, under the same id, dies inside: unresolved."""
    body = """
    with session("s-1"):
        try:
            action("p1", "payment", retryable=True, max_attempts=3, attempts=1)(lambda: 1 / 0)()
        except ZeroDivisionError:
            pass
        action("p1", "payment", retryable=True, max_attempts=3, attempts=2)(lambda: "paid")()
    """
    assert _run_intent_agent(tmp_path, body, DURABLE_SESSIONS_KILL_AT="after:2").returncode == -signal.SIGKILL
    checked = _check_with_intents(tmp_path)
    assert checked.returncode == 1 and "unresolved-side-effect" in checked.stdout, checked.stdout


def test_an_intent_is_paired_with_its_span_by_span_not_by_action_id(tmp_path: Path) -> None:
    """A tool call whose id is set after its span started (a third-party convention)."""
    body = """
    with session("s-1"), tracer.start_as_current_span(
        "execute_tool", attributes={"gen_ai.operation.name": "execute_tool", "agent.action.side_effects": True}
    ) as span:
        span.set_attribute("gen_ai.tool.call.id", "call_1")
    """
    assert _run_intent_agent(tmp_path, body).returncode == 0
    intent = json.loads((tmp_path / "intents.jsonl").read_text())
    assert intent["action_id"] != "call_1"  # at start the id was not known yet
    checked = _check_with_intents(tmp_path)
    assert "unresolved-side-effect" not in checked.stdout, checked.stdout


def test_a_replayed_side_effect_writes_no_intent(tmp_path: Path) -> None:
    body = f"""
    from durable_sessions.journal import SqliteJournal
    journal = SqliteJournal({str(tmp_path / "journal.db")!r})
    with session("s-1", journal=journal):
        action("p1", "payment", idempotency_key="k-1")(lambda: "paid")()
    """
    for _ in range(2):  # the second process replays the payment
        assert _run_intent_agent(tmp_path, body).returncode == 0
    assert len((tmp_path / "intents.jsonl").read_text().splitlines()) == 1
    assert _check_with_intents(tmp_path).returncode == 0


def test_an_intent_log_that_cannot_be_opened_is_refused_at_setup(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot open the intent log"):
        DurabilitySpanProcessor(intent_log=tmp_path / "no" / "such" / "dir" / "intents.jsonl")


def test_an_intent_write_that_fails_later_fails_open(tmp_path: Path) -> None:
    processor = DurabilitySpanProcessor(mode="silent", intent_log=tmp_path / "intents.jsonl")
    provider = TracerProvider()
    provider.add_span_processor(processor)
    os.close(processor._intents._fd)  # the file descriptor goes away under it
    with provider.get_tracer("t").start_as_current_span(
        "pay", attributes={"agent.action.id": "p1", "agent.action.kind": "payment"}
    ):
        pass
    assert processor.internal_errors == 1
    processor._intents._closer.detach()  # closed here already: its number may be another file's now
    processor._intents._fd = -1


@pytest.mark.parametrize(
    ("attribute", "value", "found"),
    [
        # a UUID's 128-bit integer: beyond orjson's 64 bits; written exactly, read back exactly
        ("session.id", "uuid.UUID(int=2**127 + 1).int", "missing-field"),
        ("agent.action.idempotency_key", "b'k-1'", "invalid-field"),  # bytes: no JSON type
        ("agent.action.id", "'p1\\udcff'", "not valid Unicode"),  # a lone surrogate
    ],
)
def test_an_intent_of_any_attribute_value_is_written(
    tmp_path: Path, attribute: str, value: str, found: str
) -> None:
    """A payment span whose attributes hold a value orjson will not write: its intent
    record was not written at all (an internal error, logged once), so the payment the
    process died inside left no trace. It is written, and the check reports it: as the
    inline check judges the value, or as a line it cannot read (a lone surrogate, which
    the SDK takes but no JSON reader does), never as nothing."""
    body = f"""
    import uuid
    attributes = {{"agent.action.id": "p1", "agent.action.kind": "payment", "session.id": "s-1"}}
    attributes["agent.action.ttl_s"] = float("nan")  # null, as orjson writes it, never NaN
    attributes[{attribute!r}] = {value}
    with tracer.start_as_current_span("pay", attributes=attributes):
        os._exit(0)  # the process dies inside the payment
    """
    done = _run_intent_agent(tmp_path, body)
    assert done.returncode == 0 and "failing open" not in done.stderr, done.stderr
    assert len((tmp_path / "intents.jsonl").read_bytes().splitlines()) == 1
    checked = _check_with_intents(tmp_path)
    assert checked.returncode == 1 and found in checked.stdout, checked.stdout + checked.stderr


def test_a_kind_that_is_a_mapping_is_no_internal_error_at_start(tmp_path: Path) -> None:
    """The SDK keeps a mapping as an attribute value; one given as the kind at the start
    made the intent's side-effect test (a set lookup) raise TypeError, an internal error,
    and with side_effects: true the intent was lost. It is no side-effecting kind; with
    side_effects: true the intent is written."""
    path = tmp_path / "intents.jsonl"
    processor = DurabilitySpanProcessor(mode="silent", intent_log=path)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    for n, side_effects in enumerate((False, True)):
        attributes = {sc.ACTION_ID: f"a{n}", sc.ACTION_KIND: {"type": "payment"}, sc.SESSION_ID: "s-1"}
        attributes[sc.ACTION_SIDE_EFFECTS] = side_effects
        with provider.get_tracer("t").start_as_current_span("act", attributes=attributes):
            pass
    assert processor.internal_errors == 0
    assert [json.loads(line)["action_id"] for line in path.read_text().splitlines()] == ["a1"]
    provider.shutdown()


def test_an_intent_log_renamed_or_removed_is_written_at_its_path_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log kept writing to the file it opened: renamed away (a rotation without
    copytruncate) or removed (a temporary-file cleaner), every later intent went to the
    rotated file or to no file at all, silently. Each intent now goes to the file at the
    log's path (made again; the path read from where the process started, whatever its
    working directory now), and a path that cannot be opened again (its directory
    removed) is an internal error, not a silent loss."""
    folder = tmp_path / "log"
    folder.mkdir()
    monkeypatch.chdir(folder)
    processor = DurabilitySpanProcessor(mode="silent", intent_log="intents.jsonl")
    provider = TracerProvider()
    provider.add_span_processor(processor)
    monkeypatch.chdir(tmp_path)  # a daemon's chdir: the log stays where it was opened

    def pay(action_id: str) -> None:
        attributes = {sc.ACTION_ID: action_id, sc.ACTION_KIND: "payment", sc.SESSION_ID: "s-1"}
        with provider.get_tracer("t").start_as_current_span("pay", attributes=attributes):
            pass

    def intents(name: str) -> list[str]:
        return [json.loads(line)["action_id"] for line in (folder / name).read_text().splitlines()]

    pay("p1")
    (folder / "intents.jsonl").rename(folder / "intents.jsonl.1")
    pay("p2")
    assert (intents("intents.jsonl.1"), intents("intents.jsonl")) == (["p1"], ["p2"])
    (folder / "intents.jsonl").unlink()
    pay("p3")
    assert intents("intents.jsonl") == ["p3"]
    assert processor.internal_errors == 0
    shutil.rmtree(folder)
    pay("p4")
    assert processor.internal_errors == 1
    provider.shutdown()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists descriptors in /proc")
def test_a_processor_dropped_without_shutdown_leaves_no_intent_log_descriptor(tmp_path: Path) -> None:
    """The intent log held a raw descriptor that only shutdown closed: each processor
    dropped without its shutdown (a reconfiguration, a test) leaked one."""
    path = tmp_path / "intents.jsonl"

    def open_on_it() -> int:
        return sum(os.path.realpath(f"/proc/self/fd/{fd}") == str(path) for fd in os.listdir("/proc/self/fd"))

    for _ in range(3):
        processor = DurabilitySpanProcessor(mode="silent", intent_log=path)
        assert open_on_it() == 1
        del processor
        gc.collect()
    assert open_on_it() == 0


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="fills the disk with RLIMIT_FSIZE")
def test_an_intent_cut_short_by_a_full_disk_does_not_take_the_next_one_with_it(tmp_path: Path) -> None:
    """A write the disk had room for only part of leaves a partial line. The next intent
    was appended to it, one line that does not read, and the side effect it announced (a
    payment the process then died inside) was lost to the check."""
    body = """
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk: writes fail, nothing kills
    with session("s-1"):
        action("p1", "payment", idempotency_key="k-1")(lambda: None)()
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize("intents.jsonl") + 40, hard))
        action("p2", "payment", idempotency_key="k-2")(lambda: None)()  # room for 40 bytes of it
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
        with action("p3", "payment"):
            os._exit(0)  # the process dies inside the payment
    """
    assert _run_intent_agent(tmp_path, body).returncode == 0
    lines = (tmp_path / "intents.jsonl").read_text().splitlines()
    assert [json.loads(line)["action_id"] for line in (lines[0], lines[-1])] == ["p1", "p3"]
    checked = _check_with_intents(tmp_path)
    assert "unresolved-side-effect" in checked.stdout and "'p3'" in checked.stdout, checked.stdout


def test_intents_pair_with_their_spans_whatever_the_case_of_their_ids(tmp_path: Path) -> None:
    assert _run_intent_agent(tmp_path, PAYMENT.format(key=', idempotency_key="k-1"')).returncode == 0
    intents = tmp_path / "intents.jsonl"
    record = json.loads(intents.read_text())
    record["trace_id"], record["span_id"] = record["trace_id"].upper(), record["span_id"].upper()
    intents.write_text(json.dumps(record) + "\n")
    checked = _check_with_intents(tmp_path)
    assert checked.returncode == 0, checked.stdout


def test_intents_with_an_action_log_for_traces_are_refused(tmp_path: Path) -> None:
    (tmp_path / "intents.jsonl").write_text("")
    (tmp_path / "actions.jsonl").write_text(
        '{"session_id":"s","action_id":"a","kind":"clock","status":"ok"}\n'
    )
    checked = _check(tmp_path, "actions.jsonl", "--intents", "intents.jsonl")
    assert checked.returncode == 2
    assert "--intents pairs intent records with the spans of OTLP/JSON traces" in checked.stderr


def test_intents_of_a_process_killed_before_any_span_ended(tmp_path: Path) -> None:
    """Killed inside its first payment: the trace file is empty, and the intent is all there is."""
    done = _run_intent_agent(
        tmp_path,
        'with session("s-1"):\n    action("p1", "payment")(lambda: 1)()\n',
        DURABLE_SESSIONS_KILL_AT="after:1",
    )
    assert done.returncode == -signal.SIGKILL and (tmp_path / "traces.jsonl").read_bytes() == b""
    checked = _check_with_intents(tmp_path)
    assert checked.returncode == 1 and "unresolved-side-effect" in checked.stdout, checked.stderr


def test_a_span_without_a_start_time_is_dated_by_its_end(setup: Setup, tmp_path: Path) -> None:
    """A span started with ``start_time=0`` (what OTLP calls unset) was dated 1970: its
    idempotency key's first use 56 years before the retry (a false key-outlived-window),
    or a retry days later re-sent 56 years before its first use (none). Its end time
    stands in, and the missing start is reported; ``durable-sessions check`` on the
    spans as the file exporter writes them finds the same."""
    traces = tmp_path / "traces.jsonl"
    setup.provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(traces)))

    end_undated_payments(setup.tracer)

    found = setup.violations
    assert [(v.session_id, v.rule) for v in found] == undated_spans.EXPECTED
    assert "no start time" in found[0].message and "end time" in found[0].message
    assert "re-sent 48.0 h after its first use" in found[2].message
    setup.provider.force_flush()
    checked = list(check_paths([str(traces)], Checker(select_rules())))
    assert [(v.session_id, v.rule, v.message) for v in checked] == [
        (v.session_id, v.rule, v.message) for v in found
    ]


def _paused_on_entering(code: Any, reached: threading.Event, go: threading.Event) -> Any:
    """A trace function for the calling thread: once it enters ``code``, it says so on
    ``reached`` and waits for ``go``, so that a test can run something else in between."""

    def trace(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is code and not reached.is_set():
            reached.set()
            go.wait()

    return trace


def test_a_span_started_while_shutdown_closes_the_intent_log_is_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A span that passed on_start's shutdown check wrote to the intent log that the
    shutdown then closed: one spurious internal error, logged as a failure. The race is
    driven step by step: the span's thread stops where its write begins, the shutdown
    runs to the end, then the write goes on."""
    from durable_sessions.intent_log import IntentLog

    processor = DurabilitySpanProcessor(mode="silent", intent_log=tmp_path / "intents.jsonl")
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("t")
    reached, go = threading.Event(), threading.Event()

    def start_a_payment() -> None:
        sys.settrace(_paused_on_entering(IntentLog.write.__code__, reached, go))
        try:
            with tracer.start_as_current_span(
                "pay", attributes={"agent.action.id": "p1", "agent.action.kind": "payment"}
            ):
                pass
        finally:
            sys.settrace(None)

    late = threading.Thread(target=start_a_payment)
    with caplog.at_level(logging.DEBUG, logger="durable_sessions"):
        late.start()
        assert reached.wait(30)
        processor.shutdown()
        go.set()
        late.join(30)
    assert not late.is_alive()
    assert processor.internal_errors == 0
    assert [r for r in caplog.records if r.levelno > logging.DEBUG] == []
    assert len([r for r in caplog.records if "during shutdown" in r.getMessage()]) == 1
    assert (tmp_path / "intents.jsonl").read_text() == ""
