"""Every rule of the catalogue, on its example logs and on the subtle cases.

``examples/rules/<rule-id>.bad.jsonl`` is a small session that breaks the rule: each line
that breaks it carries ``_fails_because``. ``<rule-id>.good.jsonl`` is the same session
with the fix applied, and is clean under every rule with strict checking on.
"""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from durable_sessions.check import check_paths
from durable_sessions.digest import digest_value
from durable_sessions.engine import Checker
from durable_sessions.record import line_location
from durable_sessions.rules import CATALOGUE, rule_references, rules_from_references, select_rules
from durable_sessions.rules.record_rules import describe, time_component
from durable_sessions.rules.state import DEFAULT_KEY_WINDOW_S, _pack_attempts, _unpack_attempts
from durable_sessions.violation import Severity, Violation
from tests.support.rule_examples import unexpected_rules

ROOT = Path(__file__).resolve().parents[1]
RULE_EXAMPLES = ROOT / "examples" / "rules"
SEED_GOOD = ROOT.parent / "shared" / "seed" / "durable-sessions" / "examples" / "actions.good.jsonl"
DURABLE_SESSIONS = Path(sys.executable).with_name("durable-sessions")
RULE_IDS = [rule.id for rule in CATALOGUE]


# -- helpers -----------------------------------------------------------------------------


def check_file(path: Path, *, strict: bool = True) -> list[Violation]:
    checker = Checker(select_rules("all", strict=strict))
    return list(check_paths([str(path)], checker, fmt="actions"))


def check_records(
    records: Iterable[dict[str, Any]], *, strict: bool = False, key_window_s: float = DEFAULT_KEY_WINDOW_S
) -> list[Violation]:
    """Check records as lines 1, 2, … of a log, then end every session."""
    checker = Checker(select_rules("all", strict=strict), key_window_s=key_window_s)
    violations = []
    for number, record in enumerate(records, 1):
        violations.extend(checker.feed(record, line_location("test.jsonl", number)))
    violations.extend(checker.finish())
    return violations


def R(
    action_id: str, kind: str, status: str = "ok", *, session: str = "s-1", **fields: Any
) -> dict[str, Any]:
    """An action record in session ``session``."""
    return {"session_id": session, "action_id": action_id, "kind": kind, "status": status, **fields}


def of(rule_id: str, violations: Iterable[Violation]) -> list[Violation]:
    return [v for v in violations if v.rule == rule_id]


def summary(violations: Iterable[Violation]) -> list[tuple[int | None, str, str]]:
    return [(v.line, v.rule, v.severity.value) for v in violations]


def failing_lines(path: Path) -> dict[int, str]:
    """``{line: reason}`` for the lines of an example that carry ``_fails_because``.

    A line that is not a JSON object (the unreadable-line example) counts when its text
    holds a ``"_fails_because"`` member.
    """
    lines: dict[int, str] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if isinstance(value, dict):
            if "_fails_because" in value:
                lines[number] = value["_fails_because"]
        elif '"_fails_because":"' in text:
            lines[number] = text.split('"_fails_because":"', 1)[1].split('"', 1)[0]
    return lines


def session_ids(path: Path) -> set[str]:
    ids = set()
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            value = json.loads(raw)
        except ValueError:
            continue
        if isinstance(value, dict) and isinstance(value.get("session_id"), str):
            ids.add(value["session_id"])
    return ids


def example(rule_id: str, which: str) -> Path:
    path = RULE_EXAMPLES / f"{rule_id}.{which}.jsonl"
    assert path.is_file(), f"rule {rule_id} has no {which} example: expected {path}"
    return path


# -- the per-rule examples ---------------------------------------------------------------


def test_examples_exist_only_for_catalogued_rules() -> None:
    names = sorted(path.name for path in RULE_EXAMPLES.iterdir())
    expected = sorted(f"{rule_id}.{which}.jsonl" for rule_id in RULE_IDS for which in ("bad", "good"))
    assert names == expected


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_bad_example_triggers_its_rule_on_every_failing_line(rule_id: str) -> None:
    path = example(rule_id, "bad")
    failing = failing_lines(path)
    assert failing, f"{path.name} has no line with _fails_because"
    assert all(reason.strip() for reason in failing.values()), "every _fails_because needs a reason"
    violations = check_file(path)
    hit = {v.line for v in of(rule_id, violations)}
    missed = {line: reason for line, reason in failing.items() if line not in hit}
    assert not missed, f"{rule_id} does not fire on {missed}; found {summary(violations)}"


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_bad_example_breaks_rules_only_on_its_failing_lines(rule_id: str) -> None:
    path = example(rule_id, "bad")
    failing = failing_lines(path)
    stray = [v for v in check_file(path) if v.line not in failing]
    assert not stray, f"violations on lines without _fails_because: {summary(stray)}"


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_bad_example_breaks_no_other_rule(rule_id: str) -> None:
    violations = check_file(example(rule_id, "bad"))
    others = unexpected_rules(rule_id, {v.rule for v in violations})
    assert not others, f"{rule_id}.bad.jsonl also breaks {sorted(others)}: {summary(violations)}"


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_good_example_is_clean_under_every_rule_with_strict(rule_id: str) -> None:
    path = example(rule_id, "good")
    violations = check_file(path, strict=True)
    assert not violations, summary(violations)
    assert not failing_lines(path), "a good example has no line with _fails_because"


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_good_example_is_the_bad_session_fixed(rule_id: str) -> None:
    assert session_ids(example(rule_id, "good")) == session_ids(example(rule_id, "bad"))


