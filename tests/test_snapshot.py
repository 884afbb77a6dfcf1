"""A session restored from a snapshot checks exactly as the session it was taken of.

``Checker.snapshot`` and ``Checker.restore`` (the format: ``rules/snapshot.py``) let a
sidecar hold a long session again without re-feeding its records. These tests feed
generated records (every kind and status, keys, attempts, retries, incarnations, failure
runs, redeliveries, results and digests, times, a tiny action limit so that actions,
keys and prompts are forgotten) to a checker, snapshot the session, restore it into
another checker whose symbol table numbered other strings first, feed both the same
records afterwards and end the session in both: every violation and finding must be
the same. With the native engine and with ``DURABLE_SESSIONS_NATIVE=false``. Then the
refusals: another version, other settings, another session, truncated, altered or
random bytes — False, and the checker goes on.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from durable_sessions import kinds
from durable_sessions.engine import Checker
from durable_sessions.record import Location, line_location, span_location
from durable_sessions.rules import CATALOGUE, Rule, select_rules, snapshot, snapshot_memory, state
from durable_sessions.rules.exact_json import from_json, to_json
from durable_sessions.rules.state import SessionState, Symbols
from tests.support.actions import OPTIONAL, json_values, locations, retries
from tests.support.senders import use_engine

SESSION = "s-1"
RULES = select_rules("all", strict=True)
KINDS = sorted(kinds.KNOWN | {"odd kind"})
INCARNATIONS = ["run-1", "run-2", "run-3", "run-4", "", 7, None, 2**70, ("run", 1), float("inf"), ["run-1"]]
times = st.one_of(
    st.sampled_from(["2026-11-29T10:00:00Z", "2026-11-30T12:00:00+01:00", "soon", None, True]),
    st.integers(1_700_000_000, 1_700_400_000),
    st.floats(1.7e9, 1.7004e9),
)
ACTION_IDS = st.sampled_from([f"a{n}" for n in range(8)])
records = st.fixed_dictionaries(
    {
        "session_id": st.just(SESSION),
        "action_id": ACTION_IDS,
        "kind": st.sampled_from(KINDS),
        "status": st.sampled_from(["ok", "ok", "error", "started", "done"]),
    },
    optional={
        **OPTIONAL,
        "attempts": st.sampled_from([1, 2, 3, 62, 63, 70, 2**70, -1, True, "2", 0, None]),
        "incarnation": st.sampled_from(INCARNATIONS),
        "ts": times,
        "name": st.sampled_from(["search", "book", 3]),
        "on_failure": st.sampled_from(["ask_user", "abort"]),
        "max_attempts": st.sampled_from([1, 2, 3, "3"]),
        "replay": st.sampled_from(["skip", "auto"]),
    },
)
# Failures of one kind and name under new action ids: a retry loop for failure_runs.
failures = st.builds(
    lambda action_id: {
        "session_id": SESSION,
        "action_id": action_id,
        "kind": "tool_call",
        "name": "book",
        "status": "error",
    },
    st.sampled_from([f"f{n}" for n in range(7)]),
)
# Questions answered in one incarnation (answered_prompts), asked again in another.
answers = st.fixed_dictionaries(
    {
        "session_id": st.just(SESSION),
        "action_id": ACTION_IDS,
        "kind": st.just(kinds.USER_PROMPT),
        "status": st.just("ok"),
        "prompt_digest": st.sampled_from(["p1", "p2"]),
        "result": st.sampled_from([1, "yes", None]),
        "incarnation": st.sampled_from(INCARNATIONS),
    },
    optional={"replayed": st.just(True), "attempts": st.sampled_from([1, 2, None])},
)
# Retries that use up their attempts (exhausted_retries), escalated or not.
exhausted = st.fixed_dictionaries(
    {
        "session_id": st.just(SESSION),
        "action_id": ACTION_IDS,
        "kind": st.sampled_from(KINDS),
        "status": st.just("error"),
        "retryable": st.just(True),
        "attempts": st.sampled_from([2, 3]),
        "max_attempts": st.just(3),
    },
    optional={"on_failure": st.just("ask_user"), "name": st.just("book")},
)
# Actions run again: in another incarnation, replayed or not, keyed, late. Each action id
# keeps its kind and key, as a resumed agent's would.
RERUN_KINDS = sorted(kinds.NON_DETERMINISTIC | kinds.SIDE_EFFECTING)
reruns = st.builds(
    lambda action_id, more: {
        "session_id": SESSION,
        "action_id": action_id,
        "kind": RERUN_KINDS[int(action_id[1:]) % len(RERUN_KINDS)],
        **more,
    },
    ACTION_IDS,
    st.fixed_dictionaries(
        {
            "status": st.sampled_from(["ok", "ok", "started"]),
            "incarnation": st.sampled_from(INCARNATIONS[:4]),
            "ts": st.integers(1_700_000_000, 1_700_400_000),
        },
        optional={
            "idempotency_key": st.sampled_from(["k-1", "k-2"]),
            "replayed": st.just(True),
            "result": st.sampled_from([1, 2, [1]]),
            "result_digest": OPTIONAL["result_digest"],
            "attempts": st.sampled_from([1, 2, 3, None]),
            "retryable": st.just(True),
            "replay": st.just("skip"),
        },
    ),
)


# Side effects started under ids of their own, some never completed (unfinished_effects).
starts = st.fixed_dictionaries(
    {
        "session_id": st.just(SESSION),
        "action_id": st.sampled_from(["e1", "e2", "e3"]),
        "kind": st.sampled_from(sorted(kinds.SIDE_EFFECTING)),
        "status": st.sampled_from(["started", "started", "ok"]),
    },
    optional={"replay": st.just("skip"), "idempotency_key": st.just("k-e")},
)


def steps_of(*kinds_of_record: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[list[Any]]:
    step = st.tuples(st.one_of(*kinds_of_record), locations)
    return st.one_of(st.lists(step, min_size=1, max_size=8), st.lists(step, min_size=20, max_size=60))


steps = st.one_of(
    steps_of(records, failures, answers, exhausted, reruns, starts, retries),
    steps_of(records, failures, exhausted),  # no user_prompt to clear the runs and retries
    steps_of(answers, reruns),
    steps_of(failures, failures, reruns, starts),  # retry loops long enough to be reported
)
WARM = [
    ({"session_id": "other", "action_id": f"w{n}", "kind": kind, "status": status}, where)
    for n, (kind, status, where) in enumerate(
        [
            ("a kind of its own", "its status", line_location("other.jsonl", 1)),
            ("email", "error", line_location("run.jsonl", 2)),
            ("payment", "started", span_location("ab" * 16, "00000000000000ff")),
            ("llm_call", "ok", line_location("", 4)),
            ("user_prompt", "done", Location(None, 5)),
        ]
    )
]
"""Fed to a restoring checker first, so that its symbol table numbers other strings, and
the snapshot's texts, in another order than the snapshot's checker."""


@pytest.fixture(params=["native", "python"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Checkers made in the test use the C engine and fold, or the Python reference."""
    use_engine(monkeypatch, request.param)
    return str(request.param)


