"""``durable_sessions.mapping``: every row of SEMCONV.md, on plain SpanData and real SDK spans."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from durable_sessions import semconv as sc
from durable_sessions.digest import digest_text, digest_value
from durable_sessions.engine import Checker
from durable_sessions.mapping import (
    Mapped,
    SpanData,
    from_readable_span,
    is_error,
    map_span,
    sdk_span_facts,
    with_problems,
)
from durable_sessions.record import Location, is_recorded, is_redacted

TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"
START = 1_764_581_640_123_456_789


def span(
    attributes: dict[str, Any],
    *,
    resource: dict[str, Any] | None = None,
    error: bool = False,
    limit: int | None = None,
    name: str = "span",
) -> SpanData:
    return SpanData(
        name=name,
        attributes=attributes,
        resource=resource if resource is not None else {"service.instance.id": "run-1"},
        status_error=error,
        start_time_ns=START,
        trace_id=TRACE,
        span_id=SPAN,
        attribute_value_limit=limit,
    )


def mapped(attributes: dict[str, Any], **options: Any) -> Mapped:
    keep = options.pop("keep_result", True)
    result = map_span(span(attributes, **options), keep_result=keep)
    assert result is not None
    return result


def rules_fired(result: Mapped) -> set[str]:
    checker = Checker()
    violations = checker.feed(with_problems(result.record, result.problems), result.where) + checker.finish()
    return {v.rule for v in violations}


# -- our own attributes --------------------------------------------------------------


def test_every_agent_action_attribute_becomes_its_record_field() -> None:
    attributes = {
        sc.SESSION_ID: "s-1",
        sc.ACTION_ID: "a07",
        sc.ACTION_KIND: "payment",
        sc.ACTION_STATUS: "ok",
        sc.ACTION_RESULT: '{"charge": "ch_1"}',
        sc.ACTION_RESULT_REF: "blob://s-1/a07.json",
        sc.ACTION_RESULT_DIGEST: "sha256:" + "0" * 64,
        sc.ACTION_IDEMPOTENCY_KEY: "pay-s-1-a07",
        sc.ACTION_REPLAY: "skip",
        sc.ACTION_REPLAYED: False,
        sc.ACTION_SIDE_EFFECTS: True,
        sc.ACTION_RETRYABLE: True,
        sc.ACTION_MAX_ATTEMPTS: 3,
        sc.ACTION_ATTEMPTS: 1,
        sc.ACTION_CACHEABLE: False,
        sc.ACTION_CACHE_KEY: "k",
        sc.ACTION_TTL_S: 60,
        sc.ACTION_CACHE_HIT: False,
        sc.ACTION_ON_FAILURE: "ask_user",
        sc.ACTION_NAME: "stripe.charge",
        sc.ACTION_PROMPT_DIGEST: "sha256:" + "1" * 64,
    }
    result = mapped(attributes)
    record = result.record
    assert set(sc.ACTION_ATTRIBUTES) <= set(attributes)
    for key, field in sc.ACTION_ATTRIBUTES.items():
        if field != "result":
            assert record[field] == attributes[key], field  # type: ignore[literal-required]
    assert record["result"] == {"charge": "ch_1"}
    assert record["session_id"] == "s-1"
    assert record["incarnation"] == "run-1"
    assert record["seq"] == START
    assert record["ts"] == pytest.approx(START / 1e9)
    assert result.where == Location(trace_id=TRACE, span_id=SPAN)
    assert result.problems == ()
    assert rules_fired(result) == set()


def test_status_defaults_from_span_status() -> None:
    ok = mapped({sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a"})
    failed = mapped({sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a"}, error=True)
    started = mapped(
        {sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", sc.ACTION_STATUS: "started"}, error=True
    )
    assert ok.record["status"] == "ok"
    assert failed.record["status"] == "error"
    assert started.record["status"] == "started"


def test_unknown_agent_action_fields_pass_through_and_sequences_become_lists() -> None:
    record = mapped({sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", "agent.action.tags": ("x", "y")}).record
    assert record["tags"] == ["x", "y"]  # type: ignore[typeddict-item]


def test_null_result_is_recorded() -> None:
    record = mapped({sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: "null"}).record
    assert "result" in record
    assert record["result"] is None
    assert is_recorded(record)


@pytest.mark.parametrize(
    ("value", "rule"),
    [("3", "unbounded-retry"), (True, "unbounded-retry"), (-1, "unbounded-retry"), (3.0, "unbounded-retry")],
)
def test_wrong_max_attempts_types_are_kept_and_reported(value: Any, rule: str) -> None:
    result = mapped(
        {
            sc.ACTION_KIND: "tool_call",
            sc.ACTION_ID: "a",
            sc.ACTION_RETRYABLE: True,
            sc.ACTION_MAX_ATTEMPTS: value,
        }
    )
    assert result.record["max_attempts"] == value
    assert type(result.record["max_attempts"]) is type(value)
    assert rule in rules_fired(result)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("cap", [2**64, 2**63, -(2**63) - 1, (3, 2**64)])
def test_an_integer_otlp_cannot_carry_is_left_out_and_reported(keep: bool, cap: Any) -> None:
    """OTLP integers are signed 64-bit: the SDK's OTLP exporter drops the attribute, and the
    sidecar judged no cap at all while the processor and check judged a valid one."""
    attributes = {sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", sc.ACTION_RETRYABLE: True}
    result = mapped({**attributes, sc.ACTION_MAX_ATTEMPTS: cap}, keep_result=keep)
    assert "max_attempts" not in result.record
    assert [sc.ACTION_MAX_ATTEMPTS in problem for problem in result.problems] == [True]
    assert rules_fired(result) == {"invalid-field", "unbounded-retry"}
    assert rules_fired(mapped({**attributes, sc.ACTION_MAX_ATTEMPTS: 2**63 - 1}, keep_result=keep)) == set()


def test_wrong_max_attempts_on_a_non_retryable_action_is_an_invalid_field() -> None:
    result = mapped({sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", sc.ACTION_MAX_ATTEMPTS: "3"})
    assert "invalid-field" in rules_fired(result)


def test_non_json_result_is_kept_and_reported_as_a_problem() -> None:
    result = mapped({sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: "not {json"})
    assert result.record["result"] == "not {json"
    assert len(result.problems) == 1
    assert "agent.action.result is not JSON text" in result.problems[0]
    violations = Checker().feed(with_problems(result.record, result.problems), result.where)
    assert [v.rule for v in violations] == ["invalid-field"]
    assert violations[0].span_id == SPAN
    assert violations[0].action_id == "a"


def test_the_mappings_problems_and_the_records_own_are_one_violation() -> None:
    # Two invalid-field violations of one span share a key: the sidecar kept the first,
    # and lost "retryable is the string 'yes'".
    result = mapped(
        {
            sc.ACTION_KIND: "tool_call",
            sc.ACTION_ID: "a",
            sc.ACTION_RESULT: "not {json",
            sc.ACTION_RETRYABLE: "yes",
        }
    )
    [violation] = Checker().feed(with_problems(result.record, result.problems), result.where)
    assert violation.rule == "invalid-field"
    assert "retryable is the string 'yes'" in violation.message
    assert "agent.action.result is not JSON text" in violation.message


def test_non_string_result_is_reported() -> None:
    result = mapped({sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: 5})
    assert result.record["result"] == 5
    assert "is a number, expected JSON text" in result.problems[0]


@pytest.mark.parametrize("value", [4111111111111111, 41111.11, True, ("4111", "1111")])
def test_a_result_that_is_not_text_is_described_by_its_type_only(value: Any) -> None:
    # The value was quoted in the message ("the number 4111111111111111"), which the
    # sidecar logs, alerts and stores: it keeps only digests of results.
    result = mapped(
        {sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: value}, keep_result=False
    )
    [problem] = result.problems
    assert "4111" not in problem and "true" not in problem.lower(), problem


def test_unknown_kind_is_a_neutral_action() -> None:
    result = mapped({sc.ACTION_KIND: "teleport", sc.ACTION_ID: "a"})
    assert result.record["kind"] == "teleport"
    assert rules_fired(result) == set()
    marked = mapped({sc.ACTION_KIND: "teleport", sc.ACTION_ID: "a", sc.ACTION_SIDE_EFFECTS: True})
    assert "unkeyed-side-effect" in rules_fired(marked)


def test_non_string_kind_is_a_missing_field() -> None:
    result = mapped({sc.ACTION_KIND: 7, sc.ACTION_ID: "a"})
    assert rules_fired(result) == {"missing-field"}


def test_missing_action_id_is_reported_not_invented() -> None:
    result = mapped({sc.ACTION_KIND: "llm_call", sc.ACTION_RESULT: "{}"})
    assert "action_id" not in result.record
    assert rules_fired(result) == {"missing-field"}


def test_agent_action_attributes_without_kind_are_reported_as_missing_kind() -> None:
    result = mapped({sc.ACTION_ID: "a", sc.ACTION_IDEMPOTENCY_KEY: "k"})
    assert "kind" not in result.record
    assert rules_fired(result) == {"missing-field"}


def test_plain_span_is_not_an_action() -> None:
    assert map_span(span({"http.method": "GET"})) is None
    assert map_span(span({})) is None


def test_twenty_megabyte_result_maps_and_digests() -> None:
    big = '"' + "x" * (20 * 1024 * 1024) + '"'
    result = mapped({sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: big}, keep_result=False)
    assert "result" not in result.record
    assert result.record["result_digest"] == digest_value("x" * (20 * 1024 * 1024))
    assert result.record["result_length"] == len(big)
    assert rules_fired(result) == set()


# -- keep_result=False (the sidecar) -------------------------------------------------


def test_without_result_text_the_digest_stands_in() -> None:
    result = mapped(
        {sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: '{"b":1,"a":2}'}, keep_result=False
    )
    assert "result" not in result.record
    assert result.record["result_digest"] == digest_value({"a": 2, "b": 1})
    assert is_recorded(result.record)


def test_given_digest_is_kept() -> None:
    given = "sha256:" + "a" * 64
    result = mapped(
        {
            sc.ACTION_KIND: "llm_call",
            sc.ACTION_ID: "a",
            sc.ACTION_RESULT: "1",
            sc.ACTION_RESULT_DIGEST: given,
        },
        keep_result=False,
    )
    assert result.record["result_digest"] == given


@pytest.mark.parametrize("given", ["", 5, ("sha256:x",), True])
def test_a_malformed_given_digest_does_not_hide_the_recorded_result(given: Any) -> None:
    """ "Present means recorded": the processor and the sidecar (keep_result=False) threw
    the result away when any digest was given, so an empty one read as no outcome at all."""
    attributes = {sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: '{"plan": "A"}'}
    by_value = mapped({**attributes, sc.ACTION_RESULT_DIGEST: given})
    by_digest = mapped({**attributes, sc.ACTION_RESULT_DIGEST: given}, keep_result=False)
    assert by_digest.record["result_digest"] == digest_value({"plan": "A"})
    assert by_value.record["result"] == {"plan": "A"} and "result_digest" not in by_value.record
    assert by_value.problems == by_digest.problems
    assert sc.ACTION_RESULT_DIGEST in by_digest.problems[0]
    assert rules_fired(by_value) == rules_fired(by_digest) == {"invalid-field"}


def test_a_malformed_digest_beside_a_different_replayed_result_is_a_mismatch_everywhere() -> None:
    def replay_mismatches(keep: bool) -> list[str]:
        checker = Checker()
        found = []
        for run, result, replayed in (("run-1", '{"plan": "A"}', False), ("run-2", '{"plan": "B"}', True)):
            attributes = {
                sc.ACTION_KIND: "llm_call",
                sc.ACTION_ID: "a",
                "session.id": "s-2",
                sc.ACTION_RESULT: result,
                sc.ACTION_RESULT_DIGEST: 5,
                sc.ACTION_REPLAYED: replayed,
            }
            one = map_span(
                dataclasses.replace(span(attributes, resource={"service.instance.id": run}), span_id=run),
                keep_result=keep,
            )
            assert one is not None
            found += checker.feed(with_problems(one.record, one.problems), one.where)
        return [v.rule for v in found + checker.finish() if v.rule == "replay-mismatch"]

    assert replay_mismatches(True) == replay_mismatches(False) == ["replay-mismatch"]


@pytest.mark.parametrize("keep", [True, False])
# action() writes the placeholder as JSON text, quoted: the sidecar (keep_result=False)
# took that for a recorded result and the offline checker did not.
@pytest.mark.parametrize("placeholder", [sc.REDACTED, f'"{sc.REDACTED}"'])
def test_redacted_result_is_not_recorded(keep: bool, placeholder: str) -> None:
    result = mapped(
        {sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: placeholder}, keep_result=keep
    )
    assert result.record["redacted"] is True  # type: ignore[typeddict-item]
    assert "result_digest" not in result.record
    assert ("result" in result.record) is keep
    assert is_redacted(result.record)
    assert not is_recorded(result.record)
    assert rules_fired(result) == {"unrecorded-result"}


@pytest.mark.parametrize("keep", [True, False])
def test_a_prompt_has_its_digest_in_every_front_end(keep: bool) -> None:
    # re-asked compares prompt digests; only the sidecar computed them, so it alone found a
    # question asked again under a new id.
    result = mapped(
        {sc.ACTION_KIND: "user_prompt", sc.ACTION_ID: "a", "agent.action.prompt": "Budget?"}, keep_result=keep
    )
    assert result.record["prompt_digest"] == digest_text("Budget?")  # type: ignore[typeddict-item]
    given = mapped({sc.ACTION_KIND: "user_prompt", sc.ACTION_ID: "a", "agent.action.prompt": "Budget?",
                    sc.ACTION_PROMPT_DIGEST: "sha256:" + "b" * 64})  # fmt: skip
    assert given.record["prompt_digest"] == "sha256:" + "b" * 64  # type: ignore[typeddict-item]


# -- truncation ------------------------------------------------------------------------


def test_result_as_long_as_the_limit_is_flagged_truncated() -> None:
    text = '{"answer": "' + "y" * 100
    result = mapped({sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: text}, limit=len(text))
    assert result.record["result_length"] == result.record["value_limit"] == len(text)
    assert result.problems == ()  # not JSON because it was cut: truncated-result says so
    assert "truncated-result" in rules_fired(result)


def test_result_shorter_than_the_limit_is_fine() -> None:
    result = mapped({sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: "[1]"}, limit=100)
    assert rules_fired(result) == set()


# -- session, incarnation, name ------------------------------------------------------


@pytest.mark.parametrize(
    "key", [sc.SESSION_ID, sc.GEN_AI_CONVERSATION_ID, sc.LANGFUSE_SESSION_ID, sc.TRACELOOP_SESSION_ID]
)
def test_session_attributes(key: str) -> None:
    record = mapped({sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", key: "s-9"}).record
    assert record["session_id"] == "s-9"
    assert "session_source" not in record


def test_session_attribute_order() -> None:
    attributes = {
        sc.TRACELOOP_SESSION_ID: "d",
        sc.LANGFUSE_SESSION_ID: "c",
        sc.GEN_AI_CONVERSATION_ID: "b",
        sc.SESSION_ID: "a",
        sc.ACTION_KIND: "tool_call",
        sc.ACTION_ID: "x",
    }
    order = [sc.SESSION_ID, sc.GEN_AI_CONVERSATION_ID, sc.LANGFUSE_SESSION_ID, sc.TRACELOOP_SESSION_ID]
    for key in order:
        expected = attributes[key]
        assert mapped(attributes, resource={"session.id": "r"}).record["session_id"] == expected
        del attributes[key]
    assert mapped(attributes, resource={"session.id": "r"}).record["session_id"] == "r"


def test_trace_stands_in_for_a_missing_session() -> None:
    record = mapped({sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a"}, resource={}).record
    assert record["session_id"] == TRACE
    assert record["session_source"] == "trace"
    assert "incarnation" not in record


@pytest.mark.parametrize(
    ("attributes", "name"),
    [
        ({sc.ACTION_NAME: "own", sc.GEN_AI_TOOL_NAME: "g"}, "own"),
        ({sc.GEN_AI_TOOL_NAME: "g", sc.TOOL_NAME: "t", sc.GEN_AI_REQUEST_MODEL: "m"}, "g"),
        ({sc.TOOL_NAME: "t", sc.GEN_AI_REQUEST_MODEL: "m"}, "t"),
        ({sc.GEN_AI_REQUEST_MODEL: "m"}, "m"),
        ({}, None),
    ],
)
def test_name_fallbacks(attributes: dict[str, Any], name: str | None) -> None:
    record = mapped({sc.ACTION_KIND: "tool_call", sc.ACTION_ID: "a", **attributes}).record
    assert record.get("name") == name


def test_own_kind_wins_over_third_party_conventions() -> None:
    record = mapped({sc.ACTION_KIND: "payment", sc.ACTION_ID: "a", "gen_ai.operation.name": "chat"}).record
    assert record["kind"] == "payment"


# -- third-party conventions: every row of SEMCONV.md's table ------------------------

THIRD_PARTY_ACTIONS = [
    # OpenTelemetry GenAI
    (
        {"gen_ai.operation.name": "chat", "gen_ai.output.messages": '[{"role":"assistant"}]'},
        "llm_call",
        SPAN,
        True,
    ),
    ({"gen_ai.operation.name": "text_completion"}, "llm_call", SPAN, False),
    ({"gen_ai.operation.name": "generate_content", "gen_ai.output.messages": "[]"}, "llm_call", SPAN, True),
    ({"gen_ai.system": "openai", "gen_ai.request.model": "gpt-4o"}, "llm_call", SPAN, False),
    ({"gen_ai.provider.name": "openai", "gen_ai.request.model": "gpt-4o"}, "llm_call", SPAN, False),
    ({"gen_ai.operation.name": "chat", "gen_ai.output.messages_ref": "blob://x"}, "llm_call", SPAN, True),
    (
        {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.call.id": "call_1",
            "gen_ai.tool.call.result": "42",
        },
        "tool_call",
        "call_1",
        True,
    ),
    ({"gen_ai.operation.name": "execute_tool"}, "tool_call", SPAN, False),
    ({"gen_ai.operation.name": "retrieval", "output.value": "ignored"}, "external_read", SPAN, False),
    # OpenInference
    ({"openinference.span.kind": "LLM", "output.value": "hi"}, "llm_call", SPAN, True),
    (
        {"openinference.span.kind": "LLM", "llm.output_messages.0.message.content": "hi"},
        "llm_call",
        SPAN,
        True,
    ),
    ({"openinference.span.kind": "LLM"}, "llm_call", SPAN, False),
    (
        {"openinference.span.kind": "TOOL", "tool_call.id": "c1", "output.value": "{}"},
        "tool_call",
        "c1",
        True,
    ),
    ({"openinference.span.kind": "TOOL", "tool.id": "t1"}, "tool_call", "t1", False),
    ({"openinference.span.kind": "RETRIEVER", "output.value": "[]"}, "external_read", SPAN, True),
    ({"openinference.span.kind": "RETRIEVER"}, "external_read", SPAN, False),
    # OpenLLMetry (Traceloop)
    ({"traceloop.span.kind": "tool", "traceloop.entity.output": '{"ok":1}'}, "tool_call", SPAN, True),
    ({"traceloop.span.kind": "tool"}, "tool_call", SPAN, False),
    (
        {"gen_ai.system": "openai", "gen_ai.request.model": "m", "gen_ai.completion.0.content": "hi"},
        "llm_call",
        SPAN,
        True,
    ),
]


@pytest.mark.parametrize(("attributes", "kind", "action_id", "recorded"), THIRD_PARTY_ACTIONS)
@pytest.mark.parametrize("keep", [True, False])
def test_third_party_actions(
    attributes: dict[str, Any], kind: str, action_id: str, recorded: bool, keep: bool
) -> None:
    result = mapped(attributes, keep_result=keep)
    record = result.record
    assert record["kind"] == kind
    assert record["action_id"] == action_id
    assert record["status"] == "ok"
    assert is_recorded(record) is recorded
    if not keep:
        assert "result" not in record
    assert result.problems == ()
    fired = rules_fired(result)
    assert ("unrecorded-result" in fired) is (kind != "tool_call" and not recorded)


@pytest.mark.parametrize(
    "attributes",
    [
        {"gen_ai.operation.name": op, "gen_ai.system": "openai", "gen_ai.request.model": "m"}
        for op in ("invoke_agent", "create_agent", "invoke_workflow", "plan", "embeddings", "something_new")
    ]
    + [
        {"openinference.span.kind": k}
        for k in ("AGENT", "CHAIN", "EMBEDDING", "RERANKER", "GUARDRAIL", "EVALUATOR", "PROMPT", "UNKNOWN")
    ]
    + [{"traceloop.span.kind": k} for k in ("workflow", "task", "agent")]
    + [{"gen_ai.system": "openai"}],  # no request model: not a legacy model call
)
def test_third_party_non_actions(attributes: dict[str, Any]) -> None:
    assert map_span(span(attributes)) is None


def test_legacy_completion_content_becomes_the_result() -> None:
    record = mapped(
        {
            "gen_ai.system": "openai",
            "gen_ai.request.model": "m",
            "gen_ai.completion.0.role": "assistant",
            "gen_ai.completion.0.content": "hello",
        }
    ).record
    assert record["result"] == {"0.content": "hello", "0.role": "assistant"}
    assert record["result_length"] == len("assistant")


def test_third_party_error_status() -> None:
    record = mapped({"openinference.span.kind": "LLM", "output.value": "x"}, error=True).record
    assert record["status"] == "error"


@pytest.mark.parametrize(
    "attributes",
    [
        {"openinference.span.kind": "LLM", "output.value": sc.REDACTED},
        {"openinference.span.kind": "LLM", "llm.output_messages.0.message.content": sc.REDACTED},
        {"openinference.span.kind": "TOOL", "output.value": sc.REDACTED},
        {"gen_ai.operation.name": "chat", "gen_ai.output.messages": sc.REDACTED},
    ],
)
@pytest.mark.parametrize("keep", [True, False])
def test_redacted_third_party_results(attributes: dict[str, Any], keep: bool) -> None:
    result = mapped(attributes, keep_result=keep)
    assert result.record["redacted"] is True  # type: ignore[typeddict-item]
    assert not is_recorded(result.record)
    if result.record["kind"] == "llm_call":
        violations = Checker().feed(result.record, result.where)
        assert [v.rule for v in violations] == ["unrecorded-result"]
        assert "redacted" in violations[0].message


def test_third_party_span_with_own_fields() -> None:
    record = mapped(
        {"gen_ai.operation.name": "chat", sc.ACTION_ID: "plan-1", sc.ACTION_RESULT: '"x"', sc.SESSION_ID: "s"}
    ).record
    assert record["action_id"] == "plan-1"
    assert record["result"] == "x"
    assert record["kind"] == "llm_call"


def test_third_party_truncated_result() -> None:
    result = mapped({"openinference.span.kind": "LLM", "output.value": "z" * 50}, limit=50)
    assert "truncated-result" in rules_fired(result)


# -- the SDK adapter -------------------------------------------------------------------


def _finished(limit: int | None = None, **resource: str):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create(resource),
        span_limits=SpanLimits(max_span_attribute_length=limit) if limit else None,
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_from_readable_span() -> None:
    provider, exporter = _finished(limit=64, **{"service.instance.id": "run-7"})
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("charge") as live:
        live.set_attribute(sc.ACTION_KIND, "payment")
        live.set_attribute(sc.ACTION_ID, "a1")
        live.set_attribute(sc.ACTION_RESULT, '{"charge": "' + "c" * 100 + '"}')
        live.set_status(Status(StatusCode.ERROR))
    (finished,) = exporter.get_finished_spans()
    data = from_readable_span(finished)
    assert data.name == "charge"
    assert data.status_error is True
    assert data.attribute_value_limit == 64
    assert data.trace_id == format(finished.context.trace_id, "032x")
    assert data.span_id == format(finished.context.span_id, "016x")
    assert data.start_time_ns == finished.start_time
    assert data.resource["service.instance.id"] == "run-7"
    result = map_span(data)
    assert result is not None
    assert result.record["status"] == "error"
    assert result.record["incarnation"] == "run-7"
    assert result.record["session_source"] == "trace"
    assert result.record["result_length"] == 64
    assert "truncated-result" in rules_fired(result)
    assert from_readable_span(finished, attribute_value_limit=10).attribute_value_limit == 10
    provider.shutdown()


def test_from_readable_span_without_limit() -> None:
    provider, exporter = _finished()
    with provider.get_tracer("t").start_as_current_span("x") as live:
        live.set_attribute(sc.ACTION_KIND, "tool_call")
    (finished,) = exporter.get_finished_spans()
    assert from_readable_span(finished).attribute_value_limit is None
    assert from_readable_span(finished).status_error is False
    provider.shutdown()


class PublicOnlySpan:
    """A span object with the ``ReadableSpan`` properties and none of its fields."""

    def __init__(self, span: Any) -> None:
        self.status, self.start_time, self.end_time, self.context, self.resource = (
            span.status,
            span.start_time,
            span.end_time,
            span.context,
            span.resource,
        )


@pytest.mark.parametrize("error", [False, True])
def test_span_facts_read_from_fields_equal_the_public_properties(error: bool) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.instance.id": "r-1"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span("s") as live:
        if error:
            live.set_status(Status(StatusCode.ERROR))
    (span,) = exporter.get_finished_spans()
    context = span.context
    public = (
        is_error(span),
        span.start_time,
        span.end_time,
        context.trace_id,
        context.span_id,
        span.resource,
    )
    assert public[0] is error
    assert sdk_span_facts(span) == public
    assert sdk_span_facts(PublicOnlySpan(span)) == public  # type: ignore[arg-type]


def test_a_result_past_64_bits_has_one_digest_recorded_and_read() -> None:
    # action().record writes such a result with the standard library's JSON (orjson refuses
    # it); a reader digesting the parsed result fell back to its repr: another digest, so
    # a replay of the same outcome looked like a different one.
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from durable_sessions.digest import fingerprint
    from durable_sessions.instrument import action

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with action("a", "llm_call", tracer_provider=provider) as act:
        act.record({"wei": 10**20, "deep": [[[1]]]})
    [span] = exporter.get_finished_spans()
    text, digest = span.attributes[sc.ACTION_RESULT], span.attributes[sc.ACTION_RESULT_DIGEST]
    assert digest_value(json.loads(text)) == digest
    assert fingerprint(json.loads(text)) == int(digest[7:23], 16)
    read = mapped({sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: text}, keep_result=False)
    assert read.record["result_digest"] == digest


@settings(max_examples=200, deadline=None)
@given(
    value=st.recursive(
        st.integers() | st.text(max_size=5) | st.booleans() | st.none(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
        max_leaves=8,
    )
)
def test_any_json_result_is_read_exactly_as_written(value: Any) -> None:
    # orjson reads an integer beyond 64 bits as a float: the mapping must not.
    text = json.dumps(value)
    result = mapped({sc.ACTION_KIND: "llm_call", sc.ACTION_ID: "a", sc.ACTION_RESULT: text})
    assert result.record["result"] == value and result.problems == ()
    assert repr(result.record["result"]) == repr(value)  # 10**20, not 1e+20