def test_cli_passes_all_good_examples_and_fails_all_bad_ones_with_every_rule() -> None:
    good = sorted(str(p) for p in RULE_EXAMPLES.glob("*.good.jsonl"))
    bad = sorted(str(p) for p in RULE_EXAMPLES.glob("*.bad.jsonl"))
    run = [str(DURABLE_SESSIONS), "check", "--strict", "--fail-on", "warning", "--format", "json"]
    passed = subprocess.run([*run, *good], capture_output=True, text=True, encoding="utf-8", timeout=60)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    document = json.loads(passed.stdout)
    assert document["ok"] is True and document["violations"] == []
    assert document["sessions"] == len(RULE_IDS)
    failed = subprocess.run([*run, *bad], capture_output=True, text=True, encoding="utf-8", timeout=60)
    assert failed.returncode == 1, failed.stderr
    assert {v["rule"] for v in json.loads(failed.stdout)["violations"]} == set(RULE_IDS)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(SEED_GOOD, id="seed"),
        pytest.param(ROOT / "examples" / "logs" / "actions.good.jsonl", id="project"),
        pytest.param(ROOT / "examples" / "logs" / "booking-recoverable.jsonl", id="booking"),
    ],
)
def test_good_fixture_is_clean_under_every_rule_with_strict(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"the seed's good fixture is expected at {path}")
    result = subprocess.run(
        [str(DURABLE_SESSIONS), "check", "--strict", "--fail-on", "warning", str(path)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "durable-sessions OK: 0 error(s), 0 warning(s)" in result.stdout


# -- duplicate-action-id ---------------------------------------------------------------


def test_same_action_id_in_two_sessions_is_not_a_duplicate() -> None:
    records = [
        R("a01", "llm_call", result={"x": 1}, session="s-1"),
        R("a01", "llm_call", result={"x": 2}, session="s-2"),
    ]
    assert check_records(records) == []
    same_session = [R("a01", "llm_call", result={"x": 1}), R("a01", "llm_call", result={"x": 2})]
    assert summary(check_records(same_session)) == [(2, "duplicate-action-id", "error")]


def test_attempts_of_a_retryable_action_are_not_duplicates() -> None:
    retry = {"retryable": True, "max_attempts": 3}
    attempts = [
        R("a04", "tool_call", "error", attempts=1, **retry),
        R("a04", "tool_call", "ok", attempts=2, **retry),
    ]
    assert check_records(attempts) == []
    same_attempt = [
        R("a04", "tool_call", "error", attempts=1, **retry),
        R("a04", "tool_call", "ok", attempts=1, **retry),
    ]
    assert summary(check_records(same_attempt)) == [(2, "duplicate-action-id", "error")]


def test_a_record_without_attempts_is_the_first_attempt_of_its_action() -> None:
    """The instrumentation writes attempts from the second attempt on."""
    retry = {"retryable": True, "max_attempts": 3, "on_failure": "ask_user"}
    first_then_second = [R("a04", "tool_call", "error", **retry), R("a04", "tool_call", attempts=2, **retry)]
    assert check_records(first_then_second) == []
    # The first attempt arriving after the second (a batch delivered again) is no duplicate.
    late_first = [R("a04", "tool_call", attempts=2, **retry), R("a04", "tool_call", "error", **retry)]
    assert check_records(late_first) == []
    # Attempt 1 twice, once without saying so, is.
    twice = [R("a04", "tool_call", "error", **retry), R("a04", "tool_call", attempts=1, **retry)]
    assert summary(check_records(twice)) == [(2, "duplicate-action-id", "error")]


@pytest.mark.parametrize(
    ("kind", "fields", "rule", "severity"),
    [
        ("user_prompt", {"result": {"budget": 2400}}, "re-asked", "error"),
        ("llm_call", {"result": {"plan": "A"}}, "diverged-result", "error"),
        ("payment", {"idempotency_key": "pay-s-1-p"}, "re-executed-side-effect", "warning"),
        ("payment", {}, "re-executed-side-effect", "error"),
    ],
)
@pytest.mark.parametrize("first", [{"attempts": 1}, {}], ids=["attempt-1", "no-attempts"])
def test_an_attempt_after_a_completed_one_executes_the_action_again(
    kind: str, fields: dict[str, Any], rule: str, severity: str, first: dict[str, Any]
) -> None:
    """With no incarnations in the log (the seed's format), a retry of a completed action
    was neither a duplicate (a new attempt) nor a re-execution (same process): it passed.
    A first attempt need not say so (the instrumentation writes attempts from the second)."""
    retry = {"retryable": True, "max_attempts": 3, **fields}
    again = [R("a1", kind, "ok", **first, **retry), R("a1", kind, "ok", attempts=2, **retry)]
    found = [(line, rule_id, level) for line, rule_id, level in summary(check_records(again)) if line == 2]
    assert (2, rule, severity) in found and ("duplicate-action-id" not in {r for _, r, _ in found})
    message = next(v.message for v in check_records(again) if v.rule == rule)
    assert "at an earlier attempt was" in message and "again at attempt 2" in message
    after_a_failure = [R("a1", kind, "error", attempts=1, **retry), R("a1", kind, "ok", attempts=2, **retry)]
    assert [v for v in check_records(after_a_failure) if v.rule == rule] == []
    # The same two attempts arriving the other way round (spans of one batch, redelivered):
    # the earlier attempt is the past, not a re-run.
    late = [R("a1", kind, "ok", attempts=2, **retry), R("a1", kind, "error", attempts=1, **retry)]
    assert [v for v in check_records(late) if v.rule == rule] == []


def test_attempts_counted_afresh_by_a_later_incarnation_are_not_duplicates() -> None:
    """A resumed process retries an action from attempt 1 again: its attempt 2 is no
    duplicate of the dead process's attempt 2 (it was, line 4)."""
    retry = {"retryable": True, "max_attempts": 3}
    records = [
        R("t", "tool_call", "error", incarnation="run-1", **retry),
        R("t", "tool_call", "error", incarnation="run-1", attempts=2, **retry),
        R("t", "tool_call", "error", incarnation="run-2", **retry),
        R("t", "tool_call", "ok", incarnation="run-2", attempts=2, **retry),
    ]
    assert check_records(records) == []
    # within the resumed run, attempts are judged as in any run: attempt 2 twice is a
    # duplicate, and an attempt after the completed one executes it again
    twice = [*records[:3], R("t", "tool_call", "error", incarnation="run-2", attempts=2, **retry), records[3]]
    assert summary(check_records(twice)) == [(5, "duplicate-action-id", "error")]
    calls = [
        *(R("c", "llm_call", "error", incarnation="run-1", attempts=n, **retry) for n in (1, 2, 3)),
        R("c", "llm_call", incarnation="run-2", result={"plan": "A"}, **retry),
        R("c", "llm_call", incarnation="run-2", attempts=2, result={"plan": "B"}, **retry),
    ]
    [violation] = [v for v in check_records(calls) if v.rule != "retry-not-escalated"]
    assert (violation.line, violation.rule) == (5, "diverged-result")
    assert "at an earlier attempt was executed again at attempt 2" in violation.message


def test_attempts_of_an_action_that_is_not_retryable_are_duplicates() -> None:
    records = [
        R("a04", "tool_call", "error", attempts=1, on_failure="abort"),
        R("a04", "tool_call", "ok", attempts=2),
    ]
    assert summary(check_records(records)) == [(2, "duplicate-action-id", "error")]


def test_started_record_then_its_completion_is_not_a_duplicate() -> None:
    records = [
        R("a07", "payment", "started", idempotency_key="pay-s-1-a07"),
        R("a07", "payment", "ok", idempotency_key="pay-s-1-a07", result={"charge": "ch_1"}),
    ]
    assert check_records(records) == []
    completed_twice = [
        *records,
        R("a07", "payment", "ok", idempotency_key="pay-s-1-a07", result={"charge": "ch_1"}),
    ]
    assert summary(check_records(completed_twice)) == [(3, "duplicate-action-id", "error")]


def test_different_kinds_under_one_id_are_duplicates_even_in_another_incarnation() -> None:
    records = [
        R("a02", "llm_call", incarnation="run-1", result={"x": 1}),
        R("a02", "clock", incarnation="run-2", result={"now": "2026-11-01T09:14:00Z"}),
    ]
    [violation] = check_records(records)
    assert violation.rule == "duplicate-action-id" and violation.line == 2
    assert "first at line 1 as 'llm_call', now 'clock'" in violation.message


REPLAYABLE = [
    pytest.param(R("a01", "user_prompt", result={"budget": 2400}), "re-asked", id="user_prompt"),
    pytest.param(R("a02", "llm_call", result={"plan": "A"}), "diverged-result", id="llm_call"),
    pytest.param(R("a03", "external_read", result={"quotes": 3}), "diverged-result", id="external_read"),
    pytest.param(
        R("a07", "payment", idempotency_key="pay-s-1-a07", result={"charge": "ch_1"}),
        "re-executed-side-effect",
        id="payment",
    ),
    pytest.param(R("a08", "email", replay="skip", result=None), "re-executed-side-effect", id="email-skip"),
]


@pytest.mark.parametrize(("record", "rule_id"), REPLAYABLE)
def test_a_replayed_record_is_not_a_re_execution(record: dict[str, Any], rule_id: str) -> None:
    first = {**record, "incarnation": "run-1"}
    replayed = {**record, "incarnation": "run-2", "replayed": True}
    assert check_records([first, replayed], strict=True) == []


# One record per record rule that judges an execution, breaking it (and no other rule
# once replayed: a replay with the same key is no re-send).
EXECUTION_FLAWS = [
    pytest.param(
        R("b01", "user_prompt", prompt_digest="sha256:aa"), "unrecorded-answer", id="unrecorded-answer"
    ),
    pytest.param(R("b02", "llm_call"), "unrecorded-result", id="unrecorded-result"),
    pytest.param(R("b03", "payment", result={"charge": "ch_1"}), "unkeyed-side-effect", id="unkeyed"),
    pytest.param(
        R("b04", "tool_call", "error", retryable=True, attempts=1, on_failure="ask_user"),
        "unbounded-retry",
        id="unbounded-retry",
    ),
    pytest.param(
        R("b05", "tool_call", "error", max_attempts=3, attempts=7, on_failure="abort"),
        "retry-overrun",
        id="retry-overrun",
    ),
    pytest.param(
        R("b06", "user_prompt", result={"seat": "aisle"}, cacheable=True, cache_key="k", ttl_s=60),
        "cached-human-answer",
        id="cached-human-answer",
    ),
    pytest.param(
        R("b07", "external_read", result={"q": 2}, cacheable=True, ttl_s=60),
        "cache-without-key",
        id="cache-without-key",
    ),
    pytest.param(
        R("b07", "external_read", result={"q": 2}, cacheable=True, cache_key="q"),
        "cache-without-ttl",
        id="cache-without-ttl",
    ),
    pytest.param(R("b08", "tool_call", "error", retryable=False), "dead-end", id="dead-end"),
    pytest.param(
        R("b10", "payment", idempotency_key="pay-1764581640123", result={"charge": "ch_1"}),
        "time-derived-key",
        id="time-derived-key",
    ),
    pytest.param(
        R("b09", "tool_call", result={"n": 1}, value_limit=9, result_length=9),
        "truncated-result",
        id="truncated-result",
    ),
]


def _replay_of(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "incarnation": "run-2", "replayed": True}


@pytest.mark.parametrize(("record", "rule_id"), EXECUTION_FLAWS)
def test_a_replay_is_not_judged_again_for_how_the_action_executed(
    record: dict[str, Any], rule_id: str
) -> None:
    """A replayed record executed nothing: the flaw is reported once, on the execution."""
    original = {**record, "incarnation": "run-1"}
    violations = check_records([original, _replay_of(record)], strict=True)
    assert [(v.line, v.rule) for v in violations] == [(1, rule_id)]


@pytest.mark.parametrize(("record", "rule_id"), EXECUTION_FLAWS)
def test_a_replay_of_an_action_the_session_never_saw_is_judged(record: dict[str, Any], rule_id: str) -> None:
    """Its replayed record is all the session holds of the action, so its flaw is reported."""
    assert rule_id in {v.rule for v in check_records([_replay_of(record)], strict=True)}


@pytest.mark.parametrize(
    "replay",
    [
        pytest.param(R("b03", "payment", replayed=False, incarnation="run-2"), id="replayed-false"),
        pytest.param(R("b03", "payment", replayed="true", incarnation="run-2"), id="replayed-string"),
    ],
)
def test_only_replayed_true_is_a_replay(replay: dict[str, Any]) -> None:
    original = R("b03", "payment", incarnation="run-1", result={"charge": "ch_1"})
    lines = [v.line for v in of("unkeyed-side-effect", check_records([original, replay]))]
    assert lines == [1, 2]


def test_a_replay_does_not_share_a_key_again() -> None:
    """The action's own use of the shared key was reported; its replay sends nothing."""
    key = {"idempotency_key": "pay-s-1"}
    records = [
        R("a07", "payment", incarnation="run-1", result={"c": 1}, **key),
        R("a11", "payment", incarnation="run-1", result={"c": 2}, **key),
        R("a11", "payment", incarnation="run-2", replayed=True, result={"c": 2}, **key),
    ]
    assert summary(check_records(records)) == [(2, "shared-key", "error")]
    unseen = [records[0], {**records[2], "action_id": "a12"}]
    assert summary(check_records(unseen)) == [(2, "shared-key", "error")]


FIRST_SEEN_AS_A_REPLAY = [
    pytest.param(
        R("a01", "user_prompt", result={"budget_gbp": 2400}),
        R("a01", "user_prompt", result={"budget_gbp": 1800}),
        "re-asked",
        id="answer-asked-again",
    ),
    pytest.param(
        R("a02", "llm_call", result_digest="sha256:" + "a" * 64),
        R("a02", "llm_call", result_digest="sha256:" + "b" * 64),
        "diverged-result",
        id="model-called-again",
    ),
    pytest.param(
        R("a08", "email", replay="skip", result=None),
        R("a08", "email", replay="skip", result=None),
        "re-executed-side-effect",
        id="email-sent-again",
    ),
    pytest.param(
        R("a02", "llm_call", result_digest="sha256:" + "a" * 64),
        R("a02", "llm_call", result_digest="sha256:" + "b" * 64, replayed=True),
        "replay-mismatch",
        id="replayed-another-result",
    ),
]


@pytest.mark.parametrize("native", ["true", "false"])
@pytest.mark.parametrize(("served", "again", "rule_id"), FIRST_SEEN_AS_A_REPLAY)
def test_an_outcome_first_seen_in_a_replay_is_the_recorded_one(
    served: dict[str, Any], again: dict[str, Any], rule_id: str, native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log (or a process's spans) that begins after the action executed holds its replay
    only, which serves the outcome recorded then. The session kept no outcome from a
    replay, so executing the action again in a later run (asking the person, calling the
    model, sending the email again) or replaying another result passed unseen."""
    monkeypatch.setenv("DURABLE_SESSIONS_NATIVE", native)
    replay = {**served, "incarnation": "run-2", "replayed": True}
    later = {"incarnation": "run-3", **again}
    assert summary(check_records([replay, later])) == [(2, rule_id, "error")]


def test_a_replay_is_still_judged_for_its_own_fields() -> None:
    """invalid-field judges the record itself: the session rules read a replay's fields too."""
    original = R("a07", "payment", idempotency_key="pay-s-1-a07", result={"charge": "ch_1"})
    replay = {**_replay_of(original), "attempts": "2"}
    assert summary(check_records([original, replay])) == [(2, "invalid-field", "error")]


@pytest.mark.parametrize(("record", "rule_id"), REPLAYABLE)
def test_executing_again_in_a_later_incarnation_is_a_re_execution(
    record: dict[str, Any], rule_id: str
) -> None:
    first = {**record, "incarnation": "run-1"}
    again = {**record, "incarnation": "run-2"}
    violations = check_records([first, again], strict=True)
    assert [(v.line, v.rule) for v in violations] == [(2, rule_id)]
    assert "'run-1'" in violations[0].message and "'run-2'" in violations[0].message


def test_repeating_in_the_same_incarnation_is_a_duplicate_not_a_re_execution() -> None:
    records = [
        R("a01", "user_prompt", incarnation="run-1", result={"budget": 2400}),
        R("a01", "user_prompt", incarnation="run-1", result={"budget": 2000}),
    ]
    assert summary(check_records(records)) == [(2, "duplicate-action-id", "error")]


# -- re-asked / re-executed-side-effect / diverged-result / replay-mismatch --------------


def test_re_asked_under_a_new_id_is_found_by_prompt_digest() -> None:
    records = [
        R(
            "q1",
            "user_prompt",
            incarnation="run-1",
            prompt_digest="sha256:5d1c",
            result={"dates": "12-19 Dec"},
        ),
        R(
            "q7",
            "user_prompt",
            incarnation="run-2",
            prompt_digest="sha256:5d1c",
            result={"dates": "12-19 Dec"},
        ),
        R("q8", "user_prompt", incarnation="run-2", prompt_digest="sha256:77aa", result={"seat": "aisle"}),
    ]
    [violation] = check_records(records)
    assert (violation.rule, violation.line, violation.severity) == ("re-asked", 2, Severity.ERROR)
    assert "already answered as 'q1'" in violation.message


def test_same_prompt_digest_in_the_same_incarnation_is_not_a_re_ask() -> None:
    records = [
        R("q1", "user_prompt", incarnation="run-1", prompt_digest="sha256:5d1c", result={"ok": True}),
        R("q2", "user_prompt", incarnation="run-1", prompt_digest="sha256:5d1c", result={"ok": True}),
    ]
    assert check_records(records) == []


def test_an_unanswered_question_may_be_asked_again_after_a_restart() -> None:
    records = [
        R("q1", "user_prompt", "error", incarnation="run-1", on_failure="ask_user"),
        R("q1", "user_prompt", incarnation="run-2", result={"budget": 2400}),
    ]
    assert check_records(records, strict=True) == []


def _payment(incarnation: str, **fields: Any) -> dict[str, Any]:
    return R("a07", "payment", incarnation=incarnation, result={"charge": "ch_1"}, **fields)


@pytest.mark.parametrize(
    ("second", "severity", "phrase"),
    [
        pytest.param({}, Severity.ERROR, "without an idempotency key", id="no-key"),
        pytest.param(
            {"idempotency_key": "pay-s-1-a07-retry"},
            Severity.ERROR,
            "with a different idempotency key",
            id="other-key",
        ),
        pytest.param(
            {"idempotency_key": "pay-s-1-a07"},
            Severity.WARNING,
            "with the same idempotency key",
            id="same-key",
        ),
    ],
)
def test_re_executed_side_effect_severity_depends_on_the_key(
    second: dict[str, Any], severity: Severity, phrase: str
) -> None:
    records = [_payment("run-1", idempotency_key="pay-s-1-a07"), _payment("run-2", **second)]
    [violation] = of("re-executed-side-effect", check_records(records))
    assert (violation.line, violation.severity) == (2, severity)
    assert phrase in violation.message


def test_a_side_effect_marked_side_effects_is_judged_like_a_side_effecting_kind() -> None:
    first = R("a09", "tool_call", side_effects=True, incarnation="run-1", idempotency_key="book-s-1-a09")
    again = R("a09", "tool_call", side_effects=True, incarnation="run-2")
    assert ("re-executed-side-effect", Severity.ERROR) in [
        (v.rule, v.severity) for v in check_records([first, again])
    ]


def test_a_side_effect_that_failed_before_the_restart_may_run_again() -> None:
    records = [
        R(
            "a07",
            "payment",
            "error",
            incarnation="run-1",
            idempotency_key="pay-s-1-a07",
            retryable=True,
            max_attempts=3,
            attempts=1,
        ),
        R(
            "a07",
            "payment",
            incarnation="run-2",
            idempotency_key="pay-s-1-a07",
            retryable=True,
            max_attempts=3,
            attempts=1,
            result={"charge": "ch_1"},
        ),
    ]
    assert check_records(records) == []


LONG_PLAN = {"plan": [f"day {n}: a long description of what happens on day {n}" for n in range(1, 6)]}


@pytest.mark.parametrize(
    ("recorded", "now"),
    [
        pytest.param({"plan": "A"}, {"plan": "B"}, id="short"),
        pytest.param(LONG_PLAN, {"plan": LONG_PLAN["plan"][:4]}, id="long"),
    ],
)
def test_diverged_result_message_gives_both_digests(recorded: Any, now: Any) -> None:
    records = [
        R("a02", "llm_call", incarnation="run-1", result=recorded),
        R("a02", "llm_call", incarnation="run-2", result=now),
    ]
    [violation] = check_records(records)
    assert (violation.rule, violation.line) == ("diverged-result", 2)
    # The session keeps the first 16 hex digits of the recorded digest; the new one is whole.
    assert f"recorded {digest_value(recorded)[:23]}…, now {digest_value(now)}" in violation.message


def test_diverged_result_with_the_same_result_still_fires_without_digests() -> None:
    records = [
        R("a03", "external_read", incarnation="run-1", result={"quotes": 3}),
        R("a03", "external_read", incarnation="run-2", result={"quotes": 3}),
    ]
    [violation] = check_records(records)
    assert violation.rule == "diverged-result"
    assert "was executed again in" in violation.message and "sha256:" not in violation.message


def test_replay_mismatch_compares_a_given_digest_with_a_recorded_value() -> None:
    value = {"plan": "A"}
    same = [
        R("a02", "llm_call", incarnation="run-1", result=value),
        R("a02", "llm_call", incarnation="run-2", replayed=True, result_digest=digest_value(value)),
    ]
    assert check_records(same) == []
    other = [
        R("a02", "llm_call", incarnation="run-1", result_digest=digest_value(value)),
        R("a02", "llm_call", incarnation="run-2", replayed=True, result={"plan": "B"}),
    ]
    [violation] = check_records(other)
    assert (violation.rule, violation.line) == ("replay-mismatch", 2)
    assert f"{digest_value(value)[:23]}… was recorded" in violation.message
    assert f"serves {digest_value({'plan': 'B'})}" in violation.message


@pytest.mark.parametrize(
    "record",
    [
        pytest.param(R("a05", "tool_call", result={"seat_map": "v1"}), id="tool_call"),
        pytest.param(
            R("a07", "payment", idempotency_key="pay-s-1-a07", result={"charge": "ch_1"}), id="payment"
        ),
    ],
)
def test_replay_mismatch_applies_to_every_recorded_result(record: dict[str, Any]) -> None:
    replayed = {**record, "incarnation": "run-2", "replayed": True, "result": {"other": True}}
    violations = check_records([{**record, "incarnation": "run-1"}, replayed])
    assert [(v.line, v.rule) for v in violations] == [(2, "replay-mismatch")]


# -- record rules: caps, recorded results, keys ------------------------------------------


@pytest.mark.parametrize("cap", [True, "3", 3.0, 0, -1, None], ids=repr)
def test_a_cap_must_be_an_integer_of_at_least_one(cap: Any) -> None:
    fields = {} if cap is None else {"max_attempts": cap}
    record = R("a04", "tool_call", "error", retryable=True, attempts=2, **fields)
    [violation] = of("unbounded-retry", check_records([record]))
    assert "without a finite max_attempts" in violation.message
    if cap is not None:
        assert "max_attempts is " in violation.message


@pytest.mark.parametrize("cap", [1, 3, 1000])
def test_an_integer_cap_bounds_a_retry(cap: int) -> None:
    record = R("a04", "tool_call", "error", retryable=True, max_attempts=cap, attempts=1)
    assert of("unbounded-retry", check_records([record])) == []


def test_retry_overrun_fires_only_beyond_the_cap() -> None:
    at_cap = R("a05", "tool_call", "ok", retryable=True, max_attempts=3, attempts=3, result={})
    beyond = R("a06", "tool_call", "ok", retryable=True, max_attempts=3, attempts=4, result={})
    [violation] = check_records([at_cap, beyond])
    assert (violation.rule, violation.line) == ("retry-overrun", 2)
    assert "attempts 4 exceeds max_attempts 3" in violation.message


@pytest.mark.parametrize("kind", ["user_prompt", "llm_call", "external_read", "random", "clock"])
def test_result_null_counts_as_recorded(kind: str) -> None:
    assert check_records([R("a01", kind, result=None)]) == []
    rule_id = "unrecorded-answer" if kind == "user_prompt" else "unrecorded-result"
    assert [v.rule for v in check_records([R("a01", kind)])] == [rule_id]


@pytest.mark.parametrize("kind", ["user_prompt", "llm_call"])
def test_result_ref_and_result_digest_count_as_recorded(kind: str) -> None:
    assert check_records([R("a01", kind, result_ref="blob://s-1/a01.json")]) == []
    assert check_records([R("a02", kind, result_digest=digest_value({"x": 1}))]) == []


@pytest.mark.parametrize(
    ("kind", "rule_id"), [("user_prompt", "unrecorded-answer"), ("llm_call", "unrecorded-result")]
)
@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"result": "__REDACTED__"}, id="placeholder"),
        pytest.param({"result": {"x": 1}, "redacted": True}, id="flag"),
    ],
)
def test_a_redacted_result_counts_as_absent_and_the_message_says_so(
    kind: str, rule_id: str, fields: dict[str, Any]
) -> None:
    [violation] = check_records([R("a01", kind, **fields)])
    assert violation.rule == rule_id
    assert "(its value was redacted)" in violation.message
    [plain] = check_records([R("a01", kind)])
    assert "redacted" not in plain.message