def new_checker(engine: str, **options: Any) -> Checker:
    checker = Checker(RULES, **options)
    native = checker.feed != Checker.feed.__get__(checker)
    assert native == (engine == "native"), "the engine under test should be selected"
    return checker


def held(checker: Checker, session_id: str = SESSION) -> SessionState:
    return checker._sessions[session_id]


def recalled(session: SessionState) -> dict[str, Any]:
    """Everything a session's rules can read, action by action as the engine recalls it
    (packed numbers differ between checkers), with the order of every map."""
    return {
        "session_id": session.session_id,
        "max_actions": session.max_actions,
        "actions": [(action_id, session.recall(action_id)) for action_id in session.actions],
        "details": list(session.details.items()),
        "keys": list(session.keys.items()),
        "answered_prompts": [(d, (a, repr(i))) for d, (a, i) in session.answered_prompts.items()],
        "exhausted_retries": list(session.exhausted_retries.items()),
        "unfinished_effects": list(session.unfinished_effects.items()),
        "failure_runs": list(session.failure_runs.items()),
        "incarnation": session.incarnation,
        "incarnations": list(session.incarnations),
        "incarnation_numbers": list(session.incarnation_numbers.items()),
        "oldest": None if session.oldest is None else {k: list(v) for k, v in session.oldest.items()},
    }


