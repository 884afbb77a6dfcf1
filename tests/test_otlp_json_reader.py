"""The OTLP/JSON reader on hand-written and malformed input: it reports, never crashes."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_sessions import readers
from durable_sessions.engine import Checker
from durable_sessions.rules import select_rules

DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")
TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PAYMENT = [
    ("session.id", {"stringValue": "s-1"}),
    ("agent.action.id", {"stringValue": "a1"}),
    ("agent.action.kind", {"stringValue": "payment"}),
    ("agent.action.idempotency_key", {"stringValue": "k-s-1-a1"}),
]


def request(attributes: list[tuple[str, Any]], **span_fields: Any) -> dict[str, Any]:
    """One OTLP/JSON request of one span with these attributes."""
    span = {
        "traceId": TRACE_ID,
        "spanId": SPAN_ID,
        "name": "act",
        "startTimeUnixNano": "1767225600000000000",
        "attributes": [{"key": key, "value": value} for key, value in attributes],
        **span_fields,
    }
    return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"scope": {"name": "t"}, "spans": [span]}]}]}


def read(document: dict[str, Any]) -> list[readers.Item]:
    line = json.dumps(document).encode() + b"\n"
    return list(readers.read_otlp_json(io.BytesIO(line), "f.jsonl"))


def check_file(path: Path) -> tuple[int, dict[str, Any], str]:
    result = subprocess.run(
        [str(DURABLE_SESSIONS), "check", "--format", "json", str(path)], capture_output=True, text=True
    )
    return result.returncode, json.loads(result.stdout) if result.stdout else {}, result.stderr


def test_a_status_that_is_an_array_or_a_key_value_list_is_reported_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    statuses = (
        {"arrayValue": {"values": [{"boolValue": True}, {"boolValue": False}]}},
        {"kvlistValue": {"values": [{"key": "a", "value": {"stringValue": "ok"}}]}},
    )
    with path.open("w") as out:
        for status in statuses:
            out.write(json.dumps(request([*PAYMENT, ("agent.action.status", status)])) + "\n")
    code, report, stderr = check_file(path)
    assert "Traceback" not in stderr
    assert code == 1
    assert [(v["line"], v["rule"]) for v in report["violations"]] == [
        (1, "missing-field"),
        (2, "missing-field"),
    ]


# -- the reader never raises, whatever the values --------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["3", "-1", "3.0", "1e2", "NaN", "Infinity", "2", "STATUS_CODE_ERROR", "eyJhIjoxfQ=="]),
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)
any_values = st.recursive(
    st.one_of(
        st.builds(
            lambda kind, inner: {kind: inner},
            st.sampled_from(["stringValue", "boolValue", "intValue", "doubleValue", "bytesValue"]),
            json_values,
        ),
        json_values,
    ),
    lambda children: st.one_of(
        st.builds(lambda values: {"arrayValue": {"values": values}}, st.lists(children, max_size=3)),
        st.builds(
            lambda values: {"kvlistValue": {"values": [{"key": k, "value": v} for k, v in values]}},
            st.lists(st.tuples(st.text(max_size=3), children), max_size=3),
        ),
    ),
    max_leaves=6,
)
FIELDS = ["status", "max_attempts", "attempts", "retryable", "result", "result_digest", "kind", "id", "ttl_s"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    st.dictionaries(st.sampled_from(FIELDS), any_values, max_size=5),
    st.one_of(st.none(), json_values),
    st.one_of(st.none(), json_values),
)
def test_the_reader_reports_every_value_and_never_raises(
    values: dict[str, Any], status_code: Any, start: Any
) -> None:
    fields: dict[str, Any] = {"status": {"code": status_code}}
    if start is not None:
        fields["startTimeUnixNano"] = start
    document = request([*PAYMENT, *((f"agent.action.{k}", v) for k, v in values.items())], **fields)
    checker = Checker(select_rules("all"))
    for item in read(document):
        if type(item) is readers.Unreadable:
            assert item.reason
            continue
        checker.feed(*item)  # type: ignore[misc]
    checker.finish()