@pytest.mark.parametrize(
    ("kind", "known"),
    [
        ("Payment", "payment"),
        ("PAYMENT", "payment"),
        (" payment", "payment"),
        ("payment\n", "payment"),
        ("User_Prompt", "user_prompt"),
        ("user-prompt", "user_prompt"),
        ("llm call", "llm_call"),
        ("Tool_Call", "tool_call"),
    ],
)
def test_a_known_kind_written_otherwise_is_reported_not_passed(kind: str, known: str) -> None:
    """The rules read a kind literally, so 'Payment' is no side-effecting kind and an
    unkeyed one passed every rule: the kind is reported, naming the one meant."""
    [violation] = check_records([R("a01", kind, retryable=False)])
    assert violation.rule == "invalid-field"
    assert f"kind is {describe(kind)}, expected '{known}'" in violation.message


@pytest.mark.parametrize("kind", [" ", "\t", "  \n"])
def test_a_kind_of_whitespace_only_is_reported(kind: str) -> None:
    """A blank kind says no more than an empty one (a missing-field); it passed as neutral."""
    [violation] = check_records([R("a01", kind)])
    assert violation.rule == "invalid-field"
    assert f"kind is {describe(kind)}, expected a kind" in violation.message


@pytest.mark.parametrize("kind", ["teleport", "payments", "pay ment", "llm_call_v2", "_payment"])
def test_a_kind_that_is_no_known_one_written_otherwise_stays_neutral(kind: str) -> None:
    assert check_records([R("a01", kind)]) == []