def feed(checker: Checker, steps: list) -> list[list[Any]]:
    return [checker.feed(dict(record), where) for record, where in steps]


def snapshot_and_go_on(
    original: Checker, restoring: Checker, steps: list, split: int, window: float | None = None
) -> None:
    """Feed ``steps[:split]`` to ``original``, restore its snapshot into ``restoring``, then
    check that both report the same for the rest and at the session's end."""
    feed(original, steps[:split])
    data = original.snapshot(SESSION)
    assert data is not None
    feed(restoring, WARM)
    assert restoring.restore(SESSION, data)
    assert recalled(held(restoring)) == recalled(held(original))
    assert restoring.snapshot(SESSION) == data, "snapshot -> restore -> snapshot gives the same bytes"
    assert feed(restoring, steps[split:]) == feed(original, steps[split:])
    assert restoring.end_session(SESSION) == original.end_session(SESSION)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=steps,
    cut=st.floats(0, 1),
    max_actions=st.sampled_from([1, 2, 3, 100_000]),
    batch=st.sampled_from([2, state.FORGET_BATCH]),
)
def test_a_restored_session_checks_as_the_original(
    engine: str, steps: list, cut: float, max_actions: int, batch: int
) -> None:
    split = max(1, round(cut * len(steps)))
    with patch.object(state, "FORGET_BATCH", batch):
        original, restoring = (new_checker(engine, max_actions_per_session=max_actions) for _ in range(2))
        snapshot_and_go_on(original, restoring, steps, split)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps, cut=st.floats(0, 1), max_actions=st.sampled_from([2, 100_000]))
def test_a_snapshot_is_restored_by_the_other_engine(
    monkeypatch: pytest.MonkeyPatch, steps: list, cut: float, max_actions: int
) -> None:
    split = max(1, round(cut * len(steps)))
    use_engine(monkeypatch, "native")
    native = new_checker("native", max_actions_per_session=max_actions)
    use_engine(monkeypatch, "python")
    python = new_checker("python", max_actions_per_session=max_actions)
    snapshot_and_go_on(native, python, steps, split)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps, cut=st.floats(0, 1), window=st.sampled_from([10.0, 3_600, 86_400]))
def test_a_restored_session_judges_keys_by_the_restoring_checkers_window(
    engine: str, steps: list, cut: float, window: float
) -> None:
    """``key_window_s`` shapes no state: restored under another window, a session finds
    what it finds re-fed under that window."""
    split = max(1, round(cut * len(steps)))
    original = new_checker(engine, key_window_s=1.0)
    refed, restored = (new_checker(engine, key_window_s=window) for _ in range(2))
    feed(original, steps[:split])
    feed(refed, steps[:split])
    assert restored.restore(SESSION, original.snapshot(SESSION))  # type: ignore[arg-type]
    assert feed(restored, steps[split:]) == feed(refed, steps[split:])
    assert restored.end_session(SESSION) == refed.end_session(SESSION)


def test_a_session_past_its_limit_mid_batch(engine: str) -> None:
    """Thousands of actions past the limit: the snapshot is taken halfway through a batch of
    oldest keys (``FORGET_BATCH``), which the restored session forgets in the same order."""
    steps = [
        (
            {
                "session_id": SESSION,
                "action_id": f"a{n}",
                "kind": "payment" if n % 3 else "user_prompt",
                "status": "ok",
                "idempotency_key": f"k{n % 1500}",
                "prompt_digest": f"p{n}",
                "result": n % 7,
                "incarnation": f"run-{n // 900}",
                "ts": 1_700_000_000 + n * 60,
            },
            span_location("ab" * 16, f"{n + 1:016x}"),
        )
        for n in range(4000)
    ]
    original, restoring = (new_checker(engine, max_actions_per_session=1000) for _ in range(2))
    snapshot_and_go_on(original, restoring, steps + steps[:1200], 2500)


