"""A first attempt written without ``attempts`` is attempt 1 (``record.attempt_number``):
the instrumentation writes ``attempts`` only from the second attempt on. A session so
written must be judged exactly as its twin with ``attempts: 1`` written, by every front
end: the offline checker over the whole file, the engine fed record by record (the C
memory and the Python one), a session restored from a snapshot at any point (as the
sidecar restores a long session after a restart), and the sidecar's evaluator over a
real store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_sessions.check import check_paths
from durable_sessions.engine import Checker
from durable_sessions.record import line_location
from durable_sessions.rules import select_rules
from tests.support.senders import use_engine

SESSION = "s-1"
RULES = select_rules("all", strict=True)
RETRY = {"session_id": SESSION, "action_id": "a1", "kind": "tool_call", "retryable": True, "max_attempts": 3}
Record = dict[str, Any]
Finding = tuple[str, str | None, int | None, str, str]


@pytest.fixture(params=["native", "python"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Checkers made in the test use the C engine and fold, or the Python reference."""
    use_engine(monkeypatch, request.param)
    return str(request.param)


def new_checker(engine: str) -> Checker:
    checker = Checker(RULES)
    assert (checker.feed != Checker.feed.__get__(checker)) == (engine == "native")
    return checker


def finding(violation: Any) -> Finding:
    return (violation.rule, violation.action_id, violation.line, violation.severity.value, violation.message)


def judged(records: list[Record], engine: str, cut: int | None = None) -> list[Finding]:
    """What the engine finds, fed the records one at a time, then told the session ended;
    with ``cut``, the session is snapshotted after that many records and the rest are fed
    to another checker that restored it."""
    checker = new_checker(engine)
    found = []
    for n, record in enumerate(records, 1):
        found += checker.feed(dict(record), line_location("run.jsonl", n))
        if n == cut:
            data, checker = checker.snapshot(SESSION), new_checker(engine)
            assert data is not None and checker.restore(SESSION, data)
    return [finding(v) for v in [*found, *checker.end_session(SESSION)]]


def offline(records: list[Record], tmp_path: Path) -> list[Finding]:
    """What the offline checker finds in the whole file."""
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return sorted(finding(v) for v in check_paths([str(path)], Checker(RULES)))


def written_out(records: list[Record]) -> list[Record]:
    """The twin: every record without ``attempts`` (or with null) says ``attempts: 1``."""
    return [{**r, "attempts": 1} if r.get("attempts") is None else r for r in records]


@pytest.mark.parametrize(
    "again",
    [{"attempts": 1}, {}, {"attempts": None}],
    ids=["attempt-1-written", "attempt-1-unwritten", "attempt-1-null"],
)
def test_attempt_1_after_attempt_2_is_a_duplicate_however_the_first_was_written(
    engine: str, tmp_path: Path, again: Record
) -> None:
    """Attempt 1 failed (written without ``attempts``), attempt 2 failed, then an
    attempt 1 succeeds: a second action under the id, which replay cannot tell apart."""
    records = [
        {**RETRY, "status": "error"},
        {**RETRY, "status": "error", "attempts": 2},
        {**RETRY, "status": "ok", **again},
    ]
    expected = judged_as_its_twin(records, engine, tmp_path)
    assert [(rule, line) for rule, _, line, *_ in expected] == [("duplicate-action-id", 3)]


def test_an_unwritten_attempt_after_one_numbered_0_is_a_later_attempt(engine: str, tmp_path: Path) -> None:
    """Attempt 1 is later than an attempt numbered 0 (an invalid number, which the
    session still keeps): a question answered there and asked again at attempt 1,
    written or not, is asked twice."""
    answered = {"session_id": SESSION, "action_id": "a1", "kind": "user_prompt", "status": "ok", "result": 1}
    expected = judged_as_its_twin([{**answered, "attempts": 0}, answered], engine, tmp_path)
    assert ("re-asked", 2) in [(rule, line) for rule, _, line, *_ in expected]


def judged_as_its_twin(records: list[Record], engine: str, tmp_path: Path) -> list[Finding]:
    """What the twin of ``records`` with attempt 1 written finds, having checked that
    ``records`` find the same, fed, restored at every cut and offline."""
    expected = judged(written_out(records), engine)
    assert judged(records, engine) == expected
    for cut in range(1, len(records)):
        assert judged(records, engine, cut) == expected, cut
    assert offline(records, tmp_path) == sorted(expected)
    return expected


# -- any session of retried actions --------------------------------------------------------

retried = st.fixed_dictionaries(
    {
        "session_id": st.just(SESSION),
        "action_id": st.sampled_from(["a1", "a2", "a3"]),
        "kind": st.sampled_from(["tool_call", "payment", "user_prompt", "llm_call"]),
        "status": st.sampled_from(["ok", "error", "started"]),
    },
    optional={
        "attempts": st.sampled_from([None, 1, 2, 3, 4, 0]),  # absent or null: attempt 1
        "retryable": st.just(True),
        "max_attempts": st.sampled_from([1, 2, 3]),
        "result": st.sampled_from([1, 2]),
        "idempotency_key": st.sampled_from(["k1", "k2"]),
        "incarnation": st.sampled_from(["run-1", "run-2"]),
        "replayed": st.just(True),
        "on_failure": st.just("ask_user"),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(retried, min_size=1, max_size=12), cut=st.floats(0, 1))
def test_a_session_is_judged_as_its_twin_with_attempt_1_written(
    engine: str, records: list[Record], cut: float
) -> None:
    expected = judged(written_out(records), engine)
    assert judged(records, engine) == expected
    assert judged(records, engine, max(1, round(cut * len(records)))) == expected