def test_unrecorded_result_message_names_the_kind() -> None:
    [violation] = check_records([R("a06", "clock")])
    assert "non-deterministic kind 'clock' has no recorded result" in violation.message


def test_a_failed_non_deterministic_action_needs_no_result() -> None:
    assert check_records([R("a02", "llm_call", "error", retryable=True, max_attempts=2, attempts=1)]) == []


def test_dead_end_is_strict_only() -> None:
    record = R("a08", "tool_call", "error", retryable=False, error="visa check failed")
    assert check_records([record], strict=False) == []
    assert [v.rule for v in check_records([record], strict=True)] == ["dead-end"]
    for on_failure in ("ask_user", "abort", "compensate"):
        assert check_records([{**record, "on_failure": on_failure}], strict=True) == []


TIME_DERIVED_KEYS = [
    pytest.param("pay-2026-11-01-a07", "the date '2026-11-01'", id="iso-date"),
    pytest.param("pay-2026-11-01T09:14:00Z", "the date '2026-11-01'", id="iso-date-time"),
    pytest.param("pay-20261101T0914", "the date '20261101T0914'", id="compact-date-time"),
    pytest.param("pay-20261101091400", "the date '20261101091400'", id="compact-date-time-no-separator"),
    pytest.param("pay-20261101-091400", "the date '20261101-091400'", id="compact-date-dash-time"),
    pytest.param("pay-20261101_0914", "the date '20261101_0914'", id="compact-date-underscore-time"),
    pytest.param("pay-20261101", "the date '20261101'", id="compact-date"),
    pytest.param("pay-19991231-a07", "the date '19991231'", id="compact-date-then-action"),
    pytest.param("pay-20261101091400123", "the date '20261101091400123'", id="compact-date-time-ms"),
    pytest.param(
        "pay-20261101T091400.123456", "the date '20261101T091400.123456'", id="compact-date-time-us"
    ),
    pytest.param("pay-2026/11/01", "the date '2026/11/01'", id="slashed-date"),
    pytest.param("pay-2026_11_01-a07", "the date '2026_11_01'", id="underscored-date"),
    pytest.param("pay-2026.11.01", "the date '2026.11.01'", id="dotted-date"),
    pytest.param("pay-01-11-2026", "the date '01-11-2026'", id="day-first-date"),
    pytest.param("pay-11/01/2026", "the date '11/01/2026'", id="month-first-date"),
    pytest.param("pay-01.11.2026", "the date '01.11.2026'", id="day-first-dotted-date"),
    pytest.param("pay-1764581640", "the epoch timestamp '1764581640'", id="epoch-s"),
    pytest.param("pay-1764581640123", "the epoch timestamp '1764581640123'", id="epoch-ms"),
    pytest.param("pay-1764581640123456", "the epoch timestamp '1764581640123456'", id="epoch-us"),
    pytest.param("pay-1764581640123456789", "the epoch timestamp '1764581640123456789'", id="epoch-ns"),
    pytest.param("pay-1764581640.25", "the epoch timestamp '1764581640'", id="epoch-fractional"),
    pytest.param(
        "mail-5d1a2b3c-9f00-11ef-8a3d-0242ac120002",
        "the time-based UUID '5d1a2b3c-9f00-11ef-8a3d-0242ac120002'",
        id="uuid-v1",
    ),
    pytest.param(
        "mail-1ef9f000-5d1a-6b3c-8a3d-0242ac120002",
        "the time-based UUID '1ef9f000-5d1a-6b3c-8a3d-0242ac120002'",
        id="uuid-v6",
    ),
    pytest.param(
        "mail-01890A5D-AC96-774B-BCCE-B302099A8057",
        "the time-based UUID '01890A5D-AC96-774B-BCCE-B302099A8057'",
        id="uuid-v7-upper",
    ),
]