def test_snapshot_leaves_the_session_as_it_was(engine: str) -> None:
    checker = new_checker(engine, max_actions_per_session=2)
    feed(
        checker, [({**WARM[1][0], "session_id": SESSION, "action_id": f"a{n}"}, WARM[1][1]) for n in range(5)]
    )
    before = recalled(held(checker))
    assert checker.snapshot(SESSION) == checker.snapshot(SESSION)
    assert recalled(held(checker)) == before
    assert checker.snapshot("not held") is None


def test_a_record_value_that_is_not_json_is_not_snapshotted(engine: str) -> None:
    """A prompt answered in an incarnation that is no JSON value (given by Python code):
    no snapshot carries it exactly, so there is none."""
    checker = new_checker(engine)
    answered = {"session_id": SESSION, "action_id": "a1", "kind": "user_prompt", "status": "ok"}
    checker.feed({**answered, "result": 1, "prompt_digest": "p1", "incarnation": object()})
    assert SESSION in checker
    assert checker.snapshot(SESSION) is None


class FullSymbols(Symbols):
    """A symbol table with no room for the kinds of the snapshot."""

    def number(self, text: str) -> int | None:
        return None if text in kinds.KNOWN else super().number(text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps)
def test_restored_into_a_full_symbol_table_actions_are_kept_as_recalled(engine: str, steps: list) -> None:
    original, restoring = new_checker(engine), new_checker(engine)
    restoring._symbols = FullSymbols()
    feed(original, steps)
    assert restoring.restore(SESSION, original.snapshot(SESSION))  # type: ignore[arg-type]
    assert recalled(held(restoring)) == recalled(held(original))


def test_every_part_of_a_sessions_state_is_in_the_snapshot() -> None:
    """A new field of SessionState fails here until the snapshot carries it (and
    FORMAT_VERSION is bumped): the others are the checker's settings, or derived."""
    settings_or_derived = {"session_id", "key_window_s", "max_actions", "symbols", "incarnation_numbers"}
    assert set(SessionState.__slots__) == set(snapshot_memory.FIELDS - {"shapes", "symbols", "unpacked"}) | (
        settings_or_derived
    )


PINNED = "8cb94b4463e0e78e"
"""The first 16 hex digits of the SHA-256 of :func:`a_rich_snapshot` with :data:`STATEFUL`,
in format version 2."""
STATEFUL = tuple(
    CATALOGUE.get(i) for i in ("retry-not-escalated", "disguised-retry-loop", "unresolved-side-effect")
)
"""The rules that keep state of their own (a fixed selection, as new rules come)."""


