"""Real third-party instrumentation of the real ``openai`` client, checked by the processor.

Each case runs ``tests/support/third_party_run.py`` in a fresh interpreter: the three
packages monkeypatch the same ``openai`` methods and some read their content-capture
settings once per process, so a subprocess per case is the only clean isolation. The
client talks to a fake OpenAI-compatible server on 127.0.0.1 started by the runner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai", reason="install the test extra: pip install -e '.[test]'")
pytest.importorskip("openinference.instrumentation.openai")
pytest.importorskip("opentelemetry.instrumentation.openai_v2")
pytest.importorskip("opentelemetry.instrumentation.openai")

TESTS = Path(__file__).parent
CAPTURE_VARIABLES = (
    "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT",
    "OTEL_SEMCONV_STABILITY_OPT_IN",
    "TRACELOOP_TRACE_CONTENT",
    "OPENINFERENCE_HIDE_OUTPUTS",
    "OPENINFERENCE_HIDE_OUTPUT_MESSAGES",
    "OPENINFERENCE_HIDE_OUTPUT_TEXT",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
)


def run(package: str, session_via: str, **environment: str) -> dict[str, Any]:
    env = {key: value for key, value in os.environ.items() if key not in CAPTURE_VARIABLES}
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(proxy, None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["OPENAI_API_KEY"] = "sk-fake"
    env.update(environment)
    completed = subprocess.run(
        [sys.executable, "-m", "support.third_party_run", package, session_via],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def the_llm_call(outcome: dict[str, Any]) -> dict[str, Any]:
    assert outcome["answer"] == "Kyoto in November: book the 08:10 Nozomi."
    assert outcome["internal_errors"] == 0
    actions = [entry["record"] for entry in outcome["records"] if entry["record"] is not None]
    assert len(actions) == 1, outcome["records"]
    record = actions[0]
    assert record["kind"] == "llm_call"
    assert record["status"] == "ok"
    assert record["incarnation"]
    return record


def rules(outcome: dict[str, Any]) -> list[str]:
    return [violation["rule"] for violation in outcome["violations"]]


# -- OpenInference: content on by default, __REDACTED__ when hidden ------------------


def test_openinference_records_the_result_and_its_session() -> None:
    outcome = run("openinference", "openinference")
    record = the_llm_call(outcome)
    assert record["session_id"] == "trip-42"
    assert "session_source" not in record
    assert "Kyoto in November" in record["result"]
    assert rules(outcome) == []


def test_openinference_hidden_outputs_are_redacted_not_recorded() -> None:
    outcome = run("openinference", "openinference", OPENINFERENCE_HIDE_OUTPUTS="true")
    record = the_llm_call(outcome)
    assert record["redacted"] is True
    assert rules(outcome) == ["unrecorded-result"]
    assert "redacted" in outcome["violations"][0]["message"]


def test_openinference_without_a_session_uses_the_trace() -> None:
    outcome = run("openinference", "none")
    record = the_llm_call(outcome)
    assert record["session_source"] == "trace"
    assert len(record["session_id"]) == 32


# -- OpenTelemetry GenAI (openai-v2): content off by default -------------------------


def test_openai_v2_without_content_capture_records_nothing() -> None:
    outcome = run("openai-v2", "ours")
    record = the_llm_call(outcome)
    assert record["session_id"] == "trip-42"  # copied by the processor from session()
    assert record["name"] == "gpt-4o-mini"
    assert "result" not in record
    assert rules(outcome) == ["unrecorded-result"]


def test_openai_v2_with_content_capture_records_the_result() -> None:
    outcome = run(
        "openai-v2",
        "ours",
        OTEL_SEMCONV_STABILITY_OPT_IN="gen_ai_latest_experimental",
        OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT="SPAN_ONLY",
    )
    record = the_llm_call(outcome)
    assert "Kyoto in November" in record["result"]
    assert record["session_id"] == "trip-42"
    assert rules(outcome) == []


def test_openai_v2_session_from_conversation_id() -> None:
    outcome = run("openai-v2", "conversation")
    record = the_llm_call(outcome)
    assert record["session_id"] == "trip-42"


# -- OpenLLMetry (Traceloop): content on by default ----------------------------------


def test_traceloop_records_the_result() -> None:
    outcome = run("traceloop", "conversation")
    record = the_llm_call(outcome)
    assert record["session_id"] == "trip-42"  # from gen_ai.conversation.id
    assert "Kyoto in November" in json.dumps(record["result"])
    assert rules(outcome) == []


def test_traceloop_without_content_records_nothing() -> None:
    outcome = run("traceloop", "ours", TRACELOOP_TRACE_CONTENT="false")
    record = the_llm_call(outcome)
    assert "result" not in record
    assert record["session_id"] == "trip-42"
    assert rules(outcome) == ["unrecorded-result"]


def test_cut_result_is_flagged_truncated() -> None:
    outcome = run("openinference", "openinference", OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT="40")
    record = the_llm_call(outcome)
    assert record["result_length"] == record["value_limit"] == 40
    assert "truncated-result" in rules(outcome)