@pytest.mark.parametrize(("key", "component"), TIME_DERIVED_KEYS)
def test_time_derived_key_is_caught(key: str, component: str) -> None:
    [violation] = check_records([R("a07", "payment", idempotency_key=key, result={})])
    assert violation.rule == "time-derived-key"
    assert f"idempotency_key '{key}' contains {component}" in violation.message


@pytest.mark.parametrize(
    "key",
    [
        pytest.param("pay-s-7f21-a07", id="session-and-action"),
        pytest.param("mail-550e8400-e29b-41d4-a716-446655440000", id="uuid-v4"),
        pytest.param("acct-5000000000", id="10-digits-after-2100"),
        pytest.param("ref-0000000042", id="10-digits-before-2000"),
        pytest.param("order-12345678901", id="11-digits"),
        pytest.param("order-123456789", id="9-digits"),
        pytest.param("order-12345678", id="8-digits-no-date"),
        pytest.param("order-20261301", id="8-digits-month-13"),
        pytest.param("order-20261132", id="8-digits-day-32"),
        pytest.param("order-21261101", id="8-digits-year-2126"),
        pytest.param("order-120261101", id="date-inside-a-longer-number"),
        pytest.param("order-2026/11-01", id="mixed-separators"),
        pytest.param("order-32-11-2026", id="day-first-day-32"),
        pytest.param("order-101-11-2026", id="day-first-inside-a-longer-number"),
        pytest.param("v1.2.2026", id="short-version"),
        pytest.param("itinerary-s-7f21", id="no-digits-run"),
    ],
)
def test_identity_derived_key_is_not_time_derived(key: str) -> None:
    assert check_records([R("a07", "payment", idempotency_key=key, result={})]) == []


# -- time-based UUIDs written without dashes -------------------------------------------------

_GREGORIAN_TO_UNIX_S = 12_219_292_800  # 1582-10-15, where v1 and v6 count from, to 1970-01-01
_KEY_YEARS_S = (946_684_800, 4_102_444_800)  # 2000-01-01 .. 2100-01-01, the years keys are made in


def time_uuid(version: int, unix_s: float, rest: int) -> uuid.UUID:
    """A UUID of ``version`` 1, 6 or 7 that embeds ``unix_s`` (RFC 9562), its other bits
    (clock sequence, node, random) from ``rest``."""
    variant = 0b10 << 62
    if version == 7:
        ms = int(unix_s * 1000)
        return uuid.UUID(int=ms << 80 | 7 << 76 | (rest >> 62) % (1 << 12) << 64 | variant | rest % (1 << 62))
    ticks = int((unix_s + _GREGORIAN_TO_UNIX_S) * 10_000_000)
    if version == 1:
        time_fields = (ticks % (1 << 32)) << 96 | (ticks >> 32) % (1 << 16) << 80 | (ticks >> 48) << 64
    else:
        time_fields = (ticks >> 28) << 96 | (ticks >> 12) % (1 << 16) << 80 | (ticks % (1 << 12)) << 64
    return uuid.UUID(int=time_fields | version << 76 | variant | rest % (1 << 62))


UUID_FORMS = {
    "hex": lambda value: value.hex,
    "upper-hex": lambda value: value.hex.upper(),
    "braced-hex": lambda value: "{" + value.hex + "}",
    "dashed": str,
    "urn": lambda value: value.urn,
    "braced": lambda value: "{" + str(value) + "}",
}
key_prefix = st.text(alphabet="ghijklmnopqrstuvwxyz-_:/", max_size=8)


@settings(max_examples=300, deadline=None)
@given(
    version=st.sampled_from([1, 6, 7]),
    unix_s=st.floats(_KEY_YEARS_S[0], _KEY_YEARS_S[1] - 1),
    rest=st.integers(0, 2**74 - 1),
    form=st.sampled_from(sorted(UUID_FORMS)),
    prefix=key_prefix,
)
def test_time_uuid_key_is_caught_in_every_form(
    version: int, unix_s: float, rest: int, form: str, prefix: str
) -> None:
    """``uuid.uuid1().hex`` (no dashes) was not read as a time-based UUID: a key made afresh
    by the clock on every attempt passed. Every form of a v1, v6 or v7 UUID made between
    2000 and 2100 is one."""
    key = prefix + UUID_FORMS[form](time_uuid(version, unix_s, rest))
    [violation] = check_records([R("a07", "payment", idempotency_key=key, result={})])
    assert violation.rule == "time-derived-key"