def test_the_format_changes_only_with_its_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bump ``snapshot.FORMAT_VERSION`` when this fails, then update PINNED: a checker
    must refuse the snapshots another format wrote rather than misread them. (The code's
    own digest, which any edit changes, is held still here.)"""
    monkeypatch.setattr(snapshot, "ENGINE", "pinned-engine")
    data = a_rich_snapshot(STATEFUL)
    assert snapshot.FORMAT_VERSION == 2
    assert hashlib.sha256(data).hexdigest()[:16] == PINNED


# -- refusals ----------------------------------------------------------------------------------


def rich_steps() -> list:
    """A session that fills every map of its memory."""
    base = {"session_id": SESSION, "ts": 1_700_000_000}
    records = [
        {"action_id": "a1", "kind": "payment", "status": "started", "incarnation": "run-1"},
        {"action_id": "a2", "kind": "user_prompt", "status": "ok", "prompt_digest": "p", "result": 1},
        {"action_id": "a3", "kind": "email", "status": "ok", "idempotency_key": "k", "attempts": 2**70},
        {
            "action_id": "a4",
            "kind": "tool_call",
            "status": "error",
            "retryable": True,
            "attempts": 3,
            "max_attempts": 3,
            "name": "book",
            "result_digest": "md5:00",
        },
        {"action_id": "a5", "kind": "llm_call", "status": "ok", "incarnation": ("run", 2), "result": [1]},
    ]
    where = [line_location("run.jsonl", 1), Location("x", 2**70), span_location("ab" * 16, "zz")]
    return [({**base, **record}, where[n % 3]) for n, record in enumerate(records)]


def a_rich_snapshot(rules: tuple[Rule, ...] = RULES) -> bytes:
    checker = Checker(rules, max_actions_per_session=4)
    feed(checker, rich_steps())
    data = checker.snapshot(SESSION)
    assert data is not None
    document = decoded(data)[0]
    for field in ("unpacked", "details", "keys", "exhausted_retries", "unfinished_effects", "failure_runs"):
        assert document[field], f"the rich session should fill {field}"
    return data


def decoded(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    parts = snapshot._frames(data[:-4], 6)
    return orjson.loads(parts[0]), parts[1:]


def encoded(document: dict[str, Any], columns: list[bytes], version: int = snapshot.FORMAT_VERSION) -> bytes:
    """Bytes as encode writes them, checksum included, of any document and columns."""
    parts = [orjson.dumps(document), *columns]
    body = struct.pack(">4sH", snapshot.MAGIC, version) + b"".join(
        struct.pack(">I", len(p)) + p for p in parts
    )
    return body + struct.pack(">I", zlib.crc32(body))


def refused(checker: Checker, data: Any, session_id: str = SESSION) -> str:
    """Why ``checker`` refuses ``data``, having checked that restore says False and holds
    nothing new, and that the checker goes on."""
    open_sessions = checker.open_sessions
    assert checker.restore(session_id, data) is False
    assert session_id not in checker and checker.open_sessions == open_sessions
    feed(checker, WARM[:1])  # the checker goes on
    assert "other" in checker
    checker.forget("other")
    with pytest.raises(snapshot.Refused) as refusal:
        snapshot.decode(
            data,
            session_id=session_id,
            settings=checker._snapshot_settings(),
            symbols=checker._symbols,
            key_window_s=checker.key_window_s,
        )
    return str(refusal.value)


@pytest.mark.parametrize("version", [1, 3])
def test_another_format_version_is_refused(version: int) -> None:
    document, columns = decoded(a_rich_snapshot())
    assert f"format version {version}, this checker reads 2" in refused(
        Checker(RULES, max_actions_per_session=4), encoded(document, columns, version)
    )


@pytest.mark.parametrize(
    "options", [{"max_actions_per_session": 5}, {"rules": select_rules("all")}, {"rules": RULES[1:]}]
)
def test_other_settings_are_refused(options: dict[str, Any]) -> None:
    checker = Checker(**{"rules": RULES, "max_actions_per_session": 4, **options})
    assert "other max_actions_per_session or rules selected" in refused(checker, a_rich_snapshot())


def test_the_rules_order_and_the_key_window_do_not_matter() -> None:
    checker = Checker(tuple(reversed(RULES)), max_actions_per_session=4, key_window_s=5)
    assert checker.restore(SESSION, a_rich_snapshot())


def test_another_sessions_snapshot_is_refused() -> None:
    assert "another session" in refused(Checker(RULES, max_actions_per_session=4), a_rich_snapshot(), "s-2")


def test_every_truncation_is_refused() -> None:
    data, checker = a_rich_snapshot(), Checker(RULES, max_actions_per_session=4)
    for length in range(len(data)):
        assert checker.restore(SESSION, data[:length]) is False
    assert SESSION not in checker and checker.restore(SESSION, data)


def test_every_flipped_bit_is_refused() -> None:
    data, checker = a_rich_snapshot(), Checker(RULES, max_actions_per_session=4)
    for at in range(len(data)):
        for bit in (0, 3, 7):
            altered = bytearray(data)
            altered[at] ^= 1 << bit
            assert checker.restore(SESSION, bytes(altered)) is False, (at, bit)
    assert SESSION not in checker and checker.restore(SESSION, data)


@pytest.mark.parametrize("data", [None, "DSSN", 7, b"", b"DSSN", bytearray(b"DSSN\x00\x01"), [b"DSSN"]])
def test_what_is_no_snapshot_at_all_is_refused(data: Any) -> None:
    refused(Checker(RULES, max_actions_per_session=4), data)


def test_a_snapshot_in_a_bytearray_or_memoryview_is_restored() -> None:
    data = a_rich_snapshot()
    for given_as in (bytearray(data), memoryview(data)):
        checker = Checker(RULES, max_actions_per_session=4)
        assert checker.restore(SESSION, given_as)
        assert checker.snapshot(SESSION) == data


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), magic=st.booleans())
def test_random_bytes_are_refused(data: bytes, magic: bool) -> None:
    checker = Checker(RULES, max_actions_per_session=4)
    assert checker.restore(SESSION, struct.pack(">4sH", snapshot.MAGIC, 1) + data if magic else data) is False
    assert SESSION not in checker


def fits_orjson(value: Any) -> bool:
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError:
        return False
    return True


odd_values = st.one_of(
    json_values.filter(fits_orjson),
    st.sampled_from(
        [-1, 0, 1, 5, 2**63, 2**64 - 1, None, [], {}, [0, 0, 0, 0, 0], {"int": "5"}, {"dict": 1}]
    ),
)


def _paths(value: Any, path: tuple = ()) -> Iterator[tuple]:
    """Every place in a JSON value, its own included."""
    yield path
    if type(value) is list:
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))
    elif type(value) is dict:
        for key, item in value.items():
            yield from _paths(item, (*path, key))


def _replaced(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    copy = list(value) if type(value) is list else dict(value)
    copy[path[0]] = _replaced(value[path[0]], path[1:], new)
    return copy


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_an_altered_snapshot_with_a_valid_checksum_never_breaks_the_checker(data: st.DataObject) -> None:
    """Any value anywhere in the document, or other columns, with the checksum made good:
    restore says True or False, never raises, and a restored session can be fed and ended."""
    document, columns = decoded(a_rich_snapshot())
    if data.draw(st.booleans()):
        path = data.draw(st.sampled_from(list(_paths(document))))
        document = _replaced(document, path, data.draw(odd_values))
    else:
        numbers = data.draw(st.lists(st.integers(-(2**70), 2**70), max_size=6))
        columns[data.draw(st.integers(0, 2))] = snapshot._column(numbers)
    checker = Checker(RULES, max_actions_per_session=4)
    if checker.restore(SESSION, encoded(document, columns)):
        for record, where in rich_steps():
            checker.feed({**record, "incarnation": "run-9", "replayed": True}, where)
        checker.end_session(SESSION)
    assert SESSION not in checker


# -- a caller's errors ---------------------------------------------------------------------------


def test_restoring_a_held_session_is_a_callers_error() -> None:
    checker = Checker(RULES, max_actions_per_session=4)
    assert checker.restore(SESSION, a_rich_snapshot())
    with pytest.raises(ValueError, match="held already"):
        checker.restore(SESSION, a_rich_snapshot())


def test_restoring_past_max_sessions_is_a_callers_error() -> None:
    checker = Checker(RULES, max_actions_per_session=4, max_sessions=1)
    feed(checker, WARM[:1])
    with pytest.raises(ValueError, match="max_sessions"):
        checker.restore(SESSION, a_rich_snapshot())
    checker.forget("other")
    assert checker.restore(SESSION, a_rich_snapshot())
    assert checker.sessions == 2


@pytest.mark.parametrize("session_id", ["", None, 7])
def test_a_session_id_that_is_no_string_is_a_callers_error(session_id: Any) -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        Checker(RULES).restore(session_id, a_rich_snapshot())


# -- the exact JSON of record values -------------------------------------------------------------

exact_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=5)
    | st.sampled_from([2**64, -(2**63) - 1, float("inf"), float("-inf"), -0.0]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=500, deadline=None)
@given(value=exact_values)
def test_record_values_come_back_exactly(value: Any) -> None:
    back = from_json(orjson.loads(orjson.dumps(to_json(value))))
    assert repr(back) == repr(value)  # repr tells a tuple from a list, and -0.0 from 0.0


def test_a_snapshot_of_other_code_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another release, or an edit of the engine or the rules, may keep a session's state
    otherwise: its snapshots are refused (the caller re-feeds), not misread."""
    data = a_rich_snapshot()
    assert snapshot.ENGINE and Checker(RULES, max_actions_per_session=4).restore(SESSION, data)
    monkeypatch.setattr(snapshot, "ENGINE", "another-release")
    assert not Checker(RULES, max_actions_per_session=4).restore(SESSION, data)
