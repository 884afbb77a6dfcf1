"""``durable-sessions check`` output formats and options, run as the installed command."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable_sessions.report import dump_json
from durable_sessions.rules import CATALOGUE

DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")
DEMO_TRACE = Path("/work/shared/seed/observability-tracing/demo-run-001.jsonl")
VIOLATION_KEYS = {"rule", "severity", "session_id", "action_id", "file", "line", "message"}
# The seed's rules, and invalid-field, which --rules seed runs on kind and status (as replay-check).
SEED_RULES = {rule.id for rule in CATALOGUE if rule.seed and not rule.strict_only} | {"invalid-field"}
ALL_RULES = {rule.id for rule in CATALOGUE if not rule.strict_only}


def ds(*args: str | Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(DURABLE_SESSIONS), *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result


def check_json(*args: str | Path) -> tuple[int, dict[str, Any]]:
    result = ds("check", "--format", "json", *args)
    return result.returncode, one_json_document(result.stdout)


def one_json_document(text: str) -> Any:
    """The single JSON document ``text`` holds (nothing before or after it)."""
    decoder = json.JSONDecoder()
    document, end = decoder.raw_decode(text.lstrip())
    assert text.lstrip()[end:].strip() == "", "more than one JSON document on stdout"
    return document


def rec(
    action_id: str, kind: str = "payment", status: str = "ok", session: str = "s-1", **fields: Any
) -> str:
    return json.dumps(
        {"session_id": session, "action_id": action_id, "kind": kind, "status": status, **fields}
    )


def write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def mixed_log(tmp_path: Path) -> Path:
    """Errors of several kinds, including ones without an action id."""
    return write(
        tmp_path / "mixed.jsonl",
        rec("a1"),  # 1 unkeyed-side-effect
        rec("a2", kind="llm_call"),  # 2 unrecorded-result
        '{"session_id": "s-1", "action_id": ',  # 3 unreadable-line
        rec("a4", status="started"),  # 4 unresolved-side-effect, at session end
        json.dumps({"session_id": "s-1", "kind": "llm_call", "status": "ok"}),  # 5 missing-field
        rec("a6", kind="llm_call", result={"plan": "A"}),  # 6 clean
    )


# -- --format json ------------------------------------------------------------------------


def test_json_document_shape(mixed_log: Path) -> None:
    code, doc = check_json(mixed_log)
    assert code == 1
    assert set(doc) == {"ok", "actions", "sessions", "violations"}
    assert doc["ok"] is False
    assert doc["actions"] == 6
    assert doc["sessions"] == 1
    for violation in doc["violations"]:
        assert set(violation) == VIOLATION_KEYS
        assert violation["severity"] in ("error", "warning")
        assert violation["rule"] in CATALOGUE
        assert isinstance(violation["message"], str) and violation["message"]
        assert violation["file"] == str(mixed_log)
        assert violation["line"] is None or type(violation["line"]) is int
        assert violation["action_id"] is None or isinstance(violation["action_id"], str)
    assert [(v["line"], v["rule"], v["action_id"]) for v in doc["violations"]] == [
        (1, "unkeyed-side-effect", "a1"),
        (2, "unrecorded-result", "a2"),
        (3, "unreadable-line", None),
        (5, "missing-field", None),
        (4, "unresolved-side-effect", "a4"),
    ]
    unreadable = doc["violations"][2]
    assert unreadable["session_id"] is None
    assert doc["violations"][3]["session_id"] == "s-1"
    assert "required field 'action_id' missing" in doc["violations"][3]["message"]


def test_json_clean_log(tmp_path: Path) -> None:
    log = write(tmp_path / "clean.jsonl", rec("a1", idempotency_key="pay-s-1-a1"))
    code, doc = check_json(log)
    assert code == 0
    assert doc == {"ok": True, "actions": 1, "sessions": 1, "violations": []}


def test_json_with_no_actions_is_still_one_document(tmp_path: Path) -> None:
    log = write(tmp_path / "empty.jsonl", "# nothing here")
    result = ds("check", "--format", "json", log)
    assert result.returncode == 0
    assert one_json_document(result.stdout) == {"ok": True, "actions": 0, "sessions": 0, "violations": []}
    assert "no actions" in result.stderr


def test_json_matches_text(mixed_log: Path) -> None:
    """Both formats report the same violations at the same places."""
    _, doc = check_json(mixed_log)
    text = ds("check", mixed_log).stdout
    for v in doc["violations"]:
        assert f"{v['file']}:{v['line']}: {v['severity']}[{v['rule']}]" in text
        assert v["message"] in text


# -- --format sarif -----------------------------------------------------------------------

SARIF_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["version", "runs"],
    "properties": {
        "version": {"const": "2.1.0"},
        "runs": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["tool", "results"],
                "properties": {
                    "tool": {
                        "type": "object",
                        "required": ["driver"],
                        "properties": {
                            "driver": {
                                "type": "object",
                                "required": ["name", "rules"],
                                "properties": {
                                    "name": {"type": "string", "minLength": 1},
                                    "rules": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "required": ["id"],
                                            "properties": {"id": {"type": "string", "minLength": 1}},
                                        },
                                    },
                                },
                            }
                        },
                    },
                    "results": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["ruleId", "level", "message", "locations"],
                            "properties": {
                                "ruleId": {"type": "string"},
                                "level": {"enum": ["none", "note", "warning", "error"]},
                                "message": {
                                    "type": "object",
                                    "required": ["text"],
                                    "properties": {"text": {"type": "string", "minLength": 1}},
                                },
                                "locations": {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": {
                                        "type": "object",
                                        "required": ["physicalLocation"],
                                        "properties": {
                                            "physicalLocation": {
                                                "type": "object",
                                                "required": ["artifactLocation", "region"],
                                                "properties": {
                                                    "artifactLocation": {
                                                        "type": "object",
                                                        "required": ["uri"],
                                                        "properties": {
                                                            "uri": {"type": "string", "minLength": 1}
                                                        },
                                                    },
                                                    "region": {
                                                        "type": "object",
                                                        "required": ["startLine"],
                                                        "properties": {
                                                            "startLine": {"type": "integer", "minimum": 1}
                                                        },
                                                    },
                                                },
                                            }
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def validate_sarif(doc: dict[str, Any]) -> None:
    """Check ``doc`` against SARIF_SCHEMA: with jsonschema when installed, and by hand always."""
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.validate(doc, SARIF_SCHEMA)
    assert doc["version"] == "2.1.0"
    assert isinstance(doc["runs"], list) and doc["runs"]
    run = doc["runs"][0]
    assert isinstance(run["tool"]["driver"]["name"], str) and run["tool"]["driver"]["name"]
    for rule in run["tool"]["driver"]["rules"]:
        assert isinstance(rule["id"], str) and rule["id"]
    for result in run["results"]:
        assert isinstance(result["ruleId"], str)
        assert result["level"] in ("none", "note", "warning", "error")
        assert isinstance(result["message"]["text"], str) and result["message"]["text"]
        assert result["locations"]
        for location in result["locations"]:
            physical = location["physicalLocation"]
            assert (
                isinstance(physical["artifactLocation"]["uri"], str) and physical["artifactLocation"]["uri"]
            )
            assert type(physical["region"]["startLine"]) is int and physical["region"]["startLine"] >= 1


def check_sarif(*args: str | Path) -> tuple[int, dict[str, Any]]:
    result = ds("check", "--format", "sarif", *args)
    return result.returncode, one_json_document(result.stdout)


def test_sarif_is_valid_and_matches_json(mixed_log: Path) -> None:
    code, sarif = check_sarif(mixed_log)
    assert code == 1
    validate_sarif(sarif)
    run = sarif["runs"][0]
    assert run["tool"]["driver"]["name"] == "durable-sessions"
    rule_ids = [rule["id"] for rule in run["tool"]["driver"]["rules"]]
    assert set(rule_ids) == ALL_RULES
    _, doc = check_json(mixed_log)
    assert len(run["results"]) == len(doc["violations"])
    for result, violation in zip(run["results"], doc["violations"], strict=True):
        assert result["ruleId"] == violation["rule"]
        assert rule_ids[result["ruleIndex"]] == result["ruleId"]
        assert result["level"] == violation["severity"]
        assert result["message"]["text"] == violation["message"]
        physical = result["locations"][0]["physicalLocation"]
        assert physical["artifactLocation"]["uri"] == Path(mixed_log).as_uri()
        assert physical["region"]["startLine"] == violation["line"]


def test_sarif_levels_and_rules_follow_the_selection(tmp_path: Path) -> None:
    log = write(
        tmp_path / "loop.jsonl",
        *(rec(f"b{i}", kind="tool_call", status="error", name="book") for i in range(1, 6)),
    )
    code, sarif = check_sarif("--rules", "seed", log)
    validate_sarif(sarif)
    assert code == 0
    assert {rule["id"] for rule in sarif["runs"][0]["tool"]["driver"]["rules"]} == SEED_RULES
    assert sarif["runs"][0]["results"] == []
    code, sarif = check_sarif(log)
    validate_sarif(sarif)
    assert code == 0
    [result] = sarif["runs"][0]["results"]
    assert (result["ruleId"], result["level"]) == ("disguised-retry-loop", "warning")
    assert result["locations"][0]["physicalLocation"]["region"]["startLine"] == 5


def test_sarif_with_no_violations(tmp_path: Path) -> None:
    log = write(tmp_path / "clean.jsonl", rec("a1", idempotency_key="pay-s-1-a1"))
    code, sarif = check_sarif(log)
    assert code == 0
    validate_sarif(sarif)
    assert sarif["runs"][0]["results"] == []


# -- --fail-on ----------------------------------------------------------------------------


def test_fail_on_warning(tmp_path: Path) -> None:
    log = write(
        tmp_path / "loop.jsonl",
        *(rec(f"b{i}", kind="tool_call", status="error", name="book") for i in range(1, 6)),
    )
    default = ds("check", log)
    assert default.returncode == 0
    assert "warning[disguised-retry-loop]" in default.stdout
    assert "durable-sessions OK: 0 error(s), 1 warning(s)" in default.stdout
    strict = ds("check", "--fail-on", "warning", log)
    assert strict.returncode == 1
    assert "durable-sessions FAIL: 0 error(s), 1 warning(s)" in strict.stdout
    code, doc = check_json("--fail-on", "warning", log)
    assert code == 1 and doc["ok"] is False
    code, doc = check_json(log)
    assert code == 0 and doc["ok"] is True and len(doc["violations"]) == 1


def test_fail_on_warning_with_a_clean_log(tmp_path: Path) -> None:
    log = write(tmp_path / "clean.jsonl", rec("a1", idempotency_key="pay-s-1-a1"))
    assert ds("check", "--fail-on", "warning", log).returncode == 0


def test_fail_on_rejects_unknown_level(tmp_path: Path) -> None:
    log = write(tmp_path / "clean.jsonl", rec("a1", idempotency_key="pay-s-1-a1"))
    result = ds("check", "--fail-on", "info", log)
    assert result.returncode == 2
    assert "--fail-on" in result.stderr


# -- rule selection -----------------------------------------------------------------------


@pytest.fixture
def beyond_seed_log(tmp_path: Path) -> Path:
    """One seed violation, and two that only rules outside the seed set see."""
    return write(
        tmp_path / "beyond.jsonl",
        rec("a1"),  # unkeyed-side-effect (seed)
        rec("a2", idempotency_key="pay-1764581640123"),  # time-derived-key
        rec("a3", kind="tool_call", status="error", retryable="yes"),  # invalid-field
    )


def test_rules_seed_runs_only_seed_rules(beyond_seed_log: Path) -> None:
    _, everything = check_json(beyond_seed_log)
    assert {(v["line"], v["rule"]) for v in everything["violations"]} == {
        (1, "unkeyed-side-effect"),
        (2, "time-derived-key"),
        (3, "invalid-field"),
    }
    code, seed = check_json("--rules", "seed", beyond_seed_log)
    assert code == 1
    assert [(v["line"], v["rule"]) for v in seed["violations"]] == [(1, "unkeyed-side-effect")]
    assert {v["rule"] for v in seed["violations"]} <= SEED_RULES


def test_rules_unknown_preset_is_a_usage_error(beyond_seed_log: Path) -> None:
    result = ds("check", "--rules", "bogus", beyond_seed_log)
    assert result.returncode == 2
    assert "--rules" in result.stderr


def test_disable_rule(beyond_seed_log: Path) -> None:
    code, doc = check_json("--disable", "unkeyed-side-effect", beyond_seed_log)
    assert code == 1
    assert {v["rule"] for v in doc["violations"]} == {"time-derived-key", "invalid-field"}
    code, doc = check_json(
        "--disable",
        "unkeyed-side-effect",
        "--disable",
        "time-derived-key",
        "--disable",
        "invalid-field",
        beyond_seed_log,
    )
    assert code == 0
    assert doc["violations"] == [] and doc["ok"] is True


def test_disable_unreadable_line_still_counts_the_line(tmp_path: Path) -> None:
    log = write(tmp_path / "bad.jsonl", "{not json", rec("a2", idempotency_key="k-a2"))
    code, doc = check_json("--disable", "unreadable-line", log)
    assert code == 0
    assert doc["violations"] == []
    assert doc["actions"] == 2


def test_disable_unknown_rule_is_a_usage_error(beyond_seed_log: Path) -> None:
    result = ds("check", "--disable", "no-such-rule", beyond_seed_log)
    assert result.returncode == 2
    assert "unknown rule 'no-such-rule'" in result.stderr
    assert "--disable" in result.stderr
    assert result.stdout == ""


# -- --key-window-s -----------------------------------------------------------------------


@pytest.fixture
def two_hour_resend(tmp_path: Path) -> Path:
    return write(
        tmp_path / "resend.jsonl",
        rec("a1", status="started", idempotency_key="pay-s-1-a1", ts="2026-11-01T09:00:00Z"),
        rec("a1", idempotency_key="pay-s-1-a1", ts="2026-11-01T11:00:00Z"),
    )


def test_key_window(two_hour_resend: Path) -> None:
    code, doc = check_json(two_hour_resend)
    assert code == 0 and doc["violations"] == []
    code, doc = check_json("--key-window-s", "3600", two_hour_resend)
    assert code == 0  # a warning
    [violation] = doc["violations"]
    assert (violation["rule"], violation["severity"], violation["line"]) == (
        "key-outlived-window",
        "warning",
        2,
    )
    assert "re-sent 2.0 h after its first use, beyond the 1 h key window" in violation["message"]
    code, doc = check_json("--key-window-s", "7200", two_hour_resend)
    assert doc["violations"] == []  # exactly at the window is inside it
    code, doc = check_json("--key-window-s", "7199.5", two_hour_resend)
    assert [v["rule"] for v in doc["violations"]] == ["key-outlived-window"]


@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon"])
def test_key_window_must_be_positive(two_hour_resend: Path, value: str) -> None:
    result = ds("check", "--key-window-s", value, two_hour_resend)
    assert result.returncode == 2
    assert "--key-window-s" in result.stderr


# -- several files are one stream ----------------------------------------------------------


def test_files_are_one_stream(tmp_path: Path) -> None:
    first = write(
        tmp_path / "run-1.jsonl",
        "# process run 1",
        rec("a1", kind="llm_call", result={"plan": "A"}),
        rec("p1", status="started", idempotency_key=None),
    )
    second = write(
        tmp_path / "run-2.jsonl",
        rec("a1", kind="llm_call", session="s-2", result={"plan": "A"}),  # other session: fine
        rec("a1", kind="clock", result={"now": 1}),  # same session, same id, other kind
        rec("p1", idempotency_key="pay-s-1-p1"),  # completes the payment started in run-1
    )
    code, doc = check_json(first, second)
    assert code == 1
    assert doc["actions"] == 5 and doc["sessions"] == 2
    assert [(v["file"], v["line"], v["rule"], v["session_id"]) for v in doc["violations"]] == [
        (str(second), 2, "duplicate-action-id", "s-1"),
    ]
    message = doc["violations"][0]["message"]
    assert f"first at {first}:2 as 'llm_call', now 'clock'" in message


def test_files_alone_miss_what_the_stream_sees(tmp_path: Path) -> None:
    first = write(tmp_path / "run-1.jsonl", rec("p1", status="started", idempotency_key=None))
    second = write(tmp_path / "run-2.jsonl", rec("p1", idempotency_key="pay-s-1-p1"))
    code, doc = check_json(first)
    assert code == 1
    assert [(v["file"], v["line"], v["rule"]) for v in doc["violations"]] == [
        (str(first), 1, "unresolved-side-effect")
    ]
    code, doc = check_json(first, second)
    assert code == 0, doc


def test_duplicate_across_files_with_same_kind(tmp_path: Path) -> None:
    first = write(
        tmp_path / "a.jsonl", rec("x", kind="llm_call", result=1), rec("y", kind="llm_call", result=2)
    )
    second = write(tmp_path / "b.jsonl", "", rec("y", kind="llm_call", result=3))
    result = ds("check", first, second)
    assert result.returncode == 1
    assert f"{second}:2: error[duplicate-action-id] s-1/y: duplicate action_id 'y' (first at {first}:2)" in (
        result.stdout
    )


# -- observability-tracing input -------------------------------------------------------------


def event(kind: str, span: str, step: int, status: str = "ok", **extra: Any) -> str:
    base = {
        "trace_id": "run-1",
        "ts": f"2026-07-05T10:00:{step:02d}Z",
        "kind": kind,
        "span": span,
        "step": step,
        "agent": "writer",
        "tool": None,
        "status": status,
        "input_tokens": 0,
        "output_tokens": 0,
        "parent": None if span == "root" else "root",
    }
    return json.dumps({**base, **extra})


@pytest.fixture
def tracing_log(tmp_path: Path) -> Path:
    return write(
        tmp_path / "trace.jsonl",
        event("trace_start", "root", 0, "started"),
        event("step_complete", "s1", 1, meta={"result_ref": "blob://run-1/s1.json", "confidence": 9}),  # 2 ok
        event("step_complete", "s2", 2, meta={"event": "DONE", "confidence": 80}),  # 3 unrecorded-result
        event("tool_call", "t1", 3, "started", tool="charge_card", meta={"action_kind": "payment"}),  # 4
        event("tool_result", "t1", 4, tool="charge_card", meta={"action_kind": "payment"}),  # 5 unkeyed
        event(
            "tool_call",
            "t2",
            5,
            tool="send_email",
            meta={"action_kind": "email", "idempotency_key": "run-1-t2"},
        ),  # 6 ok
        event("tool_result", "t2", 6, tool="send_email", status="error", error="late"),  # 7 dropped
        event("step_start", "s3", 7, "started"),  # 8 no action
        event("error", "s3", 8, "error", error="boom"),  # 9 no action
        event("step_complete", "s4", 9, "skipped"),  # 10 no action
        event("trace_end", "root", 10),
    )


TRACING_EXPECTED = [
    (3, "unrecorded-result", "run-1", "s2"),
    (5, "unkeyed-side-effect", "run-1", "t1"),
]


@pytest.mark.parametrize("input_format", [[], ["--input-format", "auto"], ["--input-format", "tracing"]])
def test_tracing_log(tracing_log: Path, input_format: list[str]) -> None:
    code, doc = check_json(*input_format, tracing_log)
    assert code == 1
    assert [
        (v["line"], v["rule"], v["session_id"], v["action_id"]) for v in doc["violations"]
    ] == TRACING_EXPECTED
    assert doc["actions"] == 5  # s1, s2, t1 started, t1 ok, t2
    assert doc["sessions"] == 1
    assert "non-deterministic kind 'llm_call' has no recorded result" in doc["violations"][0]["message"]
    assert "side-effecting kind 'payment'" in doc["violations"][1]["message"]


def test_tracing_log_read_as_actions_is_wrong(tracing_log: Path) -> None:
    """Forcing the action format shows detection matters: no event has an action_id."""
    code, doc = check_json("--input-format", "actions", tracing_log)
    assert code == 1
    assert {v["rule"] for v in doc["violations"]} == {"missing-field"}
    assert doc["sessions"] == 0


def test_action_log_read_as_tracing_finds_nothing(tmp_path: Path) -> None:
    log = write(tmp_path / "actions.jsonl", rec("a1"))
    code, doc = check_json("--input-format", "tracing", log)
    assert (code, doc["actions"], doc["violations"]) == (0, 0, [])
    code, doc = check_json(log)
    assert code == 1
    assert [v["rule"] for v in doc["violations"]] == ["unkeyed-side-effect"]


def test_tracing_and_action_logs_together(tracing_log: Path, tmp_path: Path) -> None:
    actions = write(tmp_path / "actions.jsonl", "# an action log", rec("a1"))
    code, doc = check_json(actions, tracing_log)
    assert code == 1
    assert [(v["file"], v["line"], v["rule"]) for v in doc["violations"]] == [
        (str(actions), 2, "unkeyed-side-effect"),
        *((str(tracing_log), line, rule) for line, rule, _, _ in TRACING_EXPECTED),
    ]


def test_tracing_log_with_a_comment_and_blank_first(tracing_log: Path, tmp_path: Path) -> None:
    log = tmp_path / "commented.jsonl"
    log.write_text("# exported by the tracer\n\n" + tracing_log.read_text())
    code, doc = check_json(log)
    assert code == 1
    assert [(v["line"] - 2, v["rule"]) for v in doc["violations"]] == [
        (ln, r) for ln, r, _, _ in TRACING_EXPECTED
    ]


def test_tracing_auto_detection_with_a_long_first_event(tmp_path: Path) -> None:
    """Regression: detection once saw only the first 8 KiB (the file's read buffer)."""
    long_meta = {"result_ref": "blob://run-1/s1.json", "labels": ["x" * 100] * 100}
    log = write(
        tmp_path / "long.jsonl",
        event("step_complete", "s1", 1, meta=long_meta),
        event("step_complete", "s2", 2, meta={}),
    )
    assert len(log.read_text().splitlines()[0]) > 8192
    code, doc = check_json(log)
    assert code == 1
    assert [(v["line"], v["rule"]) for v in doc["violations"]] == [(2, "unrecorded-result")]


@pytest.mark.skipif(not DEMO_TRACE.exists(), reason=f"{DEMO_TRACE} is not present (shared seed not mounted)")
@pytest.mark.parametrize("input_format", [[], ["--input-format", "tracing"]])
def test_seed_demo_trace(input_format: list[str]) -> None:
    code, doc = check_json(*input_format, DEMO_TRACE)
    assert code == 1
    assert doc["actions"] == 4 and doc["sessions"] == 1
    assert [(v["line"], v["rule"], v["session_id"], v["action_id"]) for v in doc["violations"]] == [
        (2, "unrecorded-result", "demo-run-001", "s1"),
        (4, "unrecorded-result", "demo-run-001", "s2"),
        (5, "unrecorded-result", "demo-run-001", "s3"),
    ]


def test_sarif_uri_of_a_relative_path_is_percent_encoded(tmp_path: Path) -> None:
    """A relative path with a space or '#' must still be a valid URI reference."""
    (tmp_path / "my logs #1").mkdir()
    log = tmp_path / "my logs #1" / "s.jsonl"
    log.write_text('{"session_id":"s","action_id":"a","kind":"payment","status":"ok"}\n')
    result = subprocess.run(
        [str(DURABLE_SESSIONS), "check", "--format", "sarif", "my logs #1/s.jsonl"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    [found] = json.loads(result.stdout)["runs"][0]["results"]
    assert found["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "my%20logs%20%231/s.jsonl"


_JSON_VALUES = st.recursive(
    st.one_of(st.text(), st.integers(), st.booleans(), st.none()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "300")), deadline=None)
@given(st.dictionaries(st.text(max_size=8), _JSON_VALUES, max_size=5))
def test_json_output_is_the_text_json_dumps_writes(document: dict[str, Any]) -> None:
    out = io.StringIO()
    dump_json(document, out)
    assert out.getvalue() == json.dumps(document, indent=2, ensure_ascii=False) + "\n"