def test_uuid1_hex_is_reported_as_a_time_based_uuid() -> None:
    key = uuid.uuid1().hex
    [violation] = check_records([R("a07", "payment", idempotency_key="pay-" + key, result={})])
    assert f"contains the time-based UUID '{key}'" in violation.message


@settings(max_examples=300, deadline=None)
@given(
    version=st.sampled_from([1, 6, 7]),
    unix_s=st.one_of(st.floats(-_GREGORIAN_TO_UNIX_S, _KEY_YEARS_S[0] - 1), st.floats(_KEY_YEARS_S[1], 1e12)),
    rest=st.integers(0, 2**74 - 1),
    prefix=key_prefix,
)
def test_hex_key_whose_uuid_time_is_implausible_is_no_time_uuid(
    version: int, unix_s: float, rest: int, prefix: str
) -> None:
    """A 32-hex-digit key with the version and variant digits of a time-based UUID but a
    time before 2000 or after 2100 is a hash or a random id, not a clock reading: a content
    hash, the recommended key, has those digits about one time in 21."""
    if version == 7:
        unix_s = min(max(unix_s, 0), (1 << 48) / 1000 - 1)  # the 48 bits of milliseconds since 1970 v7 holds
    else:
        unix_s = min(unix_s, (1 << 60) / 10_000_000 - _GREGORIAN_TO_UNIX_S - 1)  # the 60 bits of v1 and v6
    key = prefix + time_uuid(version, unix_s, rest).hex
    assert "time-based UUID" not in (time_component(key) or "")


@settings(max_examples=300, deadline=None)
@given(value=st.integers(0, 2**128 - 1), prefix=key_prefix)
def test_hex_key_of_another_uuid_version_or_variant_is_no_time_uuid(value: int, prefix: str) -> None:
    """Version digits other than 1, 6 and 7 (a uuid4().hex key), or a variant other than
    RFC 9562's, make no time-based UUID, whatever time the other digits would read as."""
    parsed = uuid.UUID(int=value)
    if parsed.variant == uuid.RFC_4122 and parsed.version in (1, 6, 7):
        value ^= 1 << 78  # make it version 3, 4 or 5, or a variant other than RFC 9562's
    key = prefix + uuid.UUID(int=value).hex
    assert "time-based UUID" not in (time_component(key) or "")


def test_few_truncated_content_hashes_read_as_time_uuids() -> None:
    """A SHA-256 of the action's identity cut to 32 hex digits is a recommended key. About
    one in 21 has a time-based UUID's version and variant digits; only those that also
    embed a time between 2000 and 2100 (about one in a thousand) are read as one."""
    keys = [hashlib.sha256(f"s-{n}/a07".encode()).hexdigest()[:32] for n in range(20_000)]
    read_as_uuids = [key for key in keys if "time-based UUID" in (time_component(key) or "")]
    assert len(read_as_uuids) < 40, len(read_as_uuids)


# -- ULIDs ------------------------------------------------------------------------------------

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # base32 without I, L, O and U


def crockford(value: int, width: int) -> str:
    """``value`` in ``width`` Crockford base32 digits, most significant first."""
    return "".join(_CROCKFORD[value >> 5 * (width - 1 - place) & 31] for place in range(width))


def ulid(unix_ms: int, randomness: int) -> str:
    """A ULID: 10 digits of milliseconds since 1970, then 16 of randomness (80 bits)."""
    return crockford(unix_ms, 10) + crockford(randomness, 16)


@settings(max_examples=300, deadline=None)
@given(
    unix_ms=st.integers(_KEY_YEARS_S[0] * 1000, _KEY_YEARS_S[1] * 1000 - 1),
    randomness=st.integers(0, 2**80 - 1),
    lower=st.booleans(),
    prefix=st.sampled_from(["", "pay-", "order_", "idem:", "s-1/"]),
)
def test_ulid_key_is_caught(unix_ms: int, randomness: int, lower: bool, prefix: str) -> None:
    """A ULID embeds the millisecond it was made, so one made afresh on every attempt
    keyed nothing, and passed: one made between 2000 and 2100, in either case, is caught.
    (Not one of hex digits only, which a hex digest cut to 26 is too: its 16 random
    digits are all hex one time in 65,536.)"""
    made = ulid(unix_ms, randomness)
    assume(not set(made) <= set("0123456789ABCDEF"))
    made = made.lower() if lower else made
    [violation] = check_records([R("a07", "payment", idempotency_key=prefix + made, result={})])
    assert violation.rule == "time-derived-key"
    assert f"contains the ULID '{made}'" in violation.message


@settings(max_examples=300, deadline=None)
@given(
    unix_ms=st.one_of(
        st.integers(0, _KEY_YEARS_S[0] * 1000 - 1), st.integers(_KEY_YEARS_S[1] * 1000, 2**48 - 1)
    ),
    randomness=st.integers(0, 2**80 - 1),
    prefix=key_prefix,
)
def test_ulid_like_key_of_an_implausible_time_is_no_ulid(unix_ms: int, randomness: int, prefix: str) -> None:
    """26 Crockford digits whose first ten read as a time before 2000 or after 2100 are a
    hash or a random id, not a clock reading."""
    assert "ULID" not in (time_component(prefix + ulid(unix_ms, randomness)) or "")


def _base62(digest: bytes) -> str:
    alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    value, digits = int.from_bytes(digest), []
    while value:
        value, digit = divmod(value, 62)
        digits.append(alphabet[digit])
    return "".join(reversed(digits))


HASH_KEY_FORMS_OF_ULID_LENGTH = {
    "hex": lambda digest: digest.hex(),
    "base32": lambda digest: base64.b32encode(digest).decode(),
    "base32-lower": lambda digest: base64.b32encode(digest).decode().lower(),
    "base32hex": lambda digest: base64.b32hexencode(digest).decode(),
    "base62": _base62,
    "base64url": lambda digest: base64.urlsafe_b64encode(digest).decode(),
}


@pytest.mark.parametrize("form", sorted(HASH_KEY_FORMS_OF_ULID_LENGTH))
def test_few_content_hashes_cut_to_a_ulids_length_read_as_ulids(form: str) -> None:
    """A SHA-256 of the action's identity, written in a common form and cut to a ULID's 26
    characters, is a recommended key: at most about one in a thousand reads as a ULID."""
    encode = HASH_KEY_FORMS_OF_ULID_LENGTH[form]
    keys = [encode(hashlib.sha256(f"s-{n}/a07".encode()).digest())[:26] for n in range(20_000)]
    read_as_ulids = [key for key in keys if "ULID" in (time_component(key) or "")]
    assert len(read_as_ulids) < 20, len(read_as_ulids)


def test_crockford_base32_content_hashes_cut_to_a_ulids_length_rarely_read_as_ulids() -> None:
    """Crockford base32 is a ULID's own alphabet: only the time tells a hash written in it
    from a ULID, and a uniform 50 bits read as a time between 2000 and 2100 about three
    times in a thousand, as the rule's explanation says."""
    keys = [
        crockford(int.from_bytes(hashlib.sha256(f"s-{n}/a07".encode()).digest()) >> 126, 26)
        for n in range(20_000)
    ]
    read_as_ulids = [key for key in keys if "ULID" in (time_component(key) or "")]
    assert len(read_as_ulids) < 90, len(read_as_ulids)


def test_truncated_result_is_a_warning_when_the_length_equals_the_limit() -> None:
    at_limit = R("a02", "llm_call", result="x" * 64, result_length=64, value_limit=64)
    under = R("a03", "llm_call", result="x" * 63, result_length=63, value_limit=64)
    no_limit = R("a04", "llm_call", result="x" * 64, result_length=64)
    [violation] = check_records([at_limit, under, no_limit])
    assert (violation.rule, violation.line, violation.severity) == ("truncated-result", 1, Severity.WARNING)
    assert "exactly the attribute length limit" in violation.message


# -- keys across actions -------------------------------------------------------------------


