"""Run the real ``openai`` client under one real instrumentation package, in its own process.

Usage: ``python -m support.third_party_run PACKAGE SESSION_VIA`` (from ``tests/``), where
PACKAGE is ``openinference``, ``openai-v2`` or ``traceloop`` and SESSION_VIA is how the
session is named: ``openinference`` (its ``using_session``), ``ours``
(:func:`durable_sessions.instrument.session`, copied by the processor),
``conversation`` (a framework-style processor that sets ``gen_ai.conversation.id``) or
``none``. Content capture is set by the caller's environment, read by the package when
it is instrumented.

Each package monkeypatches ``openai`` and some read their settings once per process, so
``tests/test_third_party.py`` runs every combination in a fresh interpreter. The script
prints one JSON object: the records the mapping derives from the finished spans, the
violations the processor reported, and the processor's internal error count.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack

import openai
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from durable_sessions.instrument import resource, session
from durable_sessions.mapping import from_readable_span, map_span
from durable_sessions.processor import DurabilitySpanProcessor
from support.fake_openai import fake_openai_server

SESSION = "trip-42"


class ConversationIdProcessor(SpanProcessor):
    """What an agent framework does: name the conversation on every span it starts."""

    def on_start(self, span, parent_context=None) -> None:  # type: ignore[no-untyped-def]
        span.set_attribute("gen_ai.conversation.id", SESSION)


def instrumentor(package: str):  # type: ignore[no-untyped-def]
    if package == "openinference":
        from openinference.instrumentation.openai import OpenAIInstrumentor
    elif package == "openai-v2":
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
    elif package == "traceloop":
        from opentelemetry.instrumentation.openai import OpenAIInstrumentor
    else:
        raise SystemExit(f"unknown package {package!r}")
    return OpenAIInstrumentor()


def main(package: str, session_via: str) -> None:
    exporter = InMemorySpanExporter()
    violations = []
    provider = TracerProvider(resource=resource({"service.name": "third-party-test"}))
    if session_via == "conversation":
        provider.add_span_processor(ConversationIdProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    durability = DurabilitySpanProcessor(mode="silent", on_violation=violations.append)
    provider.add_span_processor(durability)
    instrumented = instrumentor(package)
    instrumented.instrument(tracer_provider=provider)
    answer = None
    try:
        with fake_openai_server() as server, ExitStack() as stack:
            if session_via == "openinference":
                from openinference.instrumentation import using_session

                stack.enter_context(using_session(SESSION))
            elif session_via == "ours":
                stack.enter_context(session(SESSION))
            client = openai.OpenAI(base_url=server.base_url, api_key="sk-fake", max_retries=0)
            response = client.chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "Which train to Kyoto?"}]
            )
            answer = response.choices[0].message.content
    finally:
        instrumented.uninstrument()
    provider.force_flush()
    records = []
    for span in exporter.get_finished_spans():
        mapped = map_span(from_readable_span(span))
        records.append({"span": span.name, "record": mapped.record if mapped else None})
    print(
        json.dumps(
            {
                "answer": answer,
                "records": records,
                "violations": [v.as_dict() for v in violations],
                "internal_errors": durability.internal_errors,
            },
            default=str,
        )
    )
    provider.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
