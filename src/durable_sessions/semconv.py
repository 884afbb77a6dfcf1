"""The span attributes that describe agent actions: the public contract.

Every ``agent.action.<field>`` attribute is the action record's ``<field>`` (with two
renames: ``agent.action.id`` is ``action_id``; ``agent.action.result`` holds the result
as JSON text). The third-party names below are read, never written, and only when a
span has no ``agent.action.kind``. ``docs/semconv.md`` documents each attribute for
users; ``../shared/SEMCONV.md`` is the source of truth this module transcribes.
"""

from __future__ import annotations

from typing import Final

# -- our attributes ------------------------------------------------------------------

ACTION_PREFIX: Final = "agent.action."

ACTION_ID: Final = "agent.action.id"
ACTION_KIND: Final = "agent.action.kind"
ACTION_STATUS: Final = "agent.action.status"
ACTION_RESULT: Final = "agent.action.result"
ACTION_RESULT_REF: Final = "agent.action.result_ref"
ACTION_RESULT_DIGEST: Final = "agent.action.result_digest"
ACTION_IDEMPOTENCY_KEY: Final = "agent.action.idempotency_key"
ACTION_REPLAY: Final = "agent.action.replay"
ACTION_REPLAYED: Final = "agent.action.replayed"
ACTION_SIDE_EFFECTS: Final = "agent.action.side_effects"
ACTION_RETRYABLE: Final = "agent.action.retryable"
ACTION_MAX_ATTEMPTS: Final = "agent.action.max_attempts"
ACTION_ATTEMPTS: Final = "agent.action.attempts"
ACTION_CACHEABLE: Final = "agent.action.cacheable"
ACTION_CACHE_KEY: Final = "agent.action.cache_key"
ACTION_TTL_S: Final = "agent.action.ttl_s"
ACTION_CACHE_HIT: Final = "agent.action.cache_hit"
ACTION_ON_FAILURE: Final = "agent.action.on_failure"
ACTION_NAME: Final = "agent.action.name"
ACTION_PROMPT_DIGEST: Final = "agent.action.prompt_digest"

ACTION_ATTRIBUTES: Final[dict[str, str]] = {
    ACTION_ID: "action_id",
    ACTION_KIND: "kind",
    ACTION_STATUS: "status",
    ACTION_RESULT: "result",
    ACTION_RESULT_REF: "result_ref",
    ACTION_RESULT_DIGEST: "result_digest",
    ACTION_IDEMPOTENCY_KEY: "idempotency_key",
    ACTION_REPLAY: "replay",
    ACTION_REPLAYED: "replayed",
    ACTION_SIDE_EFFECTS: "side_effects",
    ACTION_RETRYABLE: "retryable",
    ACTION_MAX_ATTEMPTS: "max_attempts",
    ACTION_ATTEMPTS: "attempts",
    ACTION_CACHEABLE: "cacheable",
    ACTION_CACHE_KEY: "cache_key",
    ACTION_TTL_S: "ttl_s",
    ACTION_CACHE_HIT: "cache_hit",
    ACTION_ON_FAILURE: "on_failure",
    ACTION_NAME: "name",
    ACTION_PROMPT_DIGEST: "prompt_digest",
}
"""Each documented ``agent.action.*`` attribute and the record field it becomes."""

STATUS_OK: Final = "ok"
STATUS_ERROR: Final = "error"
STATUS_STARTED: Final = "started"
REPLAY_SKIP: Final = "skip"
ON_FAILURE_VALUES: Final = ("ask_user", "abort", "compensate")

# -- session and process -------------------------------------------------------------

SESSION_ID: Final = "session.id"
"""The OpenTelemetry standard session attribute; the instrumentation API writes it."""

GEN_AI_CONVERSATION_ID: Final = "gen_ai.conversation.id"
LANGFUSE_SESSION_ID: Final = "langfuse.session.id"
TRACELOOP_SESSION_ID: Final = "traceloop.association.properties.session_id"

SESSION_ATTRIBUTES: Final = (SESSION_ID, GEN_AI_CONVERSATION_ID, LANGFUSE_SESSION_ID, TRACELOOP_SESSION_ID)
"""Span attributes that name the session, in the order they are read."""

RESOURCE_SESSION_ID: Final = SESSION_ID
"""A resource-wide session (one process, one session), read after the span attributes."""

SERVICE_INSTANCE_ID: Final = "service.instance.id"
"""Resource attribute: one value per process start, the record's ``incarnation``."""

SESSION_SOURCE_TRACE: Final = "trace"
"""``session_source`` when no session attribute was found and the trace stands in."""

# -- name fallbacks ------------------------------------------------------------------

GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
TOOL_NAME: Final = "tool.name"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
NAME_FALLBACKS: Final = (GEN_AI_TOOL_NAME, TOOL_NAME, GEN_AI_REQUEST_MODEL)
"""Read for ``name`` when ``agent.action.name`` is absent, in this order."""

# -- OpenTelemetry GenAI -------------------------------------------------------------

GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"
GEN_AI_SYSTEM: Final = "gen_ai.system"
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
GEN_AI_OUTPUT_MESSAGES_REF: Final = "gen_ai.output.messages_ref"
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
GEN_AI_TOOL_CALL_RESULT: Final = "gen_ai.tool.call.result"
GEN_AI_COMPLETION_PREFIX: Final = "gen_ai.completion."
"""Legacy (OpenLLMetry) content: ``gen_ai.completion.<i>.content`` and siblings."""

GEN_AI_LLM_OPERATIONS: Final = frozenset({"chat", "text_completion", "generate_content"})
GEN_AI_TOOL_OPERATIONS: Final = frozenset({"execute_tool"})
GEN_AI_READ_OPERATIONS: Final = frozenset({"retrieval"})
GEN_AI_NOT_ACTIONS: Final = frozenset(
    {"invoke_agent", "create_agent", "invoke_workflow", "plan", "embeddings"}
)

# -- OpenInference -------------------------------------------------------------------

OPENINFERENCE_SPAN_KIND: Final = "openinference.span.kind"
OUTPUT_VALUE: Final = "output.value"
LLM_OUTPUT_MESSAGES_PREFIX: Final = "llm.output_messages."
TOOL_CALL_ID: Final = "tool_call.id"
TOOL_ID: Final = "tool.id"
OPENINFERENCE_NOT_ACTIONS: Final = frozenset(
    {"AGENT", "CHAIN", "EMBEDDING", "RERANKER", "GUARDRAIL", "EVALUATOR", "PROMPT"}
)

# -- OpenLLMetry (Traceloop) ---------------------------------------------------------

TRACELOOP_SPAN_KIND: Final = "traceloop.span.kind"
TRACELOOP_ENTITY_OUTPUT: Final = "traceloop.entity.output"
TRACELOOP_NOT_ACTIONS: Final = frozenset({"workflow", "task", "agent"})

REDACTED: Final = "__REDACTED__"
"""What OpenInference writes instead of a hidden value: not a recorded result."""

# -- what the mapping reads -----------------------------------------------------------

MAPPED_KEYS: Final = frozenset(
    {
        *SESSION_ATTRIBUTES,
        RESOURCE_SESSION_ID,
        SERVICE_INSTANCE_ID,
        *NAME_FALLBACKS,
        GEN_AI_OPERATION_NAME,
        GEN_AI_SYSTEM,
        GEN_AI_PROVIDER_NAME,
        GEN_AI_REQUEST_MODEL,
        GEN_AI_OUTPUT_MESSAGES,
        GEN_AI_OUTPUT_MESSAGES_REF,
        GEN_AI_TOOL_CALL_ID,
        GEN_AI_TOOL_CALL_RESULT,
        OPENINFERENCE_SPAN_KIND,
        OUTPUT_VALUE,
        TOOL_CALL_ID,
        TOOL_ID,
        TRACELOOP_SPAN_KIND,
        TRACELOOP_ENTITY_OUTPUT,
    }
)
"""The span and resource attributes ``map_attributes`` reads by name (``docs/semconv.md``)."""

MAPPED_PREFIXES: Final = (ACTION_PREFIX, GEN_AI_COMPLETION_PREFIX, LLM_OUTPUT_MESSAGES_PREFIX)
"""The attribute name prefixes it reads every attribute of: ours (an unknown
``agent.action.*`` attribute is a record field, which the rules report) and the
conventions' numbered result parts."""


def is_mapped(key: str) -> bool:
    """The mapping reads attribute ``key`` (:data:`MAPPED_KEYS`, :data:`MAPPED_PREFIXES`)."""
    return key in MAPPED_KEYS or key.startswith(MAPPED_PREFIXES)


# -- instrumentation-only ------------------------------------------------------------

EVENT_VIOLATION: Final = "durable_sessions.violation"
"""Span event the instrumentation API adds to a live span that broke a rule."""

METRIC_VIOLATIONS: Final = "durable_sessions.violations"
"""Counter of violations, with attributes ``rule``, ``severity`` and ``kind``."""

_ATTRIBUTE_BY_FIELD: Final[dict[str, str]] = {field: key for key, field in ACTION_ATTRIBUTES.items()}


def attribute(field: str) -> str:
    """The span attribute for a record field: ``attribute("action_id") == "agent.action.id"``.

    Fields not in the table map to ``agent.action.<field>``, as the mapping reads them.
    """
    return _ATTRIBUTE_BY_FIELD.get(field) or ACTION_PREFIX + field