def test_shared_key_fires_on_the_second_action_using_it() -> None:
    records = [
        R("a07", "payment", idempotency_key="pay-s-1", result={}),
        R("a11", "payment", idempotency_key="pay-s-1", result={}),
        R("a07", "payment", idempotency_key="pay-s-2", result={}, session="s-2"),
        R("a12", "payment", idempotency_key="pay-s-2", result={}, session="s-3"),
    ]
    [violation] = check_records(records)
    assert (violation.rule, violation.line, violation.action_id) == ("shared-key", 2, "a11")
    assert "already used by action 'a07' at line 1" in violation.message


def test_the_same_key_on_every_attempt_of_one_action_is_not_shared() -> None:
    retry = {"retryable": True, "max_attempts": 3, "idempotency_key": "pay-s-1-a07"}
    records = [
        R("a07", "payment", "error", attempts=1, **retry),
        R("a07", "payment", attempts=2, result={}, **retry),
    ]
    assert check_records(records) == []


def test_unstable_key_fires_when_an_attempt_changes_the_key() -> None:
    retry = {"retryable": True, "max_attempts": 3}
    records = [
        R("a07", "payment", "error", attempts=1, idempotency_key="pay-7d1c", **retry),
        R("a07", "payment", attempts=2, idempotency_key="pay-90ab", result={}, **retry),
    ]
    [violation] = check_records(records)
    assert (violation.rule, violation.line) == ("unstable-key", 2)
    assert "'pay-90ab'" in violation.message and "'pay-7d1c'" in violation.message


def _window_log(tmp_path: Path, first_ts: str, later_ts: str) -> Path:
    path = tmp_path / "window.jsonl"
    records = [
        R("a07", "payment", "started", idempotency_key="wire-s-1-a07", ts=first_ts),
        R("a07", "payment", idempotency_key="wire-s-1-a07", ts=later_ts, result={"transfer": "tr_1"}),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _check_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(DURABLE_SESSIONS), "check", "--format", "json", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=60,
    )


def test_key_outlived_window_uses_the_default_day(tmp_path: Path) -> None:
    inside = _check_cli(str(_window_log(tmp_path, "2026-11-06T17:55:00Z", "2026-11-07T17:00:00Z")))
    assert inside.returncode == 0 and json.loads(inside.stdout)["violations"] == []
    outside = _check_cli(str(_window_log(tmp_path, "2026-11-06T17:55:00Z", "2026-11-07T18:55:00Z")))
    assert outside.returncode == 0, "a warning does not fail by default"
    [violation] = json.loads(outside.stdout)["violations"]
    assert (violation["rule"], violation["severity"], violation["line"]) == (
        "key-outlived-window",
        "warning",
        2,
    )
    assert "re-sent 25.0 h after its first use, beyond the 24 h key window" in violation["message"]


def test_key_outlived_window_follows_key_window_s(tmp_path: Path) -> None:
    log = str(_window_log(tmp_path, "2026-11-06T09:00:00Z", "2026-11-06T11:00:00Z"))
    assert json.loads(_check_cli(log).stdout)["violations"] == []
    narrow = _check_cli("--key-window-s", "3600", "--fail-on", "warning", log)
    assert narrow.returncode == 1
    [violation] = json.loads(narrow.stdout)["violations"]
    assert violation["rule"] == "key-outlived-window"
    assert "re-sent 2.0 h after its first use, beyond the 1 h key window" in violation["message"]
    assert json.loads(_check_cli("--key-window-s", "7200", log).stdout)["violations"] == []


def test_key_outlived_window_reads_epoch_seconds() -> None:
    records = [
        R("a07", "payment", "started", idempotency_key="pay-s-1-a07", ts=1_762_400_000),
        R("a07", "payment", idempotency_key="pay-s-1-a07", ts=1_762_400_000 + 90_000, result={}),
    ]
    assert [v.rule for v in check_records(records)] == ["key-outlived-window"]
    assert check_records(records, key_window_s=100_000) == []


@pytest.mark.parametrize(
    "ts",
    ["2026-11-01 09:00:00 UTC", "2026-11-01T09:00:00Z[UTC]", "2026-13-01T09:00:00Z", "2026-11-01T25:00:00Z"],
)
def test_a_ts_the_key_window_cannot_read_is_reported(ts: str) -> None:
    """A ts that starts like a date but is none (Ruby's Time#to_s ends in ' UTC'; a zone
    name in brackets; month 13) was taken as well formed, and key-outlived-window, which
    cannot read it, passed a key re-sent days later without a word."""
    records = [
        R("a07", "payment", "started", idempotency_key="pay-s-1-a07", ts=ts),
        R(
            "a07",
            "payment",
            idempotency_key="pay-s-1-a07",
            ts=ts.replace("2026-11-01", "2026-11-04"),
            result={},
        ),
    ]
    found = check_records(records)
    assert [(v.line, v.rule) for v in found] == [(1, "invalid-field"), (2, "invalid-field")]
    assert f"ts is {describe(ts)}, expected an ISO-8601 date-time" in found[0].message


@pytest.mark.parametrize(
    "ts", ["2026-11-01", "2026-11-01 09:00:00+00:00", "2026-11-01T09:00:00.123456789Z", "20261101T090000Z"]
)
def test_a_ts_the_key_window_reads_is_well_formed(ts: str) -> None:
    assert check_records([R("a01", "tool_call", ts=ts)]) == []


def test_key_outlived_window_is_past_the_window_not_at_it() -> None:
    def resent(at: str) -> list[dict[str, Any]]:
        return [
            R("a07", "payment", "started", idempotency_key="pay-s-1-a07", ts="2026-11-01T09:00:00Z"),
            R("a07", "payment", idempotency_key="pay-s-1-a07", ts=at, result={}),
        ]

    assert check_records(resent("2026-11-02T09:00:00Z")) == []
    [violation] = check_records(resent("2026-11-02T09:00:00.001Z"))
    # The age rounds to the window: the message says by how much it is past, where it
    # said "re-sent 24.0 h after its first use, beyond the 24 h key window".
    assert "re-sent 24.0 h after its first use, 0.001 s beyond the 24 h key window" in violation.message


# -- end-of-session rules and the disguised retry loop --------------------------------------

EXHAUSTED = {"retryable": True, "max_attempts": 3, "attempts": 3, "error": "upstream 503"}


def test_retry_not_escalated_is_reported_at_session_end() -> None:
    checker = Checker(select_rules("all"))
    assert checker.feed(R("a05", "tool_call", "error", **EXHAUSTED), line_location("t.jsonl", 4)) == []
    assert checker.feed(R("a06", "llm_call", result={}), line_location("t.jsonl", 5)) == []
    [violation] = checker.end_session("s-1")
    assert (violation.rule, violation.line, violation.action_id) == ("retry-not-escalated", 4, "a05")
    assert "failed its last attempt (3 of 3) and nothing escalated" in violation.message


@pytest.mark.parametrize(
    "records",
    [
        pytest.param(
            [
                R("a05", "tool_call", "error", **EXHAUSTED),
                R("a06", "user_prompt", result={"retry_later": True}),
            ],
            id="later-user-prompt",
        ),
        pytest.param(
            [R("a05", "tool_call", "error", on_failure="ask_user", **EXHAUSTED)], id="on-failure-ask-user"
        ),
        pytest.param(
            [
                R("a05", "tool_call", "error", incarnation="run-1", **EXHAUSTED),
                R(
                    "a05",
                    "tool_call",
                    incarnation="run-2",
                    retryable=True,
                    max_attempts=3,
                    attempts=1,
                    result={},
                ),
            ],
            id="later-attempt-succeeded",
        ),
        pytest.param(
            [
                R("a05", "tool_call", "error", incarnation="run-1", **EXHAUSTED),
                R("a05", "tool_call", "error", incarnation="run-2", on_failure="ask_user", **EXHAUSTED),
            ],
            id="later-run-escalated-at-the-cap",  # the resumed run's last attempt asked the user
        ),
        pytest.param(
            [R("a05", "tool_call", "error", retryable=True, max_attempts=3, attempts=2)], id="cap-not-reached"
        ),
        pytest.param(
            [R("a05", "tool_call", "error", retryable=True, max_attempts=2)], id="first-attempt-below-cap"
        ),
        pytest.param(
            [R("a05", "tool_call", "error", retryable=True, max_attempts=1, attempts="1")],
            id="attempts-not-an-integer",  # invalid-field reports it; no number is read into it
        ),
    ],
)
def test_retry_not_escalated_is_silent_when_escalated_or_not_exhausted(records: list[dict[str, Any]]) -> None:
    assert of("retry-not-escalated", check_records(records)) == []


def test_the_last_run_to_exhaust_the_cap_decides_whether_it_escalated() -> None:
    escalated = R("a05", "tool_call", "error", incarnation="run-1", on_failure="ask_user", **EXHAUSTED)
    silent = R("a05", "tool_call", "error", incarnation="run-2", **EXHAUSTED)
    [violation] = of("retry-not-escalated", check_records([escalated, silent]))
    assert violation.line == 2


@pytest.mark.parametrize("attempts", [{}, {"attempts": None}], ids=["absent", "null"])
def test_a_record_without_attempts_is_the_first_attempt(attempts: dict[str, Any]) -> None:
    """The instrumentation writes attempts from the second attempt on: a failed record
    without them has used up a cap of 1."""
    records = [R("a05", "tool_call", "error", retryable=True, max_attempts=1, **attempts)]
    [violation] = of("retry-not-escalated", check_records(records))
    assert "failed its last attempt (1 of 1)" in violation.message


def test_a_replayed_user_prompt_is_no_escalation() -> None:
    """A resumed run replays the answer given before the cap was reached: no one is asked."""
    records = [
        R("a01", "user_prompt", incarnation="run-1", result={"budget": 2400}),
        R("a05", "tool_call", "error", incarnation="run-1", **EXHAUSTED),
        R("a01", "user_prompt", incarnation="run-2", replayed=True, result={"budget": 2400}),
    ]
    assert summary(check_records(records)) == [(2, "retry-not-escalated", "error")]


def test_a_user_prompt_before_the_cap_is_no_escalation() -> None:
    records = [R("a04", "user_prompt", result={"ok": True}), R("a05", "tool_call", "error", **EXHAUSTED)]
    assert [(v.rule, v.line) for v in check_records(records)] == [("retry-not-escalated", 2)]


def _failure(action_id: str, name: str = "fetch_listing", **fields: Any) -> dict[str, Any]:
    return R(action_id, "tool_call", "error", name=name, retryable=True, max_attempts=3, attempts=1, **fields)


def test_disguised_retry_loop_fires_once_on_the_fifth_failure() -> None:
    records = [_failure(f"f{n}") for n in range(1, 8)]
    [violation] = check_records(records)
    assert (violation.rule, violation.line, violation.severity) == (
        "disguised-retry-loop",
        5,
        Severity.WARNING,
    )
    assert "5 consecutive failures of 'tool_call' 'fetch_listing'" in violation.message


@pytest.mark.parametrize(
    "replay",
    [
        pytest.param(R("b0", "tool_call", name="fetch_listing", result={"ok": 1}), id="success"),
        pytest.param(R("b0", "user_prompt", result={"ok": 1}), id="user-prompt"),
    ],
)
def test_a_replay_does_not_break_a_disguised_retry_loop(replay: dict[str, Any]) -> None:
    """A replayed success or answer (served from the record by a resumed run) executed
    nothing: the failures around it are still consecutive."""
    records = [
        {**replay, "incarnation": "run-1"},
        *[_failure(f"f{n}", incarnation="run-1") for n in range(1, 4)],
        {**replay, "incarnation": "run-2", "replayed": True},
        *[_failure(f"f{n}", incarnation="run-2") for n in range(4, 6)],
    ]
    assert summary(check_records(records)) == [(7, "disguised-retry-loop", "warning")]


def test_four_failures_are_not_a_loop() -> None:
    assert check_records([_failure(f"f{n}") for n in range(1, 5)]) == []


def test_a_success_of_the_same_kind_and_name_breaks_the_loop() -> None:
    success = R("ok1", "tool_call", name="fetch_listing", result={"listings": 3})
    records = [*(_failure(f"f{n}") for n in range(1, 5)), success, *(_failure(f"g{n}") for n in range(1, 5))]
    assert check_records(records) == []


def test_other_actions_do_not_break_the_loop() -> None:
    records = [
        *(_failure(f"f{n}") for n in range(1, 4)),
        R("ok1", "tool_call", name="geocode", result={}),
        _failure("x1", name="geocode"),
        R("l1", "llm_call", result={}),
        *(_failure(f"f{n}") for n in range(4, 6)),
    ]
    assert [(v.rule, v.line) for v in check_records(records)] == [("disguised-retry-loop", 8)]


@pytest.mark.parametrize(
    "escalation",
    [
        pytest.param(R("q1", "user_prompt", result={"try_again": True}), id="user-prompt"),
        pytest.param(_failure("f4", on_failure="ask_user"), id="on-failure-ask-user"),
    ],
)
def test_an_escalation_breaks_the_loop(escalation: dict[str, Any]) -> None:
    records = [
        *(_failure(f"f{n}") for n in range(1, 4)),
        escalation,
        *(_failure(f"g{n}") for n in range(1, 4)),
    ]
    assert check_records(records) == []


def test_retries_under_one_action_id_are_not_a_disguised_loop() -> None:
    records = [
        R("f1", "tool_call", "error", name="fetch_listing", retryable=True, max_attempts=5, attempts=n)
        for n in range(1, 5)
    ]
    assert check_records(records) == []


UNRESOLVED = [
    pytest.param([R("a07", "payment", "started")], [1], id="started-only"),
    pytest.param([R("a09", "tool_call", "started", side_effects=True)], [1], id="side-effects-flag"),
    pytest.param(
        [R("a07", "payment", "started"), R("a07", "payment", idempotency_key="pay-s-1-a07", result={})],
        [],
        id="completed",
    ),
    pytest.param(
        [R("a07", "payment", "started"), R("a07", "payment", "error", on_failure="abort")], [], id="failed"
    ),
    pytest.param([R("a07", "payment", "started", idempotency_key="pay-s-1-a07")], [], id="keyed"),
    pytest.param([R("a08", "email", "started", replay="skip")], [], id="replay-skip"),
    pytest.param([R("a05", "tool_call", "started")], [], id="not-side-effecting"),
]


@pytest.mark.parametrize(("records", "lines"), UNRESOLVED)
def test_unresolved_side_effect(records: list[dict[str, Any]], lines: list[int]) -> None:
    violations = check_records(records, strict=True)
    assert [(v.rule, v.line) for v in violations] == [("unresolved-side-effect", line) for line in lines]


def test_unresolved_side_effect_waits_for_the_session_to_end() -> None:
    checker = Checker(select_rules("all"))
    assert checker.feed(R("a07", "deploy", "started"), line_location("t.jsonl", 1)) == []
    assert checker.feed(R("a07", "deploy", "started", session="s-2"), line_location("t.jsonl", 2)) == []
    [violation] = checker.end_session("s-1")
    assert (violation.rule, violation.session_id, violation.line) == ("unresolved-side-effect", "s-1", 1)
    assert "started but never completed" in violation.message
    assert [v.session_id for v in checker.finish()] == ["s-2"]


@settings(max_examples=300, deadline=None)
@given(st.frozensets(st.integers(min_value=-5, max_value=100), max_size=6))
def test_attempt_numbers_survive_packing(attempts: frozenset[int]) -> None:
    packed = _pack_attempts(attempts)
    assert _unpack_attempts(packed) == attempts
    if attempts and all(1 <= n <= 62 for n in attempts):
        assert type(packed) is int  # kept as a mask, not a frozenset


@pytest.mark.parametrize("preset", ["seed", "all"])
@pytest.mark.parametrize("strict", [False, True])
def test_another_process_rebuilds_a_selection_of_rules_identically(preset: str, strict: bool) -> None:
    """A checking worker (``--jobs``) and the processor's checker process rebuild their
    rules from names: by its id alone, the seed's ``invalid-field`` for kind and status
    would come back as the whole rule, judging fields the seed never defined."""
    chosen = select_rules(preset, strict=strict)  # type: ignore[arg-type]
    rebuilt = rules_from_references(rule_references(chosen))
    assert [id(rule) for rule in rebuilt] == [id(rule) for rule in chosen]
